"""Charts derived from a summary (see :func:`mokbench.report.summarize`), as PNG and SVG.

    speedup.{png,svg}         speedup over the fastest ok baseline per scenario, one panel per
                              pass (forward (training), backward, inference (no_grad)), grouped
                              bars per backend, a dashed line at 1.0
    time_vs_tokens.{png,svg}  median time (ms, log axis) vs tokens per rank (log2 axis), one line
                              per backend with p10-p90 error bars; one panel per (model shape,
                              world size, pass) group, split further by precision/routing/shared
                              expert so that a line never mixes those
    knobs.{png,svg}           for backend variants (``mok@minibatch=2048``): median time vs the
                              one numeric knob that varies, one line per scenario, the fastest
                              baseline of each scenario dashed; for ``minibatch`` a dotted line
                              at ``mokbench plan``'s two-waves bound when the SM count is known

Only rows with status "ok" are drawn; a chart with nothing to draw is not written.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mokbench.scenario import PASSES, pass_label  # noqa: E402

PASS_ORDER = PASSES
FORMATS = ("png", "svg")
SHAPE_COLS = ["model", "num_experts", "hidden", "intermediate", "topk"]
SPLIT_COLS = ["precision", "routing", "zipf_s", "shared_expert"]


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


def _short_labels(scenarios: list[str]) -> tuple[list[str], str]:
    """Scenario ids without the "-"-separated parts they all share, and the shared part (so
    that a sweep over tokens shows "T4096-ep8" under the bars and the shape once)."""
    split = [s.split("-") for s in scenarios]
    common = set(split[0]).intersection(*map(set, split[1:])) if len(split) > 1 else set()
    short = ["-".join(t for t in parts if t not in common) or s
             for parts, s in zip(split, scenarios)]
    return short, "-".join(t for t in split[0] if t in common)


def _speedup_panel(ax, part: pd.DataFrame, colors: dict[str, tuple], title: str) -> None:
    """Grouped bars: x = scenario, one bar per backend, height = speedup over best baseline."""
    scenarios = list(pd.unique(part["scenario_id"]))
    labels, shared = _short_labels(scenarios)
    backends = [b for b in colors if b in set(part["backend"])]
    width = 0.8 / max(len(backends), 1)
    x = np.arange(len(scenarios))
    for i, b in enumerate(backends):
        vals = (part[part["backend"] == b].set_index("scenario_id")["speedup_vs_best_baseline"]
                .reindex(scenarios))
        ax.bar(x + (i - (len(backends) - 1) / 2) * width, vals.to_numpy(dtype=float), width,
               label=b, color=colors[b])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 4 else 0,
                  ha="right" if len(labels) > 4 else "center", fontsize=7)
    if shared:
        ax.set_xlabel(f"scenario ({shared})", fontsize=8)
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
        _speedup_panel(ax, data[data["pass"] == p], colors, f"{pass_label(p)}: speedup over "
                       "the fastest baseline (same scenario and pass)")
    axes[0, 0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return _save(fig, out_dir, "speedup")


# ---------------------------------------------------------------- (b) time vs tokens


def _present(data: pd.DataFrame, cols: list[str]) -> list[str]:
    """Columns present with at least one value (older rows may lack the extras)."""
    return [c for c in cols if c in data.columns and data[c].notna().any()]


def _fmt(v) -> str:
    """Whole floats without ".0" (columns holding NaN come back as floats)."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def _group_title(key: tuple, cols: list[str], pass_: str) -> str:
    """e.g. "kimi-k2 E384 H7168 I2048 k8 EP8 bf16 uniform +shared - forward"."""
    v = {c: _fmt(x) for c, x in zip(cols, key)}
    parts = [v.get("model", ""), *(f"{p}{v[c]}" for p, c in (("E", "num_experts"), ("H", "hidden"),
             ("I", "intermediate"), ("k", "topk")) if c in v), f"EP{v['world_size']}",
             v.get("precision", ""), v.get("routing", "")]
    if v.get("routing") == "imbalanced" and "zipf_s" in v:
        parts.append(f"zipf {v['zipf_s']}")
    if key[cols.index("shared_expert")] if "shared_expert" in cols else False:
        parts.append("+shared")
    return " ".join(p for p in parts if p) + f" - {pass_label(pass_)}"


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


def time_vs_tokens_chart(summary: pd.DataFrame, out_dir: Path) -> list[Path]:
    """time_vs_tokens.{png,svg}: a grid with one row per (shape, world size, precision,
    routing, shared expert) group and one column per pass."""
    data = _ok(summary)
    data = data[data["tokens_per_rank"].notna()]
    if data.empty:
        return []
    cols = _present(data, SHAPE_COLS) + ["world_size"] + _present(data, SPLIT_COLS)
    groups = list(data.groupby(cols, sort=False, dropna=False))
    passes = [p for p in PASS_ORDER if p in set(data["pass"])]
    colors = _color_map(list(pd.unique(data["backend"])))
    fig, axes = plt.subplots(len(groups), len(passes), squeeze=False,
                             figsize=(5.5 * len(passes), 4.0 * len(groups)))
    for row, (key, part) in zip(axes, groups):
        key = key if isinstance(key, tuple) else (key,)
        for ax, p in zip(row, passes):
            panel = part[part["pass"] == p]
            if panel.empty:
                ax.set_visible(False)
                continue
            _time_panel(ax, panel, colors, _group_title(key, cols, p))
    fig.tight_layout()
    return _save(fig, out_dir, "time_vs_tokens")


# ---------------------------------------------------------------- (c) knob curves


def _knob_rows(data: pd.DataFrame) -> pd.DataFrame:
    """Variant rows with their base backend, knob name and numeric knob value (one varying
    numeric option per base backend; rows of other variants are dropped)."""
    from mokbench.backend import split_label

    rows = []
    for _, r in data[data["backend"].str.contains("@", regex=False)].iterrows():
        base, opts = split_label(r["backend"])
        for k, v in opts.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                rows.append({**r.to_dict(), "base": base, "knob": k, "knob_value": v})
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
    """knobs.{png,svg}: one panel per (base backend, knob, pass)."""
    data = _knob_rows(_ok(summary))
    if data.empty:
        return []
    groups = [(k, g) for k, g in data.groupby(["base", "knob", "pass"], sort=False)
              if g["knob_value"].nunique() > 1]
    if not groups:
        return []
    fig, axes = plt.subplots(1, len(groups), squeeze=False, figsize=(6.0 * len(groups), 4.2))
    for ax, ((base, knob, pass_), part) in zip(axes[0], groups):
        for i, (sid, line) in enumerate(part.groupby("scenario_id", sort=False)):
            line = line.sort_values("knob_value")
            color = plt.get_cmap("tab10")(i % 10)
            ax.plot(line["knob_value"], line["median_ms"], "o-", color=color, label=sid)
            best = line["best_baseline_ms"].dropna() if "best_baseline_ms" in line else []
            if len(best):
                ax.axhline(float(best.iloc[0]), color=color, ls="--", lw=1)
        bound = _two_waves_bound(part, sm_count) if knob == "minibatch" else None
        if bound:
            ax.axvline(bound, color="grey", ls=":", label=f"two-waves bound {bound:g}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(knob)
        ax.set_ylabel("median ms")
        ax.set_title(f"{base} {pass_label(pass_)}: time vs {knob} (dashed: fastest baseline)",
                     fontsize=9)
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
    return (speedup_chart(summary, out_dir) + time_vs_tokens_chart(summary, out_dir)
            + knob_chart(summary, out_dir, sm_count))
