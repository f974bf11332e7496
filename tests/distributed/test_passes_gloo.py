"""The three passes through the real launcher and torchrun over gloo (2 ranks): the forward is
called with autograd on and inputs that require grad, the inference pass under no_grad, and
each pass is a row; a backend that opts out of inference gets a skipped row."""

import json

import pytest

from mokbench.results import read_rows
from tests.distributed.helpers import mokbench, only_run_dir

pytestmark = pytest.mark.dist

SWEEP = """
name = "passes"
backends = ["grad_probe", "no_inference"]
world_sizes = [2]
[timing]
warmup = 1
iters = 3
[[scenarios]]
preset = "tiny"
tokens_per_rank = [32]
"""


def test_passes_through_gloo(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    log = tmp_path / "probe"
    log.mkdir()
    r = mokbench("sweep", str(f), "--device", "cpu", "--out", str(tmp_path / "out"),
                 env={"MOKBENCH_PROBE_LOG": str(log)})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {(x["backend"], x["pass"]): x for x in
            read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")}
    for p in ("forward", "backward", "inference"):
        assert rows[("grad_probe", p)]["status"] == "ok", rows[("grad_probe", p)]["reason"]
        assert len(rows[("grad_probe", p)]["samples_ms"]) == 3
    assert rows[("grad_probe", "forward")]["keeps_graph"] is True
    assert rows[("grad_probe", "inference")]["tflops"] > 0
    skipped = rows[("no_inference", "inference")]
    assert skipped["status"] == "skipped" and "inference" in skipped["reason"]
    assert rows[("no_inference", "forward")]["status"] == "ok"
    for rank in (0, 1):
        calls = [json.loads(ln) for ln in (log / f"rank{rank}.jsonl").read_text().splitlines()]
        per_pass = 1 + 1 + 3  # check, warm-up, timed
        assert len(calls) == 3 * per_pass  # forward, backward (its forwards), inference
        assert all(c == {"grad": True, "x": True, "p": True} for c in calls[:2 * per_pass])
        assert all(c == {"grad": False, "x": False, "p": False} for c in calls[2 * per_pass:])
    assert "forward (training) pass" in r.stdout and "inference (no_grad) pass" in r.stdout


def test_step_pass_through_gloo(tmp_path):
    """A sweep asking for the step pass (here beside the backward) gets a row for it: the
    training forward and its backward timed together, checked, at three times the forward's
    FLOPs, in the report under its own label."""
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.replace('backends = ["grad_probe", "no_inference"]',
                               'backends = ["grad_probe"]')
                 + 'passes = ["backward", "step"]\n')
    r = mokbench("sweep", str(f), "--device", "cpu", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {x["pass"]: x for x in read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")}
    assert set(rows) == {"backward", "step"}
    step = rows["step"]
    assert step["status"] == "ok", step["reason"]
    assert len(step["samples_ms"]) == 3 and step["max_rel_err"] < 1e-2
    assert step["tflops"] > 0
    assert "step (forward + backward) pass" in r.stdout
    report = (only_run_dir(tmp_path / "out") / "report.md").read_text()
    assert "## step (forward + backward)" in report


def test_sweep_env_reaches_every_rank_and_is_recorded(tmp_path):
    """A sweep file's ``[env]`` table is set in every cell process (the probe backend logs
    only where its variable is set), recorded in env.json and in each row's repro command,
    and shown in the report; variables of the launching shell that change a run (here
    NCCL_DEBUG) are recorded in env.json too."""
    from mokbench.results import read_env

    log = tmp_path / "probe"
    log.mkdir()
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.replace('backends = ["grad_probe", "no_inference"]',
                               'backends = ["grad_probe"]')
                 + f'[env]\nMOKBENCH_PROBE_LOG = "{log}"\n')
    r = mokbench("sweep", str(f), "--device", "cpu", "--out", str(tmp_path / "out"),
                 env={"NCCL_DEBUG": "WARN"})
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run_dir(tmp_path / "out")
    assert (log / "rank0.jsonl").exists() and (log / "rank1.jsonl").exists()
    env = read_env(run_dir)
    assert env["sweep_env"] == {"MOKBENCH_PROBE_LOG": str(log)}
    assert env["environment"]["NCCL_DEBUG"] == "WARN"
    rows = read_rows(run_dir / "rows.jsonl")
    assert rows and all(x["repro"].startswith(f"MOKBENCH_PROBE_LOG={log} ") for x in rows)
    rep = mokbench("report", str(run_dir), "--format", "md")
    assert rep.returncode == 0, rep.stderr
    text = (run_dir / "report.md").read_text()
    assert f"sweep [env]: MOKBENCH_PROBE_LOG={log}" in text
    assert "NCCL_DEBUG=WARN" in text
