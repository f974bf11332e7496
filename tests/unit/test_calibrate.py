"""Ceilings on CPU with small sizes: positive numbers, no all-to-all with one rank, merged into
env.json; the torchrun path over gloo (marked dist) measures the all-to-all too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mokbench import calibrate
from mokbench.backend import RunContext

SMALL = {"gemm_n": 64, "copy_bytes": 1 << 16, "a2a_bytes": 1 << 12, "iters": 3, "warmup": 1}


def test_measure_ceilings_cpu_single_process():
    got = calibrate.measure_ceilings(RunContext(device=torch.device("cpu")), **SMALL)
    assert got["bf16_tflops"] > 0 and got["copy_gbps"] > 0
    assert got["fp8_tflops"] is None or got["fp8_tflops"] > 0
    assert got["a2a_busbw_gbps"] is None  # one rank: nothing crosses a link
    assert got["gemm_n"] == 64 and got["device"] == "cpu" and got["world_size"] == 1


def test_formulas_follow_the_timed_median(monkeypatch):
    """With every iteration timed at 2 ms the ceilings are the documented formulas."""
    monkeypatch.setattr(calibrate, "_time_ms", lambda fn, device, iters, warmup: [2.0] * iters)
    cpu = torch.device("cpu")
    assert calibrate.gemm_tflops(100, cpu) == pytest.approx(2 * 100**3 / 2e-3 / 1e12)
    assert calibrate.copy_gbps(4000, cpu) == pytest.approx(2 * 4000 / 2e-3 / 1e9)


def test_main_merges_into_env_json(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(calibrate.torch.cuda, "is_available", lambda: False)
    (tmp_path / "env.json").write_text(json.dumps({"ceilings": {"nvlink_gbps": 450.0},
                                                   "note": "kept"}))
    args = ["--out", str(tmp_path), "--gemm-n", "64", "--copy-bytes", "65536", "--iters", "3",
            "--warmup", "1"]
    assert calibrate.main(args) == 0
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["note"] == "kept"
    c = env["ceilings"]
    assert c["nvlink_gbps"] == 450.0 and c["bf16_tflops"] > 0 and c["a2a_busbw_gbps"] is None


@pytest.mark.dist
def test_torchrun_gloo_two_ranks_measures_all_to_all(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "mokbench.calibrate", "--out", str(tmp_path),
           "--gemm-n", "64", "--copy-bytes", "65536", "--a2a-bytes", "65536", "--iters", "3",
           "--warmup", "1"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(repo)}
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    c = json.loads((tmp_path / "env.json").read_text())["ceilings"]
    assert c["world_size"] == 2 and c["a2a_busbw_gbps"] > 0
