"""Two runs side by side: the rows one run (A, the reference) and another (B) share, matched by
(scenario_id, backend label, pass), with B's speedup over A.

For a user who reruns a sweep after changing something (a knob, a commit, a driver, a
machine) and wants to know what moved. Per matched row:

    speedup_b_vs_a = median_ms of A / median_ms of B        (> 1: B is faster; ok rows only)
    within_noise   = A's and B's p10-p90 ranges overlap     (the change is no larger than the
                                                             iteration spread: the same rule
                                                             as the report's "~")
    same_variant   = both rows ran the same resolved backend config (the row's ``variant``
                     text); False flags a label whose defaults changed between the runs

Rows only one run has are listed with the other side empty, so nothing is silently dropped.
Times are each run's own medians over iterations of the per-iteration max over ranks (see
:mod:`mokbench.report`); comparing runs made on different machines compares the machines too,
which the header says (each run's GPU and commit).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from mokbench import report, tables
from mokbench.errors import InputError
from mokbench.labels import short_scenario_labels
from mokbench.results import read_env
from mokbench.scenario import pass_label

SIDE_COLUMNS = ["status", "median_ms", "p10_ms", "p90_ms", "variant"]


def _side(run_dir: Path, backends: list[str] | None) -> pd.DataFrame:
    """One run's rows (the last of each key), restricted to ``backends`` when given."""
    if not (Path(run_dir) / "rows.jsonl").is_file():
        raise InputError(f"run_dir={str(run_dir)!r} has no rows.jsonl: allowed a run folder")
    rows = report.load_rows(run_dir)
    if rows.empty:
        raise InputError(f"run_dir={str(run_dir)!r} has no rows: allowed a run with results")
    if "variant" not in rows.columns:
        rows["variant"] = ""
    rows["variant"] = rows["variant"].where(rows["variant"].notna(), "").astype(str)
    if backends:
        rows = rows[rows["backend"].isin(backends)]
    return rows[[*report.KEY, *SIDE_COLUMNS]]


def compare(a_dir: Path | str, b_dir: Path | str,
            backends: list[str] | None = None) -> pd.DataFrame:
    """The rows of runs ``a_dir`` and ``b_dir`` matched by (scenario_id, backend, pass): each
    side's status, median and p10/p90 (ms) with suffixes ``_a`` / ``_b``, then
    ``speedup_b_vs_a``, ``within_noise`` and ``same_variant`` (see the module docstring);
    ``in_runs`` is "both", "a" or "b". Order: A's rows as its sweep wrote them, then B's own."""
    a, b = _side(Path(a_dir), backends), _side(Path(b_dir), backends)
    if backends:
        have = set(a["backend"]) | set(b["backend"])
        missing = [x for x in backends if x not in have]
        if missing:
            raise InputError(f"backends={','.join(missing)!r} is in neither run: allowed labels "
                             "of their rows, e.g. mok or te")
    out = a.merge(b, on=report.KEY, how="outer", suffixes=("_a", "_b"), indicator="in_runs",
                  sort=False)
    out["in_runs"] = out["in_runs"].map({"both": "both", "left_only": "a", "right_only": "b"})
    ok = (out["status_a"] == "ok") & (out["status_b"] == "ok") & (out["median_ms_b"] > 0)
    out["speedup_b_vs_a"] = (out["median_ms_a"] / out["median_ms_b"]).where(ok)

    (alo, ahi), (blo, bhi) = (report.spread(out[f"median_ms_{s}"], out[f"p10_ms_{s}"],
                                            out[f"p90_ms_{s}"]) for s in "ab")
    out["within_noise"] = (ok & (alo <= bhi) & (blo <= ahi)).fillna(False).astype(bool)
    out["same_variant"] = (out["variant_a"] == out["variant_b"]) | (out["in_runs"] != "both")
    rank = {k: i for i, k in enumerate(zip(*(a[c] for c in report.KEY)))}  # A's sweep order
    out["_rank"] = [rank.get(k, len(rank) + i) for i, k in
                    enumerate(zip(*(out[c] for c in report.KEY)))]
    return out.sort_values("_rank", kind="stable").drop(columns="_rank").reset_index(drop=True)


def _ms(x: Any) -> str:
    return tables.num(x, ".3f")


def _spread(lo: Any, hi: Any) -> str:
    return "-" if pd.isna(lo) or pd.isna(hi) else f"{_ms(lo)}–{_ms(hi)}"


def _status(row: pd.Series, side: str) -> str:
    status = row[f"status_{side}"]
    return "not in run" if not isinstance(status, str) else status


def speedup_text(row: pd.Series) -> str:
    """``1.023x``, ``~0.998x`` (within noise) or empty (a side not ok); ``*`` when the two
    rows ran different resolved configs."""
    s = row["speedup_b_vs_a"]
    if not isinstance(s, float) or math.isnan(s):
        return ""
    noise = tables.NOISE_MARK if row["within_noise"] else ""
    return f"{noise}{s:.3f}x{'' if row['same_variant'] else ' *'}"


def table_rows(cmp: pd.DataFrame) -> list[list[str]]:
    """The comparison as text cells: scenario, backend, pass, A's status, median and p10-p90,
    B's the same, B vs A."""
    cells = []
    for _, r in cmp.iterrows():
        cells.append([r["scenario_id"], r["backend"], pass_label(r["pass"]),
                      _status(r, "a"), _ms(r["median_ms_a"]), _spread(r["p10_ms_a"], r["p90_ms_a"]),
                      _status(r, "b"), _ms(r["median_ms_b"]), _spread(r["p10_ms_b"], r["p90_ms_b"]),
                      speedup_text(r)])
    return cells


HEADERS = ["scenario", "backend", "pass", "A status", "A median ms", "A p10–p90 ms",
           "B status", "B median ms", "B p10–p90 ms", "B vs A"]


def _side_cells(row: pd.Series, side: str) -> tuple[str, str]:
    """(median, p10–p90) of one side, or (its status, "-") where it did not run ok."""
    status = _status(row, side)
    if status != "ok":
        return status, "-"
    return _ms(row[f"median_ms_{side}"]), _spread(row[f"p10_ms_{side}"], row[f"p90_ms_{side}"])


def _terminal_table(cmp: pd.DataFrame, labels: dict[str, str], stacked: bool,
                    widths: tuple[int | None, ...] = (None, None, None)) -> Table:
    """Scenario (short label, on its group's first row), backend, pass, then each side's median
    and spread (a side that did not run ok: its status) and B vs A. ``stacked``: each spread
    under its median, for a console narrower than the flat table; ``widths``: the scenario,
    backend and pass columns' (None: rich decides)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    for name, width in zip(("scenario", "backend", "pass"), widths):
        table.add_column(name, overflow="fold", width=width)
    heads = (["A median ms\np10–p90", "B median ms\np10–p90"] if stacked else
             ["A median ms", "A p10–p90 ms", "B median ms", "B p10–p90 ms"])
    for head in [*heads, "B vs A"]:
        table.add_column(head, justify="right", no_wrap=True)
    previous = None
    for _, r in cmp.iterrows():
        sid = r["scenario_id"]
        (ma, sa), (mb, sb) = _side_cells(r, "a"), _side_cells(r, "b")
        nums = [f"{ma}\n{sa}", f"{mb}\n{sb}"] if stacked else [ma, sa, mb, sb]
        texts = [labels.get(sid, sid) if sid != previous else "", r["backend"],
                 pass_label(r["pass"]), *nums, speedup_text(r)]
        table.add_row(*(Text(c) for c in texts))  # Text: no cell is read as rich markup
        previous = sid
    return table


def _text_widths(cmp: pd.DataFrame, labels: dict[str, str],
                 console: Console) -> tuple[int | None, ...]:
    """Scenario, backend and pass widths that leave the stacked table's numbers their full
    width: the pass and the scenario label get their longest word (they wrap at spaces), the
    backend label the rest (it folds); (None, None, None) when even that does not fit."""
    probe = _terminal_table(cmp, labels, True, (1, 1, 1))
    avail = console.width - tables.natural_width(console, probe) + 3
    passes = [pass_label(p) for p in pd.unique(cmp["pass"])]
    scen_labels = [labels.get(s, s) for s in pd.unique(cmp["scenario_id"])]
    pass_w = min(max(map(len, passes)), max(len(w) for p in passes for w in p.split()))
    scen_w = max(len(w) for lab in scen_labels for w in lab.split())
    backend_w = min(max(map(len, cmp["backend"])), avail - pass_w - scen_w)
    scen_w = min(max(map(len, scen_labels)), avail - pass_w - backend_w)
    if backend_w < 8:
        return None, None, None
    return scen_w, backend_w, pass_w


def render(cmp: pd.DataFrame, a_dir: Path | str, b_dir: Path | str, console: Console) -> None:
    """The comparison for a terminal or a piped log, by the rules of the report's tables
    (:mod:`mokbench.tables`): short scenario labels that wrap at spaces, their full ids once
    below; numbers never wrap, and where the flat table is wider than the console each spread
    is stacked under its median, so that at 80 columns no number is cut."""
    for line in header_lines(a_dir, b_dir):
        console.print(line, markup=False, highlight=False)
    labels, common = short_scenario_labels(cmp["scenario_id"])
    table = _terminal_table(cmp, labels, stacked=False)
    if tables.natural_width(console, table) > console.width:
        table = _terminal_table(cmp, labels, True, _text_widths(cmp, labels, console))
    console.print(table)
    if common:
        console.print(f"all scenarios: {common}", markup=False, highlight=False)
    for sid, label in labels.items():
        if label != sid:
            console.print(f"{label} = {sid}", markup=False, highlight=False)
    console.print(NOTE, markup=False, highlight=False)


def header_lines(a_dir: Path | str, b_dir: Path | str) -> list[str]:
    """Which run is A and which is B: folder, commit (dirty or not) and GPU of each; then
    which code folders differ between them (``code_line``)."""
    out, envs = [], []
    for side, d in (("A", Path(a_dir)), ("B", Path(b_dir))):
        env = read_env(d)
        envs.append(env)
        sha = str(env.get("git_sha") or "unknown")[:7] + (" (dirty)" if env.get("git_dirty")
                                                           else "")
        gpu = env.get("gpu_name") or "no GPU recorded"
        out.append(f"{side}: {d.name} (commit {sha}, {gpu})")
    return out + [code_line(*envs)]


def code_line(env_a: dict, env_b: dict) -> str:
    """The code folders whose git trees (env.json's ``code_trees``) differ between two runs,
    or that both ran the same code; runs from before ``code_trees`` say so."""
    a, b = env_a.get("code_trees"), env_b.get("code_trees")
    if not a or not b:
        missing = " and ".join(s for s, t in (("A", a), ("B", b)) if not t)
        return f"code: not recorded in {missing} (runs before env.json's code_trees)"
    differ = [f"{d}/" for d in sorted(set(a) | set(b)) if a.get(d) != b.get(d)]
    if not differ:
        return "code: the same in both runs (" + ", ".join(f"{d}/" for d in sorted(a)) + ")"
    return "code: differs in " + ", ".join(differ)


NOTE = ("B vs A = A's median / B's median (> 1: B faster); ~: the two p10–p90 ranges overlap "
        "(within noise); *: the two rows ran different resolved configs (the row's variant).")


def to_markdown(cmp: pd.DataFrame, a_dir: Path | str, b_dir: Path | str) -> str:
    """The comparison as a Markdown table under its header lines and the note."""
    lines = [f"- {h}" for h in header_lines(a_dir, b_dir)] + ["", NOTE, ""]
    lines += ["| " + " | ".join(HEADERS) + " |",
              "|---|---|---|---|---:|---:|---|---:|---:|---:|"]
    lines += ["| " + " | ".join(report.md_escape(c) for c in row) + " |"
              for row in table_rows(cmp)]
    return "\n".join(lines) + "\n"


def to_csv(cmp: pd.DataFrame) -> str:
    """The comparison's columns as CSV (numbers unrounded)."""
    return cmp.to_csv(index=False)
