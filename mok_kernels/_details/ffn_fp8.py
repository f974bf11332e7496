"""Host side of the FP8 expert FFN tiles (``tl_gemm_fp8``): quantise the operands for a
recipe, run the grouped gate+up (SwiGLU, h quantised in the epilogue) and down kernels, and
the torch reference with the same quantisation.

Legend: T rows grouped by expert in row blocks of BM (``grp_B[b]`` is block b's expert), H
hidden, I intermediate, F = 2*I, E experts. w1_EHF is gate/up interleaved
(``interleave_gate_up``), as the megakernel keeps it. Quantised weights are kept K-major
(w1_EFH, w2_EHI: the transposes), the layout Hopper's FP8 MMAs read (``tl_gemm_fp8``).

These run alone (tests, ``benchmarks/fp8_ffn_recipes.py``); the megakernel's FP8 path is built
from the same tiles.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from mok_kernels._details import quant_ref as qr
from mok_kernels._details import tl_quant as tq
from mok_kernels._details.tl_gemm_fp8 import BLOCKWISE, MX, RECIPES, ROWWISE_ALL, down_recipe

# Tiles the standalone kernels launch with on GPUs. BN = 256 interleaved gate/up columns give
# one 1x128 block of h per row and tile. Hopper: BM = 64, since the blockwise recipe's extra
# [BM, BN] fp32 tile per step spills at BM = 128 (sm_90, 8 warps); Blackwell MXFP8: BM = 128,
# the M of a block-scaled tcgen05 MMA (at BM = 64 Triton emulates dot_scaled with bf16 MMAs).
# tests/unit/test_mok_fp8_tiles.py pins both builds.
_HOPPER = {"BM": 64, "BN": 256, "BK": 128, "num_warps": 8, "num_stages": 3}
_BLACKWELL_MX = {"BM": 128, "BN": 256, "BK": 128, "num_warps": 8, "num_stages": 3}
TILES = {"gate_up": _HOPPER, "down": _HOPPER}
TILES_MX = {"gate_up": _BLACKWELL_MX, "down": _BLACKWELL_MX}


def tiles_for(recipe: str) -> dict:
    """The launch tiles of both kernels for a recipe (see TILES)."""
    return TILES_MX if recipe == "mx" else TILES


@dataclasses.dataclass(frozen=True)
class Fp8Ffn:
    """Quantised operands of one recipe. x_TH, w1_EFH, w2_EHI e4m3 (weights K-major, [N, K]
    per expert); scales: sx per x row (K/128 fp32 blockwise, 1 fp32 rowwise and rowwise_all,
    H/32 e8m0 mx), sw1 / sw2 per expert (K/128 x N/128 fp32 blockwise, N fp32 rowwise for w1
    and rowwise_all for both, N x K/32 e8m0 mx)."""

    recipe: str
    x_TH: torch.Tensor
    sx: torch.Tensor
    w1_EFH: torch.Tensor
    sw1: torch.Tensor
    w2_EHI: torch.Tensor
    sw2: torch.Tensor

    @property
    def down_recipe(self) -> str:
        """The down GEMM's recipe: h is quantised per 1x128 block unless the recipe is mx
        (1x32 MX) or rowwise_all (one scale per row)."""
        code = down_recipe(RECIPES[self.recipe])
        return next(name for name, c in RECIPES.items() if c == code)


def _check_recipe(recipe: str) -> int:
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is invalid: allowed {' | '.join(RECIPES)}")
    return RECIPES[recipe]


def _mx_weight(w_EKN: torch.Tensor, soft_cast: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 weights: 1x32 blocks along K of every output column; returns (w_q [E, N, K]
    K-major, codes [E, N, K/32]), the scale layout ``tl.dot_scaled`` takes."""
    E, K, N = w_EKN.shape
    q, code = tq.quantize_mx(w_EKN.transpose(1, 2).reshape(E * N, K), soft_cast=soft_cast)
    return q.view(E, N, K), code.view(E, N, K // 32)


def _quantize_act(recipe: str, x_NH: torch.Tensor, pow2_scales: bool,
                  soft_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations of a recipe: (e4m3 [N, H], scales: [N, H/128] fp32 blockwise, [N] fp32
    rowwise, [N, H/32] e8m0 mx)."""
    if recipe == "mx":
        return tq.quantize_mx(x_NH, soft_cast=soft_cast)
    kw = {"pow2_scales": pow2_scales, "soft_cast": soft_cast}
    if recipe in ("rowwise", "rowwise_all"):
        return tq.quantize_rowwise(x_NH, **kw)
    return tq.quantize_blockwise(x_NH, 128, **kw)


def quantize_ffn(recipe: str, x_TH: torch.Tensor, w1_EHF: torch.Tensor, w2_EIH: torch.Tensor,
                 *, pow2_scales: bool = False, soft_cast: bool | None = None) -> Fp8Ffn:
    """Quantise activations (at the source, once per forward) and weights (once, at setup)
    with the Triton quantisers (bitwise equal to ``quant_ref``)."""
    _check_recipe(recipe)
    x_q, sx = _quantize_act(recipe, x_TH, pow2_scales, soft_cast)
    w1 = _quantize_weight(recipe, w1_EHF, True, pow2_scales, soft_cast)
    w2 = _quantize_weight(recipe, w2_EIH, False, pow2_scales, soft_cast)
    return Fp8Ffn(recipe, x_q, sx, w1.q, w1.scale, w2.q, w2.scale)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def ffn_fp8(ops: Fp8Ffn, grp_B: torch.Tensor, *, pow2_scales: bool = False,
            tiles: dict | None = None) -> torch.Tensor:
    """y [T, H] bf16 = down(SwiGLU(x @ w1)) of each row block's expert, in FP8: two grouped
    launches, h quantised in the gate+up epilogue (never in bf16 in memory; rowwise_all: in
    bf16 only until its row's last tile, then requantised in place by the same program)."""
    from mok_kernels._details.tl_gemm_fp8 import (
        fp8_down_kernel,
        fp8_gate_up_kernel,
        fp8_gate_up_rows_kernel,
    )

    T, H = ops.x_TH.shape
    E, F, _ = ops.w1_EFH.shape
    I = F // 2  # noqa: E741 (the model's name for the intermediate size)
    t = {k: dict(v) for k, v in (tiles or tiles_for(ops.recipe)).items()}
    bm = t["gate_up"]["BM"]
    if T != grp_B.numel() * bm or t["down"]["BM"] != bm:
        raise ValueError(f"rows {T} != row blocks {grp_B.numel()} x BM {bm} (both kernels)")
    interp = _interpreting()
    rec = RECIPES[ops.recipe]
    hrec = down_recipe(rec)
    dev = ops.x_TH.device
    y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    gu, dn = t["gate_up"], t["down"]
    run = {} if interp else {"num_warps": gu["num_warps"], "num_stages": gu["num_stages"]}
    if rec == ROWWISE_ALL:  # h rows: I e4m3 + one fp32 scale in the bytes of bf16 rows
        h = torch.empty(T, I, dtype=torch.bfloat16, device=dev)
        sh, sh_cols = h, 0
        fp8_gate_up_rows_kernel[(grp_B.numel(),)](
            ops.x_TH, ops.sx, grp_B, ops.w1_EFH, ops.sw1, h, H=H, I=I, SW1=ops.sw1[0].numel(),
            BM=bm, BN=gu["BN"], BK=gu["BK"], POW2=pow2_scales, SOFT_CAST=interp,
            F32_DOT=interp, **run)
    else:
        sh_cols = I // 32 if hrec == MX else I // 128
        h = torch.empty(T, I, dtype=torch.float8_e4m3fn, device=dev)
        sh = torch.empty(T, sh_cols, dtype=torch.uint8 if hrec == MX else torch.float32,
                         device=dev)
        fp8_gate_up_kernel[(grp_B.numel(), I // (gu["BN"] // 2))](
            ops.x_TH, ops.sx, grp_B, ops.w1_EFH, ops.sw1, h, sh, H=H, I=I,
            SX=ops.sx[0].numel(), SW1=ops.sw1[0].numel(), SH=sh_cols, BM=bm, BN=gu["BN"],
            BK=gu["BK"], RECIPE=rec, H_RECIPE=hrec, POW2=pow2_scales, SOFT_CAST=interp,
            F32_DOT=interp, **run)
    run = {} if interp else {"num_warps": dn["num_warps"], "num_stages": dn["num_stages"]}
    fp8_down_kernel[(grp_B.numel(), H // dn["BN"])](
        h, sh, grp_B, ops.w2_EHI, ops.sw2, y, H=H, I=I, SH=sh_cols, SW2=ops.sw2[0].numel(),
        BM=bm, BN=dn["BN"], BK=dn["BK"], RECIPE=hrec, F32_DOT=interp,
        ROWS16=rec == ROWWISE_ALL, **run)
    return y


def dequantize_weight(recipe: str, w_q_ENK: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A K-major e4m3 weight [E, N, K] and its scales -> fp32 [E, K, N] (math layout)."""
    if recipe == "mx":
        return qr.dequantize_mx(w_q_ENK, s).transpose(1, 2)
    w_q = w_q_ENK.transpose(1, 2)
    if recipe in ("rowwise", "rowwise_all"):
        return qr.dequantize_colwise(w_q, s)
    return qr.dequantize_weight_128x128(w_q, s)


def _dequant_act(recipe: str, x_q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if recipe == "mx":
        return qr.dequantize_mx(x_q, s)
    if recipe in ("rowwise", "rowwise_all"):
        return qr.dequantize_rowwise(x_q, s)
    return qr.dequantize_blockwise(x_q, s)


def ref_ffn_fp8(ops: Fp8Ffn, grp_B: torch.Tensor, block_m: int, *,
                pow2_scales: bool = False) -> torch.Tensor:
    """The same FP8 computation in fp32 torch: dequantised operands, SwiGLU, h quantised with
    the reference quantiser of the down recipe (rowwise_all: of h rounded to bf16, as the
    kernels keep it until the row is complete), dequantised, down GEMM. y [T, H] fp32."""
    x = _dequant_act(ops.recipe, ops.x_TH, ops.sx)
    w1 = dequantize_weight(ops.recipe, ops.w1_EFH, ops.sw1)
    w2 = dequantize_weight(ops.down_recipe, ops.w2_EHI, ops.sw2)
    y = torch.empty(x.shape[0], w2.shape[2], dtype=torch.float32, device=x.device)
    for b, e in enumerate(grp_B.tolist()):  # one row block at a time: no [T, H, F] gather
        rows = slice(b * block_m, (b + 1) * block_m)
        pre = x[rows] @ w1[e]
        gate, up = pre[:, 0::2], pre[:, 1::2]
        h = gate * torch.sigmoid(gate) * up
        if ops.down_recipe == "mx":
            h = qr.dequantize_mx(*qr.ref_quantize_mx(h))
        elif ops.down_recipe == "rowwise":
            h = qr.dequantize_rowwise(*qr.ref_quantize_rowwise(h.bfloat16(),
                                                              pow2_scales=pow2_scales))
        else:
            h = qr.dequantize_blockwise(*qr.ref_quantize_blockwise(h, 128,
                                                                   pow2_scales=pow2_scales))
        y[rows] = h @ w2[e]
    return y




# --- the megakernel's FP8 operands ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """One quantised weight for the megakernel's FP8 path: q e4m3, K-major: the transpose
    ([E, N, K] or [N, K]) of the bf16 weight's math layout ([E, K, N] or [K, N], the gate+up
    one interleaved), since Hopper's FP8 MMAs read B K-major only; and its scales
    (``fp8_scale_sizes`` per expert: 128x128 blocks, one per column for rowwise gate+up, MX
    [N, K/32] codes)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The math-layout shape (that of the bf16 weight it was quantised from)."""
        *lead, n, k = self.q.shape
        return (*lead, k, n)


def _quantize_weight(recipe: str, w: torch.Tensor, gate_up: bool, pow2: bool,
                     soft_cast: bool | None = None) -> Fp8Weight:
    """One weight ([E, K, N] or [K, N]) of a recipe: 128x128 blocks, per output column for
    the rowwise recipe's gate+up weight and both rowwise_all weights, MX along K
    (``Fp8Weight``)."""
    w3 = w if w.dim() == 3 else w[None]
    kw = {"pow2_scales": pow2, "soft_cast": soft_cast}
    if recipe == "mx":
        q, s = _mx_weight(w3.contiguous(), soft_cast)
    else:
        if (recipe == "rowwise" and gate_up) or recipe == "rowwise_all":
            q, s = tq.quantize_weight_colwise(w3.contiguous(), **kw)
        else:
            q, s = tq.quantize_weight_128x128(w3.contiguous(), **kw)
        q = q.transpose(1, 2)  # K-major
    if w.dim() == 2:
        q, s = q[0], s[0]
    return Fp8Weight(q.contiguous(), s.contiguous())


def quantize_weights(config, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     shared_gate_up: torch.Tensor | None = None,
                     shared_down: torch.Tensor | None = None) -> tuple:
    """The four weights of ``forward`` quantised for ``config.fp8`` (once, at setup; the
    gate+up ones already interleaved): (w_gate_up, w_down, shared_gate_up, shared_down) as
    :class:`Fp8Weight` (None stays None)."""
    recipe, pow2 = config.fp8, config.fp8_pow2_scales
    if recipe == "none":
        raise ValueError("fp8='none' is invalid for quantize_weights: allowed "
                         + " | ".join(RECIPES))
    return (_quantize_weight(recipe, w_gate_up, True, pow2),
            _quantize_weight(recipe, w_down, False, pow2),
            None if shared_gate_up is None else _quantize_weight(recipe, shared_gate_up, True,
                                                                 pow2),
            None if shared_down is None else _quantize_weight(recipe, shared_down, False, pow2))


def quantize_tokens_into(recipe: str, x_NH: torch.Tensor, rows_NH: torch.Tensor, *,
                         pow2_scales: bool = False,
                         col_amax_H: torch.Tensor | None = None) -> None:
    """Quantise x (the tokens, at their source rank) into the FP8 row layout the megakernel
    reads: in the bytes of each bf16 row of ``rows_NH`` ([N, H] bf16, e.g. the token buffer),
    H e4m3 values, then the row's scales from byte H (fp32; e8m0 codes for mx). Rowwise
    recipes (one scale per row) in one pass straight into the rows (``quantize_rows_into``);
    the others quantise, then copy the values and scales in. ``col_amax_H`` (rowwise
    recipes into contiguous rows only): also x's column max |x| over the N rows, fp32 [H]
    (``quantize_rows_into``)."""
    N, H = x_NH.shape
    if recipe in ("rowwise", "rowwise_all") and rows_NH.is_contiguous():
        tq.quantize_rows_into(x_NH, rows_NH.view(N, H), pow2_scales=pow2_scales,
                              col_amax_H=col_amax_H)
        return
    if col_amax_H is not None:
        raise ValueError(f"col_amax_H is invalid with recipe={recipe!r} (or rows that are not "
                         "contiguous): allowed rowwise | rowwise_all into contiguous rows")
    q, s = _quantize_act(recipe, x_NH, pow2_scales)
    raw = rows_NH.view(N, H).view(torch.uint8)  # [N, 2H] bytes
    sb = s.reshape(N, -1).contiguous().view(torch.uint8)
    raw[:, :H].copy_(q.view(torch.uint8))
    raw[:, H:H + sb.shape[1]].copy_(sb)


__all__ = ["BLOCKWISE", "MX", "TILES", "TILES_MX", "Fp8Ffn", "Fp8Weight", "dequantize_weight",
           "ffn_fp8", "quantize_ffn", "quantize_tokens_into", "quantize_weights", "ref_ffn_fp8",
           "tiles_for"]
