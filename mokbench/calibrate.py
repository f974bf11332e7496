"""Measure this machine's ceilings, the denominators of the report's "fraction of ceiling".

    python -m mokbench.calibrate --out RUN_DIR                     # one process
    torchrun --nproc-per-node 8 -m mokbench.calibrate --out RUN_DIR  # adds the all-to-all

Every number is the median over timed iterations (after warm-up) of one operation on random
data: CUDA events on a GPU, ``time.perf_counter`` on CPU. Rank 0 merges the result into
``RUN_DIR/env.json`` under ``"ceilings"``:

    bf16_tflops      dense bf16 GEMM  C = A @ B, A [N, N], B [N, N]:  2 * N^3 / t / 1e12
    fp8_tflops       fp8 e4m3 ``torch._scaled_mm`` at the same N (per-tensor scales, bf16 out):
                     2 * N^3 / t / 1e12; None where the device or build lacks it
    copy_gbps        device-to-device copy of S bytes, counting bytes read + written:
                     2 * S / t / 1e9
    a2a_busbw_gbps   ``all_to_all_single`` over the group, S bytes sent per rank (S / n to each
                     peer, itself included), bus bandwidth as nccl-tests defines it:
                     algbw = S / t,  busbw = algbw * (n - 1) / n   (GB/s, 1e9 bytes); the time
                     of an iteration is its maximum over ranks. None with one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mokbench.backend import RunContext
from mokbench.results import read_env, write_env

GPU_SIZES = {"gemm_n": 8192, "copy_bytes": 1 << 30, "a2a_bytes": 256 << 20}
CPU_SIZES = {"gemm_n": 256, "copy_bytes": 8 << 20, "a2a_bytes": 1 << 20}


def _time_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Per-iteration wall times of ``fn`` in ms: CUDA events around each call on a GPU (the
    stream is synchronised once at the end), ``perf_counter`` on CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in events]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def gemm_tflops(n: int, device: torch.device, iters: int = 20, warmup: int = 5) -> float:
    """Dense bf16 GEMM [n, n] @ [n, n] in TFLOP/s: 2 * n^3 / median_seconds / 1e12."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = statistics.median(_time_ms(lambda: torch.mm(a, b), device, iters, warmup))
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def fp8_tflops(n: int, device: torch.device, iters: int = 20, warmup: int = 5) -> float | None:
    """fp8 e4m3 ``torch._scaled_mm`` [n, n] @ [n, n] (B column-major, per-tensor float32
    scales, bf16 output) in TFLOP/s: 2 * n^3 / median_seconds / 1e12. None when fp8 or
    ``_scaled_mm`` is unavailable here (e.g. GPUs below compute capability 8.9)."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None or not hasattr(torch, "_scaled_mm"):
        return None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return None
    try:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype).t()  # column-major, as _scaled_mm needs
        one = torch.ones((), device=device, dtype=torch.float32)

        def mm() -> torch.Tensor:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        ms = statistics.median(_time_ms(mm, device, iters, warmup))
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def copy_gbps(nbytes: int, device: torch.device, iters: int = 20, warmup: int = 5) -> float:
    """Device-to-device copy of ``nbytes`` in GB/s, counting bytes read + written:
    2 * nbytes / median_seconds / 1e9."""
    src = torch.randn(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = statistics.median(_time_ms(lambda: dst.copy_(src), device, iters, warmup))
    return 2.0 * src.numel() * 4 / (ms * 1e-3) / 1e9


def a2a_busbw_gbps(ctx: RunContext, nbytes: int, iters: int = 20, warmup: int = 5
                   ) -> float | None:
    """All-to-all bus bandwidth over ``ctx.group`` in GB/s, as nccl-tests defines it.

    Each rank sends ``nbytes`` (``nbytes / n`` to every rank, itself included) with
    ``all_to_all_single``. Per iteration, t = max over ranks of that rank's time;
    algbw = nbytes / median(t), busbw = algbw * (n - 1) / n (the share that crosses links).
    None without a process group or with one rank.
    """
    n = ctx.world_size
    if n < 2 or not dist.is_available() or not dist.is_initialized():
        return None
    device = torch.device(ctx.device)
    numel = max(n, (nbytes // 2) // n * n)  # bf16 elements, a multiple of n
    send = torch.randn(numel, device=device, dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    dist.barrier(group=ctx.group)
    times = torch.tensor(_time_ms(lambda: dist.all_to_all_single(recv, send, group=ctx.group),
                                  device, iters, warmup), device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=ctx.group)
    seconds = statistics.median(times.tolist()) * 1e-3
    return numel * 2 / seconds / 1e9 * (n - 1) / n


def measure_ceilings(ctx: RunContext, *, gemm_n: int | None = None, copy_bytes: int | None = None,
                     a2a_bytes: int | None = None, iters: int = 20, warmup: int = 5
                     ) -> dict[str, Any]:
    """This machine's ceilings (see the module docstring for each formula), plus the sizes
    used. Sizes default to 8192^3 GEMMs, 1 GiB copies and 256 MiB all-to-alls on a GPU, and to
    small ones (256^3, 8 MiB, 1 MiB) on CPU. Every rank must call it (the all-to-all is
    collective); each returns the same all-to-all number and its own local numbers."""
    device = torch.device(ctx.device)
    sizes = dict(GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    sizes.update({k: v for k, v in (("gemm_n", gemm_n), ("copy_bytes", copy_bytes),
                                    ("a2a_bytes", a2a_bytes)) if v is not None})
    torch.manual_seed(1234 + ctx.rank)
    kw = {"iters": iters, "warmup": warmup}
    result: dict[str, Any] = {
        "bf16_tflops": gemm_tflops(sizes["gemm_n"], device, **kw),
        "fp8_tflops": fp8_tflops(sizes["gemm_n"], device, **kw),
        "copy_gbps": copy_gbps(sizes["copy_bytes"], device, **kw),
        "a2a_busbw_gbps": a2a_busbw_gbps(ctx, sizes["a2a_bytes"], **kw),
    }
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result.update(sizes, device=device_name, world_size=ctx.world_size, iters=iters,
                  measured_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return result


def _context() -> RunContext:
    """RunContext from torchrun's environment; starts the process group (nccl on a GPU, else
    gloo) when WORLD_SIZE is set, none otherwise."""
    if "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return RunContext(device=device, dist_backend="none")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, **kwargs)
    return RunContext(rank=rank, world_size=world, local_rank=local_rank, device=device,
                      group=dist.group.WORLD, dist_backend=backend)


def store_ceilings(run_dir: Path, ceilings: dict[str, Any]) -> dict[str, Any]:
    """Merge ``ceilings`` into ``run_dir/env.json`` under "ceilings" (keys not measured now are
    kept) and return the merged ceilings."""
    merged = dict(read_env(run_dir).get("ceilings") or {})
    merged.update(ceilings)
    write_env(run_dir, extra={"ceilings": merged})
    return merged


def main(argv: list[str] | None = None) -> int:
    """``python -m mokbench.calibrate --out RUN_DIR`` (alone or under torchrun)."""
    ap = argparse.ArgumentParser(prog="mokbench.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="run folder holding env.json")
    ap.add_argument("--gemm-n", type=int, default=None, help="GEMM size N (N x N x N)")
    ap.add_argument("--copy-bytes", type=int, default=None)
    ap.add_argument("--a2a-bytes", type=int, default=None, help="bytes sent per rank")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    ctx = _context()
    try:
        ceilings = measure_ceilings(ctx, gemm_n=args.gemm_n, copy_bytes=args.copy_bytes,
                                    a2a_bytes=args.a2a_bytes, iters=args.iters,
                                    warmup=args.warmup)
        if ctx.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            print(json.dumps(store_ceilings(args.out, ceilings), indent=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
