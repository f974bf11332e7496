"""Result rows, the append-only writer, run folders and the environment record.

A run folder ``results/<run_id>/`` holds:
    rows.jsonl   one JSON object per (scenario, backend, pass); append-only, fsynced per row
    env.json     machine, software versions, git state, ceilings from ``mokbench calibrate``
    sweep.*      a copy of the sweep file that produced it
    cells/       per-cell scratch files written by the workers (rank 0)
    report.md    the tables (written at the end of a sweep, or by ``mokbench report``)
    plots/       the charts (likewise)
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from mokbench.errors import InputError

log = logging.getLogger("mokbench")

STATUSES = ("ok", "failed", "timeout", "skipped")

# Columns every row carries (scripts and checks rely on them). Extra columns may follow.
ROW_COLUMNS = (
    "run_id", "scenario_id", "backend", "is_baseline", "pass", "status", "reason",
    "median_ms", "p10_ms", "p90_ms", "min_ms", "max_ms", "iters", "tflops",
    "max_abs_err", "max_rel_err", "world_size", "gpu_name", "tokens_per_rank", "hidden",
    "intermediate", "num_experts", "topk", "shared_expert", "precision", "routing", "repro",
)


def new_row(**values: Any) -> dict[str, Any]:
    """A row with every schema column present (missing ones None), extras kept after them."""
    row = {c: values.pop(c, None) for c in ROW_COLUMNS}
    row.update(values)
    if row["status"] not in STATUSES:
        raise ValueError(f"status={row['status']!r} is invalid: allowed {' | '.join(STATUSES)}")
    return row


def scenario_columns(scenario) -> dict[str, Any]:
    """The scenario's columns of a row."""
    s = scenario.shape
    return {
        "scenario_id": scenario.scenario_id, "world_size": scenario.world_size,
        "tokens_per_rank": scenario.tokens_per_rank, "hidden": s.hidden,
        "intermediate": s.intermediate, "num_experts": s.num_experts, "topk": s.topk,
        "shared_expert": scenario.shared_expert, "precision": scenario.precision,
        "routing": scenario.routing, "model": s.name, "zipf_s": scenario.zipf_s,
    }


class RowWriter:
    """Append-only JSONL writer: every row is flushed and fsynced before ``append`` returns,
    so rows already written survive a crash or Ctrl-C of the sweep."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, default=str, allow_nan=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def read_rows(path: Path) -> list[dict[str, Any]]:
    """All rows of a rows.jsonl. A line that is not a JSON object (a torn write after a crash,
    an edit) is skipped with a warning naming the file and line; the other rows are kept."""
    rows: list[dict[str, Any]] = []
    p = Path(path)
    if not p.is_file():
        return rows
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InputError(f"rows file {str(p)!r} cannot be read ({exc.strerror or exc}): allowed "
                         "a readable rows.jsonl") from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            log.warning("%s line %d is not valid JSON (%s); skipped", p, n, exc.msg)
            continue
        if not isinstance(row, dict):
            log.warning("%s line %d is a JSON %s, not a row object; skipped", p, n,
                        type(row).__name__)
            continue
        rows.append(row)
    return rows


def make_run_id(sweep_name: str) -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + sweep_name


def git_dirty(run_dir: Path | None = None, repo: Path | None = None) -> bool | None:
    """Whether the checkout (of ``repo``, default this package's) differs from its commit:
    modified tracked files or untracked ones, leaving out ``results/`` and ``run_dir`` (a run's
    own folder does not make a fresh clone dirty). None outside a git checkout."""
    excludes = [":(top,exclude)results"]
    top = _git("rev-parse", "--show-toplevel", cwd=repo)
    if top and run_dir is not None:
        try:
            rel = Path(run_dir).resolve().relative_to(Path(top).resolve())
            excludes.append(f":(top,exclude){rel.as_posix()}")
        except ValueError:
            pass  # the run folder is outside the checkout
    out = _git("status", "--porcelain", "--", ":/", *excludes, cwd=repo)
    return None if out is None else bool(out)


def git_commit() -> str | None:
    """The commit this code runs at: MOKBENCH_GIT_SHA where set (a copy of the tree without
    .git, shipped to a remote machine), else ``git rev-parse HEAD``; None outside a checkout."""
    return os.environ.get("MOKBENCH_GIT_SHA") or _git("rev-parse", "HEAD")


# The folders whose code decides what a run measures (see ``code_trees``).
CODE_DIRS = ("mok_kernels", "mokbench", "baselines", "benchmarks", "sweeps")


def code_trees(repo: Path | None = None) -> dict[str, str] | None:
    """Git tree ids of ``CODE_DIRS`` as the files stand in the working tree (tracked and
    untracked, .gitignore honoured), so a run names the code it ran even where the checkout's
    HEAD is not that code (a tree copied onto a machine over an older .git): equal to
    ``git rev-parse COMMIT:mok_kernels`` and so on for the commit whose code ran. Built in a
    temporary index and object folder (the repository's objects are read, never written).
    None outside a git checkout; a folder that does not exist is left out."""
    top = _git("rev-parse", "--show-toplevel", cwd=repo)
    objects = top and _git("rev-parse", "--git-path", "objects", cwd=Path(top))
    if not top or not objects:
        return None
    objects = str(Path(top, objects))  # relative to top unless already absolute
    dirs = [d for d in CODE_DIRS if Path(top, d).is_dir()]
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp, "index")),
               "GIT_OBJECT_DIRECTORY": str(Path(tmp, "objects")),
               "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects}
        Path(tmp, "objects").mkdir()
        if dirs and _git("add", "-A", "--", *dirs, cwd=Path(top), env=env) is None:
            return None
        root = _git("write-tree", cwd=Path(top), env=env)
        if root is None:
            return None
        trees = {d: _git("rev-parse", f"{root}:{d}", cwd=Path(top), env=env) for d in dirs}
    return {d: t for d, t in trees.items() if t}


def _git(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                             cwd=cwd or Path(__file__).resolve().parent,
                             env=None if env is None else {**os.environ, **env})
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


LIBRARIES = ("torch", "triton", "transformer_engine", "megatron-core", "deep_ep",
             "mixture-of-kittens", "mok",
             "numpy", "pandas")


# Environment variables that can change what a run measures (communication libraries, the
# allocator, compilers, backend knobs): env.json records those set where the sweep started.
RECORDED_ENV_PREFIXES = ("NCCL_", "NVSHMEM_", "TORCH_", "PYTORCH_", "CUDA_", "MOKBENCH_",
                         "TRITON_", "NVTE_", "OMP_NUM_THREADS", "LD_PRELOAD")


def recorded_environment() -> dict[str, str]:
    """The set variables of ``RECORDED_ENV_PREFIXES``, sorted by name."""
    return {k: os.environ[k] for k in sorted(os.environ)
            if k.startswith(RECORDED_ENV_PREFIXES)}


def capture_env(run_dir: Path | None = None) -> dict[str, Any]:
    """Machine and software facts for env.json (no GPU work beyond reading properties);
    ``run_dir`` is left out of the git dirty check."""
    import torch

    env: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(),
        "python": platform.python_version(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                       time.gmtime()),
        # A copy of the tree without .git (e.g. shipped to a remote machine) can name its
        # commit through MOKBENCH_GIT_SHA / MOKBENCH_GIT_DIRTY.
        "git_sha": git_commit(),
        "git_dirty": (os.environ["MOKBENCH_GIT_DIRTY"] == "1" if "MOKBENCH_GIT_DIRTY" in os.environ
                      else bool(git_dirty(run_dir))),
        "code_trees": code_trees(),
        "cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count(),
        "libraries": {lib: _version(lib) for lib in LIBRARIES},
        "environment": recorded_environment(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu_name=props.name, sm_count=props.multi_processor_count,
                   compute_capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1))
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            env["nccl"] = None
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = None
    else:
        env.update(gpu_name="cpu", sm_count=None, compute_capability=None, driver=None, nccl=None)
    return env


def write_env(run_dir: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write (or update) env.json; keeps existing keys such as stored ceilings."""
    path = Path(run_dir) / "env.json"
    env = read_env(run_dir)
    env.update(capture_env(run_dir))
    env.update(extra or {})
    path.write_text(json.dumps(env, indent=2, default=str))
    return env


def read_env(run_dir: Path) -> dict[str, Any]:
    """A run folder's env.json ({} when it has none); a corrupt one is a one-line error."""
    path = Path(run_dir) / "env.json"
    if not path.exists():
        return {}
    try:
        env = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = getattr(exc, "msg", None) or getattr(exc, "strerror", None) or type(exc).__name__
        where = f" (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise InputError(f"env.json of {str(run_dir)!r} is unreadable{where}: {why}; allowed "
                         "a JSON object (delete the file to drop it)") from None
    if not isinstance(env, dict):
        raise InputError(f"env.json of {str(run_dir)!r} holds a JSON {type(env).__name__}: "
                         "allowed a JSON object (delete the file to drop it)")
    return env
