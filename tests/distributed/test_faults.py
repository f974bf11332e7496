"""Faults: a backend that raises, one that hangs, one that kills its process, one whose
backward runs out of memory. The sweep completes and records each; Ctrl-C keeps finished rows
and --resume completes the run without redoing them."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mokbench.results import read_rows
from tests.distributed.helpers import REPO, cli_env, mokbench, only_run_dir, rows_by_key

pytestmark = pytest.mark.dist

def _default_sigint() -> None:
    """In the sweep's process: SIGINT back to its default, as in a terminal. A background
    job of a non-interactive shell (``bash script &``, how CI or nohup may start the tests)
    ignores SIGINT, its children inherit that, and Python then installs no Ctrl-C handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


SWEEP = """
name = "faults"
backends = [{backends}]
world_sizes = [2]
[timing]
warmup = 1
iters = 2
[[scenarios]]
preset = "tiny"
tokens_per_rank = [32]
"""


def test_faults_are_recorded_and_the_sweep_goes_on(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(backends='"fault_raise", "fault_hang", "fault_kill", '
                                       '"fault_backward", "nccl_torch"'))
    r = mokbench("sweep", str(f), "--device", "cpu", "--timeout-s", "25", "--out",
                 str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {(b, p): r for (b, p, _), r in rows_by_key(only_run_dir(tmp_path / "out")).items()}
    assert rows[("fault_raise", "forward")]["status"] == "failed"
    assert "deliberate failure" in rows[("fault_raise", "forward")]["reason"]
    assert rows[("fault_hang", "forward")]["status"] == "timeout"
    assert rows[("fault_kill", "forward")]["status"] == "failed"
    assert "exit code" in rows[("fault_kill", "backward")]["reason"]
    assert rows[("fault_backward", "forward")]["status"] == "ok"
    assert rows[("fault_backward", "backward")]["status"] == "failed"
    assert "out of memory" in rows[("fault_backward", "backward")]["reason"]
    assert rows[("nccl_torch", "forward")]["status"] == "ok"
    assert rows[("nccl_torch", "backward")]["status"] == "ok"
    assert rows[("nccl_torch", "inference")]["status"] == "ok"
    assert rows[("fault_backward", "inference")]["status"] == "ok"  # after the failed backward


def test_a_crashed_worker_row_carries_its_own_exception(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(backends='"fault_crash"'))
    r = mokbench("sweep", str(f), "--device", "cpu", "--timeout-s", "120", "--out",
                 str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = rows_by_key(only_run_dir(tmp_path / "out"))
    assert sorted(p for _, p, _ in rows) == ["backward", "forward", "inference"]
    for row in rows.values():
        assert row["status"] == "failed"
        assert row["reason"] == "exit code 1: RuntimeError: deliberate crash outside a pass"


def _processes_naming(text: str) -> list[str]:
    """Command lines of the live processes that contain ``text`` (Linux /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if text in cmd:
            found.append(cmd)
    return found


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_then_resume(tmp_path, sig, code):
    """Ctrl-C (SIGINT) or SIGTERM in a hanging cell: the sweep exits with 130 / 143 and says
    how to resume, the cell's torchrun and workers are gone (they have their own process
    group), finished rows are kept, and --resume runs only what is missing; each row names
    the commit it was made at, and the report lists both commits of the resumed run."""
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(backends='"nccl_torch", "fault_hang", "nccl_torch_compile"'))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mokbench.cli", "sweep", str(f), "--device",
                             "cpu", "--timeout-s", "300", "--out", str(out)], cwd=REPO,
                            env=cli_env(MOKBENCH_GIT_SHA="a" * 40), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_default_sigint)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait for the first cell's three rows (one per pass)
        dirs = list(out.glob("*/rows.jsonl")) if out.exists() else []
        if dirs and len(read_rows(dirs[0])) >= 3:
            break
        time.sleep(0.5)
    time.sleep(3)  # now inside the hanging cell
    proc.send_signal(sig)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == code, text
    run_dir = only_run_dir(out)
    assert f"--resume {run_dir}" in " ".join(text.split()), text
    assert not _processes_naming(str(run_dir / "cells")), "the stopped cell left processes"
    first = read_rows(run_dir / "rows.jsonl")
    assert [r["backend"] for r in first] == ["nccl_torch"] * 3
    stopped_md = (run_dir / "report.md").read_text()  # the finished rows' report, at the stop
    assert "| nccl_torch |" in " ".join(stopped_md.split()) and "## Not run" in stopped_md
    assert "fault_hang" in stopped_md.split("## Not run", 1)[1]

    r = mokbench("sweep", "--resume", str(run_dir), "--device", "cpu", "--timeout-s", "20",
                 "--backends", "nccl_torch,fault_hang", env={"MOKBENCH_GIT_SHA": "b" * 40})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(run_dir / "rows.jsonl")
    assert rows[:3] == first, "finished rows must be kept as they were"
    assert [r["git_sha"] for r in rows] == ["a" * 40] * 3 + ["b" * 40] * 3
    report_md = (run_dir / "report.md").read_text()
    assert f"{'a' * 12} (3 rows), {'b' * 12} (3 rows)" in report_md
    assert sum(r["backend"] == "nccl_torch" for r in rows) == 3, "finished cell not redone"
    assert [r["status"] for r in rows if r["backend"] == "fault_hang"] == ["timeout"] * 3


def test_a_stop_between_rounds_keeps_the_finished_rounds_and_resume_redoes_them(tmp_path):
    """``rounds = 2``, stopped in the hanging cell of round 1: the cell that finished its
    first round gets rows pooled over that round (marked 1 of 2, named in the report) instead
    of none; --resume runs it again, both rounds, and its new rows replace them."""
    from mokbench.runner import _finished_keys  # what --resume skips

    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(backends='"nccl_torch", "fault_hang"')
                 .replace("iters = 2", "iters = 2\nrounds = 2"))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mokbench.cli", "sweep", str(f), "--device",
                             "cpu", "--timeout-s", "300", "--out", str(out)], cwd=REPO,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=_default_sigint)
    deadline = time.time() + 120
    while time.time() < deadline:  # nccl_torch's first round: one result file per pass
        if len(list(out.glob("*/cells/*-nccl_torch.r0.*.json"))) == 3:
            break
        time.sleep(0.5)
    time.sleep(3)  # now inside the hanging cell, round 1 of 2
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, text
    run_dir = only_run_dir(out)
    cut = read_rows(run_dir / "rows.jsonl")
    assert [r["backend"] for r in cut] == ["nccl_torch"] * 3, text
    for r in cut:
        assert r["status"] == "ok" and r["rounds"] == 1 and r["rounds_planned"] == 2
        assert r["iters"] == 2 and len(r["round_medians_ms"]) == 1
    assert "rows pooled over the rounds that finished" in " ".join(text.split())
    assert "(1 of 2)" in (run_dir / "report.md").read_text()
    assert _finished_keys(run_dir) == set()

    r = mokbench("sweep", "--resume", str(run_dir), "--device", "cpu", "--timeout-s", "60",
                 "--backends", "nccl_torch")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(run_dir / "rows.jsonl")
    assert rows[:3] == cut and [x["backend"] for x in rows] == ["nccl_torch"] * 6
    for x in rows[3:]:
        assert x["status"] == "ok" and x["rounds"] == 2 and x.get("rounds_planned") is None
        assert x["iters"] == 4 and len(x["round_medians_ms"]) == 2
    assert "(1 of 2)" not in (run_dir / "report.md").read_text()
    assert {b for _, b in _finished_keys(run_dir)} == {"nccl_torch"}


def test_parallel_cells_stop_together_and_resume(tmp_path):
    """--parallel 2 on CPU (gloo): the two eager cells finish side by side with the hanging
    ones; SIGTERM stops both hanging cells (no process left, no rows for them), and --resume
    --parallel 2 times both out at once."""
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.format(backends='"nccl_torch", "fault_hang"')
                 .replace("tokens_per_rank = [32]", "tokens_per_rank = [32, 48]"))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mokbench.cli", "sweep", str(f), "--device",
                             "cpu", "--timeout-s", "300", "--parallel", "2", "--out", str(out)],
                            cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:  # both nccl_torch cells done: six rows
        dirs = list(out.glob("*/rows.jsonl")) if out.exists() else []
        if dirs and len(read_rows(dirs[0])) >= 6:
            break
        time.sleep(0.5)
    time.sleep(3)  # both hanging cells running now
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, text
    run_dir = only_run_dir(out)
    assert not _processes_naming(str(run_dir / "cells")), "a stopped cell left processes"
    first = read_rows(run_dir / "rows.jsonl")
    assert [(r["backend"], r["status"], r["parallel_cells"]) for r in first] == \
        [("nccl_torch", "ok", 2)] * 6

    t0 = time.time()
    r = mokbench("sweep", "--resume", str(run_dir), "--device", "cpu", "--timeout-s", "20",
                 "--parallel", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(run_dir / "rows.jsonl")
    assert rows[:6] == first
    assert [r["status"] for r in rows[6:]] == ["timeout"] * 6
    assert time.time() - t0 < 2 * 20, "the two hanging cells timed out side by side"
