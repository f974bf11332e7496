"""One-shot GPU check of the mok forward: correctness against the float32 layer, then timing
of variants at the published single-GPU point (48 experts x 16384 tokens, H 7168, I 2048,
top-8, shared expert) next to eager torch, and stage-skipping runs that show where time goes.

    PYTHONUNBUFFERED=1 python benchmarks/mok_device_check.py --out results/_scratch

Legend: T tokens, H hidden, I intermediate, E experts, K top-k. Layer FLOPs (as published):
6 * (T + T*K) * H * I with the shared expert.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import mok_kernels as mk
from mok_kernels._details.forward import launch_megakernel, weighted_sum
from mokbench.reference import reference_all_experts

DEV = "cuda"


def make_layer(T, H, I, E, K, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=DEV).bfloat16()
    idx = torch.rand(T, E, generator=g, device=DEV).topk(K, dim=1).indices
    p = torch.softmax(torch.randn(T, K, generator=g, device=DEV), 1)
    w1 = (torch.randn(E, H, 2 * I, generator=g, device=DEV) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, I, H, generator=g, device=DEV) * I ** -0.5).bfloat16()
    ws1 = (torch.randn(H, 2 * I, generator=g, device=DEV) * H ** -0.5).bfloat16()
    ws2 = (torch.randn(I, H, generator=g, device=DEV) * I ** -0.5).bfloat16()
    return x, idx, p, (w1, w2, ws1, ws2)


def bench(fn, iters=10, warmup=3) -> float:
    """Median ms over iterations timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def mok_runner(cfg, x, idx, p, w, E):
    T, H = x.shape
    ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=w[1].shape[1], local_experts=E,
                          topk=idx.shape[1], shared=True, device=DEV)

    def run():
        sched = mk.build_schedule(ws, idx)
        return mk.forward(cfg, ws, sched, x, p, *w)
    return ws, run


def torch_eager(x, idx, p, w):
    """The plain layer (nccl_torch on one rank: argsort permute, torch._grouped_mm)."""
    from baselines.common import expert_params
    from baselines.nccl_torch import moe_alltoall_forward
    from mokbench.backend import RunContext
    from mokbench.inputs import MoEWeights

    params = expert_params(MoEWeights(*w, first_expert=0))
    ctx = RunContext(device=torch.device(DEV))
    E = w[0].shape[0]

    def run():
        with torch.no_grad():
            return moe_alltoall_forward(x, idx, p, params, ctx, E)
    return run


def correctness(log, name, cfg, T, H, I, E, K):
    x, idx, p, w = make_layer(T, H, I, E, K, seed=T + E)
    ws, run = mok_runner(cfg, x, idx, p, w, E)
    t0 = time.time()
    y = run()
    torch.cuda.synchronize()
    mk.check_errors(ws)
    ref = reference_all_experts(x, idx, p, *w).y_TH
    err = ((y.float() - ref).norm() / ref.norm()).item()
    y2 = run()
    same = bool(torch.equal(y, y2))
    log(name, rel_err=err, bitwise_rerun=same, first_call_s=round(time.time() - t0, 1))
    return err


def timing(log, T=16384, H=7168, I=2048, E=48, K=8):
    x, idx, p, w = make_layer(T, H, I, E, K, seed=7)
    flops = 6.0 * (T + T * K) * H * I

    def show(name, ms, **kw):
        log(name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), **kw)

    show("torch_eager", bench(torch_eager(x, idx, p, w)))
    variants = [
        ("mok comm0 mb4096", dict(minibatch=4096, macrobatch=3 * 4096)),
        ("mok comm0 mb4096 graph", dict(minibatch=4096, macrobatch=3 * 4096)),
        ("mok comm0 mb8192 graph", dict(minibatch=8192, macrobatch=3 * 8192)),
        ("mok comm0 mb4096 dt1 graph", dict(minibatch=4096, macrobatch=3 * 4096,
                                            down_tiles=1)),
        ("mok comm16 mb4096 graph", dict(minibatch=4096, macrobatch=3 * 4096,
                                         fwd_comm_sms=16)),
    ]
    ref = None
    for name, fields in variants:
        cfg = mk.MoKConfig.for_shape(H, I, **fields)
        try:
            ws, run = mok_runner(cfg, x, idx, p, w, E)
            if "graph" in name:
                gf = mk.GraphedForward(cfg, ws, w)
                run = lambda gf=gf: gf(x, idx, p)  # noqa: E731
            y = run()
            torch.cuda.synchronize()
            mk.check_errors(ws)
            if ref is None:
                ref = reference_all_experts(x, idx, p, *w).y_TH
            err = ((y.float() - ref).norm() / ref.norm()).item()
            show(name, bench(run), rel_err=round(err, 5))
            if name == "mok comm0 mb4096":
                breakdown(show, ws, cfg, x, idx, p, w)
        except Exception as exc:  # record and go on with the other variants
            log(name, error=f"{type(exc).__name__}: {exc}"[:300])
        mk.clear_workspace_cache()
    gemm_only(show, x, idx, w)


def breakdown(show, ws, cfg, x, idx, p, w):
    """Each stage alone (the others already done once): where the time goes."""
    sched = mk.build_schedule(ws, idx)
    y = torch.empty_like(x)
    p32 = p.float().contiguous()
    show("  stage: schedule", bench(lambda: mk.build_schedule(ws, idx)))
    show("  stage: x copy + counter reset", bench(
        lambda: (ws.x_LTH.view(-1, ws.H).copy_(x), ws.counters_LC.zero_())))

    def kernel_only():
        ws.counters_LC.zero_()
        launch_megakernel(ws, sched.tensors, *w, y_NH=y, p_NK=p32)
    show("  stage: megakernel", bench(kernel_only))
    show("  stage: weighted sum", bench(lambda: weighted_sum(ws, p32, y)))
    mk.check_errors(ws)


def gemm_only(show, x, idx, w):
    """torch._grouped_mm on rows already grouped by expert (+ shared): the GEMM ceiling."""
    w1, w2, ws1, ws2 = w
    E, I = w1.shape[0], w2.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = torch.cat([x[order // idx.shape[1]], x])
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(torch.cat([counts, counts.new_tensor([x.shape[0]])]), 0).int()
    w1a = torch.cat([w1, ws1[None]]).transpose(1, 2).contiguous().transpose(1, 2)
    w2a = torch.cat([w2, ws2[None]]).transpose(1, 2).contiguous().transpose(1, 2)

    def run():
        h = torch._grouped_mm(xs, w1a, offs=offs)
        torch._grouped_mm(torch.nn.functional.silu(h[:, :I]) * h[:, I:], w2a, offs=offs)
    show("torch._grouped_mm GEMMs only", bench(run))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/_scratch")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def log(name, **kw):
        rows.append({"name": name, **kw})
        print(f"{name:32s} " + " ".join(f"{k}={v}" for k, v in kw.items()), flush=True)
        (out / "mok_device_check.json").write_text(json.dumps(rows, indent=1))

    props = torch.cuda.get_device_properties(0)
    import triton

    log("env", gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__)
    for comm in (0, 8):
        cfg = mk.MoKConfig.for_shape(7168, 2048, minibatch=2048, macrobatch=6144,
                                     fwd_comm_sms=comm)
        correctness(log, f"check T4096 E8 K8 comm{comm}", cfg, 4096, 7168, 2048, 8, 8)
    if not args.skip_timing:
        timing(log)
    print("\n".join(f"{r['name']:32s} {r.get('ms', '')!s:>8} {r.get('tflops', '')!s:>7} "
                    f"{r.get('rel_err', r.get('error', ''))}" for r in rows))


if __name__ == "__main__":
    main()
