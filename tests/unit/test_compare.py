"""`mokbench compare RUN_A RUN_B`: rows matched by (scenario, backend label, pass), B's speedup
over A from each run's own medians, within noise where the p10-p90 ranges overlap, a flag where
the same label ran another resolved config, rows of one run only kept; bad input one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mokbench import compare
from mokbench.errors import InputError
from mokbench.results import new_row
from tests.unit.cli_errors import assert_one_line_error, invoke

REPO = Path(__file__).resolve().parents[2]
OLD, NEW = (REPO / "results" / r for r in ("20261202-014259-h200-bf16-train",
                                            "20261202-104809-h200-bf16-train"))


def _row(scenario: str, backend: str, pass_: str, median: float, spread: float = 0.1,
         status: str = "ok", variant: str = "") -> dict:
    return new_row(run_id="r", scenario_id=scenario, backend=backend,
                   is_baseline=backend != "mok", **{"pass": pass_}, status=status,
                   median_ms=median if status == "ok" else None,
                   p10_ms=median - spread if status == "ok" else None,
                   p90_ms=median + spread if status == "ok" else None, variant=variant)


def _run(path: Path, rows: list[dict], sha: str = "abc1234ffff") -> Path:
    path.mkdir()
    path.joinpath("rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.joinpath("env.json").write_text(json.dumps({"git_sha": sha, "git_dirty": False,
                                                     "gpu_name": "NVIDIA H200"}))
    return path


def test_two_committed_runs_give_their_own_medians_ratio():
    cmp = compare.compare(OLD, NEW, ["mok", "te"])
    key = (cmp.scenario_id.str.startswith("kimi-k2-e48-") & (cmp.backend == "mok")
           & (cmp["pass"] == "backward"))
    row = cmp[key].iloc[0]
    old = [json.loads(ln) for ln in OLD.joinpath("rows.jsonl").read_text().splitlines()]
    a = next(r for r in old if r["scenario_id"] == row.scenario_id and r["backend"] == "mok"
             and r["pass"] == "backward")
    assert row.median_ms_a == a["median_ms"]
    assert row.speedup_b_vs_a == pytest.approx(a["median_ms"] / row.median_ms_b)
    assert not row.same_variant  # the backward's pull token by token since that run
    # Kimi K2.7 Code ran in the old run only: kept, with nothing on B's side
    k27 = cmp[cmp.scenario_id.str.startswith("kimi-k2.7-code")]
    assert len(k27) and set(k27.in_runs) == {"a"} and k27.speedup_b_vs_a.isna().all()
    assert set(cmp.backend) == {"mok", "te"}


def test_noise_status_and_one_sided_rows(tmp_path: Path):
    a = _run(tmp_path / "a", [_row("s1", "te", "forward", 10.0),
                              _row("s1", "mok", "forward", 10.0, variant="x=1"),
                              _row("s1", "mok", "backward", 20.0),
                              _row("s2", "mok", "forward", 5.0)])
    b = _run(tmp_path / "b", [_row("s1", "te", "forward", 10.05),
                              _row("s1", "mok", "forward", 8.0, variant="x=2"),
                              _row("s1", "mok", "backward", 0, status="failed"),
                              _row("s3", "mok", "forward", 4.0)])
    cmp = compare.compare(a, b).set_index(["scenario_id", "backend", "pass"])
    te = cmp.loc[("s1", "te", "forward")]
    assert te.within_noise and te.speedup_b_vs_a == pytest.approx(10.0 / 10.05)
    fast = cmp.loc[("s1", "mok", "forward")]
    assert fast.speedup_b_vs_a == pytest.approx(1.25) and not fast.within_noise
    assert not fast.same_variant and compare.speedup_text(fast) == "1.250x *"
    failed = cmp.loc[("s1", "mok", "backward")]
    assert math.isnan(failed.speedup_b_vs_a) and not failed.within_noise
    assert cmp.loc[("s2", "mok", "forward")].in_runs == "a"
    assert cmp.loc[("s3", "mok", "forward")].in_runs == "b"
    assert list(cmp.index.get_level_values(0)) == ["s1", "s1", "s1", "s2", "s3"]  # A's order


def test_cli_markdown_names_both_runs(tmp_path: Path):
    a = _run(tmp_path / "a", [_row("s1", "mok", "forward", 10.0)], sha="1111111aaaa")
    b = _run(tmp_path / "b", [_row("s1", "mok", "forward", 9.0)], sha="2222222bbbb")
    r = invoke("compare", a, b, "--format", "md")
    assert r.exit_code == 0, r.output
    assert "- A: a (commit 1111111, NVIDIA H200)" in r.output
    assert "- B: b (commit 2222222, NVIDIA H200)" in r.output
    assert "- code: not recorded in A and B" in r.output
    assert "| s1 | mok | forward (training) | ok | 10.000 | 9.900–10.100 | ok | 9.000 " in r.output
    assert "| 1.111x |" in r.output
    table = invoke("compare", a, b)
    assert table.exit_code == 0 and "1.111x" in table.output, table.output


def test_header_says_which_code_folders_differ():
    """The header's code line compares env.json's code_trees folder by folder."""
    from mokbench.compare import code_line

    a = {"code_trees": {"mok_kernels": "k1", "mokbench": "m1", "baselines": "b1"}}
    assert code_line(a, a) == "code: the same in both runs (baselines/, mok_kernels/, mokbench/)"
    b = {"code_trees": {"mok_kernels": "k2", "mokbench": "m1", "baselines": "b2"}}
    assert code_line(a, b) == "code: differs in baselines/, mok_kernels/"
    assert code_line({}, b) == "code: not recorded in A (runs before env.json's code_trees)"
    assert code_line({}, {}).startswith("code: not recorded in A and B")


def test_bad_input_is_one_line(tmp_path: Path):
    a = _run(tmp_path / "a", [_row("s1", "mok", "forward", 10.0)])
    assert_one_line_error(invoke("compare", a, tmp_path / "nope"), "run_dir", "nope")
    assert_one_line_error(invoke("compare", a, a, "--format", "xlsx"), "format", "xlsx")
    assert_one_line_error(invoke("compare", a, a, "-b", "deepep"), "backends", "deepep")
    empty = tmp_path / "empty"
    empty.mkdir()
    empty.joinpath("rows.jsonl").write_text("")
    with pytest.raises(InputError, match="no rows"):
        compare.compare(a, empty)


def test_readme_example_is_what_compare_prints():
    """README's `compare` example quotes the command's own cells for TE's backward at Kimi K2
    384 x 4096."""
    readme = " ".join(REPO.joinpath("README.md").read_text().split())
    cmp = compare.compare(OLD, NEW, ["mok", "te"])
    row = cmp[cmp.scenario_id.str.startswith("kimi-k2-e384-") & (cmp.backend == "te")
              & (cmp["pass"] == "backward")].iloc[0]
    cells = compare.table_rows(cmp.loc[[row.name]])[0]
    quoted = (f"{compare.speedup_text(row)} faster in the second run ({cells[4]} against "
              f"{cells[7]} ms; p10–p90 {cells[5]} and {cells[8]} ms)")
    assert quoted in readme, quoted


@pytest.mark.parametrize("width", [80, 200])
def test_terminal_table_cuts_no_number_at_80_columns(width: int):
    """The table as a piped log or a narrow terminal prints it: every line within the console,
    every median, spread and speedup whole (stacked at 80 columns, flat at 200), the short
    scenario labels' full ids below."""
    import io

    from rich.console import Console

    cmp = compare.compare(OLD, NEW)
    out = io.StringIO()
    compare.render(cmp, OLD, NEW, Console(file=out, width=width))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    for cells in compare.table_rows(cmp):
        for cell in (cells[4], cells[5], cells[7], cells[8], cells[9]):
            assert cell in ("", "-") or cell in text, (width, cell)
    assert ("A p10–p90 ms" in text) == (width == 200)
    for sid in cmp["scenario_id"].unique():
        assert sid in " ".join(text.split()), sid
