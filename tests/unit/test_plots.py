"""Charts are written from a small synthetic summary, and skipped when there is nothing to draw."""

from __future__ import annotations

import pandas as pd

from mokbench import plots, report
from mokbench.results import new_row


def synthetic_rows() -> list[dict]:
    rows = []
    for world in (1, 2):
        for tokens in (256, 512, 1024):
            for backend, base, ms in (("nccl_torch", True, 2.0), ("te", True, 1.5),
                                      ("mok", False, 1.0)):
                for p, scale in (("forward", 1.0), ("backward", 2.0), ("inference", 0.8)):
                    t = ms * scale * tokens / 256
                    rows.append(new_row(
                        run_id="r", scenario_id=f"tiny-T{tokens}-ep{world}", backend=backend,
                        is_baseline=base, status="ok", median_ms=t, p10_ms=0.9 * t,
                        p90_ms=1.2 * t, tflops=10.0, world_size=world, tokens_per_rank=tokens,
                        hidden=128, intermediate=64, num_experts=8, topk=2, shared_expert=True,
                        precision="bf16", routing="uniform", model="tiny", zipf_s=1.0,
                        **{"pass": p}))
    rows.append(new_row(run_id="r", scenario_id="tiny-T256-ep1", backend="deepep",
                        is_baseline=True, status="failed", reason="x", world_size=1,
                        tokens_per_rank=256, **{"pass": "forward"}))
    return rows


def test_make_plots_writes_png_and_svg(tmp_path):
    summary = report.summarize(pd.DataFrame(synthetic_rows()), {})
    paths = plots.make_plots(summary, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["speedup.png", "speedup.svg", "time_vs_tokens.png", "time_vs_tokens.svg"]
    for p in paths:
        assert p.exists() and p.stat().st_size > 1000
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (tmp_path / "plots" / "time_vs_tokens.svg").read_text()
    # 2 world sizes x 3 passes = 6 panels, each titled with its group and pass.
    assert svg.count("EP1") >= 3 and svg.count("EP2") >= 3
    for label in ("forward (training)", "inference (no_grad)"):
        assert label in svg
        assert label in (tmp_path / "plots" / "speedup.svg").read_text()


def test_no_baseline_skips_speedup_chart(tmp_path):
    rows = [r for r in synthetic_rows() if not r["is_baseline"]]
    summary = report.summarize(pd.DataFrame(rows), {})
    names = sorted(p.name for p in plots.make_plots(summary, tmp_path))
    assert names == ["time_vs_tokens.png", "time_vs_tokens.svg"]
    assert not (tmp_path / "speedup.png").exists()


def test_nothing_ok_writes_nothing(tmp_path):
    rows = [r for r in synthetic_rows() if r["status"] != "ok"]
    summary = report.summarize(pd.DataFrame(rows), {})
    assert plots.make_plots(summary, tmp_path) == []
    empty = report.summarize(pd.DataFrame(columns=list(report.ROW_COLUMNS)), {})
    assert plots.make_plots(empty, tmp_path) == []


def test_speedup_chart_panels_values_and_geomean(tmp_path):
    summary = report.summarize(pd.DataFrame(synthetic_rows()), {})
    plots.speedup_chart(summary, tmp_path)
    svg = (tmp_path / "speedup.svg").read_text()
    for title in ("forward (training), bf16, EP 1", "backward, bf16, EP 2",
                  "inference (no_grad), bf16, EP 1"):
        assert title in svg
    assert svg.count("geomean") >= 6  # one group per panel
    assert "1.50" in svg and "0.75" in svg  # values on the bars: mok and nccl_torch over te


def test_geomean_and_colors():
    import numpy as np

    assert plots.geomean(np.array([1.0, 4.0, float("nan")])) == 2.0
    a = plots.color_map(["mok", "te"])
    b = plots.color_map(["nccl_torch", "te", "mok@minibatch=512", "mok", "deepep"])
    assert a["mok"] == b["mok"] and a["te"] == b["te"]  # fixed per backend, any run
    assert len({b[k] for k in b}) == len(b)


def test_knob_curves_do_not_mix_other_options(tmp_path):
    rows = []
    for label, ms in (("mok@minibatch=512", 3.0), ("mok@minibatch=1024", 2.0),
                      ("mok@tma=true,minibatch=1024", 1.0), ("nccl_torch", 4.0)):
        rows.append(new_row(run_id="r", scenario_id="tiny-T256-ep1", backend=label,
                            is_baseline=label == "nccl_torch", status="ok", median_ms=ms,
                            p10_ms=ms, p90_ms=ms, world_size=1, tokens_per_rank=256,
                            hidden=128, intermediate=64, **{"pass": "forward"}))
    data = plots._knob_rows(report.summarize(pd.DataFrame(rows), {}))
    mb = data[data["knob"] == "minibatch"]
    assert sorted(mb["others"].unique()) == ["", "tma=True"]
    plots.knob_chart(report.summarize(pd.DataFrame(rows), {}), tmp_path)
    svg = (tmp_path / "knobs.svg").read_text()
    assert "time vs minibatch" in svg and "tma=True" not in svg  # one point: no curve


def test_charts_log_no_font_fallback_noise(tmp_path):
    """A fresh process drawing the charts (log axes with mathtext ticks) writes no
    "findfont ... Falling back" lines, on a machine with or without the math fonts."""
    import subprocess
    import sys

    code = ("import pandas as pd, sys\n"
            "from mokbench import plots, report\n"
            "from tests.unit.test_plots import synthetic_rows\n"
            "plots.make_plots(report.summarize(pd.DataFrame(synthetic_rows()), {}),"
            " __import__('pathlib').Path(sys.argv[1]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plots")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "plots" / "time_vs_tokens.svg").exists()
    assert "findfont" not in out.stderr + out.stdout, out.stderr[-2000:]
