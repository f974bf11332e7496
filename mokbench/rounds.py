"""Rounds: each scenario's cells run R times, the order rotated each round, samples pooled.

Why: a cell's place in a sweep can cost it time that is not its backend's (the cell after a
long one on a GPU held at its power limit, the first cell of a backend that compiles its
kernels). With ``[timing] rounds = R`` (or ``mokbench sweep --rounds R``) the cells of each
scenario run R times, round r in the sweep's order rotated by r cells, so each backend takes
up to R places; a row is written after the cell's last round, its statistics over all
rounds' timed iterations (R x iters samples, each the per-iteration max over ranks) and its
errors the worst round's. ``round_medians_ms`` keeps each round's median, so a reader sees how
much the place moved it.

A sweep stopped between a cell's rounds (Ctrl-C, SIGTERM, a time limit) does not lose the
rounds that finished: their rows are pooled over those rounds, ``rounds`` fewer than
``rounds_planned``, and ``mokbench sweep --resume`` runs such cells again, every round
(:func:`is_partial`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mokbench.sweep import Cell

ERROR_FIELDS = ("max_abs_err", "max_rel_err")


def rotated(todo: Sequence[tuple[int, Cell]], rounds: int) -> list[tuple[int, Cell, int]]:
    """(sweep index, cell, round) in run order: per scenario (its consecutive cells in
    ``todo``), round 0 in the given order, round r rotated left by r cells. ``rounds`` = 1
    gives ``todo`` itself, round 0 each."""
    out: list[tuple[int, Cell, int]] = []
    for _, group in itertools.groupby(todo, key=lambda ic: ic[1].scenario.scenario_id):
        cells = list(group)
        for r in range(rounds):
            k = r % len(cells)
            out += [(i, c, r) for i, c in cells[k:] + cells[:k]]
    return out


def is_partial(row: dict) -> bool:
    """Whether a row pools fewer rounds than its run planned (a sweep stopped between the
    cell's rounds); ``--resume`` runs its cell again."""
    planned, ran = row.get("rounds_planned"), row.get("rounds")
    return planned is not None and ran is not None and ran < planned


def pool(results: Sequence[dict], planned: int | None = None) -> dict:
    """One pass's result fields from its rounds' (in round order). Any round not ok gives
    the row that round's status and reason, the round named; else the statistics of every
    round's samples together, TFLOP/s scaled to the pooled median, the largest error and
    peak memory of any round, ``cell_wall_s`` summed. ``planned``: the rounds the run asked
    for, when fewer finished (kept as ``rounds_planned``)."""
    from mokbench.timing import summarize_ms

    n = len(results)
    of = planned or n
    extra = {"rounds_planned": planned} if planned is not None else {}
    for k, r in enumerate(results):
        if r.get("status") != "ok":
            out = {**r, "rounds": n, **extra}
            if r.get("status") != "skipped" and of > 1:
                out["reason"] = f"round {k + 1} of {of}: {r.get('reason') or ''}".rstrip()
            return out
    worst = max(results, key=lambda r: r.get("max_rel_err") or 0.0)
    samples = [s for r in results for s in r["samples_ms"]]
    stats = summarize_ms(samples).to_dict()
    out = {**worst, **stats, "rounds": n, **extra,
           "round_medians_ms": [r["median_ms"] for r in results]}
    first = results[0]
    if first.get("tflops") and first.get("median_ms"):
        out["tflops"] = first["tflops"] * first["median_ms"] / stats["median_ms"]
    for name in ERROR_FIELDS + ("peak_mem_bytes",):
        values = [r[name] for r in results if r.get(name) is not None]
        out[name] = max(values) if values else None
    walls = [r["cell_wall_s"] for r in results if r.get("cell_wall_s") is not None]
    if walls:
        out["cell_wall_s"] = sum(walls)
    return out
