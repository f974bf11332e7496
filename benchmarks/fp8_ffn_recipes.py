"""Time the FP8 expert-FFN tiles (``mok_kernels.ffn_fp8``) per recipe against the same grouped
FFN in bf16 through ``torch._grouped_mm``, at one shape, on one GPU: the measurement that
picks the recipe of mok's FP8 path (blockwise scales inside the K loop against rowwise scales
after it, in the gate+up GEMM or, rowwise_all, in both; MXFP8 on Blackwell). Timed as the
harness times (``mokbench.timing``: CUDA events, median of ``--iters`` after ``--warmup``).
The FP8 times cover both kernels (gate+up with SwiGLU and the h quantisation, down), not the
activation quantisation, which is timed apart (once per forward, at the source rank).

    python benchmarks/fp8_ffn_recipes.py --experts 48 --tokens 16384 --topk 8 [--block-m 128]
"""

from __future__ import annotations

import argparse

import torch
from bench_common import add_shape_args, cuda_ms

import mok_kernels as mk

# The activation quantiser of each recipe (what runs once per forward at the source rank).
QUANT_X = {"blockwise": lambda x: mk.quantize_blockwise(x, 128),
           "rowwise": mk.quantize_rowwise, "mx": mk.quantize_mx,
           "rowwise_all": mk.quantize_rowwise}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--recipes", default=",".join(mk.FP8_RECIPES))
    ap.add_argument("--block-m", type=int, default=0,
                    help="row block of both kernels (default: the recipe's launch tiles)")
    a = ap.parse_args()
    H, I, E = a.hidden, a.intermediate, a.experts
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(E, H, 2 * I, device=dev, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, I, H, device=dev, generator=g) * I ** -0.5).bfloat16()
    w1i = mk.interleave_gate_up(w1)
    print(f"shape H{H} I{I} E{E}, {a.tokens} tokens x top-{a.topk} rows; "
          f"{torch.cuda.get_device_name()}")
    for recipe in a.recipes.split(","):
        tiles = {k: {**v, "BM": a.block_m or v["BM"]}
                 for k, v in mk.tiles_for(recipe).items()}
        bm = tiles["gate_up"]["BM"]
        per = -(-a.tokens * a.topk // E // bm)  # row blocks per expert (balanced routing)
        grp = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(per)
        T = grp.numel() * bm
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        ops = mk.quantize_ffn(recipe, x, w1i, w2)
        y8 = mk.ffn_fp8(ops, grp, tiles=tiles)
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (per * bm)

        def bf16(x=x, offs=offs):
            pre = torch._grouped_mm(x, w1, offs=offs)
            h = torch.nn.functional.silu(pre[:, :I]) * pre[:, I:]
            return torch._grouped_mm(h, w2, offs=offs)

        y16 = bf16()
        err = ((y8.float() - y16.float()).norm() / y16.float().norm()).item()
        flops = 6.0 * T * H * I
        for name, fn in ((f"{recipe} fp8 FFN (BM {bm})",
                          lambda ops=ops, grp=grp, t=tiles: mk.ffn_fp8(ops, grp, tiles=t)),
                         ("bf16 grouped_mm FFN", bf16),
                         (f"{recipe} x quantisation", lambda q=QUANT_X[recipe], x=x: q(x))):
            t = cuda_ms(fn, warmup=a.warmup, iters=a.iters).median_ms
            tf = f"{flops / t / 1e9:7.1f} TFLOP/s" if "FFN" in name else ""
            print(f"{name:28s} rows {T:7d}  median {t:8.3f} ms  {tf}")
        print(f"{recipe}: fp8 output vs bf16 output, norm relative {err:.3e}")


if __name__ == "__main__":
    main()
