"""Charts derived from a summary (see :func:`mokbench.report.summarize`), as PNG and SVG.

    speedup.{png,svg}         speedup over the fastest ok baseline per scenario, forward and
                              backward panels, grouped bars per backend, a dashed line at 1.0
    time_vs_tokens.{png,svg}  median time (ms) vs tokens per rank (log2 axis), one line per
                              backend with p10-p90 error bars; one panel per (model shape, world
                              size, pass) group, split further by precision/routing/shared expert
                              so that a line never mixes those

Only rows with status "ok" are drawn; a chart with nothing to draw is not written.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

PASS_ORDER = ("forward", "backward")
FORMATS = ("png", "svg")
SHAPE_COLS = ["model", "num_experts", "hidden", "intermediate", "topk"]
SPLIT_COLS = ["precision", "routing", "zipf_s", "shared_expert"]
MAX_COLS = 3


def _color_map(backends: list[str]) -> dict[str, tuple]:
    """One stable color per backend name (same color in every chart of a run)."""
    cmap = plt.get_cmap("tab10")
    return {b: cmap(i % 10) for i, b in enumerate(sorted(backends))}


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


def _speedup_panel(ax, part: pd.DataFrame, colors: dict[str, tuple], title: str) -> None:
    """Grouped bars: x = scenario, one bar per backend, height = speedup over best baseline."""
    scenarios = list(pd.unique(part["scenario_id"]))
    backends = [b for b in colors if b in set(part["backend"])]
    width = 0.8 / max(len(backends), 1)
    x = np.arange(len(scenarios))
    for i, b in enumerate(backends):
        vals = (part[part["backend"] == b].set_index("scenario_id")["speedup_vs_best_baseline"]
                .reindex(scenarios))
        ax.bar(x + (i - (len(backends) - 1) / 2) * width, vals.to_numpy(dtype=float), width,
               label=b, color=colors[b])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(x, scenarios, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("speedup vs fastest baseline (x)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


def speedup_chart(summary: pd.DataFrame, out_dir: Path) -> list[Path]:
    """speedup.{png,svg}: one panel per pass; nothing written when no speedup is known."""
    data = _ok(summary)
    data = data[data["speedup_vs_best_baseline"].notna()]
    if data.empty:
        return []
    passes = [p for p in PASS_ORDER if p in set(data["pass"])]
    colors = _color_map(list(pd.unique(data["backend"])))
    n_scen = data["scenario_id"].nunique()
    fig, axes = plt.subplots(len(passes), 1, squeeze=False,
                             figsize=(max(6.0, 1.2 * n_scen + 2), 4.5 * len(passes)))
    for ax, p in zip(axes[:, 0], passes):
        _speedup_panel(ax, data[data["pass"] == p], colors, f"{p}: speedup over the fastest "
                       "baseline (same scenario)")
    axes[0, 0].legend(fontsize=8, ncols=min(len(colors), 4))
    fig.tight_layout()
    return _save(fig, out_dir, "speedup")


# ---------------------------------------------------------------- (b) time vs tokens


def _present(data: pd.DataFrame, cols: list[str]) -> list[str]:
    """Columns present with at least one value (older rows may lack the extras)."""
    return [c for c in cols if c in data.columns and data[c].notna().any()]


def _group_title(key: tuple, cols: list[str]) -> str:
    vals = dict(zip(cols, key))
    shape = (f"E{vals.get('num_experts')} H{vals.get('hidden')} I{vals.get('intermediate')} "
             f"k{vals.get('topk')}")
    parts = [str(vals["model"]) if "model" in vals else "", shape, f"EP{vals.get('world_size')}"]
    for c in SPLIT_COLS:
        if c in vals and c != "zipf_s":
            v = vals[c]
            parts.append(("+shared" if v else "") if c == "shared_expert" else str(v))
    if vals.get("routing") == "imbalanced" and "zipf_s" in vals:
        parts.append(f"zipf {vals['zipf_s']:g}")
    return " ".join(p for p in parts if p) + f" - {vals.get('pass')}"


def _time_panel(ax, part: pd.DataFrame, colors: dict[str, tuple], title: str) -> None:
    """One line per backend: median ms vs tokens per rank, p10-p90 as error bars."""
    for b, line in part.groupby("backend", sort=True):
        line = line.sort_values("tokens_per_rank")
        x = line["tokens_per_rank"].to_numpy(dtype=float)
        y = line["median_ms"].to_numpy(dtype=float)
        lo = np.clip(y - line["p10_ms"].fillna(line["median_ms"]).to_numpy(dtype=float), 0, None)
        hi = np.clip(line["p90_ms"].fillna(line["median_ms"]).to_numpy(dtype=float) - y, 0, None)
        ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=b, color=colors[b])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("median ms (p10-p90)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def time_vs_tokens_chart(summary: pd.DataFrame, out_dir: Path) -> list[Path]:
    """time_vs_tokens.{png,svg}: a grid of panels, one per shape/world size/pass group."""
    data = _ok(summary)
    data = data[data["tokens_per_rank"].notna()]
    if data.empty:
        return []
    cols = _present(data, SHAPE_COLS) + ["world_size"] + _present(data, SPLIT_COLS) + ["pass"]
    data = data.assign(_p=data["pass"].map({p: i for i, p in enumerate(PASS_ORDER)}))
    groups = list(data.sort_values(["_p"], kind="stable").groupby(cols, sort=False, dropna=False))
    colors = _color_map(list(pd.unique(data["backend"])))
    ncols = min(MAX_COLS, len(groups))
    nrows = -(-len(groups) // ncols)
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, figsize=(5.5 * ncols, 4.0 * nrows))
    for ax, (key, part) in zip(axes.flat, groups):
        _time_panel(ax, part, colors, _group_title(key, cols))
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    return _save(fig, out_dir, "time_vs_tokens")


def make_plots(summary: pd.DataFrame, out_dir: Path | str) -> list[Path]:
    """Write every chart that has data to ``out_dir`` (created); returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if summary.empty:
        return []
    return speedup_chart(summary, out_dir) + time_vs_tokens_chart(summary, out_dir)
