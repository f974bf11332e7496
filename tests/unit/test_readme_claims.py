"""Numbers the README quotes from a committed run agree with that run's own files (rows.jsonl
and env.json, from which its report.md is derived); CI runs the README's test command."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "results" / "20261130-002830-h200-bf16"
SCENARIO = "kimi-k2-e48-E48H7168I2048k8-T16384-ep1-bf16-uniform"


def test_ceiling_fraction_of_the_one_h200_run():
    readme = " ".join(REPO.joinpath("results", "README.md").read_text().split())
    m = re.search(r"\(([\d.]+) TFLOP/s, (\d+)% of the (\d+) TFLOP/s bf16 ceiling that run "
                  r"measured", readme)
    assert m, "the sentence on the one-H200 run's ceiling is gone"
    tflops, percent, ceiling = float(m.group(1)), int(m.group(2)), int(m.group(3))
    measured = json.loads((RUN / "env.json").read_text())["ceilings"]["bf16_tflops"]
    assert ceiling == round(measured)
    assert percent == round(100 * tflops / measured)
    rows = [json.loads(ln) for ln in (RUN / "rows.jsonl").read_text().splitlines()]
    mok = [r for r in rows if r["scenario_id"] == SCENARIO and r["backend"] == "mok"
           and r["pass"] == "forward" and r["status"] == "ok"]
    assert [round(r["tflops"], 1) for r in mok] == [tflops]


def test_ci_runs_the_readme_test_command_then_ruff():
    """.ci/run runs the README's second set-up command (the tests) verbatim, then ruff."""
    setup = REPO.joinpath("README.md").read_text().split("\n## Set up\n", 1)[1].split("\n#", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", setup)
    assert len(commands) == 2, commands
    lines = [ln for ln in REPO.joinpath(".ci", "run").read_text().splitlines()
             if ln and not ln.startswith("#")]
    i = lines.index(commands[1])
    assert lines[i + 1:] == ["ruff check ."]


def _speedups(run: str, scenarios: list[str], pass_: str, column: str,
              backend: str = "mok") -> list[float]:
    """A mok backend's figures (default plain ``mok``) of one pass over ``scenarios`` (id
    prefixes, in order) of a committed run, rounded as the README prints them; scenarios
    without the figure are left out."""
    from mokbench import report
    from mokbench.results import read_env

    summary = report.summarize(report.load_rows(REPO / "results" / run),
                               read_env(REPO / "results" / run))
    out = []
    for prefix in scenarios:
        row = summary[summary.scenario_id.str.startswith(prefix) & (summary.backend == backend)
                      & (summary["pass"] == pass_)]
        assert len(row) == 1, (run, prefix, pass_)
        value = row.iloc[0][column]
        if value == value:  # not NaN
            out.append(round(float(value), 3))
    return out


# The "Where mok stands" table: (row label start, run, scenario id prefixes in the row's order
# [, the row's mok backend when not plain mok, or (forward's, backward's) backends]).
STANDS = [
    ("| one GPU, bf16:", ["20261206-201917-h200-bf16-train",
                         "20261206-033130-h200-bf16-train-presets",
                         "20261203-062448-h200-bf16-train-presets"],
     ["kimi-k2-e48-", "kimi-k2.7-code-E48", "kimi-k2-e384-", "qwen3.5-397b-E64", "glm-5.2-E32",
      "deepseek-v4-pro-E48"]),
    ("| one GPU, FP8 (", ["20261201-013037-h200-fp8"],
     ["kimi-k2-e48-E48H7168I2048k8-T16384-ep1-fp8",
      "kimi-k2.7-code-E48H7168I2048k8+se-T16384-ep1-fp8",
      "kimi-k2-e384-E384H7168I2048k8-T4096-ep1-fp8",
      "qwen3.5-397b-E64H4096I1024k10+se-T16384-ep1-fp8"]),
    ("| one GPU, FP8, the whole FP8 backward", ["20261205-165752-h200-fp8-backward"],
     ["kimi-k2-e48-", "kimi-k2.7-code-", "qwen3.5-397b-", "kimi-k2-e384-"]),
    ("| one H100 (80 GB), bf16", ["20261207-074644-h100-bf16-train"],
     ["kimi-k2-e48-", "qwen3.5-397b-"]),
    ("| two GPUs, EP 2, bf16, every backend", ["20261204-145626-h200x2"],
     ["kimi-k2.7-code-E12H7168I2048k8+se-T8192-ep2-bf16-uniform"]),
    ("| two GPUs, EP 2, bf16, with DeepEP", ["20261130-233319-h200x2"],
     ["kimi-k2.7-code-E12H7168I2048k8+se-T8192-ep2-bf16-uniform",
      "kimi-k2.7-code-E12H7168I2048k8+se-T8192-ep2-bf16-zipf1", "deepseek-v4-pro-",
      "qwen3.5-397b-", "kimi-k2.7-code-E12H7168I2048k8+se-T2048"]),
    ("| two GPUs, EP 2, FP8, every", ["20261204-144655-h200x2-fp8"],
     ["kimi-k2.7-code-", "deepseek-v4-pro-", "qwen3.5-397b-"]),
    ("| two GPUs, EP 2, bf16, beside", ["20261201-102706-h200x2-mok-ep"],
     ["qwen3.5-397b-", "kimi-k2.7-code-",
      "deepseek-v4-pro-E12H7168I3072k6+se-T4096-ep2-bf16-uniform",
      "deepseek-v4-pro-E12H7168I3072k6+se-T4096-ep2-bf16-ranklocal"],
     ("mok", "mok@dispatch_dedup=true,bwd_pull_dedup=true")),
]


def test_where_mok_stands_matches_the_runs():
    """Every speedup in README's "Where mok stands" table is the committed run's own figure
    (report.summarize over its rows.jsonl), in the order of the row's scenarios: training
    forward against the fastest baseline (then, for FP8, against mok's own bf16), backward."""
    lines = REPO.joinpath("README.md").read_text().splitlines()
    for label, runs, scenarios, *backend in STANDS:
        who = backend[0] if backend else "mok"
        who_fwd, who_bwd = who if isinstance(who, tuple) else (who, who)
        row = [ln for ln in lines if ln.startswith(label)]
        assert len(row) == 1, label
        _, _, forward_cell, backward_cell, _ = row[0].split("|")
        quoted_fwd = [float(x) for x in re.findall(r"([\d.]+)x", forward_cell)]
        quoted_bwd = [float(x) for x in re.findall(r"([\d.]+)x", backward_cell)]
        want_fwd, want_bwd = [], []
        for prefix in scenarios:
            for run in runs:
                try:
                    fwd = _speedups(run, [prefix], "forward", "speedup_vs_best_baseline",
                                    who_fwd)
                    bwd = _speedups(run, [prefix], "backward", "speedup_vs_best_baseline",
                                    who_bwd)
                    want_fwd, want_bwd = want_fwd + fwd, want_bwd + bwd
                    break
                except AssertionError:
                    continue
            else:
                raise AssertionError(f"{prefix} is in none of {runs}")
        if "FP8" in label and len(runs) == 1:
            want_fwd += _speedups(runs[0], scenarios, "forward", "speedup_vs_bf16", who_fwd)
        assert quoted_fwd == want_fwd, (label, quoted_fwd, want_fwd)
        assert quoted_bwd == want_bwd, (label, quoted_bwd, want_bwd)
