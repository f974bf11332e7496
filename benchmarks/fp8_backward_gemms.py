"""What FP8 could buy mok's backward: the four GEMM kinds of the backward (A: dA = dY @
W_down^T, B: dX = [dG dU] @ W_gate_up^T, C: dW_down = (r h)^T @ dY, D: dW_gate_up = x^T @
[dG dU]) for every expert, in bf16 (``torch.mm``) and in FP8 e4m3 with one scale per row of
A and per column of B (``torch._scaled_mm``, rowwise scaling, fp32 accumulation, bf16 out),
one GPU, balanced rows per expert. Both run as one call per expert, so they pay the same
launches; the GEMMs are cuBLAS/CUTLASS ones, a proxy for what FP8 tiles in the megakernel
could reach at this shape and under this GPU's power limit (notes/mok-kernel.md, "FP8
backward: the plan"). The quantisation (and, for C and D, the transposes an FP8 weight
gradient needs, TE's "columnwise" copies) is done untimed beforehand, in plain torch, and its
own time printed apart: a fused kernel would do it in the pull or an epilogue instead.

    python benchmarks/fp8_backward_gemms.py --experts 48 --tokens 16384 --topk 8
"""

from __future__ import annotations

import argparse

import torch
from bench_common import add_shape_args, cuda_ms

E4M3_MAX = 448.0


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of a 2-D tensor with one fp32 scale per row (amax / 448): (q, scale [rows, 1])."""
    amax = t.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def operands(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """FP8 operands of a @ b for ``torch._scaled_mm``: A row-major with a scale per row, B
    column-major with a scale per column (quantised as the rows of b^T)."""
    qa, sa = quantize_rows(a.contiguous())
    qbt, sbt = quantize_rows(b.t().contiguous())
    return qa, qbt.t(), sa, sbt.t()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    a = ap.parse_args()
    H, I, E = a.hidden, a.intermediate, a.experts
    M = -(-a.tokens * a.topk // E // 16) * 16  # rows per expert (balanced), 16-aligned
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).bfloat16()

    w1 = rand(E, H, 2 * I, scale=H ** -0.5)  # [E, H, 2I]
    w2 = rand(E, I, H, scale=I ** -0.5)  # [E, I, H]
    x, dy, dgu, rh = rand(E, M, H), rand(E, M, H), rand(E, M, 2 * I), rand(E, M, I)
    # per kind: (A of expert e, B of expert e, FLOPs per expert)
    kinds = {
        "A  dA = dY @ W_down^T": (lambda e: dy[e], lambda e: w2[e].t(), 2 * M * H * I),
        "B  dX = [dG dU] @ W_gate_up^T": (lambda e: dgu[e], lambda e: w1[e].t(),
                                          2 * M * 2 * I * H),
        "C  dW_down = (r h)^T @ dY": (lambda e: rh[e].t(), lambda e: dy[e], 2 * I * M * H),
        "D  dW_gate_up = x^T @ [dG dU]": (lambda e: x[e].t(), lambda e: dgu[e],
                                          2 * H * M * 2 * I),
    }
    print(f"shape H{H} I{I} E{E}, {M} rows per expert ({a.tokens} tokens x top-{a.topk}); "
          f"{torch.cuda.get_device_name()}")
    total16 = total8 = 0.0
    for name, (fa, fb, flops) in kinds.items():
        bf = [(fa(e).contiguous(), fb(e)) for e in range(E)]
        t16 = cuda_ms(lambda bf=bf: [torch.mm(p, q) for p, q in bf], warmup=a.warmup,
                      iters=a.iters)
        prep = cuda_ms(lambda fa=fa, fb=fb: [operands(fa(e), fb(e)) for e in range(E)],
                       warmup=1, iters=3)
        q8 = [operands(fa(e), fb(e)) for e in range(E)]
        t8 = cuda_ms(lambda q8=q8: [torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb,
                                                     out_dtype=torch.bfloat16,
                                                     use_fast_accum=True)
                                    for qa, qb, sa, sb in q8],
                     warmup=a.warmup, iters=a.iters)
        err = max(float((torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb,
                                          out_dtype=torch.bfloat16).float()
                         - (p.float() @ q.float())).norm() / (p.float() @ q.float()).norm())
                  for (qa, qb, sa, sb), (p, q) in zip(q8[:2], bf[:2], strict=True))
        tf = E * flops / 1e12
        total16, total8 = total16 + t16.median_ms, total8 + t8.median_ms
        print(f"{name:32s} bf16 {t16.median_ms:8.3f} ms ({tf / t16.median_ms * 1e3:6.1f} "
              f"TFLOP/s)  fp8 {t8.median_ms:8.3f} ms ({tf / t8.median_ms * 1e3:6.1f} TFLOP/s)"
              f"  {t16.median_ms / t8.median_ms:5.2f}x  rel err {err:.1e}  "
              f"(torch quantise+transpose, untimed above: {prep.median_ms:.3f} ms)")
    print(f"{'all four':32s} bf16 {total16:8.3f} ms  fp8 {total8:8.3f} ms  "
          f"{total16 / total8:5.2f}x")


if __name__ == "__main__":
    main()
