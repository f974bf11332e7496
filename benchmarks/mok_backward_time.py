"""Quick timing of the mok kernels on one GPU, outside the harness: inference forward,
training forward and backward at one shape (CUDA events, median of ``--iters`` after
``--warmup``; each backward after an untimed training forward). For tuning; the numbers
that go into tables come from ``mokbench sweep``.

    python benchmarks/mok_backward_time.py --experts 48 --tokens 16384 [--shared]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import mok_kernels as mk
from mokbench.mok_backend import config_from_env, default_config_fields


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--shared", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--options", default="{}", help="JSON MoKConfig overrides")
    ap.add_argument("--phases", default="", help="comma-separated backward item masks to time "
                    "(1 dA, 2 dX, 4 dW_down, 8 dW_gate_up; 0 everything outside the items; "
                    "masks without 1 end at their first wait; profiling only)")
    a = ap.parse_args()
    H, I, E, T, K = a.hidden, a.intermediate, a.experts, a.tokens, a.topk
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = config_from_env(H, I, default_config_fields(H, I, T, K, sms, 1, E),
                          json.loads(a.options))
    ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E, topk=K,
                          shared=a.shared, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    p = torch.softmax(torch.randn(T, K, device=dev, generator=g), 1)
    dy = torch.randn(T, H, device=dev, generator=g).bfloat16()
    lay = mk.interleave_gate_up if cfg.gate_up_interleaved else torch.Tensor.contiguous
    w1 = lay((torch.randn(E, H, 2 * I, device=dev, generator=g) * H ** -0.5).bfloat16())
    w2 = (torch.randn(E, I, H, device=dev, generator=g) * I ** -0.5).bfloat16()
    ws1 = lay((torch.randn(H, 2 * I, device=dev) * H ** -0.5).bfloat16()) if a.shared else None
    ws2 = (torch.randn(I, H, device=dev) * I ** -0.5).bfloat16() if a.shared else None
    w = (w1, w2, ws1, ws2)

    def infer():
        return mk.forward(cfg, ws, mk.build_schedule(ws, idx), x, p, *w)

    def train():
        return mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *w)

    def timed(fn, prep=None):
        out = []
        for i in range(a.warmup + a.iters):
            arg = prep() if prep else None
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(arg)
            e.record()
            if i >= a.warmup:
                out.append((s, e))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in out]

    fwd_flops = 6.0 * (T * K + (T if a.shared else 0)) * H * I
    res = {"inference": timed(lambda _: infer()), "forward_train": timed(lambda _: train()),
           "backward": timed(lambda c: mk.backward(cfg, ws, c[1], dy, *w), train)}
    mk.check_errors(ws)
    for ph in filter(None, a.phases.split(",")):
        res[f"backward[{ph}]"] = timed(
            lambda c, m=int(ph): mk.backward(cfg, ws, c[1], dy, *w, _phases=m), train)
    ctx = train()[1]
    print(f"shape H{H} I{I} E{E} T{T} k{K} shared={a.shared}; config {cfg}")
    print(f"context memory {ctx.nbytes / 2**30:.2f} GiB")
    for name, t in res.items():
        med = statistics.median(t)
        fl = fwd_flops * (2 if name.startswith("backward") else 1)
        print(f"{name:14s} median {med:8.3f} ms  min {min(t):8.3f}  max {max(t):8.3f}  "
              f"{fl / med / 1e9:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
