"""The real launcher and torchrun over gloo: nccl_torch at world sizes 2 and 4 against the
reference, the CLI's default sweep, and the two-node path on localhost."""

import json
import socket
import subprocess
import sys

import pytest
import torch

from mokbench.results import ROW_COLUMNS, read_rows
from tests.distributed.helpers import REPO, cli_env, mokbench, only_run_dir

pytestmark = pytest.mark.dist

SWEEP = """
name = "dist"
backends = ["nccl_torch"]
world_sizes = [{ws}]
[timing]
warmup = 1
iters = 3
[[scenarios]]
preset = "tiny"
num_experts = 16
tokens_per_rank = [96]
routing = ["uniform", "imbalanced"]
"""


def _free_port_range() -> int:
    """A base port whose RDZV_PORT_SLOTS ports (one per cell) are all free, below Linux's
    ephemeral range (32768 and up): a port the OS hands out for outgoing connections can
    be taken by a client socket of an earlier cell between the check and its use."""
    import random

    from mokbench.launch import RDZV_PORT_SLOTS

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - RDZV_PORT_SLOTS)
        try:
            for p in range(base, base + RDZV_PORT_SLOTS):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range below 32000")


def test_nccl_torch_over_gloo_world_2_and_4(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(ws="2, 4"))
    r = mokbench("sweep", str(f), "--device", "cpu", "--nproc-per-node", "4", "--out",
                 str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run_dir(tmp_path / "out")
    rows = read_rows(run_dir / "rows.jsonl")
    assert len(rows) == 2 * 2 * 3  # world sizes x routings x passes
    for row in rows:
        assert set(ROW_COLUMNS) <= set(row)
        assert row["status"] == "ok", row["reason"]
        assert 0 < row["max_rel_err"] < 1e-2 and row["median_ms"] > 0
        assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
    assert {r["world_size"] for r in rows} == {2, 4}
    assert (run_dir / "env.json").exists() and (run_dir / "sweep.toml").exists()


def test_backend_variants_are_separate_rows(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(ws=2).replace('["nccl_torch"]',
                                            '["nccl_torch", "nccl_torch@tag=b"]')
                 .replace('["uniform", "imbalanced"]', '"uniform"'))
    r = mokbench("sweep", str(f), "--device", "cpu", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")
    assert sorted({x["backend"] for x in rows}) == ["nccl_torch", "nccl_torch@tag=b"]
    assert all(x["status"] == "ok" for x in rows) and len(rows) == 6
    assert all(x["registry"] == "baselines.nccl_torch:NcclTorchBackend" for x in rows)
    assert any("--backends nccl_torch@tag=b" in x["repro"] for x in rows)


def test_rounds_rotate_the_cells_and_pool_their_samples(tmp_path):
    """``[timing] rounds = 2``: each cell runs twice, the second round in the order rotated
    by one cell, and each row is written once, over both rounds' samples; a backend that
    fails names the round; the report and env.json say so."""
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(ws=2).replace('["nccl_torch"]',
                                            '["nccl_torch", "nccl_torch@tag=b", "fault_raise"]')
                 .replace('["uniform", "imbalanced"]', '"uniform"')
                 .replace("iters = 3", "iters = 3\nrounds = 2")
                 + 'passes = ["forward"]\n')
    r = mokbench("sweep", str(f), "--device", "cpu", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run_dir(tmp_path / "out")
    rows = {x["backend"]: x for x in read_rows(run_dir / "rows.jsonl")}
    assert len(read_rows(run_dir / "rows.jsonl")) == 3
    for name in ("nccl_torch", "nccl_torch@tag=b"):
        row = rows[name]
        assert row["status"] == "ok" and row["rounds"] == 2, row["reason"]
        assert row["iters"] == 6 and len(row["samples_ms"]) == 6
        assert len(row["round_medians_ms"]) == 2
        pooled = torch.quantile(torch.tensor(row["samples_ms"], dtype=torch.float64), 0.5)
        assert row["median_ms"] == pytest.approx(float(pooled), rel=1e-6)
        assert 0 < row["max_rel_err"] < 1e-2
    assert rows["fault_raise"]["status"] == "failed"
    assert rows["fault_raise"]["reason"].startswith("round 1 of 2: ")
    cells = run_dir / "cells"
    stems = {name: next(cells.glob(f"*-{name}.r0.log")).name.split(".r0")[0]
             for name in ("nccl_torch", "fault_raise")}
    ends = {(n, k): cells.joinpath(f"{s}.r{k}.log").stat().st_mtime_ns
            for n, s in stems.items() for k in (0, 1)}
    assert ends[("nccl_torch", 0)] < ends[("fault_raise", 0)]  # round 0: sweep order
    assert ends[("fault_raise", 1)] < ends[("nccl_torch", 1)]  # round 1: rotated by one
    assert "Rounds: each scenario's cells ran 2 times" in (run_dir / "report.md").read_text()
    assert json.loads((run_dir / "env.json").read_text())["rounds"] == 2


def test_default_sweep_runs_on_cpu(tmp_path):
    r = mokbench("sweep", "--device", "cpu", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run_dir(tmp_path / "out")
    rows = read_rows(run_dir / "rows.jsonl")
    ok = [x for x in rows if x["backend"] == "nccl_torch"]
    assert ok and all(x["status"] == "ok" and x["world_size"] == 2 for x in ok)
    mok = [x for x in rows if x["backend"] == "mok"]
    assert mok and all(x["status"] == "skipped" and "GPU" in x["reason"] for x in mok)
    assert {x["pass"] for x in ok} == {"forward", "backward", "inference"}
    for label in ("forward (training) pass", "backward pass", "inference (no_grad) pass"):
        assert label in r.stdout
    # The sweep leaves report.md and the charts; the report reads whole at 80 columns, piped.
    md = (run_dir / "report.md").read_text()
    assert "## inference (no_grad)" in md and "plots/speedup.png" in md
    assert (run_dir / "plots" / "speedup.png").exists()
    narrow = mokbench("report", str(run_dir), env={"COLUMNS": "80"})
    assert narrow.returncode == 0, narrow.stdout + narrow.stderr
    lines = [ln for ln in narrow.stdout.splitlines() if not ln.startswith("run folder:")]
    assert max(len(line.rstrip()) for line in lines) <= 80
    for x in ok:
        assert f"{x['median_ms']:.3f}" in narrow.stdout


def test_two_nodes_on_localhost(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(ws=2))
    port = str(_free_port_range())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "mokbench.cli", "sweep", str(f), "--device", "cpu", "--nnodes", "2",
         "--node-rank", str(i), "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--out", str(tmp_path / f"out{i}")], cwd=REPO, env=cli_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    rows = read_rows(only_run_dir(tmp_path / "out0") / "rows.jsonl")
    assert len(rows) == 6 and all(r["status"] == "ok" and r["world_size"] == 2 for r in rows)
    assert not (tmp_path / "out1").exists() or not list((tmp_path / "out1").rglob("rows.jsonl"))


def test_dry_run_and_bad_input(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(ws=2))
    r = mokbench("sweep", str(f), "--dry-run", "--device", "cpu")
    assert r.returncode == 0 and "torch.distributed.run" in r.stdout and "2 cells" in r.stdout
    f.write_text(SWEEP.format(ws=2).replace('"nccl_torch"', '"ncll"'))
    r = mokbench("sweep", str(f), "--device", "cpu")
    assert r.returncode == 2
    assert "backend='ncll' is unknown: allowed nccl_torch" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr
