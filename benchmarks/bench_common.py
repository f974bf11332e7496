"""What the one-GPU timing scripts share: the layer-shape flags, and timing through the
harness's own timing code (``mokbench.timing.time_pass``: untimed warm-up, CUDA events around
each timed iteration, an untimed ``prepare`` before each)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from mokbench.timing import TimingStats, time_pass


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """--hidden, --intermediate, --experts, --tokens, --topk (Kimi 48 x 16384 by default),
    --iters, --warmup."""
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20,
                    help="timed iterations (default 20). Short runs time a GPU that has not "
                    "yet settled at its power limit: at Kimi K2 48 x 16384 on one H100 the "
                    "backward read 37.073 ms at 10 and 37.965 at 100, the sweep's cell "
                    "38.033 (notes/mok-kernel.md, the session of 2026-12-07 07:25); use "
                    "100 to compare with a sweep's figure")
    ap.add_argument("--warmup", type=int, default=5)


def cuda_ms(body: Callable[[], object], prepare: Callable[[], object] | None = None, *,
            warmup: int, iters: int) -> TimingStats:
    """Milliseconds per call of ``body`` on the current GPU (median, min, max, samples)."""
    return time_pass(body, prepare, warmup=warmup, iters=iters,
                     device=torch.device("cuda", torch.cuda.current_device()))


# FLOPs of each backward item kind (phase bit) in units of F = 2 x rows x H x I, one GEMM of
# the layer: dA = dY W_down^T (F), dX = [dG dU] W_gate_up^T (2F), dW_down (F), dW_gate_up (2F).
# Bit 16 (the dA items' K loop without their epilogue) adds no FLOPs of its own, nor bit 32
# (the FP8 weight gradients' quantisation (Q) items, which bits 4 and 8 run too, alone).
PHASE_GEMMS = {1: ("dA", 1), 2: ("dX", 2), 4: ("dW_down", 1), 8: ("dW_gate_up", 2)}


def phase_lines(median_ms: dict[int, float], gemm_flops: float) -> list[str]:
    """For each timed phase mask other than 0, a line with its items' time beyond mask 0
    (everything outside the items) and the items' TFLOP/s, given each mask's median in ms and
    F = ``gemm_flops``; nothing without mask 0. Mask 17 (the dA items' K loop) is set beside
    mask 1 by the epilogue's share: (t[1] - t[17]) / (t[1] - t[0]); mask 33 (the dA items,
    then the Q items alone) by the Q items' time, t[33] - t[1]."""
    if 0 not in median_ms:
        return []
    base, out = median_ms[0], []
    for mask, ms in median_ms.items():
        if mask == 0:
            continue
        kinds = [name for bit, (name, _) in PHASE_GEMMS.items() if mask & bit]
        flops = gemm_flops * sum(n for bit, (_, n) in PHASE_GEMMS.items() if mask & bit)
        items = ms - base
        what = "+".join(kinds + (["Q"] if mask & 32 and not mask & 12 else []))
        what += " K loop only" if mask & 16 else ""
        rate = f"{flops / items / 1e9:8.1f} TFLOP/s" if items > 0 and flops else "   n/a"
        out.append(f"items[{mask}] {what:28s} {items:8.3f} ms beyond mask 0  {rate}")
    if 1 in median_ms and 17 in median_ms and median_ms[1] > base:
        share = (median_ms[1] - median_ms[17]) / (median_ms[1] - base)
        out.append(f"dA epilogue share {share:.3f} of the dA items' time "
                   f"({median_ms[1] - median_ms[17]:.3f} ms)")
    if 1 in median_ms and 33 in median_ms:
        out.append(f"Q items {median_ms[33] - median_ms[1]:.3f} ms (mask 33 less mask 1)")
    return out
