"""Runs cells: one torchrun subprocess per cell, with a timeout, turning results into rows.

Single node: ``torchrun --standalone --nproc-per-node W``. Several nodes: every node runs the
same ``mokbench sweep`` with ``--nnodes N --nproc-per-node G --node-rank I --rdzv-endpoint
HOST:PORT``; a cell of world size W then spans the first W / G nodes (a static-rendezvous
torchrun with G ranks on each), the other nodes take no part in it, a cell of W <= G runs on
node 0 alone, and only node 0 writes rows. So an 18 x 4 allocation runs an EP-64 sweep on its
first 16 nodes.

``--parallel N`` (one node; ``cellpool``): up to N cells at once, each on GPUs of its own
(``CUDA_VISIBLE_DEVICES``; a cell of world size W takes W of them; on CPU, N cells of gloo
ranks). Rows then carry ``parallel_cells`` and ``cell_gpus``.

A cell whose process crashes, hangs past its timeout or runs out of memory becomes a row with
that status and the tail of its error; the sweep goes on, rows already written stay.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mokbench.errors import InputError, is_int, is_number
from mokbench.results import RowWriter, git_commit, new_row, scenario_columns
from mokbench.sweep import Cell

ERROR_TAIL_CHARS = 600


@dataclass(frozen=True)
class LaunchOptions:
    """Where and how cells run (from the CLI)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = "localhost:29500"
    timeout_s: float = 900.0
    device: str = "auto"  # "cpu" forces gloo on CPU even where GPUs exist
    gpus_on_node: int = 0
    parallel: int = 1  # cells at once on this node, each on GPUs of its own

    def __post_init__(self) -> None:
        """One-line errors for flags that cannot describe a launch."""
        for name in ("nproc_per_node", "nnodes"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise InputError(f"{name}={v!r} is invalid: allowed a positive integer")
        if not is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise InputError(f"node_rank={self.node_rank!r} is invalid: allowed 0..nnodes-1 "
                             f"(0..{self.nnodes - 1})")
        if not is_number(self.timeout_s) or self.timeout_s <= 0:
            raise InputError(f"timeout_s={self.timeout_s!r} is invalid: allowed a number of "
                             "seconds > 0")
        if self.device not in DEVICES:
            raise InputError(f"device={self.device!r} is invalid: allowed {' | '.join(DEVICES)}")
        rdzv_host_port(self.rdzv_endpoint)
        top = self.gpus_on_node if self.on_gpus else None
        if not is_int(self.parallel) or self.parallel < 1 or (top and self.parallel > top):
            allowed = f"1..{top} (the GPUs of this node)" if top else "a positive integer"
            raise InputError(f"parallel={self.parallel!r} is invalid: allowed {allowed}")
        if self.parallel > 1 and self.nnodes > 1:
            raise InputError(f"parallel={self.parallel} is invalid with nnodes {self.nnodes}: "
                             "allowed 1 (cells of several nodes run one at a time)")

    @property
    def on_gpus(self) -> bool:
        """Whether cells run on this node's GPUs (not gloo on CPU)."""
        return self.device != "cpu" and self.gpus_on_node > 0

    def gpu_ids(self) -> list[str]:
        """The ids of this node's GPUs as CUDA_VISIBLE_DEVICES names them (the ones already
        set there, else 0..G-1); [] on CPU."""
        if not self.on_gpus:
            return []
        given = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                 if g.strip()]
        return (given or [str(i) for i in range(self.gpus_on_node)])[: self.gpus_on_node]

    @property
    def writes_rows(self) -> bool:
        return self.node_rank == 0


RDZV_PORT_SLOTS = 32  # multi-node: consecutive cells rendezvous on different ports
DEVICES = ("auto", "cpu")
_HOST = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")  # name, IPv4, [IPv6]


def rdzv_host_port(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); the port leaves room for the cells' port slots."""
    host, sep, port = str(endpoint).rpartition(":")
    top = 65535 - RDZV_PORT_SLOTS + 1
    if not sep or not host or not _HOST.match(host) or not port.isdigit() \
            or not 1 <= int(port) <= top:
        raise InputError(f"rdzv_endpoint={endpoint!r} is invalid: allowed HOST:PORT with a "
                         f"port in 1..{top}")
    return host, int(port)


def cell_nodes(world_size: int, opts: LaunchOptions) -> int:
    """Nodes a cell spans in a multi-node launch: W / nproc-per-node, at least one."""
    return max(1, math.ceil(world_size / opts.nproc_per_node))


def takes_part(cell: Cell, opts: LaunchOptions) -> bool:
    """Whether this node runs ranks of the cell (node 0 always does: it writes the rows)."""
    return opts.nnodes == 1 or opts.node_rank < cell_nodes(cell.scenario.world_size, opts)


def torchrun_command(cell: Cell, cell_file: Path, opts: LaunchOptions, index: int = 0
                     ) -> list[str]:
    """The exact command that runs one cell on this node. ``index`` is the cell's position in
    the sweep (the same on every node): with several nodes, cell i meets on port
    PORT + i % RDZV_PORT_SLOTS, so a node that reaches cell i+1 early cannot join the store
    that cell i still holds open on another node."""
    ws = cell.scenario.world_size
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    nodes = cell_nodes(ws, opts)
    if opts.nnodes == 1 or nodes == 1:
        cmd += ["--standalone", f"--nproc-per-node={ws}"]
    else:
        host, port = rdzv_host_port(opts.rdzv_endpoint)
        cmd += [f"--nnodes={nodes}", f"--node-rank={opts.node_rank}",
                f"--nproc-per-node={ws // nodes}", f"--master-addr={host}",
                f"--master-port={port + index % RDZV_PORT_SLOTS}",
                f"--rdzv-id={cell.stem}"]
    return cmd + ["-m", "mokbench.worker", "--cell", str(cell_file)]


def placement_reason(cell: Cell, opts: LaunchOptions) -> str | None:
    """Why this cell cannot be placed on the ranks at hand (None when it can)."""
    ws = cell.scenario.world_size
    if opts.nnodes > 1:
        return multinode_reason(ws, opts.nnodes, opts.nproc_per_node)
    if opts.device != "cpu" and opts.gpus_on_node and ws > opts.gpus_on_node:
        return f"needs {ws} GPUs; this node has {opts.gpus_on_node}"
    return None


def multinode_reason(world_size: int, nnodes: int, nproc_per_node: int) -> str | None:
    """Why a cell of ``world_size`` ranks cannot run on ``nnodes`` x ``nproc_per_node`` (None
    when it can: on node 0 alone, or on the first W / nproc-per-node nodes)."""
    if world_size > nproc_per_node and world_size % nproc_per_node:
        return (f"world size {world_size} is neither <= nor a multiple of nproc-per-node "
                f"{nproc_per_node}")
    if world_size > nnodes * nproc_per_node:
        return (f"world size {world_size} > nnodes x nproc-per-node "
                f"({nnodes} x {nproc_per_node})")
    return None


# Environment variables that change what a backend does; a repro command carries those set.
BACKEND_ENV = ("MOKBENCH_MOK_CONFIG", "MOKBENCH_COMPILE_MODE", "MOKBENCH_DEEPEP_SMS",
               "MOKBENCH_TE_COMM", "MOKBENCH_HYBRIDEP_SMS")


def repro_command(cell: Cell, cell_env: dict[str, str] | None = None) -> str:
    """A one-line command that reruns this cell alone (with the backend knobs set in the
    environment, if any, and the sweep's ``[env]`` variables ``cell_env``)."""
    s = cell.scenario
    sh = s.shape
    from mokbench.scenario import PRESETS

    parts = ["mokbench", "run", "--backends", cell.backend]
    if sh.name in PRESETS:
        parts += ["--preset", sh.name]
    parts += ["--experts", str(sh.num_experts),
             "--hidden", str(sh.hidden), "--intermediate", str(sh.intermediate), "--topk",
             str(sh.topk), "--tokens", str(s.tokens_per_rank), "--world-size", str(s.world_size),
             "--precision", s.precision, "--routing", s.routing, "--zipf-s", f"{s.zipf_s:g}",
             "--seed", str(s.seed), "--warmup", str(s.timing.warmup), "--iters",
             str(s.timing.iters), "--passes", ",".join(s.passes)]
    parts.append("--shared-expert" if s.shared_expert else "--no-shared-expert")
    given = {**{k: os.environ[k] for k in BACKEND_ENV if os.environ.get(k)}, **(cell_env or {})}
    env = [f"{k}={shlex.quote(v)} " for k, v in given.items()]
    return "".join(env) + shlex.join(parts)


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d+)\]:\s?")  # torchrun's per-rank prefix
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\w*(:|$)")
_ROOT_CAUSE = re.compile(r"Root Cause[^\n]*\n(?:.*\n){0,3}?\s*rank\s*:\s*(\d+)"
                         r"(?:.*\n){0,2}?\s*exitcode\s*:\s*(-?\d+)")


def _tail(text: str) -> str:
    """The most informative line of a cell's log: the worker's own exception line (of the rank
    torchrun names as the root cause, else of any rank), not torchrun's ``ChildFailedError``;
    else how the root-cause rank ended (a signal); else the log's last lines."""
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    root = _ROOT_CAUSE.search(text)
    root_rank = int(root.group(1)) if root else None
    found: list[tuple[int | None, str]] = []
    for ln in lines:
        m = _RANK_PREFIX.match(ln)
        rank, body = (int(m.group(1)), ln[m.end():]) if m else (None, ln)
        if _EXCEPTION.match(body) and "ChildFailedError" not in body:
            found.append((rank, body.strip()))
    ranked = [b for r, b in found if r == root_rank] or [b for _, b in found]
    if ranked:
        return ranked[-1][:ERROR_TAIL_CHARS]
    if root and int(root.group(2)) < 0:
        sig = -int(root.group(2))
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"rank {root_rank} was killed by {name}"
    kept = [ln for ln in lines if "ChildFailedError" not in ln]
    return " | ".join(kept[-4:])[-ERROR_TAIL_CHARS:]


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def exit_text(rc: int) -> str:
    """How a cell's launcher ended, for a row's reason: ``exit code N``, or, for a negative
    code (the launcher itself was killed by a signal from outside the harness, whose own
    timeout is reported as a timeout), the signal's name."""
    if rc >= 0:
        return f"exit code {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return f"killed by {name} from outside the harness (exit code {rc})"


class LiveProcesses:
    """The cells' running launchers, so that another thread can stop them all. Once stopped,
    a launcher that starts afterwards (its thread was between the stop and its start) is
    killed at once instead of running to its timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self.stopped = False

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)
            late = self.stopped
        if late:
            _kill_group(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop_all(self) -> None:
        with self._lock:
            self.stopped = True
            procs = list(self._procs)
        for proc in procs:
            _kill_group(proc)


def run_process(cmd: list[str], log_path: Path, timeout_s: float, env: dict,
                live: LiveProcesses | None = None) -> tuple[int, bool]:
    """Run ``cmd`` in its own process group; returns (exit code, timed_out). ``live``: holds
    the process while it runs (so another thread can stop it)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        if live is not None:
            live.add(proc)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return -9, True
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if live is not None:
                live.discard(proc)


class CellRunner:
    """Runs cells of one run folder and appends their rows."""

    def __init__(self, run_dir: Path, run_id: str, opts: LaunchOptions,
                 cell_env: dict[str, str] | None = None) -> None:
        """``cell_env``: variables set in every cell's processes (the sweep's ``[env]``)."""
        self.run_dir, self.run_id, self.opts = Path(run_dir), run_id, opts
        self.cell_env = dict(cell_env or {})
        self.cells_dir = self.run_dir / "cells"
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        self.writer = RowWriter(self.run_dir / "rows.jsonl")
        self._backends: dict = {}
        self._lock = threading.Lock()  # rows and the backend cache, for --parallel
        self._live = LiveProcesses()
        self._rounds_begun: dict[tuple[str, str], Cell] = {}  # cells whose round 0 ran here

    @property
    def stopping(self) -> bool:
        return self._live.stopped

    def stop_all(self) -> None:
        """Stop every running cell (their process groups), and any a thread starts after this;
        their rows are not written, so ``--resume`` runs them again."""
        self._live.stop_all()

    def _row(self, cell: Cell, pass_: str, **values) -> dict:
        from mokbench.backend import registry, split_label

        return new_row(run_id=self.run_id, backend=cell.backend,
                       is_baseline=self._is_baseline(cell.backend),
                       **{"pass": pass_}, gpu_name=self.gpu_name,
                       device="cpu" if self.opts.device == "cpu" or not self.opts.gpus_on_node
                       else "cuda", repro=repro_command(cell, self.cell_env),
                       registry=registry()[split_label(cell.backend)[0]],
                       git_sha=self.git_sha, **scenario_columns(cell.scenario), **values)

    @functools.cached_property
    def git_sha(self) -> str | None:
        """The commit each row was made at (a resumed run's rows may differ from env.json's)."""
        return git_commit()

    @functools.cached_property
    def gpu_name(self) -> str:
        if self.opts.device == "cpu" or not self.opts.gpus_on_node:
            return "cpu"
        import torch

        return torch.cuda.get_device_name(0)

    def backend_of(self, name: str):
        """A (not set up) backend instance, for its capability record; cached per name."""
        from mokbench.backend import get_backend

        with self._lock:
            if name not in self._backends:
                self._backends[name] = get_backend(name)
            return self._backends[name]

    def _is_baseline(self, name: str) -> bool:
        try:
            return bool(self.backend_of(name).capabilities.is_baseline)
        except Exception:  # noqa: BLE001 - adapter that fails to import: judge by its name
            return not name.startswith("mok")

    def skip(self, cell: Cell, reason: str, status: str = "skipped") -> list[dict]:
        rows = [self._row(cell, p, status=status, reason=reason) for p in cell.scenario.passes]
        self._emit(rows)
        return rows

    def host_reason(self, cell: Cell) -> str | None:
        """Reasons known before launching (package, GPU kind, world size, precision, pass)."""
        if self.opts.device == "cpu" or not self.opts.gpus_on_node:
            caps = self.backend_of(cell.backend).capabilities
            if caps.needs_gpu or caps.min_cc is not None:
                return "needs a CUDA GPU; this run is on CPU"
        return self.backend_of(cell.backend).unavailable_reason(None, cell.scenario)

    def _emit(self, rows: list[dict]) -> None:
        if self.opts.writes_rows:
            with self._lock:
                for r in rows:
                    self.writer.append(r)

    def run(self, cell: Cell, index: int = 0, gpus: tuple[str, ...] | None = None,
            round_: int = 0, rounds: int = 1) -> list[dict]:
        """Launch the cell, wait (bounded), and write one row per pass (none where this node
        takes no part in the cell, or when :meth:`stop_all` stopped it). ``gpus``: the GPUs
        the cell gets (``--parallel``), else every GPU of the node. ``round_`` of ``rounds``
        (:mod:`mokbench.rounds`): each round's results are kept in the cells folder and the
        rows, pooled over every round, are written after the last; earlier rounds write none
        (after a stop, :meth:`pool_stopped_rounds` writes the finished rounds' rows)."""
        if not takes_part(cell, self.opts):
            return []
        last = round_ == rounds - 1
        try:
            reason = placement_reason(cell, self.opts) or self.host_reason(cell)
        except Exception as exc:  # noqa: BLE001 - a broken adapter fails its cells only
            if not last:
                return []
            rows = [self._row(cell, p, status="failed",
                              reason=f"adapter failed to load: {type(exc).__name__}: {exc}")
                    for p in cell.scenario.passes]
            self._emit(rows)
            return rows
        if reason:
            return self.skip(cell, reason) if last else []
        cell_file = self.cells_dir / f"{cell.stem}.json"
        cell_file.write_text(json.dumps({"scenario": cell.scenario.to_dict(),
                                         "backend": cell.backend, "run_id": self.run_id}))
        for p in cell.scenario.passes:
            self.cells_dir.joinpath(f"{cell.stem}.{p}.json").unlink(missing_ok=True)
        env = {**os.environ, **self.cell_env}
        if self.opts.device == "cpu":
            env["MOKBENCH_DEVICE"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1" if self.opts.device == "cpu" else "4")
        extra = {}
        if self.opts.parallel > 1:
            extra["parallel_cells"] = self.opts.parallel
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = extra["cell_gpus"] = ",".join(gpus)
        log_path = self.cells_dir / f"{cell.stem}.log"
        if self.stopping:  # stopped while this thread was setting the cell up
            return []
        t0 = time.monotonic()
        rc, timed_out = run_process(torchrun_command(cell, cell_file, self.opts, index), log_path,
                                    self.opts.timeout_s, env, self._live)
        wall = time.monotonic() - t0
        if self.stopping:
            return []
        log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
        results = {}
        for p in cell.scenario.passes:
            res_file = self.cells_dir / f"{cell.stem}.{p}.json"
            if res_file.exists():
                results[p] = {"cell_wall_s": wall, **extra, **json.loads(res_file.read_text())}
            elif timed_out:
                results[p] = {"status": "timeout", "cell_wall_s": wall, **extra,
                              "reason": f"timeout after {self.opts.timeout_s:g} s: "
                                        + _tail(log_text)}
            else:
                results[p] = {"status": "failed", "cell_wall_s": wall, **extra,
                              "reason": f"{exit_text(rc)}: " + _tail(log_text)}
        if rounds > 1:
            if not self.opts.writes_rows:  # another node's files are node 0's to pool
                return []
            results = self._pool_rounds(cell, results, round_, rounds)
            if results is None:
                return []
        rows = [self._row(cell, p, **results[p]) for p in cell.scenario.passes]
        self._emit(rows)
        return rows

    def _pool_rounds(self, cell: Cell, results: dict[str, dict], round_: int, rounds: int
                     ) -> dict[str, dict] | None:
        """Keep this round's results per pass (``STEM.rN.PASS.json``, the log as
        ``STEM.rN.log``); after the last round, the results pooled over every round
        (:func:`mokbench.rounds.pool`), else None. A round whose file is missing (a round
        of an earlier, stopped sweep) counts as failed."""
        from mokbench.rounds import pool

        if round_ == 0:  # rounds of an earlier, stopped sweep must not join this one's
            for f in self.cells_dir.glob(f"{cell.stem}.r*"):
                if re.fullmatch(rf"{re.escape(cell.stem)}\.r\d+\..+", f.name):
                    f.unlink(missing_ok=True)
            self._rounds_begun[cell.key] = cell
        log = self.cells_dir / f"{cell.stem}.log"
        if log.exists():
            log.replace(self.cells_dir / f"{cell.stem}.r{round_}.log")
        for p, result in results.items():
            self._round_file(cell, round_, p).write_text(json.dumps(result, default=str))
        if round_ < rounds - 1:
            return None
        pooled = {}
        for p in cell.scenario.passes:
            per_round = []
            for k in range(rounds):
                f = self._round_file(cell, k, p)
                per_round.append(json.loads(f.read_text()) if f.exists() else
                                 {"status": "failed", "reason": "no result of this round"})
            pooled[p] = pool(per_round)
        return pooled

    def _round_file(self, cell: Cell, round_: int, pass_: str) -> Path:
        """Where one round's result of one pass is kept (``STEM.rN.PASS.json``)."""
        return self.cells_dir / f"{cell.stem}.r{round_}.{pass_}.json"

    def _finished_rounds(self, cell: Cell, rounds: int) -> list[int]:
        """The rounds of ``cell`` whose results (one file per pass) are in the cells folder."""
        return [k for k in range(rounds)
                if all(self._round_file(cell, k, p).exists() for p in cell.scenario.passes)]

    def pool_stopped_rounds(self, rounds: int) -> list[dict]:
        """After a stop between rounds: one row per pass for each cell whose first round ran
        in this sweep but not its last, pooled over the rounds that finished
        (:func:`mokbench.rounds.pool`; ``rounds`` in the row, ``rounds_planned`` the run's),
        so a stopped sweep keeps every finished round's samples. ``--resume`` runs such a
        cell again, every round, and its new rows replace these. Returns the rows written."""
        from mokbench.rounds import pool

        if rounds < 2 or not self.opts.writes_rows:
            return []
        written: list[dict] = []
        for cell in self._rounds_begun.values():
            finished = self._finished_rounds(cell, rounds)
            if not finished or len(finished) == rounds:  # no round, or its rows are written
                continue
            rows = []
            for p in cell.scenario.passes:
                per_round = [json.loads(self._round_file(cell, k, p).read_text())
                             for k in finished]
                rows.append(self._row(cell, p, **pool(per_round, planned=rounds)))
            self._emit(rows)
            written += rows
        return written
