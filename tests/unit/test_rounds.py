"""Rounds (mokbench.rounds): the run order each round and how a row pools its rounds."""

from __future__ import annotations

import json

import pytest
import torch

from mokbench.rounds import pool, rotated
from mokbench.scenario import Scenario, preset
from mokbench.sweep import Cell


def _cells(tokens: int, backends: list[str]) -> list[Cell]:
    scn = Scenario(shape=preset("tiny"), tokens_per_rank=tokens, world_size=1)
    return [Cell(scn, b) for b in backends]


def test_each_round_rotates_the_scenario_by_one_cell():
    todo = list(enumerate(_cells(8, ["a", "b", "c"]) + _cells(16, ["a", "b", "c"])))
    order = [(i, c.backend, r) for i, c, r in rotated(todo, 3)]
    assert order == [
        (0, "a", 0), (1, "b", 0), (2, "c", 0),
        (1, "b", 1), (2, "c", 1), (0, "a", 1),
        (2, "c", 2), (0, "a", 2), (1, "b", 2),
        (3, "a", 0), (4, "b", 0), (5, "c", 0),
        (4, "b", 1), (5, "c", 1), (3, "a", 1),
        (5, "c", 2), (3, "a", 2), (4, "b", 2),
    ]
    # every backend takes every place once, and its last round closes its row
    assert rotated(todo, 1) == [(i, c, 0) for i, c in todo]


def test_more_rounds_than_cells_wraps():
    todo = list(enumerate(_cells(8, ["a", "b"])))
    assert [c.backend for _, c, _ in rotated(todo, 3)] == ["a", "b", "b", "a", "a", "b"]


def _ok(samples: list[float], err: float, tflops_at_median: float, **extra) -> dict:
    t = torch.tensor(samples, dtype=torch.float64)
    med = float(torch.quantile(t, 0.5))
    return {"status": "ok", "reason": "", "median_ms": med, "samples_ms": samples,
            "iters": len(samples), "max_rel_err": err, "max_abs_err": err / 10,
            "tflops": tflops_at_median, "peak_mem_bytes": 100, "cell_wall_s": 2.0, **extra}


def test_pool_is_over_every_rounds_samples():
    r0 = _ok([1.0, 2.0, 3.0], 1e-3, 30.0, worst_tensor="dx")
    r1 = _ok([10.0, 11.0, 12.0], 2e-3, 2.0 * 30.0 / 11.0, worst_tensor="dw")
    out = pool([r0, r1])
    assert out["status"] == "ok" and out["rounds"] == 2
    assert out["iters"] == 6 and out["samples_ms"] == [1.0, 2.0, 3.0, 10.0, 11.0, 12.0]
    assert out["median_ms"] == pytest.approx(6.5)  # the pooled median, not a mean of medians
    assert out["p10_ms"] == pytest.approx(1.5) and out["p90_ms"] == pytest.approx(11.5)
    assert out["min_ms"] == 1.0 and out["max_ms"] == 12.0
    assert out["round_medians_ms"] == [2.0, 11.0]
    assert out["tflops"] == pytest.approx(30.0 * 2.0 / 6.5)  # same FLOPs, pooled median
    assert out["max_rel_err"] == 2e-3 and out["worst_tensor"] == "dw"  # the worst round's
    assert out["cell_wall_s"] == 4.0


def test_a_failed_round_fails_the_row_and_is_named():
    bad = {"status": "timeout", "reason": "timeout after 60 s: hang"}
    out = pool([_ok([1.0], 1e-3, 1.0), bad, _ok([1.0], 1e-3, 1.0)])
    assert out["status"] == "timeout" and out["reason"] == "round 2 of 3: timeout after 60 s: hang"
    skipped = {"status": "skipped", "reason": "needs a CUDA GPU"}
    assert pool([skipped, skipped])["reason"] == "needs a CUDA GPU"


def test_the_report_says_what_a_pooled_row_means():
    import pandas as pd

    from mokbench.report import rounds_note

    assert rounds_note(pd.DataFrame({"median_ms": [1.0]})) is None
    assert rounds_note(pd.DataFrame({"rounds": [None, 1]})) is None
    note = rounds_note(pd.DataFrame({"rounds": [None, 3]}))
    assert "ran 3 times" in note and "round_medians_ms" in note


def test_a_resumed_run_keeps_its_rounds(tmp_path):
    import json

    from mokbench.runner import _rounds
    from mokbench.sweep import Sweep

    sw = Sweep("s", rounds=2)
    assert _rounds(None, sw, None) == 2  # the sweep's [timing] rounds
    assert _rounds(4, sw, None) == 4  # --rounds over it
    (tmp_path / "env.json").write_text(json.dumps({"rounds": 3}))
    assert _rounds(None, sw, tmp_path) == 3  # the run's own, on --resume
    (tmp_path / "env.json").write_text(json.dumps({"rounds": 1}))
    assert _rounds(None, sw, tmp_path) == 1  # --rounds 1 over the file's 2, kept
    (tmp_path / "env.json").write_text(json.dumps({}))  # a run made before rounds existed
    assert _rounds(None, Sweep("s"), tmp_path) == 1


def test_rounds_cut_short_are_pooled_and_marked_partial():
    from mokbench.rounds import is_partial

    out = pool([_ok([1.0, 2.0, 3.0], 1e-3, 30.0)], planned=3)
    assert out["status"] == "ok" and out["rounds"] == 1 and out["rounds_planned"] == 3
    assert out["median_ms"] == pytest.approx(2.0) and out["round_medians_ms"] == [2.0]
    assert is_partial(out)
    assert not is_partial(pool([_ok([1.0], 1e-3, 1.0)] * 2))  # every round ran
    assert not is_partial({"rounds": 3, "rounds_planned": 3}) and not is_partial({})
    bad = {"status": "timeout", "reason": "timeout after 60 s: hang"}
    failed = pool([_ok([1.0], 1e-3, 1.0), bad], planned=3)
    assert failed["reason"] == "round 2 of 3: timeout after 60 s: hang"
    assert failed["rounds"] == 2 and failed["rounds_planned"] == 3


def test_the_report_names_the_rows_a_stop_cut_short():
    import pandas as pd

    from mokbench.report import rounds_note

    summary = pd.DataFrame({"backend": ["a", "b"], "scenario_id": ["s", "s"],
                            "rounds": [2, 1], "rounds_planned": [None, 2]})
    note = rounds_note(summary)
    assert "ran 2 times" in note and "b at s (1 of 2)" in note and "a at" not in note
    only_cut = rounds_note(summary.iloc[[1]])  # a run stopped in its second round
    assert only_cut is not None and "b at s (1 of 2)" in only_cut


def test_a_stop_pools_only_the_rounds_this_sweep_ran(tmp_path):
    """``CellRunner.pool_stopped_rounds``: a cell stopped after two of three rounds gets rows
    over those two; a cell whose first round never ran in this sweep gets none, even with an
    earlier sweep's round files in the folder; a cell that began again here pools only its
    new round, the earlier sweep's later rounds removed when its round 0 ran."""
    from mokbench.launch import CellRunner, LaunchOptions
    from mokbench.results import read_rows

    runner = CellRunner(tmp_path, "run", LaunchOptions(device="cpu"))
    a, b, c = (_cells(t, ["nccl_torch"])[0] for t in (8, 16, 24))
    passes = a.scenario.passes

    def result(ms: float) -> dict:
        return {p: _ok([ms, ms, ms], 1e-3, 1.0) for p in passes}

    for stale in (b, c):  # an earlier, stopped sweep's rounds 0 and 1
        for k in (0, 1):
            for p in passes:
                runner.cells_dir.joinpath(f"{stale.stem}.r{k}.{p}.json").write_text(
                    json.dumps(_ok([9.0], 1e-3, 1.0)))
    assert runner._pool_rounds(a, result(1.0), 0, 3) is None
    assert runner._pool_rounds(a, result(2.0), 1, 3) is None
    assert runner._pool_rounds(c, result(3.0), 0, 3) is None
    rows = runner.pool_stopped_rounds(3)
    assert read_rows(tmp_path / "rows.jsonl") == json.loads(json.dumps(rows, default=str))
    by_cell = {(r["tokens_per_rank"], r["pass"]): r for r in rows}
    assert len(rows) == 2 * len(passes) and {t for t, _ in by_cell} == {8, 24}
    for p in passes:
        assert by_cell[(8, p)]["rounds"] == 2 and by_cell[(8, p)]["rounds_planned"] == 3
        assert by_cell[(8, p)]["round_medians_ms"] == [1.0, 2.0]
        assert by_cell[(24, p)]["rounds"] == 1 and by_cell[(24, p)]["round_medians_ms"] == [3.0]
