"""Charts derived from a summary (see :func:`mokbench.report.summarize`), as PNG and SVG.

    speedup.{png,svg}         speedup over the fastest ok baseline per scenario, one panel per
                              (pass, precision, EP size), grouped bars per backend with their
                              values, a geometric mean per backend at the right, a dashed line
                              at 1.0, short scenario labels, the legend below the panels
    time_vs_tokens.{png,svg}  median time (ms, log axis) vs tokens per rank (log2 axis), one line
                              per backend with p10-p90 error bars; one panel per (model shape,
                              world size, pass) group, split further by precision/routing/shared
                              expert so that a line never mixes those
    knobs.{png,svg}           for backend variants (``mok@minibatch=2048``): median time vs a
                              numeric knob, one line per scenario where every other option of
                              the variant is the same, the fastest baseline of each scenario
                              dashed; for ``minibatch`` a dotted line at ``mokbench plan``'s
                              two-waves bound when the SM count is known

Only rows with status "ok" are drawn; a chart with nothing to draw is not written. A backend has
one colour in every chart (:func:`color_map`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
# The log axes' 10^n tick labels are mathtext, which loads every math font set; a machine
# without the STIX and Computer Modern fonts then logs 21 "findfont: ... Falling back to
# DejaVu Sans" warnings per sweep. The fallback draws the same charts: only noise in the log.
logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mokbench.labels import short_scenario_labels  # noqa: E402
from mokbench.scenario import PASSES, pass_label  # noqa: E402

PASS_ORDER = PASSES
FORMATS = ("png", "svg")
SHAPE_COLS = ["model", "num_experts", "hidden", "intermediate", "topk"]
SPLIT_COLS = ["precision", "routing", "zipf_s", "shared_expert"]


# Fixed colours for the registry's backends (tab10), so a backend has the same colour in every
# chart of every run; other labels (variants, plugins) take the next free colour in name order.
BASE_COLORS = {"nccl_torch": 0, "megatron_alltoall": 1, "te": 2, "mok": 3, "deepep": 4,
               "hybridep_megatron": 5, "mok_upstream": 6, "nccl_torch_compile": 9}
GEOMEAN = "geomean"


def color_map(backends: list[str]) -> dict[str, tuple]:
    """One colour per backend label: fixed for the registry names, the rest from tab20b and
    tab20c in sorted order (build it once per run, from all its rows, for every chart)."""
    tab10 = plt.get_cmap("tab10")
    colors = {b: tab10(BASE_COLORS[b]) for b in backends if b in BASE_COLORS}
    others = sorted(b for b in set(backends) if b not in BASE_COLORS)
    spare = [plt.get_cmap(m)(i) for m in ("tab20b", "tab20c") for i in range(20)]
    for i, b in enumerate(others):
        colors[b] = spare[i % len(spare)]
    return colors


def _save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    paths = []
    for ext in FORMATS:
        path = out_dir / f"{stem}.{ext}"
        fig.savefig(path, dpi=150, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def _ok(summary: pd.DataFrame) -> pd.DataFrame:
    return summary[(summary["status"] == "ok") & summary["median_ms"].notna()]


# ---------------------------------------------------------------- (a) speedup bars


def geomean(values: np.ndarray) -> float:
    """Geometric mean of the finite positive values (NaN when there are none)."""
    v = values[np.isfinite(values) & (values > 0)]
    return float(np.exp(np.log(v).mean())) if len(v) else float("nan")


def _panels(data: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per (pass, precision, world size), passes in their order."""
    out = []
    for p in [p for p in PASS_ORDER if p in set(data["pass"])]:
        part = data[data["pass"] == p]
        for (prec, ws), g in part.groupby(["precision", "world_size"], sort=False, dropna=False):
            out.append((f"{pass_label(p, data)}, {prec}, EP {_fmt(ws)}", g))
    return out


def _tick_labels(labels: list[str], group_in: float) -> tuple[list[str], float]:
    """Scenario labels one field a line where a group is wide enough, else on one line
    turned 90 degrees (readable at any number of scenarios); returns (labels, rotation)."""
    if group_in >= 1.1:
        return [lab.replace(" ", "\n") for lab in labels], 0.0
    return labels, 90.0


def _speedup_panel(ax, part: pd.DataFrame, colors: dict[str, tuple], labels: dict[str, str],
                   title: str, fig_in: float, n_bars: int) -> None:
    """Grouped bars: x = scenario, then the geometric mean (over the scenarios a backend ran
    ok); one bar per backend with its value on top; a dashed line at 1.0 (the fastest
    baseline). ``n_bars``: the most backends of any panel, so all panels label alike."""
    scenarios = list(pd.unique(part["scenario_id"]))
    backends = [b for b in colors if b in set(part["backend"])]
    width = 0.8 / max(len(backends), 1)
    x = np.arange(len(scenarios) + 1)
    bar_in = fig_in * 0.85 / (len(scenarios) + 1) / n_bars  # a bar's width in inches
    many = bar_in < 0.3  # values turned upright where "0.00" would not fit across a bar
    for i, b in enumerate(backends):
        vals = (part[part["backend"] == b].set_index("scenario_id")["speedup_vs_best_baseline"]
                .reindex(scenarios).to_numpy(dtype=float))
        heights = np.append(vals, geomean(vals))
        bars = ax.bar(x + (i - (len(backends) - 1) / 2) * width, heights, width, label=b,
                      color=colors[b])
        ax.bar_label(bars, labels=["" if np.isnan(h) else f"{h:.2f}" for h in heights],
                     fontsize=5 if many else 7, rotation=90 if many else 0, padding=2)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.axvline(len(scenarios) - 0.5, color="grey", linestyle=":", linewidth=1)
    ticks, rotation = _tick_labels([labels.get(s, s) for s in scenarios],
                                   fig_in / (len(scenarios) + 1))
    ax.set_xticks(x, [*ticks, GEOMEAN], rotation=rotation, fontsize=7)
    ax.set_xlim(-0.6, len(scenarios) + 0.6)
    top = np.nanmax(part["speedup_vs_best_baseline"].to_numpy(dtype=float))
    ax.set_ylim(0, max(1.0, top) * (1.3 if many else 1.15))
    ax.set_ylabel("speedup vs fastest baseline (x)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def speedup_chart(summary: pd.DataFrame, out_dir: Path,
                  colors: dict[str, tuple] | None = None) -> list[Path]:
    """speedup.{png,svg}: one panel per (pass, precision, EP size); nothing written when no
    speedup is known. The legend sits below the panels, so many variants do not squeeze them."""
    data = _ok(summary)
    data = data[data["speedup_vs_best_baseline"].notna()]
    if data.empty:
        return []
    colors = colors or color_map(list(pd.unique(summary["backend"])))
    labels, common = short_scenario_labels(summary["scenario_id"].astype(str))
    panels = _panels(data)
    bars = max((g["scenario_id"].nunique() + 1) * g["backend"].nunique() for _, g in panels)
    fig_in = float(np.clip(2.0 + 0.3 * bars, 8.0, 30.0))
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(fig_in, 4.2 * len(panels)))
    n_bars = max(g["backend"].nunique() for _, g in panels)
    for ax, (title, part) in zip(axes[:, 0], panels):
        _speedup_panel(ax, part, colors, labels, f"{title}: speedup over the fastest baseline",
                       fig_in, n_bars)
    if common:
        fig.suptitle(f"all scenarios: {common}", fontsize=9)
    _legend_below(fig, [b for b in colors if b in set(data["backend"])], colors, fig_in)
    return _save(fig, out_dir, "speedup")


def _legend_below(fig: Figure, backends: list[str], colors: dict[str, tuple],
                  fig_in: float) -> None:
    """One legend for the figure, under the panels, as many columns as the width holds."""
    from matplotlib.patches import Patch

    longest = max((len(b) for b in backends), default=10)
    ncol = max(1, min(len(backends), int(fig_in / (0.08 * longest + 0.5))))
    fig.tight_layout()
    fig.legend([Patch(color=colors[b]) for b in backends], backends, loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8, frameon=False)


# ---------------------------------------------------------------- (b) time vs tokens


def _present(data: pd.DataFrame, cols: list[str]) -> list[str]:
    """Columns present with at least one value (older rows may lack the extras)."""
    return [c for c in cols if c in data.columns and data[c].notna().any()]


def _fmt(v) -> str:
    """Whole floats without ".0" (columns holding NaN come back as floats)."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def _group_title(key: tuple, cols: list[str], pass_: str, rows=None) -> str:
    """e.g. "kimi-k2 E384 H7168 I2048 k8 EP8 bf16 uniform +shared" and, on a second line,
    "forward (training)"."""
    v = {c: _fmt(x) for c, x in zip(cols, key)}
    parts = [v.get("model", ""), *(f"{p}{v[c]}" for p, c in (("E", "num_experts"), ("H", "hidden"),
             ("I", "intermediate"), ("k", "topk")) if c in v), f"EP{v['world_size']}",
             v.get("precision", ""), v.get("routing", "")]
    if v.get("routing") == "imbalanced" and "zipf_s" in v:
        parts.append(f"zipf {v['zipf_s']}")
    if key[cols.index("shared_expert")] if "shared_expert" in cols else False:
        parts.append("+shared")
    return " ".join(p for p in parts if p) + f"\n{pass_label(pass_, rows)}"


def _time_panel(ax, part: pd.DataFrame, colors: dict[str, tuple], title: str) -> None:
    """One line per backend: median ms vs tokens per rank (log2 x, log y), p10-p90 error bars."""
    for b, line in part.groupby("backend", sort=True):
        line = line.sort_values("tokens_per_rank")
        x = line["tokens_per_rank"].to_numpy(dtype=float)
        y = line["median_ms"].to_numpy(dtype=float)
        lo = np.clip(y - line["p10_ms"].fillna(line["median_ms"]).to_numpy(dtype=float), 0, None)
        hi = np.clip(line["p90_ms"].fillna(line["median_ms"]).to_numpy(dtype=float) - y, 0, None)
        ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=b, color=colors[b])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("median ms (p10-p90)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def time_vs_tokens_chart(summary: pd.DataFrame, out_dir: Path,
                         colors: dict[str, tuple] | None = None) -> list[Path]:
    """time_vs_tokens.{png,svg}: a grid with one row per (shape, world size, precision,
    routing, shared expert) group and one column per pass."""
    data = _ok(summary)
    data = data[data["tokens_per_rank"].notna()]
    if data.empty:
        return []
    cols = _present(data, SHAPE_COLS) + ["world_size"] + _present(data, SPLIT_COLS)
    groups = list(data.groupby(cols, sort=False, dropna=False))
    passes = [p for p in PASS_ORDER if p in set(data["pass"])]
    colors = colors or color_map(list(pd.unique(summary["backend"])))
    fig, axes = plt.subplots(len(groups), len(passes), squeeze=False,
                             figsize=(5.5 * len(passes), 4.0 * len(groups)))
    for row, (key, part) in zip(axes, groups):
        key = key if isinstance(key, tuple) else (key,)
        for ax, p in zip(row, passes):
            panel = part[part["pass"] == p]
            if panel.empty:
                ax.set_visible(False)
                continue
            _time_panel(ax, panel, colors, _group_title(key, cols, p, summary))
    fig.tight_layout()
    return _save(fig, out_dir, "time_vs_tokens")


# ---------------------------------------------------------------- (c) knob curves


def _knob_rows(data: pd.DataFrame) -> pd.DataFrame:
    """Variant rows with their base backend, a numeric knob's name and value, and the
    variant's other options (``others``), so that a curve only joins points where every other
    option is the same."""
    from mokbench.backend import split_label

    rows = []
    for _, r in data[data["backend"].str.contains("@", regex=False)].iterrows():
        base, opts = split_label(r["backend"])
        for k, v in opts.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                others = ",".join(f"{o}={opts[o]}" for o in sorted(opts) if o != k)
                rows.append({**r.to_dict(), "base": base, "knob": k, "knob_value": v,
                             "others": others})
    return pd.DataFrame(rows)


def _two_waves_bound(part: pd.DataFrame, sm_count: int | None) -> float | None:
    try:
        from mok_kernels import plan
    except ImportError:
        return None
    if not sm_count:
        return None
    r = part.iloc[0]
    return float(plan(int(r["hidden"]), int(r["intermediate"]), sm_count, 0).minibatch)


def knob_chart(summary: pd.DataFrame, out_dir: Path, sm_count: int | None = None) -> list[Path]:
    """knobs.{png,svg}: one panel per (base backend, knob, other options, pass), one line per
    scenario."""
    data = _knob_rows(_ok(summary))
    if data.empty:
        return []
    groups = [(k, g) for k, g in data.groupby(["base", "knob", "others", "pass"], sort=False)
              if g["knob_value"].nunique() > 1]
    if not groups:
        return []
    labels, _ = short_scenario_labels(summary["scenario_id"].astype(str))
    fig, axes = plt.subplots(1, len(groups), squeeze=False, figsize=(6.0 * len(groups), 4.2))
    for ax, ((base, knob, others, pass_), part) in zip(axes[0], groups):
        for i, (sid, line) in enumerate(part.groupby("scenario_id", sort=False)):
            line = line.sort_values("knob_value")
            color = plt.get_cmap("tab10")(i % 10)
            ax.plot(line["knob_value"], line["median_ms"], "o-", color=color,
                    label=labels.get(sid, sid))
            best = line["best_baseline_ms"].dropna() if "best_baseline_ms" in line else []
            if len(best):
                ax.axhline(float(best.iloc[0]), color=color, ls="--", lw=1)
        bound = _two_waves_bound(part, sm_count) if knob == "minibatch" else None
        if bound:
            ax.axvline(bound, color="grey", ls=":", label=f"two-waves bound {bound:g}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(knob)
        ax.set_ylabel("median ms")
        where = f" ({others})" if others else ""
        ax.set_title(f"{base}{where} {pass_label(pass_, summary)}: time vs {knob}\n"
                     "(dashed: fastest baseline)", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, out_dir, "knobs")


def make_plots(summary: pd.DataFrame, out_dir: Path | str, env: dict | None = None
               ) -> list[Path]:
    """Write every chart that has data to ``out_dir`` (created); returns the files written.
    ``env`` (the run's env.json) supplies the SM count for the minibatch bound line."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if summary.empty:
        return []
    sm_count = (env or {}).get("sm_count")
    colors = color_map(list(pd.unique(summary["backend"])))  # the same in every chart
    return (speedup_chart(summary, out_dir, colors)
            + time_vs_tokens_chart(summary, out_dir, colors)
            + knob_chart(summary, out_dir, sm_count))
