"""mokbench.item_trace: the megakernel's per-item trace as a table and a timeline chart."""

from __future__ import annotations

import numpy as np
import pytest

from mokbench import item_trace


def _trace() -> np.ndarray:
    """Two programs of one rank: A items 0-2 ms and 0-1 ms, then a B item 1-3 ms on
    program 1 (times in ns from an arbitrary clock origin); ticket 3 unused."""
    t0 = 5_000_000_000
    rows = [(0, 2, 0, 0), (0, 1, 1, 0), (1, 3, 1, 1)]
    out = np.full((1, 4, 4), -1, dtype=np.int64)
    for i, (a, b, prog, kind) in enumerate(rows):
        out[0, i] = (t0 + a * 1_000_000, t0 + b * 1_000_000, prog, kind)
    return out


def test_summary_adds_up_the_items_per_kind():
    df = item_trace.items(_trace())
    assert list(df.ticket) == [0, 1, 2] and list(df.start_ms) == [0.0, 0.0, 1.0]
    table = item_trace.summarize(df, programs=2)
    a, b, total = table.loc["A dgrad down"], table.loc["B dgrad gate+up"], table.loc["total"]
    assert a["items"] == 2 and a.ms_per_program == pytest.approx(1.5)
    assert b["items"] == 1 and b.ms_per_program == pytest.approx(1.0)
    assert b.first_start_ms == 1.0 and b.last_end_ms == 3.0
    assert total.last_end_ms == 3.0 and total.ms_per_program == pytest.approx(2.5)
    assert total.busy_share == pytest.approx(2.5 / 3.0)


def test_timeline_chart_is_written(tmp_path):
    path = item_trace.plot_timeline(item_trace.items(_trace()), tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("bad, match", [(np.zeros((2, 4)), "shape"),
                                        (np.full((1, 2, 4), -1), "no item"),
                                        (np.array([[[0, 1, 0, 7]]]), "kinds")])
def test_bad_traces_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        item_trace.items(bad)


def test_forward_kinds_name_the_forward_items():
    t = _trace()
    t[0, :3, 3] = (0, 0, 1)
    df = item_trace.items(t, item_trace.FORWARD_KINDS)
    table = item_trace.summarize(df, programs=2)
    assert list(table.index) == ["gate+up", "down", "total"]
    assert table.loc["down", "items"] == 1


def test_windows_put_each_item_in_the_slice_where_it_starts():
    """Over a 3 ms span in three 1 ms slices: both A items start at 0 (1 and 2 ms long), the
    B item at 1 ms; with one slice every item is in it."""
    df = item_trace.items(_trace())
    w = item_trace.windows(df, 3)
    assert list(zip(w.kind, w.window_ms, w["items"])) == [
        ("A dgrad down", "0.00-1.00", 2), ("B dgrad gate+up", "1.00-2.00", 1)]
    a = w.iloc[0]
    assert a.median_us == pytest.approx(1500.0) and a.p90_us == pytest.approx(1900.0)
    assert a.p10_us == pytest.approx(1100.0)
    assert list(item_trace.windows(df, 1)["items"]) == [2, 1]
    with pytest.raises(ValueError, match="n: want >= 1, got 0"):
        item_trace.windows(df, 0)
