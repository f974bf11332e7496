"""Bad run folders through the real CLI: --resume with another sweep or another EP size, a
folder that is not a run, a corrupt env.json (one-line errors); rows.jsonl lines that are not
row objects (skipped with a warning naming the line, the other rows kept)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from mokbench.results import RowWriter, new_row, read_rows
from tests.unit.cli_errors import assert_one_line_error, invoke
from tests.unit.test_bad_sweep_files import GOOD

AUTO = GOOD.replace("world_sizes = [2]", 'world_sizes = ["auto"]')


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder as `sweep` leaves it: the sweep copy, env.json (4 ranks), rows."""
    d = tmp_path / "20260101-000000-t"
    d.mkdir()
    (d / "sweep.toml").write_text(AUTO)
    (d / "env.json").write_text(json.dumps({"nproc_per_node": 4, "nnodes": 1}))
    (d / "rows.jsonl").write_text("")
    return d


def test_resume_uses_the_runs_own_ranks(run_dir):
    r = invoke("sweep", "--resume", run_dir, "--dry-run", "--device", "cpu")
    assert r.exit_code == 0 and "--nproc-per-node=4" in r.output and "ep4" in r.output, r.output


@pytest.mark.parametrize("flags, needles", [
    (["--nproc-per-node", "2"], ("nproc_per_node=2", "with --resume", "allowed 4")),
    (["--nnodes", "2"], ("nnodes=2", "with --resume", "allowed 1")),
])
def test_resume_with_another_ep_size(run_dir, flags, needles):
    r = invoke("sweep", "--resume", run_dir, "--dry-run", "--device", "cpu", *flags)
    assert_one_line_error(r, *needles)


def test_resume_with_another_sweep_file(run_dir, tmp_path):
    other = tmp_path / "other.toml"
    other.write_text(AUTO.replace("tokens_per_rank = 32", "tokens_per_rank = 64"))
    r = invoke("sweep", other, "--resume", run_dir, "--dry-run", "--device", "cpu")
    assert_one_line_error(r, "sweep_file=", "differs from")
    same = tmp_path / "same.toml"
    same.write_text(AUTO)  # the run's own sweep, named again: allowed
    r = invoke("sweep", same, "--resume", run_dir, "--dry-run", "--device", "cpu")
    assert r.exit_code == 0, r.output


def test_resume_of_something_that_is_not_a_run(tmp_path):
    assert_one_line_error(invoke("sweep", "--resume", tmp_path / "nope", "--device", "cpu"),
                          "resume=", "not a folder")
    assert_one_line_error(invoke("sweep", "--resume", tmp_path, "--device", "cpu"),
                          "resume=", "no sweep copy")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff"])
def test_corrupt_env_json(run_dir, text):
    (run_dir / "env.json").write_text(text, encoding="latin-1")
    RowWriter(run_dir / "rows.jsonl").append(new_row(status="ok", backend="nccl_torch",
                                                     scenario_id="s", **{"pass": "forward"}))
    for args in (["report", run_dir], ["report", run_dir, "-f", "md"],
                 ["sweep", "--resume", run_dir, "--dry-run", "--device", "cpu"]):
        assert_one_line_error(invoke(*args), "env.json of", "JSON object")


def _row(backend: str, median: float) -> dict:
    return new_row(run_id="r", scenario_id="tiny-T64", backend=backend, is_baseline=True,
                   status="ok", median_ms=median, p10_ms=median, p90_ms=median, tflops=1.0,
                   precision="bf16", tokens_per_rank=64, world_size=1, **{"pass": "forward"})


def test_rows_that_are_not_row_objects_are_skipped_with_a_warning(run_dir, caplog):
    lines = [json.dumps(_row("nccl_torch", 2.0)), "[1, 2]", '{"torn": ',
             json.dumps(_row("te", 1.0)), ""]
    (run_dir / "rows.jsonl").write_text("\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="mokbench"):
        rows = read_rows(run_dir / "rows.jsonl")
    assert [r["backend"] for r in rows] == ["nccl_torch", "te"]
    warned = [rec.getMessage() for rec in caplog.records]
    assert any("line 2 is a JSON list" in m for m in warned), warned
    assert any("line 3 is not valid JSON" in m for m in warned), warned


def test_report_names_the_skipped_lines_and_keeps_the_rest(run_dir, capsys):
    lines = [json.dumps(_row("nccl_torch", 2.0)), "[1, 2]", "{oops", json.dumps(_row("te", 1.0))]
    (run_dir / "rows.jsonl").write_text("\n".join(lines) + "\n")
    r = invoke("report", run_dir, "-f", "json")
    assert r.exit_code == 0, r.output
    out = r.output + capsys.readouterr().err
    assert "line 2 is a JSON list" in out and "line 3 is not valid JSON" in out, out
    summary = json.loads((run_dir / "report.json").read_text())
    assert sorted(x["backend"] for x in summary) == ["nccl_torch", "te"]


def test_parquet_hint_keeps_its_brackets(run_dir, monkeypatch):
    RowWriter(run_dir / "rows.jsonl").append(_row("nccl_torch", 2.0))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    r = invoke("report", run_dir, "-f", "parquet")
    assert r.exit_code == 2 and "pip install 'mokbench[parquet]'" in r.output, r.output
