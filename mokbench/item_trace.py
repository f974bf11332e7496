"""Where a persistent megakernel's time goes: the per-item trace of
``mok_kernels.backward(..., _trace=...)`` (or of the forward's compute items,
``mok_kernels.forward_train(..., _trace=...)``) as a table and a timeline chart.

A trace row is one work item: (start ns, end ns, program, kind), in the GPU's global timer
(one clock for every SM); rows whose kind is negative were not written (tickets not used).
An item's time includes its waits (the start is taken once its ticket is claimed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

BACKWARD_KINDS = ("A dgrad down", "B dgrad gate+up", "Q quantise", "C wgrad down",
                  "D wgrad gate+up")
FORWARD_KINDS = ("gate+up", "down")


def items(trace_LT4: np.ndarray, kinds: tuple[str, ...] = BACKWARD_KINDS) -> pd.DataFrame:
    """The written rows of an [L, tickets, 4] trace as one row per item: rank, ticket,
    program, kind (its name in ``kinds``: the backward's by default, ``FORWARD_KINDS`` for
    the forward), start_ms and end_ms from the rank's first start."""
    t = np.asarray(trace_LT4)
    if t.ndim != 3 or t.shape[-1] != 4:
        raise ValueError(f"trace: want shape [L, tickets, 4], got {list(t.shape)}")
    frames = []
    for rank in range(t.shape[0]):
        ticket = np.nonzero(t[rank, :, 3] >= 0)[0]
        rows = t[rank, ticket]
        if not len(rows):
            continue
        if (rows[:, 3] >= len(kinds)).any():
            raise ValueError(f"trace: rank {rank} has kinds outside 0..{len(kinds) - 1}")
        t0 = rows[:, 0].min()
        frames.append(pd.DataFrame({
            "rank": rank, "ticket": ticket, "program": rows[:, 2],
            "kind": pd.Categorical([kinds[k] for k in rows[:, 3]], categories=kinds),
            "start_ms": (rows[:, 0] - t0) / 1e6, "end_ms": (rows[:, 1] - t0) / 1e6}))
    if not frames:
        raise ValueError("trace: no item was written")
    return pd.concat(frames, ignore_index=True)


def summarize(df: pd.DataFrame, programs: int) -> pd.DataFrame:
    """Per item kind (and a total row), over every rank: items, their summed time divided by
    ``programs`` (the wall time the kind would take if its items ran side by side on every
    program: comparable with the kernel's span), mean item time, and the window from the
    kind's first start to its last end; ``busy_share`` is ``ms_per_program`` over the
    kernel's span. The total row: every item, ``last_end_ms`` the span (mean over ranks),
    ``busy_share`` the fraction of programs x span spent inside items."""
    if programs < 1:
        raise ValueError(f"programs: want >= 1, got {programs}")
    dur = df.end_ms - df.start_ms
    ranks = df["rank"].nunique()
    span = float((df.groupby("rank").end_ms.max() - df.groupby("rank").start_ms.min()).mean())
    out = []
    for kind, g in df.assign(dur=dur).groupby("kind", observed=True):
        out.append({"kind": kind, "items": len(g),
                    "ms_per_program": g.dur.sum() / ranks / programs,
                    "mean_item_us": 1e3 * g.dur.mean(),
                    "first_start_ms": g.start_ms.min(), "last_end_ms": g.end_ms.max()})
    table = pd.DataFrame(out).set_index("kind")
    table.index = table.index.astype(str)
    busy = dur.sum() / ranks / programs
    table.loc["total"] = [len(df), busy, 1e3 * dur.mean(), 0.0, span]
    table["busy_share"] = table.ms_per_program / span
    return table


def windows(df: pd.DataFrame, n: int = 4) -> pd.DataFrame:
    """Per item kind and time window (the span of the trace cut into ``n`` equal slices;
    an item falls in the slice where it starts): items, and their median, p10 and p90 time
    in microseconds. Says whether a kind's items run slower in one part of the kernel, e.g.
    the backward's dA items while its pull copies rows beside them; an item's time includes
    its waits, so early items that wait for their rows show in p90 first."""
    if n < 1:
        raise ValueError(f"n: want >= 1, got {n}")
    span = float(df.end_ms.max() - df.start_ms.min())
    edges = df.start_ms.min() + span * np.arange(n + 1) / n
    slot = np.clip(np.searchsorted(edges, df.start_ms, side="right") - 1, 0, n - 1)
    rows = pd.DataFrame({"kind": df.kind, "window": slot,
                         "dur_us": 1e3 * (df.end_ms - df.start_ms)})
    out = []
    for (kind, w), g in rows.groupby(["kind", "window"], observed=True, sort=True):
        out.append({"kind": str(kind), "window_ms": f"{edges[w]:.2f}-{edges[w + 1]:.2f}",
                    "items": len(g), "median_us": g.dur_us.median(),
                    "p10_us": g.dur_us.quantile(0.1), "p90_us": g.dur_us.quantile(0.9)})
    return pd.DataFrame(out)


def plot_timeline(df: pd.DataFrame, path: Path, rank: int = 0) -> Path:
    """One horizontal bar per item of ``rank``: programs on the y axis, time (ms from the
    first start) on the x axis, a colour per kind. Written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = df[df["rank"] == rank]
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.04 * (d.program.max() + 1))))
    colors = plt.get_cmap("tab10")
    for i, kind in enumerate(df.kind.cat.categories):
        k = d[d.kind == kind]
        if len(k):  # one line segment per item: a whole backward has ~1e5 of them
            ax.hlines(k.program, k.start_ms, k.end_ms, colors=[colors(i)], label=kind,
                      linewidth=max(0.5, 300.0 / (d.program.max() + 1)))
    ax.set_xlabel("ms from the first item's start")
    ax.set_ylabel("program")
    ax.invert_yaxis()
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
