"""Shared check for the bad-input tests: the real CLI (typer's CliRunner) ends a user's mistake
with exit code 2 and one line that names the field, and no Python exception escapes."""

from __future__ import annotations

from typer.testing import CliRunner, Result

from mokbench.cli import app

runner = CliRunner()


def invoke(*args: str) -> Result:
    """Run ``mokbench ARGS`` in-process, wide enough that no line wraps."""
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def assert_one_line_error(r: Result, *needles: str) -> str:
    """Exit code 2, a SystemExit (not an escaped exception), one ``error:`` line holding every
    needle and "allowed"; returns that line."""
    assert isinstance(r.exception, SystemExit), (r.exception, r.output)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.output
    line = errors[0]
    assert all(n in line for n in needles) and "allowed" in line, line
    assert r.output.rstrip("\n").endswith(line), r.output  # nothing after it: one line
    return line
