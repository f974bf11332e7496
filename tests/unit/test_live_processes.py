"""Stopping the cells' launchers (``launch.LiveProcesses``): a stop kills the running ones'
process groups, and a launcher that a thread starts after the stop (it was between the stop
and its start) is killed at once instead of running to its cell timeout."""

from __future__ import annotations

import subprocess
import sys
import time

from mokbench.launch import LiveProcesses, run_process

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_stop_kills_a_running_launcher(tmp_path):
    live = LiveProcesses()
    proc = subprocess.Popen(SLEEP, start_new_session=True)
    live.add(proc)
    t0 = time.monotonic()
    live.stop_all()
    assert proc.wait(timeout=15) != 0
    assert time.monotonic() - t0 < 15
    assert live.stopped


def test_a_launcher_started_after_the_stop_ends_at_once(tmp_path):
    live = LiveProcesses()
    live.stop_all()
    t0 = time.monotonic()
    rc, timed_out = run_process(SLEEP, tmp_path / "cell.log", 60, env={}, live=live)
    assert time.monotonic() - t0 < 15, "ran on after the stop"
    assert rc != 0 and not timed_out
