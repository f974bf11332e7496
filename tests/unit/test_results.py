"""Row schema and the append-only writer."""

import json

import pytest

from mokbench.results import ROW_COLUMNS, RowWriter, new_row, read_rows


def test_new_row_has_every_column_in_order():
    row = new_row(status="ok", backend="nccl_torch", extra_col=3)
    assert list(row)[: len(ROW_COLUMNS)] == list(ROW_COLUMNS)
    assert row["extra_col"] == 3 and row["median_ms"] is None


def test_bad_status_rejected():
    with pytest.raises(ValueError, match="status='great' is invalid: allowed ok"):
        new_row(status="great")


def test_writer_appends_and_reader_skips_torn_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    w = RowWriter(path)
    w.append(new_row(status="ok", backend="a"))
    w.append(new_row(status="failed", backend="b", reason="boom"))
    with open(path, "a") as f:
        f.write('{"run_id": "x", "trunc')  # a crash mid-write
    rows = read_rows(path)
    assert [r["backend"] for r in rows] == ["a", "b"]
    assert json.loads(path.read_text().splitlines()[1])["reason"] == "boom"
