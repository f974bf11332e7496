"""Report math on known rows: fastest ok baseline per (scenario, pass), ceiling fraction, and the
files each format writes."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from mokbench import report
from mokbench.results import RowWriter, new_row

S1, S2 = "tiny-T64-ep1-bf16", "tiny-T128-ep1-fp8"


def row(scenario: str, backend: str, pass_: str, median: float | None, *, status: str = "ok",
        baseline: bool = True, tflops: float | None = None, precision: str = "bf16",
        reason: str | None = None) -> dict:
    return new_row(run_id="r", scenario_id=scenario, backend=backend, is_baseline=baseline,
                   status=status, reason=reason, median_ms=median, p10_ms=median, p90_ms=median,
                   tflops=tflops, precision=precision, max_rel_err=1e-3, tokens_per_rank=64,
                   world_size=1, **{"pass": pass_})


def known_rows() -> list[dict]:
    return [
        # S1 forward: te (8 ms) beats nccl_torch (10 ms); deepep failed with a faster "time".
        row(S1, "nccl_torch", "forward", 10.0, tflops=100.0),
        row(S1, "te", "forward", 8.0, tflops=125.0),
        row(S1, "deepep", "forward", 1.0, status="failed", reason="boom " * 40),
        row(S1, "mok", "forward", 4.0, baseline=False, tflops=250.0),
        # S1 backward: only nccl_torch ran ok.
        row(S1, "nccl_torch", "backward", 30.0, tflops=66.0),
        row(S1, "te", "backward", None, status="skipped", reason="no TE"),
        row(S1, "mok", "backward", 20.0, baseline=False, tflops=99.0),
        # S2 forward (fp8): no baseline ran ok; mok failed.
        row(S2, "nccl_torch", "forward", None, status="timeout", reason="600 s", precision="fp8"),
        row(S2, "mok", "forward", 5.0, baseline=False, tflops=700.0, precision="fp8"),
    ]


ENV = {"ceilings": {"bf16_tflops": 500.0, "fp8_tflops": None}}


@pytest.fixture
def summary() -> pd.DataFrame:
    return report.summarize(pd.DataFrame(known_rows()), ENV)


def pick(df: pd.DataFrame, scenario: str, backend: str, pass_: str) -> pd.Series:
    sel = df[(df.scenario_id == scenario) & (df.backend == backend) & (df["pass"] == pass_)]
    assert len(sel) == 1
    return sel.iloc[0]


def test_speedup_uses_fastest_ok_baseline_per_scenario_and_pass(summary):
    mok_f = pick(summary, S1, "mok", "forward")
    assert mok_f.best_baseline == "te"
    assert mok_f.speedup_vs_best_baseline == pytest.approx(8.0 / 4.0)
    assert pick(summary, S1, "te", "forward").speedup_vs_best_baseline == pytest.approx(1.0)
    assert pick(summary, S1, "nccl_torch", "forward").speedup_vs_best_baseline == pytest.approx(0.8)
    mok_b = pick(summary, S1, "mok", "backward")
    assert mok_b.best_baseline == "nccl_torch"  # the skipped te backward is ignored
    assert mok_b.speedup_vs_best_baseline == pytest.approx(30.0 / 20.0)


def test_failed_baseline_is_ignored_and_failed_rows_get_nan(summary):
    deepep = pick(summary, S1, "deepep", "forward")
    assert deepep.best_baseline == "te"  # its 1 ms did not count
    assert math.isnan(deepep.speedup_vs_best_baseline)
    assert math.isnan(deepep.ceiling_frac)


def test_no_ok_baseline_gives_nan(summary):
    mok = pick(summary, S2, "mok", "forward")
    assert math.isnan(mok.speedup_vs_best_baseline)
    assert pd.isna(mok.best_baseline)


def test_ceiling_fraction_by_precision(summary):
    assert pick(summary, S1, "mok", "forward").ceiling_frac == pytest.approx(250.0 / 500.0)
    assert pick(summary, S1, "nccl_torch", "backward").ceiling_frac == pytest.approx(66 / 500)
    assert math.isnan(pick(summary, S2, "mok", "forward").ceiling_frac)  # fp8 ceiling is None
    no_env = report.summarize(pd.DataFrame(known_rows()), {})
    assert no_env.ceiling_frac.isna().all()


def test_order_scenario_pass_then_baselines_first(summary):
    got = list(zip(summary.scenario_id, summary["pass"], summary.backend))
    assert got == [
        (S1, "forward", "deepep"), (S1, "forward", "nccl_torch"), (S1, "forward", "te"),
        (S1, "forward", "mok"), (S1, "backward", "nccl_torch"), (S1, "backward", "te"),
        (S1, "backward", "mok"), (S2, "forward", "nccl_torch"), (S2, "forward", "mok"),
    ]


def write_run(tmp_path: Path, rows: list[dict], env: dict | None = None) -> Path:
    run = tmp_path / "run1"
    w = RowWriter(run / "rows.jsonl")
    for r in rows:
        w.append(r)
    (run / "env.json").write_text(json.dumps(env if env is not None else ENV))
    return run


def test_load_rows_keeps_last_duplicate(tmp_path):
    rows = known_rows() + [row(S1, "mok", "forward", 2.0, baseline=False, tflops=500.0)]
    with open(write_run(tmp_path, rows) / "rows.jsonl", "a") as f:
        f.write('{"torn": ')  # a crash mid-write
    df = report.load_rows(tmp_path / "run1")
    assert len(df) == len(known_rows())
    assert pick(df, S1, "mok", "forward").median_ms == 2.0
    assert set(report.ROW_COLUMNS) <= set(df.columns)


def test_render_rich_shows_passes_and_reasons(summary):
    console = Console(file=io.StringIO(), width=250, record=True)
    report.render_rich(summary, console)
    text = console.export_text()
    # rows without keeps_graph or an inference pass: the forward's mode is not recorded
    assert "forward pass" in text and "backward pass" in text
    assert "2.00x" in text and "1.50x" in text and "50%" in text
    assert "skipped [" in text and "timeout [" in text  # reasons as numbered notes
    assert "] no TE" in text and "] 600 s" in text
    assert "boom " * 5 in text and "…" in text  # long reason truncated
    assert "boom " * 40 not in text


@pytest.mark.parametrize("fmt", ["md", "csv", "json", "parquet", "table"])
def test_write_report_formats(tmp_path, fmt):
    run = write_run(tmp_path, known_rows())
    path = report.write_report(run, fmt)
    assert path.exists() and path.parent == run
    if fmt == "md":
        assert path.name == "report.md"
        text = path.read_text()
        assert "per-iteration max over ranks" in text and "untimed forward" in text
        assert "## forward" in text and "## backward" in text
        assert "| tiny-T64-ep1-bf16 | **mok** | ok | 4.000 |" in text
    elif fmt == "csv":
        df = pd.read_csv(path)
        assert len(df) == 9 and "speedup_vs_best_baseline" in df.columns
    elif fmt == "json":
        recs = json.loads(path.read_text())
        mok = [r for r in recs if r["backend"] == "mok" and r["scenario_id"] == S1
               and r["pass"] == "forward"][0]
        assert mok["speedup_vs_best_baseline"] == pytest.approx(2.0)
        assert recs[0]["speedup_vs_best_baseline"] is None  # deepep failed: NaN -> null
    elif fmt == "parquet":
        df = pd.read_parquet(path)
        assert df.ceiling_frac.notna().sum() == 5  # ok bf16 rows with tflops
    else:
        assert path.name == "report.txt" and "forward pass" in path.read_text()


def test_write_report_rejects_unknown_format(tmp_path):
    with pytest.raises(report.ReportError, match="allowed table"):
        report.write_report(write_run(tmp_path, known_rows()), "xlsx")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name == "pyarrow":
            raise ImportError("no pyarrow")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(report.ReportError, match="needs pyarrow"):
        report.write_report(write_run(tmp_path, known_rows()), "parquet")


def test_empty_run(tmp_path):
    run = write_run(tmp_path, [])
    assert report.summarize(report.load_rows(run), {}).empty
    assert "No rows" in report.write_report(run, "md").read_text()


def test_variant_is_a_tag_with_its_knobs_in_the_legend():
    rows = known_rows()
    rows[3]["variant"] = "comm=nccl_a2a,tiles=4"
    md = report.to_markdown(report.summarize(pd.DataFrame(rows), ENV), {}, "r")
    assert "**mok [a]**" in md
    assert "- [a] mok: comm=nccl_a2a, tiles=4" in md


def test_inference_is_its_own_comparison():
    """Speedup is per pass: the no_grad forward compares with the baselines' no_grad forwards."""
    rows = known_rows() + [
        row(S1, "nccl_torch", "inference", 6.0, tflops=160.0),
        row(S1, "te", "inference", 7.0, tflops=140.0),
        row(S1, "mok", "inference", 3.0, baseline=False, tflops=330.0),
    ]
    summary = report.summarize(pd.DataFrame(rows), ENV)
    mok_i = pick(summary, S1, "mok", "inference")
    assert mok_i.best_baseline == "nccl_torch"
    assert mok_i.speedup_vs_best_baseline == pytest.approx(6.0 / 3.0)
    assert pick(summary, S1, "mok", "forward").best_baseline == "te"
    passes = list(pd.unique(summary[summary.scenario_id == S1]["pass"]))
    assert passes == ["forward", "backward", "inference"]
    md = report.to_markdown(summary, ENV, "r")
    for head in ("## forward (training)", "## backward", "## inference (no_grad)"):
        assert head in md
    assert md.index("## backward") < md.index("## inference (no_grad)")
    assert "torch.no_grad()" in md


def test_forward_label_follows_what_the_run_recorded(summary):
    """A run without keeps_graph or inference rows (made before the training/inference split)
    labels its forward plainly and says why; with them, "forward (training)"."""
    from mokbench.scenario import pass_label

    old = report.to_markdown(summary, {}, "old")
    assert "## forward\n" in old and report.OLD_RUN_NOTE in old
    assert pass_label("forward", summary) == "forward"
    new = summary.assign(keeps_graph=True)
    md = report.to_markdown(new, {}, "new")
    assert "## forward (training)" in md and report.OLD_RUN_NOTE not in md
    assert pass_label("forward", new) == "forward (training)" == pass_label("forward")


def test_cells_the_sweep_did_not_reach_are_listed(tmp_path):
    """A run stopped part way (a lease ended, a node went away): report.md lists every cell of
    the run's sweep copy with no row, in sweep order, and says how to run them; a complete run
    has no such section."""
    from mokbench.sweep import expand, parse_text

    text = ('name = "t"\nbackends = ["nccl_torch", "mok"]\nworld_sizes = [1]\n'
            '[[scenarios]]\npreset = "kimi-k2"\nnum_experts = 8\ntokens_per_rank = [64, 128]\n')
    keys = [c.key for c in expand(parse_text(text, ".toml"), 1).cells]
    assert len(keys) == 4
    first = [row(keys[0][0], keys[0][1], p, 1.0) for p in ("forward", "backward")]
    run = write_run(tmp_path, first, {"nproc_per_node": 1})
    (run / "sweep.toml").write_text(text)
    md = report.write_report(run, "md").read_text()
    section = md.split("## Not run", 1)[1]
    assert "3 cells of this run's sweep have no rows" in section
    listed = [tuple(c.strip() for c in ln.strip("|").split("|"))
              for ln in section.splitlines() if ln.startswith("| kimi")]
    assert listed == [(*k, "stopped before it, or left out by --backends") for k in keys[1:]]
    # a run that recorded its --backends tells the two apart
    env = json.loads((run / "env.json").read_text())
    (run / "env.json").write_text(json.dumps({**env, "backends": ["nccl_torch"]}))
    section = report.write_report(run, "md").read_text().split("## Not run", 1)[1]
    why = {tuple(c.strip() for c in ln.strip("|").split("|"))[1:] for ln in section.splitlines()
           if ln.startswith("| kimi")}
    assert why == {("mok", "left out by --backends"), ("nccl_torch", "stopped before it")}
    done = [row(s, b, p, 1.0) for s, b in keys for p in ("forward", "backward")]
    (run / "rows.jsonl").unlink()
    run = write_run(tmp_path, done, {"nproc_per_node": 1})
    assert "## Not run" not in report.write_report(run, "md").read_text()


def test_fp8_rows_show_their_speedup_over_the_same_backend_in_bf16(tmp_path):
    """An FP8 row of a backend that also ran the same scenario in bf16 in the run gets
    bf16 median / FP8 median; other rows (no twin, bf16 themselves, not ok) get NaN, and the
    Markdown report shows the column only when some row has it."""
    fp8, bf16 = "m-E8H64I32k2-T64-ep1-fp8-uniform", "m-E8H64I32k2-T64-ep1-bf16-uniform"
    rows = [row(fp8, "te", "forward", 8.0, precision="fp8"),
            row(fp8, "mok", "forward", 4.0, baseline=False, precision="fp8"),
            row(fp8, "mok@fp8=rowwise", "forward", 5.0, baseline=False, precision="fp8"),
            row(fp8, "mok", "backward", None, baseline=False, precision="fp8", status="failed"),
            row(bf16, "mok", "forward", 6.0, baseline=False),
            row(bf16, "mok", "backward", 9.0, baseline=False)]
    s = report.summarize(pd.DataFrame(rows), {})
    assert pick(s, fp8, "mok", "forward")["speedup_vs_bf16"] == pytest.approx(1.5)
    for backend, pass_, scenario in (("te", "forward", fp8), ("mok@fp8=rowwise", "forward", fp8),
                                     ("mok", "backward", fp8), ("mok", "forward", bf16)):
        assert math.isnan(pick(s, scenario, backend, pass_)["speedup_vs_bf16"])
    md = report.to_markdown(s, {}, "r")
    assert "| vs own bf16 |" in md and "| 1.50x |" in md
    plain = report.summarize(pd.DataFrame(known_rows()), {})
    assert "| vs own bf16 |" not in report.to_markdown(plain, {}, "r")


def test_side_by_side_one_row_per_scenario_and_pass(summary: pd.DataFrame):
    """Medians per backend label (baselines by name, then ours), statuses where a row did not
    run ok, "not run" for the sweep's cells without rows, "-" for a pass a backend lacks, and
    our speedups over the fastest baseline."""
    table = report.side_by_side(summary, not_run=[(S2, "te")])
    lines = table.splitlines()
    assert lines[0] == ("| scenario | pass | deepep ms | nccl_torch ms | te ms | mok ms "
                        "| mok vs best |")
    body = {tuple(c.strip() for c in ln.strip("|").split("|")[:2]): ln for ln in lines[2:]}
    assert list(body) == [(S1, "forward"), (S1, "backward"),  # rows without the mode: "forward"
                          (S2, "forward")]
    assert body[S1, "forward"].endswith("| failed | 10.000 | 8.000 | 4.000 | 2.000x |")
    assert body[S1, "backward"].endswith("| - | 30.000 | skipped | 20.000 | 1.500x |")
    assert body[S2, "forward"].endswith("| - | timeout | not run | 5.000 | - |")
    # A speedup within the spread of the fastest baseline carries "~".
    close = [row(S1, "te", "forward", 8.0), row(S1, "mok", "forward", 7.9, baseline=False)]
    close[1]["p90_ms"] = 8.5  # overlaps te's [8.0, 8.0]
    assert "| ~1.013x |" in report.side_by_side(report.summarize(pd.DataFrame(close), ENV))


def test_the_markdown_report_has_the_side_by_side_table(summary: pd.DataFrame):
    md = report.to_markdown(summary, ENV, "r")
    section = md.split("## Side by side\n", 1)[1].split("\n## ", 1)[0]
    assert report.side_by_side(summary) in section
    assert report.side_by_side(summary.iloc[0:0]) == ""
