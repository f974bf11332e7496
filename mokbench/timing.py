"""One timing implementation for every backend, following the published MoK method.

Per pass: ``warmup`` untimed iterations, a barrier, then ``iters`` timed iterations. Each
iteration first runs an untimed ``prepare`` (for the backward pass: the forward that builds the
autograd graph) and then the timed ``body``. On CUDA each body is bracketed by CUDA events on
the current stream (no host sync inside the loop; one at the end); on CPU by perf_counter.
Per-iteration times are all-gathered and the maximum over ranks is taken per iteration (the
layer is as slow as its slowest rank); the statistics are over those maxima, in milliseconds,
and the maxima themselves are kept (``samples_ms``, in iteration order) so a reader can
recompute any statistic from a row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TimingStats:
    """Milliseconds per iteration (per-iteration max over ranks); ``samples_ms`` holds every
    iteration's time in the order run."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    iters: int
    samples_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_ms(times_ms: list[float] | torch.Tensor) -> TimingStats:
    t = torch.as_tensor(times_ms, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return TimingStats(float(q[1]), float(q[0]), float(q[2]), float(t.min()), float(t.max()),
                       int(t.numel()), [round(float(v), 6) for v in t])


def max_over_ranks(times_ms: torch.Tensor, group: dist.ProcessGroup | None,
                   device: torch.device) -> torch.Tensor:
    """Element-wise maximum of every rank's per-iteration times."""
    if group is None or dist.get_world_size(group) == 1:
        return times_ms
    t = times_ms.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu()


def _barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pass(body: Callable[[], object], prepare: Callable[[], object] | None, *,
              warmup: int, iters: int, device: torch.device,
              group: dist.ProcessGroup | None = None) -> TimingStats:
    """Time ``body`` (after an untimed ``prepare`` each iteration); see the module docstring."""
    for _ in range(warmup):
        if prepare is not None:
            prepare()
        body()
    _barrier(group, device)
    times = torch.empty(iters, dtype=torch.float64)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if prepare is not None:
                prepare()
            starts[i].record()
            body()
            ends[i].record()
        torch.cuda.synchronize(device)
        for i in range(iters):
            times[i] = starts[i].elapsed_time(ends[i])
    else:
        for i in range(iters):
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            body()
            times[i] = (time.perf_counter() - t0) * 1e3
    return summarize_ms(max_over_ranks(times, group, device))
