"""Sweep orchestration: run folder, resume, dry run, progress display, calibration launch."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mokbench.cellpool import run_parallel
from mokbench.errors import InputError
from mokbench.launch import (
    DEVICES,
    CellRunner,
    LaunchOptions,
    placement_reason,
    takes_part,
    torchrun_command,
)
from mokbench.results import make_run_id, read_env, read_rows, write_env
from mokbench.rounds import is_partial, rotated
from mokbench.sweep import Sweep, check_rounds, expand, load_sweep, read_sweep_text

CPU_DEFAULT_RANKS = 2
DESCRIPTION_CHARS = 40  # the progress bar's label, so bar and counts fit 80 columns


def local_gpus(device: str) -> int:
    """GPUs this node offers to a sweep (0 when forced to CPU or none is visible)."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _options(nproc_per_node, nnodes, node_rank, rdzv_endpoint, timeout_s, device,
             parallel: int = 1) -> LaunchOptions:
    if device not in DEVICES:
        raise InputError(f"device={device!r} is invalid: allowed {' | '.join(DEVICES)}")
    gpus = local_gpus(device)
    nproc = nproc_per_node if nproc_per_node is not None else (gpus or CPU_DEFAULT_RANKS)
    return LaunchOptions(nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank,
                         rdzv_endpoint=rdzv_endpoint, timeout_s=timeout_s,
                         device="cpu" if not gpus else device, gpus_on_node=gpus,
                         parallel=parallel)


def _finished_keys(run_dir: Path) -> set[tuple[str, str]]:
    """(scenario id, backend) of the cells whose last row is final: not pooled over fewer
    rounds than planned (:func:`mokbench.rounds.is_partial`), which ``--resume`` runs again."""
    last = {(r.get("scenario_id"), r.get("backend")): r for r in read_rows(run_dir / "rows.jsonl")}
    return {key for key, r in last.items() if not is_partial(r)}


def unfinished_cells(run_dir: Path | str) -> list[tuple[str, str]]:
    """(scenario id, backend) of every cell of the run's sweep copy that has no row yet (the
    sweep stopped before it, or ``--backends`` left it out: ``mokbench sweep --resume
    RUN_DIR`` runs them), in sweep order;
    world sizes "auto" resolve to the ranks the run had (env.json). [] when the folder has no
    sweep copy."""
    run_dir = Path(run_dir)
    if not any(run_dir.glob("sweep.*")):
        return []
    env = read_env(run_dir)
    opts = LaunchOptions(nproc_per_node=env.get("nproc_per_node") or 1,
                         nnodes=env.get("nnodes") or 1)
    done = _finished_keys(run_dir)
    return [c.key for c in _resume_sweep(run_dir, opts, None).cells if c.key not in done]


def _load(sweep_file, data, opts: LaunchOptions, backends) -> Sweep:
    auto_world = opts.nproc_per_node * opts.nnodes
    if data is not None:
        sw = expand(data, auto_world, backends, data.get("name", "adhoc"))
        sw.source_text = json.dumps(data, indent=2)
        sw.source_suffix = ".json"
        return sw
    default = "default_gpu" if opts.gpus_on_node else "default_cpu"
    return load_sweep(sweep_file, auto_world, backends, default_name=default)


def _prepare_run_dir(sw: Sweep, out: Path, resume: Path | None, opts: LaunchOptions,
                     backends: list[str] | None = None, rounds: int = 1) -> Path:
    if resume is not None:
        return Path(resume)
    run_dir = Path(out) / make_run_id(sw.name)
    if opts.writes_rows:
        if Path(out).exists() and not Path(out).is_dir():
            raise InputError(f"out={str(out)!r} is a file: allowed a folder (created if missing)")
        try:
            run_dir = _new_folder(run_dir)
            (run_dir / f"sweep{sw.source_suffix}").write_text(sw.source_text)
        except OSError as exc:
            raise InputError(f"out={str(out)!r} is not writable ({exc.strerror or exc}): allowed "
                             "a folder this user can write") from None
        env = {"sweep": sw.name, "device": opts.device,
               "nproc_per_node": opts.nproc_per_node, "nnodes": opts.nnodes,
               "parallel": opts.parallel}
        if backends:  # --backends: the report tells the cells it left out from unfinished ones
            env["backends"] = list(backends)
        if sw.env:  # the sweep's [env], set in every cell's processes
            env["sweep_env"] = dict(sw.env)
        env["rounds"] = rounds  # mokbench.rounds; --resume runs the rest with as many
        write_env(run_dir, env)
    return run_dir


def _new_folder(path: Path) -> Path:
    """Create ``path``, or ``path-2``, ``path-3``, ... where a sweep of the same name started
    in the same second already made it (two sweeps must not share a run folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise InputError(f"out={str(path.parent)!r} has 999 run folders named {path.name}: allowed "
                     "a folder with room for another")


def _resume_options(resume: Path, nproc_per_node, nnodes) -> tuple[int | None, int]:
    """The run's own ranks per node and node count (env.json), so its "auto" world sizes
    resolve as they did; a flag that asks for others is an error, not rows of another EP size
    in the same run."""
    if not Path(resume).is_dir():
        raise InputError(f"resume={str(resume)!r} is not a folder: allowed a run folder")
    env = read_env(resume)
    for name, given in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes)):
        stored = env.get(name)
        if given is not None and stored is not None and given != stored:
            raise InputError(f"{name}={given!r} is invalid with --resume: allowed {stored} "
                             f"(the value {str(resume)!r} ran with) or none")
    nproc = nproc_per_node if nproc_per_node is not None else env.get("nproc_per_node")
    return nproc, nnodes if nnodes is not None else env.get("nnodes", 1)


def _resume_sweep(resume: Path, opts: LaunchOptions, backends, sweep_file=None) -> Sweep:
    copies = sorted(Path(resume).glob("sweep.*"))
    if not copies:
        raise InputError(f"resume={str(resume)!r} has no sweep copy: allowed a run folder")
    src = copies[0]
    if sweep_file is not None and read_sweep_text(Path(sweep_file)) != src.read_text():
        raise InputError(f"sweep_file={str(sweep_file)!r} differs from {str(src)!r}, the sweep "
                         "of the run to resume: allowed that sweep, or no sweep file")
    if src.suffix == ".json":
        return _load(None, json.loads(src.read_text()), opts, backends)
    return load_sweep(src, opts.nproc_per_node * opts.nnodes, backends)


def run_sweep(sweep_file: Path | None, *, data: dict | None = None, backends=None,
              nproc_per_node: int | None = None, nnodes: int | None = None, node_rank: int = 0,
              rdzv_endpoint: str = "localhost:29500", out: Path = Path("results"),
              resume: Path | None = None, dry_run: bool = False, timeout_s: float = 900.0,
              device: str = "auto", calibrate_first: bool = False,
              console: Console | None = None, parallel: int = 1,
              rounds: int | None = None) -> Path | None:
    """Run (or, with ``dry_run``, print) every cell of a sweep. Returns the run folder.
    ``parallel``: cells at once on this node, each on GPUs of its own (launch module).
    ``rounds``: each scenario's cells run that many times, the order rotated, the rows pooled
    (:mod:`mokbench.rounds`); default the sweep's ``[timing] rounds`` (a resumed run's own)."""
    console = console or Console()
    if rounds is not None:
        check_rounds(rounds)
    if resume is not None:
        nproc_per_node, nnodes = _resume_options(resume, nproc_per_node, nnodes)
    opts = _options(nproc_per_node, 1 if nnodes is None else nnodes, node_rank, rdzv_endpoint,
                    timeout_s, device, parallel)
    sw = (_resume_sweep(resume, opts, backends, sweep_file) if resume is not None
          else _load(sweep_file, data, opts, backends))
    rounds = _rounds(rounds, sw, resume)
    if rounds > 1 and opts.parallel > 1:
        raise InputError(f"parallel={opts.parallel} is invalid with rounds {rounds}: allowed 1 "
                         "(rounds run each scenario's cells one after the other)")
    if dry_run:
        print_dry_run(sw, opts, console, rounds)
        return None
    run_dir = _prepare_run_dir(sw, out, resume, opts, backends, rounds)
    run_id = run_dir.name
    if calibrate_first and opts.writes_rows:
        try:
            run_calibrate(run_dir, nproc_per_node=opts.nproc_per_node, device=opts.device,
                          console=console)
        except subprocess.CalledProcessError as exc:  # ceilings are optional: go on without
            console.print(f"[yellow]calibrate failed (exit {exc.returncode}); no ceilings[/]")
    done = _finished_keys(run_dir) if resume is not None else set()
    todo = [(i, c) for i, c in enumerate(sw.cells) if c.key not in done]
    runner = CellRunner(run_dir, run_id, opts, sw.env)
    console.print(f"run [bold]{run_id}[/bold]: {len(todo)} cells to run"
                  + (f", {rounds} rounds each" if rounds > 1 else "")
                  + (f" ({len(done)} already finished)" if done else ""))
    try:
        _run_cells(runner, rotated(todo, rounds), opts, console, rounds)
    except KeyboardInterrupt as stop:  # the caller reports the finished rows of this folder
        stop.run_dir = run_dir
        kept = runner.pool_stopped_rounds(rounds)
        if kept:
            console.print(f"[yellow]{len(kept)} rows pooled over the rounds that finished "
                          f"before the stop (fewer than {rounds}); --resume runs their cells "
                          "again[/yellow]", soft_wrap=True)
        raise
    return run_dir


def _rounds(given: int | None, sw: Sweep, resume: Path | None) -> int:
    """The rounds a run takes: ``--rounds``, else a resumed run's own (env.json), else the
    sweep's ``[timing] rounds``."""
    if given is not None:
        return given
    stored = read_env(resume).get("rounds") if resume is not None else None
    return sw.rounds if stored is None else check_rounds(stored)


def _run_cells(runner: CellRunner, todo: list, opts: LaunchOptions, console: Console,
               rounds: int = 1) -> None:
    """Run the cells ``todo`` ((index, cell, round) triples) one by one or ``opts.parallel``
    at once, printing each row as it lands, under a progress bar."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("sweep", total=len(todo))

        def started(cell) -> None:
            label = f"{cell.backend} {cell.scenario.scenario_id}"
            progress.update(task, description=label if len(label) <= DESCRIPTION_CHARS
                            else label[: DESCRIPTION_CHARS - 1] + "…")

        def finished(cell, rows: list[dict]) -> None:
            for r in rows:
                ms = f"{r['median_ms']:.3f} ms" if r.get("median_ms") else ""
                style = {"ok": "green", "skipped": "dim"}.get(r["status"], "red")
                progress.console.print(
                    f"[{style}]{r['status']:>7}[/{style}] {cell.backend:<20} {r['pass']:<9} "
                    f"{ms:>12}  {cell.scenario.scenario_id}"
                    + (f"  [dim]{r['reason'][:100]}[/dim]" if r.get("reason") else ""),
                    soft_wrap=True, markup=True, highlight=False)
            progress.advance(task)

        if opts.parallel == 1:
            for index, cell, round_ in todo:
                started(cell)
                # index * rounds + round_: consecutive launches meet on different ports
                # across nodes, even a scenario's one cell run round after round
                rows = runner.run(cell, index * rounds + round_, round_=round_, rounds=rounds)
                if rounds > 1 and round_ < rounds - 1 and not runner.stopping:
                    progress.console.print(
                        f"[dim]  round {round_ + 1}/{rounds} {cell.backend:<20} "
                        f"{cell.scenario.scenario_id}[/dim]",
                        soft_wrap=True, markup=True, highlight=False)
                finished(cell, rows)
        else:
            run_parallel(runner, [(i, c) for i, c, _ in todo], opts, started, finished)


def print_dry_run(sw: Sweep, opts: LaunchOptions, console: Console, rounds: int = 1) -> None:
    """Each cell and what this node does with it, decided as the run decides: the torchrun
    command it launches, a placement skip, or no part (multi-node, beyond the cell's nodes).
    Skips that depend on the backend's packages or GPU are decided on the node at run time."""
    if rounds > 1:
        console.print(f"{rounds} rounds: each scenario's cells run {rounds} times, round r in "
                      "this order rotated by r cells, each row pooled over its rounds",
                      soft_wrap=True, markup=False)
    for i, cell in enumerate(sw.cells):
        console.print(f"[bold]{cell.scenario.scenario_id}[/bold] {cell.backend}", soft_wrap=True,
                      highlight=False)
        if sw.env:
            console.print("  env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sw.env.items()),
                          soft_wrap=True, markup=False, highlight=False)
        reason = placement_reason(cell, opts)
        if reason:
            console.print(f"  skipped: {reason}", soft_wrap=True, markup=False)
        elif not takes_part(cell, opts):
            console.print(f"  node {opts.node_rank} takes no part", soft_wrap=True, markup=False)
        else:
            cmd = torchrun_command(cell, Path("RUN_DIR/cells") / f"{cell.stem}.json", opts, i)
            console.print("  " + shlex.join(cmd), soft_wrap=True, markup=False)
    console.print(f"{len(sw.cells)} cells")


def run_calibrate(run_dir: Path | None, *, nproc_per_node: int | None = None,
                  device: str = "auto", console: Console | None = None) -> Path:
    """Launch ``mokbench.calibrate`` under torchrun; ceilings land in RUN_DIR/env.json."""
    console = console or Console()
    opts = _options(nproc_per_node, 1, 0, "localhost:29500", 900.0, device)
    if run_dir is None:
        run_dir = Path("results") / make_run_id("calibrate")
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise InputError(f"out={str(run_dir)!r} is a file: allowed a run folder")
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if not (Path(run_dir) / "env.json").exists():
            write_env(run_dir)
    except OSError as exc:
        raise InputError(f"out={str(run_dir)!r} is not writable ({exc.strerror or exc}): "
                         "allowed a folder this user can write") from None
    env = dict(os.environ)
    if opts.device == "cpu":
        env["MOKBENCH_DEVICE"] = "cpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={opts.nproc_per_node}", "-m", "mokbench.calibrate", "--out",
           str(run_dir)]
    console.print("calibrating: " + shlex.join(cmd), markup=False, soft_wrap=True)
    subprocess.run(cmd, env=env, check=True)
    return Path(run_dir)
