"""Run a Python script in Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
imported, hence a fresh process), from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
