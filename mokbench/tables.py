"""Terminal tables of a summary (see :func:`mokbench.report.summarize`), one per pass.

Readable at 80 columns and in piped logs: scenarios carry short labels (:mod:`mokbench.labels`)
that wrap at spaces, backend labels wrap between options, numeric columns never wrap, and where
the table would be wider than the console the spread (p10–p90) is stacked under the median and
the ceiling fraction under the TFLOP/s, so no number is cut. What would widen every row is said once
below the tables: the scenarios' full ids, each backend variant's knobs (``[a]``), and the
reasons of rows that did not run ok (``[1]``). A speedup marked ``~`` is within noise: its
p10–p90 range overlaps the fastest baseline's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from mokbench.labels import backend_display, short_scenario_labels
from mokbench.scenario import PASSES, pass_label

NOISE_MARK = "~"
REASON_WIDTH = 160
GIB = 2**30
NOISE_NOTE = (f"{NOISE_MARK} within noise: this row's p10–p90 range overlaps the fastest "
              "baseline's.")


def ordered_passes(summary: pd.DataFrame) -> list[str]:
    """The passes present, forward (training), backward, inference (no_grad) first."""
    present = list(pd.unique(summary["pass"])) if not summary.empty else []
    return [p for p in PASSES if p in present] + [p for p in present if p not in PASSES]


@dataclass
class Legend:
    """What the table cells refer to: short scenario labels (and the fields all scenarios
    share), a tag per (backend, variant), a number per distinct reason."""

    scenarios: dict[str, str]
    common: str
    variants: dict[tuple[str, str], str] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)


def _reason_text(row: pd.Series) -> str:
    reason = " ".join(str(row.get("reason") or "").split())
    return reason if len(reason) <= REASON_WIDTH else reason[: REASON_WIDTH - 1] + "…"


def _variant(row: pd.Series) -> str:
    v = row.get("variant")
    return v if isinstance(v, str) else ""


def build_legend(summary: pd.DataFrame) -> Legend:
    """Short labels for the summary's scenarios; a letter per distinct (backend, variant) in
    order of appearance; a number per distinct reason of a row that did not run ok."""
    labels, common = short_scenario_labels(summary["scenario_id"].astype(str))
    legend = Legend(labels, common)
    for _, row in summary.iterrows():
        variant = _variant(row)
        key = (str(row["backend"]), variant)
        if variant and key not in legend.variants:
            legend.variants[key] = _letters(len(legend.variants))
        reason = _reason_text(row)
        if row["status"] != "ok" and reason and reason not in legend.reasons:
            legend.reasons[reason] = len(legend.reasons) + 1
    return legend


def _letters(i: int) -> str:
    """0 -> a, 25 -> z, 26 -> aa, ..."""
    out = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        out = chr(ord("a") + r) + out
    return out


# ---------------------------------------------------------------- cells (shared with Markdown)


def num(x: Any, fmt: str) -> str:
    """A number in ``fmt``; "-" for None and NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def backend_cell(row: pd.Series, legend: Legend) -> str:
    tag = legend.variants.get((str(row["backend"]), _variant(row)))
    name = backend_display(str(row["backend"]))
    return f"{name} [{tag}]" if tag else name


def status_cell(row: pd.Series, legend: Legend) -> str:
    note = legend.reasons.get(_reason_text(row)) if row["status"] != "ok" else None
    return f"{row['status']} [{note}]" if note else str(row["status"])


def tflops_text(x: Any) -> str:
    """TFLOP/s with one decimal, or three significant digits below 1 (CPU runs)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, ".1f") if abs(x) >= 1 else format(x, ".3g")


def speedup_cell(row: pd.Series) -> str:
    s = num(row.get("speedup_vs_best_baseline"), ".2f")
    if s == "-":
        return s
    return (NOISE_MARK if bool(row.get("within_noise")) else "") + s + "x"


def number_cells(row: pd.Series) -> dict[str, str]:
    """Display strings of a row's numbers; "-" where a row did not run ok (its error stays:
    a correctness failure is worth seeing)."""
    ok = row["status"] == "ok"
    frac, mem = row.get("ceiling_frac"), row.get("peak_mem_bytes")
    has_frac = ok and frac is not None and not pd.isna(frac)
    has_mem = ok and mem is not None and not pd.isna(mem)
    return {
        "median": num(row["median_ms"], ".3f") if ok else "-",
        "spread": (f"{num(row['p10_ms'], '.3f')}–{num(row['p90_ms'], '.3f')}" if ok else "-"),
        "tflops": tflops_text(row["tflops"]) if ok else "-",
        "speedup": speedup_cell(row) if ok else "-",
        "vs_bf16": (num(row.get("speedup_vs_bf16"), ".2f") + "x"
                    if ok and not pd.isna(row.get("speedup_vs_bf16", math.nan)) else "-"),
        "ceiling": f"{100 * frac:.0f}%" if has_frac else "-",
        "mem": f"{float(mem) / GIB:.2f}" if has_mem else "-",
        "err": num(row["max_rel_err"], ".2e"),
    }


def optional_columns(summary: pd.DataFrame) -> dict[str, bool]:
    """Columns shown only when some row has them: speedup over the same backend's bf16 row,
    ceiling fraction, peak GPU memory."""
    def has(col: str) -> bool:
        return col in summary.columns and bool(summary[col].notna().any())

    return {"vs_bf16": has("speedup_vs_bf16"), "ceiling": has("ceiling_frac"),
            "mem": has("peak_mem_bytes")}


# ---------------------------------------------------------------- rich


def _columns(stacked: bool, show: dict[str, bool]) -> list[tuple[str, str]]:
    """(header, cell keys) per numeric column; "a+b" stacks cell b under cell a."""
    if stacked:
        cols = [("median ms\np10–p90", "median+spread"),
                ("TFLOP/s\nceiling" if show["ceiling"] else "TFLOP/s",
                 "tflops+ceiling" if show["ceiling"] else "tflops"),
                ("vs best\nvs bf16" if show["vs_bf16"] else "vs best",
                 "speedup+vs_bf16" if show["vs_bf16"] else "speedup"),
                ("rel err\npeak GiB" if show["mem"] else "rel err",
                 "err+mem" if show["mem"] else "err")]
        return cols
    cols = [("median ms", "median"), ("p10–p90 ms", "spread"), ("TFLOP/s", "tflops"),
            ("vs best", "speedup")]
    if show["vs_bf16"]:
        cols.append(("vs bf16", "vs_bf16"))
    if show["ceiling"]:
        cols.append(("ceiling", "ceiling"))
    if show["mem"]:
        cols.append(("peak GiB", "mem"))
    return cols + [("rel err", "err")]


def _values(row: pd.Series, legend: Legend, cols: list[tuple[str, str]]) -> list[Text]:
    """A row's numeric cells for ``cols``; a row that did not run ok shows its status and
    reason note where its median would be, on one line."""
    if row["status"] != "ok":
        style = "yellow" if row["status"] == "skipped" else "red"
        return [Text(status_cell(row, legend), style=style), *(Text("-") for _ in cols[1:])]
    cells = number_cells(row)
    return [Text("\n".join(cells[k] for k in key.split("+"))) for _, key in cols]


def _text_widths(console: Console, part: pd.DataFrame, legend: Legend, title: str,
                 cols: list[tuple[str, str]]) -> tuple[int | None, int | None]:
    """(scenario, backend) column widths that leave every numeric column its full width in a
    console-wide table: the backend's name gets the room first, the scenario label wraps one
    field a line if it must. (None, None) when not even that fits (rich then decides)."""
    probe = _build(part, legend, title, cols, (1, 1))
    avail = console.width - natural_width(console, probe) + 2
    labels = [legend.scenarios.get(s, s) for s in pd.unique(part["scenario_id"])]
    scen_word = max(len(w) for lab in labels for w in lab.split())
    backend_nat = max(len(backend_cell(r, legend)) for _, r in part.iterrows())
    if avail < 16:
        return None, None
    backend = min(backend_nat, max(avail - scen_word, avail // 2))
    scenario = min(avail - backend, max(len(lab) for lab in labels))
    return scenario, backend


def _rich_table(console: Console, part: pd.DataFrame, legend: Legend, title: str,
                show: dict[str, bool]) -> Table:
    """The pass's table: natural widths where it fits the console; else the spread and the
    ceiling stacked under the median and the TFLOP/s, and the text columns sized so the
    numbers keep their full width."""
    table = _build(part, legend, title, _columns(False, show), (None, None))
    if natural_width(console, table) <= console.width:
        return table
    cols = _columns(True, show)
    return _build(part, legend, title, cols, _text_widths(console, part, legend, title, cols))


def _build(part: pd.DataFrame, legend: Legend, title: str, cols: list[tuple[str, str]],
           widths: tuple[int | None, int | None]) -> Table:
    """Scenario (short label, on its first row), backend, then the numbers (see
    :func:`_values`); a rule between scenarios. ``widths``: the scenario and backend columns'
    (None: rich decides)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 1))
    table.add_column("scenario", overflow="fold", width=widths[0])
    table.add_column("backend", overflow="fold", width=widths[1])
    for header, _ in cols:
        table.add_column(header, justify="right", no_wrap=True)
    groups = list(part.groupby("scenario_id", sort=False))
    for g, (sid, rows) in enumerate(groups):
        for i, (_, row) in enumerate(rows.iterrows()):
            name = Text(backend_cell(row, legend), style="" if row["is_baseline"] else "bold")
            table.add_row(legend.scenarios.get(sid, sid) if i == 0 else "", name,
                          *_values(row, legend, cols),
                          end_section=i == len(rows) - 1 and g < len(groups) - 1)
    return table


def natural_width(console: Console, table: Table) -> int:
    """The table's width with nothing wrapped."""
    return Measurement.get(console, console.options.update_width(10_000), table).maximum


def legend_lines(legend: Legend, markup_name=lambda s: s) -> list[str]:
    """The notes below the tables: shared fields, scenarios, variants, reasons."""
    lines = []
    if legend.common:
        lines.append(f"all scenarios: {legend.common}")
    short = {s: lab for s, lab in legend.scenarios.items() if s != lab}
    lines += [f"{markup_name(lab)} = {sid}" for sid, lab in short.items()]
    lines += [f"[{tag}] {b}: {backend_display(v)}" for (b, v), tag in legend.variants.items()]
    lines += [f"[{n}] {reason}" for reason, n in legend.reasons.items()]
    return lines


def render(summary: pd.DataFrame, console: Console, notes: tuple[str, ...] = ()) -> None:
    """Print one table per pass (forward (training), backward, inference (no_grad)), then the
    legend and ``notes``."""
    if summary.empty:
        console.print("no rows")
        return
    legend = build_legend(summary)
    show = optional_columns(summary)
    for p in ordered_passes(summary):
        part = summary[summary["pass"] == p]
        console.print(_rich_table(console, part, legend, f"{pass_label(p, summary)} pass",
                                  show))
    for line in legend_lines(legend):
        console.print(line, markup=False, highlight=False)
    if summary.get("within_noise") is not None and summary["within_noise"].fillna(False).any():
        console.print(NOISE_NOTE, style="dim")
    for note in notes:
        console.print(note, style="dim")
