"""Run the real CLI (and through it torchrun over gloo) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mokbench.results import read_rows

REPO = Path(__file__).resolve().parents[2]
FAULTS = ",".join(f"fault_{n}=tests.fault_backends:{c}" for n, c in (
    ("raise", "RaiseBackend"), ("hang", "HangBackend"), ("kill", "KillBackend"),
    ("backward", "BackwardOnlyFailsBackend"), ("crash", "CrashBackend")))
PROBES = "grad_probe=tests.probe_backends:GradProbeBackend," \
         "no_inference=tests.probe_backends:NoInferenceBackend"


def cli_env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), MOKBENCH_EXTRA_BACKENDS=f"{FAULTS},{PROBES}",
               COLUMNS="200", OMP_NUM_THREADS="1")
    return {**env, **extra}


def mokbench(*args: str, timeout: float = 600, env: dict | None = None,
             **kw) -> subprocess.CompletedProcess:
    """Run the CLI; ``env`` adds variables to :func:`cli_env`'s."""
    return subprocess.run([sys.executable, "-m", "mokbench.cli", *args], cwd=REPO,
                          env=cli_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout, **kw)


def only_run_dir(out: Path) -> Path:
    dirs = [d for d in Path(out).iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def rows_by_key(run_dir: Path) -> dict[tuple[str, str, str], dict]:
    rows = read_rows(run_dir / "rows.jsonl")
    return {(r["backend"], r["pass"], r["scenario_id"]): r for r in rows}
