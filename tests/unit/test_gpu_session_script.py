"""benchmarks/gpu_session.sh on CPU: a session begun in the background runs its commands (with
the tree and benchmarks/ importable) and a sweep through device_sweep.sh, logs a line per step,
packs the logs and the run folder; a second start does nothing; bad arguments get one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None,
                                reason="needs bash and setsid")


def sh(state: Path, *args: str, timeout: float = 60,
       env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "STATE": str(state), **(env or {}),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def test_a_session_runs_commands_and_a_sweep_then_packs(tmp_path: Path):
    state, pack = tmp_path / "state", tmp_path / "pack"
    commands = tmp_path / "commands.txt"
    commands.write_text("# timing commands\n\necho first line\n"
                        "python -c 'import bench_common, mokbench; print(\"imports ms\")'\n"
                        "exit 3\n")
    r = sh(state, "start", "--until", "500", "--commands", str(commands), "--sweep",
           "sweeps/quick.toml", "--sweep", "sweeps/quick.toml", "--", "--backends", "nccl_torch",
           "--timeout-s", "200")
    assert r.returncode == 0 and "session begun" in r.stdout, r.stderr
    again = sh(state, "start", "--until", "5")
    assert again.returncode == 0 and "already begun" in again.stdout
    rep = sh(state, "report", "--wait", "480", "--pack", str(pack), timeout=500)
    assert rep.returncode == 0, rep.stderr
    log = (state / "session.log").read_text()
    assert "command rc=0: echo first line" in log
    assert "command rc=0: python -c" in log  # the tree and benchmarks/ on PYTHONPATH
    assert "command rc=3: exit 3" in log
    assert "sweep-1: rc=0" in log and "sweep-2: rc=0" in log, log  # one after the other
    assert log.rstrip().endswith("done"), log
    assert "--- session (done)" in rep.stdout and "imports ms" in rep.stdout
    with tarfile.open(pack / "logs.tgz") as t:
        names = t.getnames()
    assert "./session.log" in names and "./commands.log" in names
    runs = []
    for n in (1, 2):  # each sweep's own run folder
        with tarfile.open(pack / f"run-{n}.tgz") as t:
            rows = [m for m in t.getnames() if m.endswith("/rows.jsonl")]
        assert len(rows) == 1
        runs.append(rows[0].split("/")[0])
    assert runs[0] != runs[1]


def test_too_little_time_skips_the_sweep_and_a_long_command_is_stopped(tmp_path: Path):
    state = tmp_path / "state"
    commands = tmp_path / "commands.txt"
    commands.write_text("sleep 30\necho after\n")
    assert sh(state, "start", "--until", "100", "--commands", str(commands), "--sweep",
              "sweeps/quick.toml", env={"COMMAND_S": "2"}).returncode == 0
    rep = sh(state, "report", "--wait", "50")
    assert "command rc=124: sleep 30" in rep.stdout, rep.stdout  # COMMAND_S stops it
    assert "command rc=0: echo after" in rep.stdout
    assert "sweep-1 skipped" in rep.stdout and "(done)" in rep.stdout, rep.stdout
    assert not (state / "sweep-1").exists()


def test_commands_run_while_te_waits_for_its_batches_and_the_sweep_waits_for_te(tmp_path: Path):
    """The commands time mok and torch only, so they run beside TE's install; the sweeps (te
    and megatron rows) wait for it. Here no batch ever comes: the install gives up at the
    deadline, after the command has run, and no sweep starts. The tier runs beside the install
    without TE's and Megatron's tests, which run after a successful install only."""
    state, store = tmp_path / "state", tmp_path / "wheels"
    store.mkdir()
    commands = tmp_path / "commands.txt"
    commands.write_text("echo ran\n")
    assert sh(state, "start", "--until", "75", "--te", str(store), "--tier", "5", "--commands",
              str(commands), "--sweep", "sweeps/quick.toml").returncode == 0
    rep = sh(state, "report", "--wait", "100", timeout=120)
    assert "(done)" in rep.stdout, rep.stdout
    log = (state / "session.log").read_text().splitlines()
    ran = next(i for i, ln in enumerate(log) if "command rc=0: echo ran" in ln)
    te = next(i for i, ln in enumerate(log) if "te: rc=" in ln)
    assert ran < te, log  # the command did not wait for the install
    assert "te: rc=0" not in log[te] and "sweep-1 skipped" in "\n".join(log[te:]), log
    assert not (state / "sweep-1").exists()
    assert any("tier: begun (at most 5s; TE's and Megatron's tests after their install)" in ln
               for ln in log), log
    assert not any("te-check" in ln for ln in log), log  # the install failed


def test_a_deepep_build_runs_beside_the_commands_and_the_sweep_waits_for_it(tmp_path: Path):
    """--deepep unpacks the carried checkout and builds it in the background; a packed folder
    that is not a DeepEP checkout fails with build_deepep.sh's one line, logged and kept in
    deepep.log, the command does not wait for it, and the sweep starts after it."""
    state, src = tmp_path / "state", tmp_path / "DeepEP"
    src.mkdir()
    (src / "README.md").write_text("not a checkout\n")
    tgz = tmp_path / "deepep.tgz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(src, arcname="DeepEP")
    commands = tmp_path / "commands.txt"
    commands.write_text("echo ran\n")
    assert sh(state, "start", "--until", "300", "--deepep", str(tgz), "--commands",
              str(commands), "--sweep", "sweeps/quick.toml", "--", "--backends", "nccl_torch",
              "--timeout-s", "200").returncode == 0
    rep = sh(state, "report", "--wait", "280", timeout=300)
    assert "(done)" in rep.stdout, rep.stdout
    log = (state / "session.log").read_text().splitlines()
    built = next(i for i, ln in enumerate(log) if "deepep: rc=" in ln)
    assert "deepep: rc=2" in log[built] and "not a DeepEP checkout" in log[built], log
    assert "not a DeepEP checkout" in (state / "deepep.log").read_text()
    sweep = next(i for i, ln in enumerate(log) if "sweep-1: sweeps/quick.toml" in ln)
    assert built < sweep, log  # the sweep waited for the build
    assert any("sweep-1: rc=0" in ln for ln in log), log


def test_cut_interrupts_the_running_sweep_keeps_its_cells_and_starts_nothing_after(
        tmp_path: Path):
    """`cut` (to fit the device time left): the running sweep stops as at its time limit,
    its finished cells kept and its run folder packed; the next sweep does not start."""
    import time

    state, pack = tmp_path / "state", tmp_path / "pack"
    sweep = tmp_path / "long.toml"
    sweep.write_text('name = "long"\nbackends = ["nccl_torch"]\nworld_sizes = [1]\n'
                     "[timing]\nwarmup = 1\niters = 3\n[[scenarios]]\npreset = \"tiny\"\n"
                     "tokens_per_rank = [64, 96, 128, 160, 192, 224, 256, 288]\n")
    assert sh(state, "start", "--until", "400", "--sweep", str(sweep), "--sweep",
              "sweeps/quick.toml", "--", "--timeout-s", "200").returncode == 0
    log = state / "sweep-1" / "sweep.log"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (
            log.exists() and " ok " in log.read_text()):  # a first finished cell
        time.sleep(1)
    mid = sh(state, "report", "--pack", str(tmp_path / "mid"))  # the machine could go now
    assert "packed run-1.partial.tgz" in mid.stdout, mid.stdout
    with tarfile.open(tmp_path / "mid" / "run-1.partial.tgz") as t:
        rows = [m for m in t.getnames() if m.endswith("/rows.jsonl")]
        assert len(rows) == 1 and t.extractfile(rows[0]).read().strip(), rows
        t.extractall(tmp_path / "mid", filter="data")
    partial = tmp_path / "mid" / rows[0].split("/")[0]  # a run folder: its tables are made
    rep = subprocess.run([sys.executable, "-m", "mokbench.cli", "report", str(partial)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert rep.returncode == 0 and "nccl_torch" in rep.stdout, rep.stdout + rep.stderr
    cut = sh(state, "cut")
    assert cut.returncode == 0 and "interrupted the running sweep" in cut.stdout, cut
    rep = sh(state, "report", "--wait", "120", "--pack", str(pack), timeout=150)
    assert "(done)" in rep.stdout, rep.stdout
    session = (state / "session.log").read_text()
    assert "sweep-2 skipped (cut)" in session, session
    with tarfile.open(pack / "run-1.tgz") as t:
        rows = [m for m in t.getnames() if m.endswith("/rows.jsonl")]
        text = t.extractfile(rows[0]).read().decode()
    done = [ln for ln in text.splitlines() if ln.strip()]
    assert 1 <= len(done) < 8 * 3, len(done)  # kept, and stopped before the end
    assert not (pack / "run-2.tgz").exists()
    assert not (pack / "run-1.partial.tgz").exists()  # packed whole once it stopped
    again = sh(state, "cut")
    assert again.returncode == 0 and "no sweep was running" in again.stdout


@pytest.mark.parametrize("args, words", [
    (("start", "--until", "soon"), ("--until", "'soon'", "seconds")),
    (("start", "--sweep", "nowhere.toml"), ("--sweep", "nowhere.toml")),
    (("start", "--tie", "5"), ("--tie", "--tier")),
    (("start", "--deepep", "nowhere.tgz"), ("--deepep", "nowhere.tgz", "DeepEP checkout")),
    (("report",), ("no session",)),
    (("nothing",), ("usage",)),
    (("cut",), ("no session",)),
])
def test_bad_arguments_get_one_line(tmp_path: Path, args: tuple, words: tuple):
    r = sh(tmp_path / "state", *args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln]
    assert len(lines) == 1 and "error:" in lines[0], r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_tier_outcome_names_the_failures_of_a_tier_stopped_early(tmp_path: Path):
    """A tier its time limit stopped has no pytest summary: the session's log line still counts
    the outcomes (pytest -v lines) and names each failed test; a finished tier gives pytest's
    summary."""
    stopped, finished = tmp_path / "gpu0.log", tmp_path / "gpu1.log"
    stopped.write_text("[gw0] [  1%] PASSED tests/gpu/test_a.py::test_x[1]\n"
                       "[gw1] [  2%] FAILED tests/gpu/test_b.py::test_y[2-3]\n"
                       "[gw2] [  3%] PASSED tests/gpu/test_b.py::test_z\n")
    func = ("source <(sed -n '/^tier_outcome()/,/^}/p' " + str(SCRIPT) + ")\n"
            'tier_outcome "$@"')
    out = subprocess.run(["bash", "-c", func, "x", str(stopped)], capture_output=True,
                         text=True, check=True).stdout
    assert "stopped early" in out and "1 FAILED" in out and "2 PASSED" in out, out
    assert out.rstrip().endswith("failures: tests/gpu/test_b.py::test_y[2-3]"), out
    finished.write_text("[gw0] [100%] PASSED tests/gpu/test_a.py::test_x[1]\n"
                        "===== 1 failed, 160 passed, 2 skipped in 120.33s (0:02:00) =====\n")
    out = subprocess.run(["bash", "-c", func, "x", str(finished)], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "1 failed, 160 passed, 2 skipped in 120.33s (0:02:00)", out


def test_tier_args_split_as_a_command_line_and_bad_quoting_gets_one_line(tmp_path: Path):
    """TIER_ARGS='-k "fp8 or split"' reaches pytest as two words, not four (which pytest
    reads as the file names 'or' and 'split"'); an unclosed quote stops `start` at once."""
    func = ("source <(sed -n '/^tier_words()/,/^}/p' " + str(SCRIPT) + ")\n"
            "PROG=gpu_session.sh; tier_words")
    env = {**os.environ, "TIER_ARGS": '-k "fp8 or split" -x'}
    out = subprocess.run(["bash", "-c", func], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert out.splitlines() == ["-k", "fp8 or split", "-x"], out
    env["TIER_ARGS"] = ""
    assert subprocess.run(["bash", "-c", func], capture_output=True, text=True, env=env,
                          check=True).stdout == ""
    r = sh(tmp_path / "state", "start", "--until", "5", env={"TIER_ARGS": '-k "fp8 or'})
    lines = [ln for ln in r.stderr.splitlines() if ln]
    assert r.returncode == 2 and len(lines) == 1 and "TIER_ARGS" in lines[0], r.stderr
    assert not (tmp_path / "state" / "begun").exists()
