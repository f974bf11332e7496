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
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)


def cuda_ms(body: Callable[[], object], prepare: Callable[[], object] | None = None, *,
            warmup: int, iters: int) -> TimingStats:
    """Milliseconds per call of ``body`` on the current GPU (median, min, max, samples)."""
    return time_pass(body, prepare, warmup=warmup, iters=iters,
                     device=torch.device("cuda", torch.cuda.current_device()))
