"""Quick check outside the harness: mok forward at 48 x 16384 (H7168 I2048 top-8, no shared
expert) with the router-weighted sum as its own pass and inside the kernel (``fused_sum``),
timed with triton.testing.do_bench (median ms). The harness's numbers come from sweeps."""

from __future__ import annotations

import sys
from pathlib import Path

import triton.testing

sys.path.insert(0, str(Path(__file__).parent))
from mok_device_check import make_layer  # noqa: E402

import mok_kernels as mk  # noqa: E402

T, E, H, I, K = 16384, 48, 7168, 2048, 8
x, idx, p, (w1, w2, _, _) = make_layer(T, H, I, E, K)
w1k = mk.interleave_gate_up(w1)
ys = {}
for fused in (False, True, False, True):
    cfg = mk.MoKConfig.for_shape(H, I, minibatch=4096, macrobatch=12288, tma=True,
                                 gate_up_interleaved=True, num_stages=4, down_tiles=2,
                                 gate_up_tiles=2, fused_sum=fused)
    ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E, topk=K,
                          shared=False, device="cuda")
    ms = triton.testing.do_bench(
        lambda cfg=cfg, ws=ws: mk.forward(cfg, ws, mk.build_schedule(ws, idx), x, p, w1k, w2),
        warmup=200, rep=2000, return_mode="median")
    ys[fused] = mk.forward(cfg, ws, mk.build_schedule(ws, idx), x, p, w1k, w2)
    mk.check_errors(ws)
    print(f"fused_sum={fused}: {ms:.3f} ms")
print("max |fused - separate|:", (ys[True].float() - ys[False].float()).abs().max().item())
