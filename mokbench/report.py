"""Tables derived from a run folder: speedup over the fastest baseline, fraction of the machine's
ceiling, and the same summary as a rich table, Markdown, CSV, Parquet or JSON.

Formulas (per row, i.e. per (scenario, backend, pass)):

    tflops                    = Scenario.flops(pass) / (median_ms * 1e-3) / 1e12   (written by
                                the worker: per-rank layer TFLOP/s at the median time)
    speedup_vs_best_baseline  = min(median_ms of the ok baselines, same scenario and pass)
                                / median_ms of this row                (> 1: faster than all)
    ceiling_frac              = tflops / env["ceilings"]["<precision>_tflops"]
                                (the dense GEMM TFLOP/s measured by ``mokbench calibrate``)
    within_noise              = this row's [p10_ms, p90_ms] overlaps the fastest baseline's
                                (a speedup that the iteration spread could account for)
    speedup_vs_bf16           = median_ms of the same backend label and pass at the same
                                scenario in bf16 (same run) / median_ms of this row, for
                                rows of another precision (FP8 over its own bf16)

The derived columns are NaN where they cannot be computed (row not ok, no ok baseline for the
scenario and pass, no ceiling stored for the precision, no ok bf16 twin); within_noise is
False there and on the fastest baseline's own row. Terminal tables are drawn by
:mod:`mokbench.tables`.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from mokbench import tables
from mokbench.results import ROW_COLUMNS, read_env, read_rows
from mokbench.scenario import PASSES, modes_recorded, pass_label

KEY = ["scenario_id", "backend", "pass"]
PASS_ORDER = PASSES
FORMATS = ("table", "md", "csv", "parquet", "json")
OURS = frozenset({"mok", "mok_upstream"})  # used only when a row lacks is_baseline
NUMERIC = ["median_ms", "p10_ms", "p90_ms", "min_ms", "max_ms", "tflops", "max_abs_err",
           "max_rel_err", "peak_mem_bytes"]

OLD_RUN_NOTE = (
    "This run does not record the forward's mode (made before the training / inference "
    "split): its forward rows are labelled plain \"forward\"; the baselines ran with inputs "
    "requiring grad, the mok backend then without."
)
TIMING_NOTE = (
    "Times are the median over iterations of the per-iteration max over ranks. A forward "
    "includes schedule/dispatch/experts/combine/weighted sum. forward (training): autograd on, "
    "x and router weights require grad, each backend keeps what its backward needs; backward: "
    "timed after an untimed forward; inference (no_grad): the forward under torch.no_grad() on "
    "inputs without grad; step (forward + backward), where a sweep asks for it: the training "
    "forward and its backward timed together."
)
FORMULA_NOTE = (
    "TFLOP/s = per-rank layer FLOPs / median time (forward and inference 6*(T + T*k)*H*I with "
    "the shared expert, 6*T*k*H*I without; backward 2x forward; step 3x). Speedup = fastest ok "
    "baseline median (same scenario and pass) / this median. vs own bf16 (rows of another "
    "precision) = the same backend's bf16 median at the same scenario and pass in this run / "
    "this median. Ceiling = TFLOP/s / dense GEMM TFLOP/s measured on this machine for the "
    "precision."
)


def rounds_note(summary: pd.DataFrame) -> str | None:
    """What a pooled row means, for runs with ``rounds`` > 1 (:mod:`mokbench.rounds`)."""
    if "rounds" not in summary:
        return None
    rounds = pd.to_numeric(summary["rounds"], errors="coerce")
    planned = (pd.to_numeric(summary["rounds_planned"], errors="coerce")
               if "rounds_planned" in summary else pd.Series(math.nan, index=summary.index))
    n = int(max(rounds.fillna(1).max(), planned.fillna(1).max()))
    if n < 2:
        return None
    note = (f"Rounds: each scenario's cells ran {n} times, round r in the sweep's order rotated "
            "by r cells; a row's median, p10 and p90 are over every round's timed iterations, "
            "its error the worst round's (round_medians_ms in rows.jsonl holds each round's "
            "median).")
    partial = summary[rounds < planned]
    if not partial.empty:
        cells = sorted({f"{b} at {s} ({int(k)} of {int(n_)})" for b, s, k, n_ in zip(
            partial["backend"], partial["scenario_id"], partial["rounds"],
            partial["rounds_planned"], strict=True)})
        note += (" The sweep was stopped before these cells' last round, so their rows pool "
                 "only the rounds that finished (`mokbench sweep --resume` runs them again): "
                 + "; ".join(cells) + ".")
    return note


class ReportError(RuntimeError):
    """A report cannot be written (unknown format, missing optional dependency, no rows)."""


def load_rows(run_dir: Path | str) -> pd.DataFrame:
    """All rows of ``run_dir/rows.jsonl`` (or of the given .jsonl file) as a DataFrame.

    Every schema column is present. When the same (scenario_id, backend, pass) appears more than
    once (a resumed or re-run cell), the last row written wins; row order otherwise follows the
    file (sweep order).
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / "rows.jsonl"
    df = pd.DataFrame(read_rows(path))
    for col in ROW_COLUMNS:
        if col not in df.columns:
            df[col] = None
    if df.empty:
        return df
    df = df.drop_duplicates(subset=KEY, keep="last").reset_index(drop=True)
    if "peak_mem_bytes" not in df.columns:
        df["peak_mem_bytes"] = None
    df[NUMERIC] = df[NUMERIC].apply(pd.to_numeric, errors="coerce").astype(float)
    return df


def _baseline_mask(df: pd.DataFrame) -> pd.Series:
    """is_baseline as a clean bool; rows without it fall back to the backend's name."""
    inferred = ~df["backend"].isin(OURS)
    return df["is_baseline"].where(df["is_baseline"].notna(), inferred).astype(bool)


BEST_COLUMNS = {"backend": "best_baseline", "median_ms": "best_baseline_ms",
                "p10_ms": "best_baseline_p10_ms", "p90_ms": "best_baseline_p90_ms"}


def _best_baselines(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (scenario_id, pass): the fastest ok baseline's name, median and p10/p90."""
    ok = df[df["is_baseline"] & (df["status"] == "ok") & (df["median_ms"] > 0)]
    if ok.empty:
        return pd.DataFrame(columns=["scenario_id", "pass", *BEST_COLUMNS.values()])
    idx = ok.groupby(["scenario_id", "pass"], sort=False)["median_ms"].idxmin()
    best = ok.loc[idx, ["scenario_id", "pass", *BEST_COLUMNS]]
    return best.rename(columns=BEST_COLUMNS)


def spread(median: pd.Series, p10: pd.Series, p90: pd.Series) -> tuple[pd.Series, pd.Series]:
    """A row's p10-p90 range in ms, its median where a bound is missing; two rows are within
    noise of each other where their ranges overlap (the report's and ``compare``'s rule)."""
    def num(s: pd.Series) -> pd.Series:
        return pd.to_numeric(s, errors="coerce").astype(float)

    return num(p10).fillna(num(median)), num(p90).fillna(num(median))


def _within_noise(out: pd.DataFrame, ok: pd.Series) -> pd.Series:
    """True where an ok row other than the fastest baseline has a p10-p90 range that overlaps
    the fastest baseline's: the speedup is no larger than the iteration spread."""
    lo, hi = spread(out["median_ms"], out["p10_ms"], out["p90_ms"])
    blo, bhi = spread(out["best_baseline_ms"], out["best_baseline_p10_ms"],
                      out["best_baseline_p90_ms"])
    overlap = (lo <= bhi) & (blo <= hi)
    return (ok & overlap & (out["backend"] != out["best_baseline"])).fillna(False).astype(bool)


def _ceiling(ceilings: dict[str, Any], precision: Any) -> float:
    """Dense GEMM ceiling in TFLOP/s for a precision ("bf16" -> ceilings["bf16_tflops"])."""
    value = ceilings.get(f"{precision}_tflops")
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.nan
    return value if value > 0 else math.nan


def _order(df: pd.DataFrame) -> pd.DataFrame:
    """Scenarios in first-appearance (sweep) order, forward before backward, and within each
    (scenario, pass) the baselines first, then the others, each by backend name."""
    scen_rank = {s: i for i, s in enumerate(pd.unique(df["scenario_id"]))}
    keys = pd.DataFrame({
        "s": df["scenario_id"].map(scen_rank),
        "p": df["pass"].map({p: i for i, p in enumerate(PASS_ORDER)}).fillna(len(PASS_ORDER)),
        "b": (~df["is_baseline"]).astype(int),
        "n": df["backend"].astype(str),
    })
    order = keys.sort_values(["s", "p", "b", "n"], kind="stable").index
    return df.loc[order].reset_index(drop=True)


def _bf16_twin_key(scenario_id: str, precision: Any) -> str:
    """The id the same scenario has in bf16 (ids end in ``-<precision>-<routing>[-seed]``)."""
    return str(scenario_id).replace(f"-{precision}-", "-bf16-", 1)


def _speedup_vs_bf16(out: pd.DataFrame, ok: pd.Series) -> pd.Series:
    """bf16 median / this median for ok rows of another precision whose backend label ran the
    same scenario and pass in bf16, ok, in the same run; NaN elsewhere."""
    bf16 = out[ok & (out["precision"] == "bf16")]
    ms = dict(zip(zip(bf16["scenario_id"], bf16["backend"], bf16["pass"]), bf16["median_ms"]))
    keys = zip(out["scenario_id"], out["precision"], out["backend"], out["pass"])
    twin = [ms.get((_bf16_twin_key(s, p), b, q), math.nan) if p != "bf16" else math.nan
            for s, p, b, q in keys]
    return (pd.Series(twin, index=out.index, dtype=float) / out["median_ms"]).where(ok)


def summarize(df: pd.DataFrame, env: dict[str, Any] | None) -> pd.DataFrame:
    """The rows plus ``best_baseline``, ``speedup_vs_best_baseline`` and ``ceiling_frac``.

    speedup = best_baseline_ms / median_ms, where best_baseline_ms is the smallest median_ms among
    rows with is_baseline and status "ok" for the same scenario_id and pass (failed, timed-out or
    skipped baselines are ignored). NaN when the row is not ok or no baseline ran ok.
    within_noise, speedup_vs_bf16: see the module docstring.
    ceiling_frac = tflops / env["ceilings"]["<precision>_tflops"]; NaN when no ceiling is stored.
    """
    if df.empty:
        return df.assign(best_baseline=None, best_baseline_ms=math.nan,
                         speedup_vs_best_baseline=math.nan, ceiling_frac=math.nan,
                         within_noise=False, speedup_vs_bf16=math.nan)
    out = df.copy()
    out["is_baseline"] = _baseline_mask(out)
    out = out.merge(_best_baselines(out), on=["scenario_id", "pass"], how="left")
    for col in BEST_COLUMNS.values():
        if col != "best_baseline":
            out[col] = pd.to_numeric(out[col], errors="coerce").astype(float)
    ok = (out["status"] == "ok") & (out["median_ms"] > 0)
    out["speedup_vs_best_baseline"] = (out["best_baseline_ms"] / out["median_ms"]).where(ok)
    out["within_noise"] = _within_noise(out, ok)
    out["speedup_vs_bf16"] = _speedup_vs_bf16(out, ok)
    ceilings = (env or {}).get("ceilings") or {}
    ceiling = out["precision"].map(lambda p: _ceiling(ceilings, p)).astype(float)
    out["ceiling_frac"] = (out["tflops"] / ceiling).where(ok)
    return _order(out)


def render_rich(summary: pd.DataFrame, console: Console) -> None:
    """Print one table per pass to ``console``, then the legend and what the numbers mean
    (see :mod:`mokbench.tables`)."""
    tables.render(summary, console,
                  notes=(TIMING_NOTE, *filter(None, [rounds_note(summary)])))


# ---------------------------------------------------------------- markdown


def md_escape(s: str) -> str:
    """A Markdown table cell's text: pipes escaped, newlines as spaces."""
    return str(s).replace("|", "\\|").replace("\n", " ")


MD_COLUMNS = [("median ms", "median"), ("p10–p90 ms", "spread"), ("TFLOP/s", "tflops"),
              ("vs best baseline", "speedup"), ("vs own bf16", "vs_bf16"),
              ("of ceiling", "ceiling"), ("peak GiB", "mem"), ("max rel err", "err")]


def _md_table(part: pd.DataFrame, legend: tables.Legend, show: dict[str, bool]) -> str:
    """Scenario (short label), backend (variant tag), status (reason note), then the numbers;
    the own-bf16, ceiling and memory columns only where some row has them."""
    cols = [(h, k) for h, k in MD_COLUMNS if show.get(k, True)]
    lines = ["| scenario | backend | status | " + " | ".join(h for h, _ in cols) + " |",
             "|---|---|---|" + "---:|" * len(cols)]
    for _, row in part.iterrows():
        name = md_escape(tables.backend_cell(row, legend))
        nums = tables.number_cells(row)
        cells = [md_escape(legend.scenarios.get(row["scenario_id"], row["scenario_id"])),
                 name if row["is_baseline"] else f"**{name}**",
                 md_escape(tables.status_cell(row, legend)), *(nums[k] for _, k in cols)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def side_by_side(summary: pd.DataFrame, not_run: list[tuple[str, str]] | None = None) -> str:
    """One Markdown table of the whole run, for reports: a row per (scenario, pass), scenarios
    in run order and each one's passes together, a column
    per backend label (baselines first, by name, then ours in run order) holding its median ms
    (its status where it did not run ok; "not run" for a cell of the sweep with no row, "-"
    where the backend has no row for that pass), then per backend of ours its speedup over the
    fastest baseline ("~" where within noise, as in the per-pass tables)."""
    if summary.empty:
        return ""
    labels = list(pd.unique(summary["backend"]))
    base = set(summary.loc[summary["is_baseline"], "backend"])
    ours = [b for b in labels if b not in base]
    cols = sorted(base) + ours
    missing = {(s, b) for s, b in (not_run or [])}
    head = ["scenario", "pass", *(f"{b} ms" for b in cols), *(f"{b} vs best" for b in ours)]
    lines = ["| " + " | ".join(md_escape(h) for h in head) + " |",
             "|---|---|" + "---:|" * (len(head) - 2)]
    by_key = {(r.scenario_id, r.backend, r["pass"]): r for _, r in summary.iterrows()}
    present = {(s, p) for s, _, p in by_key}
    for s in pd.unique(summary["scenario_id"]):
        for p in tables.ordered_passes(summary):
            if (s, p) not in present:
                continue
            cells, speedups = [], []
            for b in cols:
                row = by_key.get((s, b, p))
                if row is None:
                    cells.append("not run" if (s, b) in missing else "-")
                elif row["status"] == "ok":
                    cells.append(tables.num(row["median_ms"], ".3f"))
                else:
                    cells.append(str(row["status"]))
                if b in ours:
                    x = None if row is None else row["speedup_vs_best_baseline"]
                    speedups.append("-" if x is None or pd.isna(x) else
                                    ("~" if row["within_noise"] else "") + f"{x:.3f}x")
            lines.append("| " + " | ".join([md_escape(s), pass_label(p, summary), *cells,
                                             *speedups]) + " |")
    return "\n".join(lines)


def _md_legend(summary: pd.DataFrame, legend: tables.Legend) -> list[str]:
    lines = [f"- {md_escape(x)}" for x in tables.legend_lines(legend)]
    if summary["within_noise"].any():
        lines.append(f"- {tables.NOISE_NOTE}")
    return ["## Legend", "", *lines, ""] if lines else []


def _md_env(env: dict[str, Any]) -> list[str]:
    libs = env.get("libraries") or {}
    facts = [("GPU", env.get("gpu_name")), ("driver", env.get("driver")),
             ("CUDA", env.get("cuda")), ("NCCL", env.get("nccl")), ("torch", libs.get("torch")),
             ("triton", libs.get("triton")), ("git", env.get("git_sha"))]
    out = [f"{k}: {v}" for k, v in facts if v]
    ceilings = env.get("ceilings") or {}
    ceil = [f"{k} {ceilings[k]:.0f}" for k in ("bf16_tflops", "fp8_tflops")
            if isinstance(ceilings.get(k), (int, float))]
    if ceil:
        out.append("ceilings (TFLOP/s): " + ", ".join(ceil))
    sweep_env = env.get("sweep_env") or {}
    if sweep_env:
        out.append("sweep [env]: " + ", ".join(f"{k}={v}" for k, v in sweep_env.items()))
    shell = {k: v for k, v in (env.get("environment") or {}).items() if k not in sweep_env}
    if shell:
        out.append("environment: " + ", ".join(f"{k}={v}" for k, v in shell.items()))
    return out


def _md_commits(summary: pd.DataFrame, env: dict[str, Any]) -> list[str]:
    """A line naming the commits of the rows where they are not all env.json's (a run
    completed by ``--resume`` at a later commit); rows made before rows recorded their commit
    are counted as env.json's."""
    if "git_sha" not in summary.columns:
        return []
    first = env.get("git_sha") or "unknown"
    shas = summary["git_sha"].fillna(first)
    counts = shas.value_counts(sort=False)
    if len(counts) < 2:
        return []
    order = sorted(counts.index, key=lambda sha: sha != first)  # env.json's commit first
    parts = [f"{sha[:12]} ({counts[sha]} rows)" for sha in order]
    return ["Rows from more than one commit (resumed run): " + ", ".join(parts) + ".", ""]


def _md_not_run(not_run: list[tuple[str, str]], backends: list[str] | None = None) -> list[str]:
    """The cells of the sweep with no row, as a section: each says why where the run knows
    (``backends``: the run's ``--backends`` list from env.json; a cell of another backend was
    left out by it, any other the sweep stopped before), else both possibilities."""
    if not not_run:
        return []

    def why(backend: str) -> str:
        if backends is None:
            return "stopped before it, or left out by --backends"
        return "left out by --backends" if backend not in backends else "stopped before it"

    lines = ["## Not run", "",
             f"{len(not_run)} cells of this run's sweep have no rows: `mokbench sweep --resume "
             "RUN_DIR` runs them all (with `--backends`, those backends only).", "",
             "| scenario | backend | why |", "|---|---|---|"]
    lines += [f"| {md_escape(s)} | {md_escape(b)} | {why(b)} |" for s, b in not_run]
    return [*lines, ""]


def not_run_cells(run_dir: Path) -> list[tuple[str, str]]:
    """``runner.unfinished_cells``, or [] where the run's sweep copy no longer expands (a
    sweep written for an older version of this tool): nothing is claimed then."""
    from mokbench.runner import unfinished_cells

    try:
        return unfinished_cells(run_dir)
    except ValueError:  # InputError, ScenarioError: the copy is no longer a valid sweep
        return []


def to_markdown(summary: pd.DataFrame, env: dict[str, Any], run_id: str,
                charts: list[str] | None = None,
                not_run: list[tuple[str, str]] | None = None) -> str:
    """The report as Markdown: a header (what the numbers mean, the machine), a table per pass
    (our backends in bold), the legend (full scenario ids, variants' knobs, reasons), the
    cells of the sweep that have no rows (``not_run``) and the ``charts`` (paths relative to
    the report) as images."""
    parts = [f"# mokbench report: {run_id}", "", TIMING_NOTE, "", FORMULA_NOTE, ""]
    pooled = None if summary.empty else rounds_note(summary)
    if pooled:
        parts += [pooled, ""]
    if not summary.empty and not modes_recorded(summary):
        parts += [OLD_RUN_NOTE, ""]
    env_lines = _md_env(env)
    if env_lines:
        parts += ["Machine: " + "; ".join(env_lines) + ".", ""]
    parts += _md_commits(summary, env)
    if summary.empty:
        parts += ["No rows.", "", *_md_not_run(not_run or [], env.get("backends"))]
        return "\n".join(parts).rstrip() + "\n"
    legend, show = tables.build_legend(summary), tables.optional_columns(summary)
    for p in tables.ordered_passes(summary):
        part = summary[summary["pass"] == p]
        parts += [f"## {pass_label(p, summary)}", "", _md_table(part, legend, show), ""]
    parts += ["## Side by side", "",
              "Medians in ms (full scenario ids), then each of our backends' speedup over the "
              "fastest baseline of its scenario and pass.", "", side_by_side(summary, not_run),
              ""]
    parts += _md_legend(summary, legend)
    parts += _md_not_run(not_run or [], env.get("backends"))
    if charts:
        parts += ["## Charts", "", *(f"![{Path(c).stem}]({c})" for c in charts), ""]
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------- files


def _require_parquet() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise ReportError("parquet output needs pyarrow: pip install 'mokbench[parquet]' "
                          "(or choose --format csv|json|md)") from e


def _write_json(summary: pd.DataFrame, path: Path) -> None:
    records = json.loads(summary.to_json(orient="records", default_handler=str))
    path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")


def write_report(run_dir: Path | str, fmt: str = "md") -> Path:
    """Summarize ``run_dir`` and write ``run_dir/report.<ext>``; returns the path written.

    fmt: table (the rich tables as plain text, report.txt) | md (report.md) | csv | parquet
    (needs pyarrow) | json (a list of row objects, NaN as null).
    """
    if fmt not in FORMATS:
        raise ReportError(f"format={fmt!r} is invalid: allowed {' | '.join(FORMATS)}")
    if fmt == "parquet":
        _require_parquet()
    run_dir = Path(run_dir)
    env = read_env(run_dir)
    summary = summarize(load_rows(run_dir), env)
    path = run_dir / f"report.{ {'table': 'txt'}.get(fmt, fmt) }"
    if fmt == "table":
        console = Console(record=True, width=160, file=io.StringIO())
        render_rich(summary, console)
        path.write_text(console.export_text(), encoding="utf-8")
    elif fmt == "md":
        charts = sorted(str(c.relative_to(run_dir)) for c in (run_dir / "plots").glob("*.png"))
        path.write_text(to_markdown(summary, env, run_dir.name, charts,
                                    not_run_cells(run_dir)), encoding="utf-8")
    elif fmt == "csv":
        summary.to_csv(path, index=False)
    elif fmt == "parquet":
        _parquet_safe(summary).to_parquet(path, index=False)
    else:
        _write_json(summary, path)
    return path


def finish_run(run_dir: Path | str) -> list[Path]:
    """What a sweep leaves in its run folder at its end: the charts (plots/) and report.md,
    which shows them. Returns the files written."""
    from mokbench.plots import make_plots

    run_dir = Path(run_dir)
    env = read_env(run_dir)
    written = make_plots(summarize(load_rows(run_dir), env), run_dir / "plots", env)
    return [*written, write_report(run_dir, "md")]


def _parquet_safe(summary: pd.DataFrame) -> pd.DataFrame:
    """Object columns holding mixed types (None and bool, numbers and strings) become strings so
    pyarrow can store them; numeric and bool columns keep their types."""
    out = summary.copy()
    mixed = [c for c in out.columns if out[c].dtype == object]
    for col in mixed:
        kinds = {type(v) for v in out[col] if v is not None and not
                 (isinstance(v, float) and math.isnan(v))}
        if len(kinds) > 1 or kinds & {dict, list}:
            out[col] = out[col].map(lambda v: None if v is None else str(v))
    return out
