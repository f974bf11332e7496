"""Terminal tables at 80 columns and in logs: short scenario labels, knobs in a legend, reasons
as notes, numbers never cut; the within-noise flag; short labels."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from rich.console import Console

from mokbench import report
from mokbench.labels import short_scenario_labels
from mokbench.results import new_row

IDS = ["kimi-k2.7-code-E384H7168I2048k8+se-T16384-ep1-bf16-uniform",
       "kimi-k2.7-code-E384H7168I2048k8+se-T4096-ep1-bf16-uniform",
       "qwen3-30b-a3b-E128H2048I768k8+se-T16384-ep1-bf16-zipf1.2"]
MOK_VARIANT = ("comm_sms=0,minibatch=4096,macrobatch=12288,graph=0,tma=1,down_tiles=4,"
               "gate_up_tiles=4,num_stages=4,interleaved=1,prefetch=0,compiled_schedule=1")
BACKENDS = [("nccl_torch", True, 1.0, ""), ("nccl_torch_compile", True, 0.9, "mode=default"),
            ("megatron_alltoall", True, 0.8, ""), ("te", True, 0.7, "comm=none"),
            ("mok", False, 0.5, MOK_VARIANT),
            ("mok@gate_up_tiles=1,down_tiles=1", False, 0.69, MOK_VARIANT)]


def gpu_rows() -> list[dict]:
    rows = []
    for i, sid in enumerate(IDS):
        for p, scale in (("forward", 1.0), ("backward", 2.0), ("inference", 0.9)):
            for b, base, f, variant in BACKENDS:
                ms = 1234.567 * f * scale / (i + 1)
                ok = not (b == "mok" and p == "backward")
                rows.append(new_row(
                    run_id="r", scenario_id=sid, backend=b, is_baseline=base,
                    status="ok" if ok else "skipped", reason="" if ok else
                    "mok has no backward pass yet", median_ms=ms if ok else None,
                    p10_ms=0.99 * ms if ok else None, p90_ms=1.05 * ms if ok else None,
                    tflops=987.6 / f if ok else None, max_rel_err=2.87e-3, precision="bf16",
                    variant=variant, peak_mem_bytes=(40 + i) * 2**30 if ok else None,
                    **{"pass": p}))
    return rows


ENV = {"ceilings": {"bf16_tflops": 796.8}}


def render(width: int) -> tuple[str, pd.DataFrame]:
    summary = report.summarize(pd.DataFrame(gpu_rows()), ENV)
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    report.render_rich(summary, console)
    return console.export_text(), summary


@pytest.mark.parametrize("width", [80, 100, 200])
def test_every_number_whole_at_any_width(width):
    text, summary = render(width)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width
    ok = summary[summary["status"] == "ok"]
    for _, r in ok.iterrows():
        for s in (f"{r.median_ms:.3f}", f"{r.p10_ms:.3f}–{r.p90_ms:.3f}", f"{r.tflops:.1f}",
                  f"{r.speedup_vs_best_baseline:.2f}x", f"{r.peak_mem_bytes / 2**30:.2f}"):
            assert s in text, (width, s)
    assert "2.87e-03" in text
    assert "…" not in text
    for label in ("forward (training) pass", "backward pass", "inference (no_grad) pass"):
        assert label in text


def test_narrow_tables_keep_long_names_out_of_rows():
    text, _ = render(80)
    flat = " ".join(text.split())
    assert "kimi-k2.7-code" in text and "T4096" in text
    assert text.count(IDS[0]) == 1  # the full id once, in the legend
    assert "[a] nccl_torch_compile: mode=default" in flat
    assert f"[c] mok: {MOK_VARIANT.replace(',', ', ')}" in flat
    assert "comm_sms=0" not in text.split("all scenarios:")[0]  # knobs only in the legend
    assert "skipped [1]" in text and "[1] mok has no backward pass yet" in text


def test_short_labels_keep_what_differs():
    labels, common = short_scenario_labels(IDS)
    assert labels[IDS[0]] == "kimi-k2.7-code T16384 uniform"
    assert labels[IDS[2]] == "qwen3-30b-a3b T16384 zipf1.2"
    assert common == "k8 +se ep1 bf16"
    one, common1 = short_scenario_labels(IDS[:1])
    assert one[IDS[0]] == "kimi-k2.7-code T16384" and "E384" in common1
    odd = short_scenario_labels(["not-a-scenario-id", IDS[0]])[0]
    assert odd["not-a-scenario-id"] == "not-a-scenario-id"
    same_model = short_scenario_labels(
        [IDS[0], IDS[0].replace("E384", "E48").replace("kimi-k2.7-code", "kimi-k2.7-code")])[0]
    assert len(set(same_model.values())) == 2 and "E48" in " ".join(same_model.values())


def test_within_noise_flags_overlapping_spreads():
    rows = [new_row(run_id="r", scenario_id="s", backend=b, is_baseline=base, status="ok",
                    median_ms=m, p10_ms=lo, p90_ms=hi, **{"pass": "forward"})
            for b, base, m, lo, hi in (("te", True, 20.0, 19.8, 20.6),
                                       ("nccl_torch", True, 30.0, 29.0, 31.0),
                                       ("mok", False, 19.9, 19.7, 20.0),
                                       ("mok@x=1", False, 15.0, 14.0, 16.0))]
    s = report.summarize(pd.DataFrame(rows), {}).set_index("backend")
    assert bool(s.loc["mok", "within_noise"]) is True
    assert bool(s.loc["mok@x=1", "within_noise"]) is False
    assert bool(s.loc["te", "within_noise"]) is False  # the fastest baseline itself
    assert bool(s.loc["nccl_torch", "within_noise"]) is False
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    report.render_rich(s.reset_index(), console)
    text = console.export_text()
    assert "~1.01x" in text and "within noise" in text
