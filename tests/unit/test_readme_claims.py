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
    readme = " ".join(REPO.joinpath("README.md").read_text().split())
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
