"""Quick timing of the mok kernels on one GPU, outside the harness: inference forward,
training forward and backward at one shape (``mokbench.timing``: CUDA events, median of
``--iters`` after ``--warmup``; each backward after an untimed training forward). For
tuning; the numbers that go into tables come from ``mokbench sweep``.

    python benchmarks/mok_backward_time.py --experts 48 --tokens 16384 [--shared]
        [--passes inference,forward_train]   # forward only: no backward compile or timing
        [--fp8]   # the FP8 forward and backward, as the backend runs precision = "fp8"

Real EP: under torchrun with more than one process (``torchrun --nproc-per-node 2
benchmarks/mok_backward_time.py ...``) each rank holds ``--experts`` local experts and
``--tokens`` tokens routed over all ranks' experts, the workspace spans the process group
(symmetric memory), and rank 0 prints each pass's median per rank and their max (each rank
times its own calls; the kernels' barriers keep the ranks in step); ``--trace`` then writes
PREFIX-r<rank>-{forward,backward}.csv and .png per rank and prints rank 0's tables.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_common import add_shape_args, cuda_ms, phase_lines

import mok_kernels as mk
from mokbench.mok_backend import (
    config_from_env,
    default_config_fields,
    fp8_backward_fields,
    fp8_config_fields,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--shared", action="store_true")
    ap.add_argument("--fp8", action="store_true",
                    help="the backend's FP8 cell defaults (FP8 forward with its recipe, the "
                         "FP8 backward) under --options, weights quantised once as it does")
    ap.add_argument("--options", default="{}", help="JSON MoKConfig overrides")
    ap.add_argument("--phases", default="", help="comma-separated backward item masks to time "
                    "(1 dA, 2 dX, 4 dW_down, 8 dW_gate_up; 0 everything outside the items; "
                    "+16 the dA items without their epilogue (one dA tile per item); +32 the "
                    "FP8 weight gradients' Q items, alone without 4 and 8; masks "
                    "without 1 end at their first wait; profiling only)")
    ap.add_argument("--ncu-mask", type=int, default=None, metavar="MASK",
                    help="after the timed runs, one backward with this phase mask (15: all) "
                    "between cudaProfilerStart and Stop, for Nsight Compute's "
                    "--profile-from-start off (its launches alone are profiled)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each kernel's device time over 3 backwards (torch.profiler)")
    ap.add_argument("--passes", default="inference,forward_train,backward",
                    help="comma-separated passes to time (a forward-only look skips the "
                    "backward's compile and timing)")
    ap.add_argument("--trace-runs", type=int, default=3, metavar="N",
                    help="traced forward+backward runs back to back; the last one is kept "
                         "(default 3: the first compiles, leaving the GPU rested)")
    ap.add_argument("--trace", default="", metavar="PREFIX",
                    help="also trace the megakernels' items in one training forward and its "
                    "backward (after the timed ones): a table per item kind, "
                    "PREFIX-{forward,backward}.csv (every item) and .png (timeline)")
    ap.add_argument("--trace-phases", type=int, default=15, metavar="MASK",
                    help="the traced backward's phase mask (as --phases; default 15: every "
                         "item); its table per time window says whether a kind's items run "
                         "slower in part of the kernel, e.g. the dA items beside the pull")
    a = ap.parse_args()
    passes = [p for p in a.passes.split(",") if p]
    bad = sorted(set(passes) - {"inference", "forward_train", "backward"})
    if a.trace_runs < 1:
        ap.error(f"--trace-runs: got {a.trace_runs}; allowed an integer >= 1")
    if not 0 <= a.trace_phases <= 63:
        ap.error(f"--trace-phases: got {a.trace_phases}; allowed a phase mask in 0..63")
    if a.ncu_mask is not None and not 0 <= a.ncu_mask <= 63:
        ap.error(f"--ncu-mask: got {a.ncu_mask}; allowed a phase mask in 0..63")
    if bad or not passes:
        ap.error(f"--passes: got {a.passes!r}; allowed a comma-separated subset of "
                 "inference, forward_train, backward")
    H, I, E, T, K = a.hidden, a.intermediate, a.experts, a.tokens, a.topk
    R, rank, group = 1, 0, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # real EP under torchrun
        import torch.distributed as dist

        R, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    arch = torch.cuda.get_device_capability(dev)[0] * 10
    defaults = default_config_fields(H, I, T, K, sms, R, E, arch)
    if a.fp8:  # as mok_backend.scenario_config for precision "fp8"
        defaults.update(fp8_config_fields(arch, json.loads(a.options).get("fp8")))
        defaults.update(fp8_backward_fields(arch, R))
    cfg = config_from_env(H, I, defaults, json.loads(a.options))
    ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E, topk=K,
                          shared=a.shared, device=dev, group=group)
    g = torch.Generator(device=dev).manual_seed(rank)  # each rank its own tokens and experts
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    idx = torch.rand(T, R * E, device=dev, generator=g).topk(K, dim=1).indices
    p = torch.softmax(torch.randn(T, K, device=dev, generator=g), 1)
    dy = torch.randn(T, H, device=dev, generator=g).bfloat16()
    lay = mk.interleave_gate_up if cfg.gate_up_interleaved else torch.Tensor.contiguous
    w1 = lay((torch.randn(E, H, 2 * I, device=dev, generator=g) * H ** -0.5).bfloat16())
    w2 = (torch.randn(E, I, H, device=dev, generator=g) * I ** -0.5).bfloat16()
    ws1 = lay((torch.randn(H, 2 * I, device=dev) * H ** -0.5).bfloat16()) if a.shared else None
    ws2 = (torch.randn(I, H, device=dev) * I ** -0.5).bfloat16() if a.shared else None
    w = (w1, w2, ws1, ws2)
    w8 = mk.quantize_backward_weights(cfg, w2, ws2, w1, ws1)  # None without FP8 dgrad knobs
    wf = mk.quantize_weights(cfg, *w) if cfg.fp8 != "none" else w  # the forward's weights

    def infer():
        return mk.forward(cfg, ws, mk.build_schedule(ws, idx), x, p, *wf)

    def train():
        return mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *wf)

    held = {}

    def pre_train():  # the untimed training forward before each backward
        held["ctx"] = train()[1]

    def back(phases=15):
        return mk.backward(cfg, ws, held["ctx"], dy, *w, fp8_weights=w8, _phases=phases)

    def timed(body, prepare=None):
        return cuda_ms(body, prepare, warmup=a.warmup, iters=a.iters)

    fwd_flops = 6.0 * (T * K + (T if a.shared else 0)) * H * I
    bodies = {"inference": (infer, None), "forward_train": (train, None),
              "backward": (back, pre_train)}
    res = {name: timed(*bodies[name]) for name in passes}
    mk.check_errors(ws)
    for ph in filter(None, a.phases.split(",") if "backward" in passes else []):
        res[f"backward[{ph}]"] = timed(
            lambda m=int(ph): back(m), pre_train)
    if a.ncu_mask is not None:
        pre_train()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        back(a.ncu_mask)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        mk.check_errors(ws)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                pre_train()
                back()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                        max_name_column_width=60))
    if a.trace:
        from mokbench import item_trace

        ftr = torch.full((1, mk.forward_trace_capacity(ws), 4), -1, dtype=torch.int64,
                         device=dev)
        btr = torch.full((1, mk.backward_trace_capacity(ws), 4), -1, dtype=torch.int64, device=dev)
        # Back to back, the last one kept: the first compiles the traced kernels, which
        # leaves the GPU idle for seconds, and a rested GPU runs faster than one at its power
        # limit (notes/mok-kernel.md), so one traced run alone spans less than the timed ones.
        for _ in range(a.trace_runs):
            ftr.fill_(-1)
            btr.fill_(-1)
            held["ctx"] = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *wf,
                                           _trace=ftr)[1]
            mk.backward(cfg, ws, held["ctx"], dy, *w, fp8_weights=w8, _trace=btr,
                        _phases=a.trace_phases)
        mk.check_errors(ws)
        prefix = f"{a.trace}-r{rank}" if R > 1 else a.trace
        for name, tr, kinds in (("forward", ftr, item_trace.FORWARD_KINDS),
                                ("backward", btr, item_trace.BACKWARD_KINDS)):
            df = item_trace.items(tr.cpu().numpy(), kinds)
            df.to_csv(f"{prefix}-{name}.csv", index=False)
            item_trace.plot_timeline(df, f"{prefix}-{name}.png")
            if rank == 0:
                print(f"{name} items" + (" (compute programs only)" if name == "forward"
                                         else "") + (" of rank 0" if R > 1 else ""))
                print(item_trace.summarize(df, int(df.program.max()) + 1).round(3).to_string())
                if name == "backward":
                    print(f"backward items by time window (phase mask {a.trace_phases})")
                    print(item_trace.windows(df, 4).round(1).to_string(index=False))
    ctx = train()[1]
    if R > 1:  # every rank's medians, printed by rank 0
        import torch.distributed as dist

        medians = [None] * R
        dist.all_gather_object(medians, {n: t.median_ms for n, t in res.items()})
        if rank == 0:
            print(f"EP {R}: {E} local experts and {T} tokens per rank")
            for name in res:
                per = [m[name] for m in medians]
                print(f"{name:14s} per rank " + " ".join(f"{v:8.3f}" for v in per)
                      + f"  max {max(per):8.3f} ms")
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return
    print(f"shape H{H} I{I} E{E} T{T} k{K} shared={a.shared}; config {cfg}")
    print(f"context memory {ctx.nbytes / 2**30:.2f} GiB")
    for name, t in res.items():
        fl = fwd_flops * (2 if name.startswith("backward") else 1)
        print(f"{name:14s} median {t.median_ms:8.3f} ms  min {t.min_ms:8.3f}  "
              f"max {t.max_ms:8.3f}  {fl / t.median_ms / 1e9:7.1f} TFLOP/s")
    masks = {int(n[9:-1]): t.median_ms for n, t in res.items() if n.startswith("backward[")}
    for line in phase_lines(masks, fwd_flops / 3):  # one GEMM's FLOPs: a third of forward's
        print(line)


if __name__ == "__main__":
    main()
