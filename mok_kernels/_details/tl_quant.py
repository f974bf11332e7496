"""FP8 quantisation for the mok FP8 path: Triton kernels, the register-tile helpers the
megakernel calls, thin host wrappers, and (from ``quant_ref``) the pure-torch reference
quantisers and the dequantisers.

Legend: T rows (tokens), H hidden (the reduction dimension of the next GEMM), E experts,
K reduction rows and N output columns of a weight w_EKN (y = x @ w), BM/BN tile sizes.

Recipes (every value e4m3, ``torch.float8_e4m3fn``, largest finite 448):

- Hopper, what TransformerEngine's ``Float8BlockScaling`` does on SM90: activations with one
  fp32 scale per 1x128 block along H, weights with one per 128x128 block. Per block:
  ``amax = max |x|``, ``inv = 448 / amax`` (correctly rounded; 1 where amax == 0; the largest
  fp32 where it overflows), ``x_q = e4m3(x * inv)``, ``scale = 1 / inv``, so x ~ x_q * scale
  and scale ~ amax / 448. ``pow2_scales`` rounds inv down to a power of two first
  (TransformerEngine's default; its ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` is the default
  here). Row-wise (one scale per activation row, one per weight output column) is the knob
  whose scales apply once in the GEMM epilogue.
- Blackwell MXFP8: one e8m0 scale per 1x32 block along the reduction dimension, rounded up:
  the least power of two 2^e >= amax / 448, stored as the uint8 ``e + 127`` (0 is 2^-127);
  ``x_q = e4m3(x * 2^-e)``. Codes [rows, K/32] are what ``tl.dot_scaled`` takes.

The e4m3 cast rounds to nearest even and saturates at +-448 (``cvt.rn.satfinite`` on GPUs).
A block holding NaN or +-inf gets a NaN scale (e8m0: 255) and NaN values, so the bad block
stays visible through dequantisation; nothing raises (kernels cannot, and a host check would
cost a sync). SOFT_CAST does the conversions in (bf16 -> fp32) and out (fp32 -> e4m3) with
integer arithmetic instead of the hardware's; it exists for TRITON_INTERPRET, whose
conversions (Triton 3.9) lose bf16 subnormals and neither round fp8 to nearest even nor
saturate, and it is bitwise the same as the GPU conversions.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mok_kernels._details.quant_ref import (
    E4M3_MAX,
    MX_BLOCK,
    dequantize_blockwise,
    dequantize_colwise,
    dequantize_mx,
    dequantize_rowwise,
    dequantize_weight_128x128,
    ref_quantize_blockwise,
    ref_quantize_colwise,
    ref_quantize_mx,
    ref_quantize_rowwise,
    ref_quantize_weight_128x128,
)

__all__ = [
    "E4M3_MAX", "MX_BLOCK", "dequantize_blockwise", "dequantize_colwise", "dequantize_mx",
    "dequantize_rowwise", "dequantize_weight_128x128", "quantize_blockwise", "quantize_mx",
    "quantize_rowwise", "quantize_weight_128x128", "quantize_weight_colwise",
    "ref_quantize_blockwise", "ref_quantize_colwise", "ref_quantize_mx", "ref_quantize_rowwise",
    "ref_quantize_weight_128x128",
]

# Tiles of the one-scale-per-line kernel: rows of x (16 rows x 128 contiguous elements per
# step) and output columns of w (64 contiguous columns x 32 rows of K per step); both build
# for sm_90 and sm_100 without spills at num_warps 4 (``compile_quant_kernel``).
ROW_LINES = {"BL": 16, "BD": 128}
COL_LINES = {"BL": 64, "BD": 32}


@triton.jit
def e4m3_bits(v):
    """The e4m3 bits (uint8) of fp32 ``v``, rounded to nearest even, saturated at +-448, NaN
    as 0x7F, in integer arithmetic only (bitwise what ``cvt.rn.satfinite`` gives)."""
    u = v.to(tl.uint32, bitcast=True)
    sign = ((u >> 24) & 0x80).to(tl.uint8)
    a = tl.where(tl.abs(v) > 448.0, 448.0, tl.abs(v))
    au = a.to(tl.uint32, bitcast=True)
    # normal e4m3 (a >= 2^-6): round the fp32 mantissa to 3 bits, ties to even, then rebias
    # the exponent from 127 to 7; the carry of a round-up moves into the exponent.
    r = au + 0x7FFFF + ((au >> 20) & 1)
    normal = (r >> 20) - (120 << 3)
    # subnormal e4m3 (steps of 2^-9): a * 2^9 + 2^23 rounds to an integer, ties to even, and
    # that integer is the low mantissa bits of the sum (0x4B000000 is 2^23)
    sub = (a * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.where(a >= 0.015625, normal, sub).to(tl.uint8) | sign
    return tl.where(v != v, 0x7F, code).to(tl.uint8)


@triton.jit
def to_e4m3(v, SOFT_CAST: tl.constexpr):
    """fp32 -> e4m3, nearest even, saturating; SOFT_CAST: through :func:`e4m3_bits`."""
    if SOFT_CAST:
        return e4m3_bits(v).to(tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def to_f32(v, SOFT_CAST: tl.constexpr):
    """Any float -> fp32, exact; SOFT_CAST widens bf16 by a 16-bit shift of its bits (the
    interpreter's bf16 -> fp32 loses bf16 subnormals, e.g. -2.755e-40 -> -5.877e-39)."""
    if SOFT_CAST and v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def to_bf16(v, SOFT_CAST: tl.constexpr):
    """fp32 -> bf16, nearest even (the GPU's cvt.rn.bf16.f32); SOFT_CAST in integer
    arithmetic, since the interpreter's cast truncates (1 + 2^-8 + 2^-20 -> 1.0); NaN stays
    NaN."""
    if SOFT_CAST:
        u = v.to(tl.uint32, bitcast=True)
        r = tl.where(v != v, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def finite_abs(v):
    """|v| with NaN read as +inf (GPU max ignores NaN, so NaN cannot propagate through a max
    by itself): a max over these is +inf exactly where a non-finite value was."""
    return tl.where(v == v, tl.abs(v), float("inf"))


@triton.jit
def finite_amax(v, AXIS: tl.constexpr):
    """max |v| along AXIS with NaN read as +inf: the result is +inf exactly where the block
    holds a non-finite value (``finite_abs``)."""
    return tl.max(finite_abs(v), axis=AXIS)


@triton.jit
def e4m3_scales(amax, POW2: tl.constexpr):
    """(inv, scale) for fp32 ``amax`` (any shape): x_q = e4m3(x * inv), x ~ x_q * scale.
    inv = 448 / amax correctly rounded (1 where amax == 0, the largest fp32 where 448 / amax
    overflows), rounded down to a power of two with POW2; scale = 1 / inv; both NaN where
    amax is +inf (a non-finite block)."""
    inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    inv = tl.where(amax == 0.0, 1.0, inv)
    inv = tl.where(inv == float("inf"), 3.4028234663852886e38, inv)
    if POW2:
        inv = (inv.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    inv = tl.where(amax == float("inf"), float("nan"), inv)
    return inv, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), inv)


@triton.jit
def quant_rows_e4m3(v, POW2: tl.constexpr, SOFT_CAST: tl.constexpr):
    """Quantise a [BM, BN] register tile with one scale per row (a 1x128 block when BN
    is 128): returns (e4m3 [BM, BN], fp32 scales [BM]). The megakernel's dispatch and SwiGLU
    epilogue call this on the tile they already hold (any float dtype; computed in fp32)."""
    v = to_f32(v, SOFT_CAST)
    inv, scale = e4m3_scales(finite_amax(v, 1), POW2)
    return to_e4m3(v * inv[:, None], SOFT_CAST), scale


@triton.jit
def e8m0_scales(amax):
    """(code, inv) for fp32 ``amax``: code (uint8) = e + 127 for the least 2^e >= amax / 448
    (0, i.e. 2^-127, for amax == 0; 255, NaN, for a non-finite block); inv = 2^-e."""
    v = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    u = v.to(tl.uint32, bitcast=True)
    exp = u >> 23
    up = exp + ((u & 0x7FFFFF) != 0).to(tl.uint32)
    code = tl.where(exp == 0, (u > 0x400000).to(tl.uint32), up)  # v subnormal: 2^-127 or -126
    code = tl.where(amax == float("inf"), 255, code)
    inv = ((254 - code) << 23).to(tl.float32, bitcast=True)
    return code.to(tl.uint8), tl.where(code == 255, float("nan"), inv)


@triton.jit
def quant_rows_mx(v, SOFT_CAST: tl.constexpr):
    """MXFP8-quantise a [BM, BK] register tile (BK a multiple of 32): returns (e4m3
    [BM, BK], e8m0 codes uint8 [BM, BK // 32]), the operand and scale of ``tl.dot_scaled``."""
    v = to_f32(v, SOFT_CAST)
    BM: tl.constexpr = v.shape[0]
    BK: tl.constexpr = v.shape[1]
    v3 = tl.reshape(v, (BM, BK // 32, 32))
    code, inv = e8m0_scales(finite_amax(v3, 2))
    q = to_e4m3(tl.reshape(v3 * inv[:, :, None], (BM, BK)), SOFT_CAST)
    return q, code


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, T, H: tl.constexpr, BLOCK: tl.constexpr,
                      BT: tl.constexpr, POW2: tl.constexpr, SOFT_CAST: tl.constexpr):
    """One [BT, BLOCK] tile of x [T, H] per program, one scale per row of it."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    ok = rows < T
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0)
    q, scale = quant_rows_e4m3(x, POW2, SOFT_CAST)
    tl.store(q_ptr + offs, q, mask=ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * (H // BLOCK) + tl.program_id(1), scale, mask=ok)


@triton.jit
def _quant_w_kernel(w_ptr, q_ptr, s_ptr, N: tl.constexpr, POW2: tl.constexpr,
                    SOFT_CAST: tl.constexpr):
    """One 128x128 block of w viewed as [E*K, N] per program (K % 128 == 0, so no block
    straddles two experts), one scale for the whole block."""
    rows = tl.program_id(0) * 128 + tl.arange(0, 128)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    w = to_f32(tl.load(w_ptr + offs), SOFT_CAST)
    inv, scale = e4m3_scales(tl.max(finite_amax(w, 1), 0), POW2)
    tl.store(q_ptr + offs, to_e4m3(w * inv, SOFT_CAST))
    tl.store(s_ptr + tl.program_id(0) * (N // 128) + tl.program_id(1), scale)


@triton.jit
def _quant_lines_kernel(x_ptr, q_ptr, s_ptr, LINES, batch_stride, line_stride, elem_stride,
                        q_line_stride, s_line_stride, LEN: tl.constexpr, BL: tl.constexpr,
                        BD: tl.constexpr, POW2: tl.constexpr, SOFT_CAST: tl.constexpr,
                        CMAX: tl.constexpr = False, cmax_ptr=None):
    """One scale per line of LEN elements (rows of x: line_stride H, elem_stride 1; output
    columns of w: line_stride 1, elem_stride N), BL lines of batch ``program_id(1)`` per
    program, in two passes over the line: amax, then quantise. LEN is a constexpr so that
    the element mask is known to be all-true where BD divides it (vector loads). The line
    blocks are grid axis 0 (up to 2**31 - 1; axis 1 stops at 65535: 384 experts' rows of
    7168 are 2.75 M lines). q's lines are ``q_line_stride`` apart (line_stride for a q shaped
    like x; 2H for the FP8 row layout inside bf16 rows, ``quantize_rows_into``), the scales
    ``s_line_stride`` apart (1; H / 2 fp32 in that layout). CMAX (rows of one batch,
    ``quantize_rows_into``'s ``col_amax_H``): the amax pass also stores, per element
    position, the max |x| over this program's lines (NaN as +inf; lines past LINES read 0)
    at ``cmax_ptr`` [programs, LEN]: each column's partial max, from the loads it makes
    anyway."""
    lines = tl.program_id(0) * BL + tl.arange(0, BL)
    base = tl.program_id(1).to(tl.int64) * batch_stride + lines.to(tl.int64) * line_stride
    qbase = tl.program_id(1).to(tl.int64) * batch_stride + lines.to(tl.int64) * q_line_stride
    ok = lines < LINES
    amax = tl.zeros((BL,), dtype=tl.float32)
    for d in range(0, LEN, BD):
        e = d + tl.arange(0, BD)
        m = ok[:, None] & (e < LEN)[None, :]
        x = tl.load(x_ptr + base[:, None] + e.to(tl.int64)[None, :] * elem_stride, mask=m,
                    other=0.0)
        xf = to_f32(x, SOFT_CAST)
        amax = tl.maximum(amax, finite_amax(xf, 1))
        if CMAX:
            tl.store(cmax_ptr + tl.program_id(0).to(tl.int64) * LEN + e, finite_amax(xf, 0),
                     mask=e < LEN)
    inv, scale = e4m3_scales(amax, POW2)
    for d in range(0, LEN, BD):
        e = d + tl.arange(0, BD)
        m = ok[:, None] & (e < LEN)[None, :]
        e_off = e.to(tl.int64)[None, :] * elem_stride
        x = to_f32(tl.load(x_ptr + base[:, None] + e_off, mask=m, other=0.0), SOFT_CAST)
        tl.store(q_ptr + qbase[:, None] + e_off, to_e4m3(x * inv[:, None], SOFT_CAST), mask=m)
    tl.store(s_ptr + (tl.program_id(1).to(tl.int64) * LINES + lines) * s_line_stride, scale,
             mask=ok)


@triton.jit
def _quant_mx_kernel(x_ptr, q_ptr, s_ptr, T, H: tl.constexpr, BT: tl.constexpr,
                     BH: tl.constexpr, SOFT_CAST: tl.constexpr):
    """One [BT, BH] tile of x [T, H] per program (H % 32 == 0; whole 32-blocks past H are
    masked off), BH / 32 codes per row."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = (rows < T)[:, None] & (cols < H)[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    q, code = quant_rows_mx(x, SOFT_CAST)
    blk = tl.program_id(1) * (BH // 32) + tl.arange(0, BH // 32)
    tl.store(q_ptr + offs, q, mask=m)
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * (H // 32) + blk[None, :], code,
             mask=(rows < T)[:, None] & (blk < H // 32)[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _soft(soft_cast: bool | None) -> bool:
    """None: the integer cast under TRITON_INTERPRET, the hardware cast elsewhere."""
    return _interpreting() if soft_cast is None else soft_cast


def _rows(x: torch.Tensor, multiple: int, what: str) -> torch.Tensor:
    """x [..., H] as a contiguous [T, H] view, H checked to be a multiple of ``multiple``."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: x.dtype={x.dtype} is invalid: allowed fp32 | bf16 | fp16")
    if x.dim() < 1 or x.shape[-1] % multiple:
        raise ValueError(f"{what}: x.shape={tuple(x.shape)} is invalid: the last dimension "
                         f"must be a positive multiple of {multiple}")
    return x.reshape(-1, x.shape[-1]).contiguous()


def act_rows(block: int) -> int:
    """Rows of x per program of the 1 x block kernel: 32 rows, at most 4096 elements."""
    return max(1, min(32, 4096 // block))


def quantize_blockwise(x: torch.Tensor, block: int = 128, *, pow2_scales: bool = False,
                       soft_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (x_q [..., H] e4m3, scale [..., H/block] fp32), one scale per 1 x block
    elements along H (block a power of two >= 16; 128 is the Hopper recipe)."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} is invalid: allowed a power of two >= 16")
    x_TH = _rows(x, block, "quantize_blockwise")
    T, H = x_TH.shape
    q_TH = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=x.device)
    s_TB = torch.empty(T, H // block, dtype=torch.float32, device=x.device)
    bt = act_rows(block)
    if T:
        _quant_act_kernel[(triton.cdiv(T, bt), H // block)](
            x_TH, q_TH, s_TB, T, H=H, BLOCK=block, BT=bt, POW2=pow2_scales,
            SOFT_CAST=_soft(soft_cast), num_warps=4)
    return q_TH.view(x.shape), s_TB.view(*x.shape[:-1], H // block)


def _lines(x: torch.Tensor, batches: int, lines: int, length: int, strides: tuple[int, ...],
           pow2_scales: bool, soft_cast: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(batches, lines, dtype=torch.float32, device=x.device)
    tile = COL_LINES if strides[1] == 1 else ROW_LINES
    if batches and lines:
        _quant_lines_kernel[(triton.cdiv(lines, tile["BL"]), batches)](
            x, q, s, lines, *strides, strides[1], 1, LEN=length, **tile, POW2=pow2_scales,
            SOFT_CAST=_soft(soft_cast), num_warps=4)
    return q, s


def quantize_rows_into(x: torch.Tensor, rows_NH: torch.Tensor, *, pow2_scales: bool = False,
                       soft_cast: bool | None = None,
                       col_amax_H: torch.Tensor | None = None) -> None:
    """Rowwise FP8 of x [N, H] written straight into the row layout of ``rows_NH`` ([N, H]
    bf16, contiguous: each row's 2H bytes hold H e4m3 values, then the row's fp32 scale at
    byte H), the bytes ``quantize_rowwise`` and two copies would put there, in one pass: no
    e4m3 temporary, no strided copies (about 0.7 GB less traffic for dY at Kimi K2 x 16384).
    ``col_amax_H`` (fp32 [H], contiguous): also each column's max |x| over the N rows, NaN
    read as +inf (so a NaN column's FP8 scales turn NaN, as a NaN max's would), from the
    quantiser's own loads (a partial max per program, then one max over those): what the
    FP8 weight gradients' column scales need, without a reduction pass over x of its own
    (about 0.1 ms of HBM reads per tensor at Kimi K2 x 16384). The maxima are exact, so the
    same as any other order's."""
    x_TH = _rows(x, 1, "quantize_rows_into")
    T, H = x_TH.shape
    if tuple(rows_NH.shape) != (T, H) or rows_NH.dtype != torch.bfloat16 or H % 4 \
            or not rows_NH.is_contiguous():
        raise ValueError(f"rows_NH {tuple(rows_NH.shape)} {rows_NH.dtype} is invalid: allowed a "
                         f"contiguous bf16 [{T}, {H}] tensor (H a multiple of 4)")
    if col_amax_H is not None and (tuple(col_amax_H.shape) != (H,)
                                   or col_amax_H.dtype != torch.float32
                                   or not col_amax_H.is_contiguous()):
        raise ValueError(f"col_amax_H {tuple(col_amax_H.shape)} {col_amax_H.dtype} is invalid: "
                         f"allowed a contiguous float32 [{H}] tensor")
    q = rows_NH.view(torch.uint8).view(torch.float8_e4m3fn)  # [T, 2H]
    s = rows_NH.view(torch.float32)[:, H // 4:]  # each row's scale at byte H
    programs = triton.cdiv(T, ROW_LINES["BL"])
    part_PH = (torch.empty(programs, H, dtype=torch.float32, device=x.device)
               if col_amax_H is not None and T else None)
    if T:
        _quant_lines_kernel[(programs, 1)](
            x_TH, q, s, T, 0, H, 1, 2 * H, H // 2, LEN=H, **ROW_LINES, POW2=pow2_scales,
            SOFT_CAST=_soft(soft_cast), CMAX=part_PH is not None, cmax_ptr=part_PH,
            num_warps=4)
    if col_amax_H is not None:
        if part_PH is None:
            col_amax_H.zero_()
        else:
            torch.amax(part_PH, dim=0, out=col_amax_H)


def quantize_rowwise(x: torch.Tensor, *, pow2_scales: bool = False,
                     soft_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (x_q e4m3, scale [...] fp32), one scale per row (any H)."""
    x_TH = _rows(x, 1, "quantize_rowwise")
    T, H = x_TH.shape
    q_TH, s_1T = _lines(x_TH, 1, T, H, (0, H, 1), pow2_scales, soft_cast)
    return q_TH.view(x.shape), s_1T.view(x.shape[:-1])


def _weights(w: torch.Tensor, multiple: int, what: str) -> torch.Tensor:
    if w.dim() != 3 or w.shape[1] % multiple or w.shape[2] % multiple:
        raise ValueError(f"{what}: w.shape={tuple(w.shape)} is invalid: allowed [E, K, N] "
                         f"with K and N multiples of {multiple}")
    return _rows(w, 1, what).view(w.shape)


def quantize_weight_colwise(w: torch.Tensor, *, pow2_scales: bool = False,
                            soft_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] -> (w_q e4m3, scale [E, N] fp32), one scale per output column over K: the
    weight half of the row-wise knob."""
    w_EKN = _weights(w, 1, "quantize_weight_colwise")
    E, K, N = w_EKN.shape
    return _lines(w_EKN, E, N, K, (K * N, 1, N), pow2_scales, soft_cast)


def quantize_weight_128x128(w: torch.Tensor, *, pow2_scales: bool = False,
                            soft_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] -> (w_q [E, K, N] e4m3, scale [E, K/128, N/128] fp32), one scale per
    128 x 128 block. Done once at setup, as the baselines quantise their weights."""
    w_EKN = _weights(w, 128, "quantize_weight_128x128")
    E, K, N = w_EKN.shape
    q = torch.empty(w_EKN.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(E, K // 128, N // 128, dtype=torch.float32, device=w.device)
    if q.numel():
        _quant_w_kernel[(E * K // 128, N // 128)](w_EKN, q, s, N=N, POW2=pow2_scales,
                                                  SOFT_CAST=_soft(soft_cast), num_warps=8)
    return q, s


def quantize_mx(x: torch.Tensor, *, soft_cast: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_q [..., K] e4m3, scale_u8 [..., K/32] e8m0), blocks of 32 along the
    last dimension. Activations [T, H] give ``tl.dot_scaled``'s lhs and lhs_scale; for its
    rhs pass weights transposed, [E, N, K] (contiguous), to get rhs_scale [E, N, K/32]."""
    x_TH = _rows(x, MX_BLOCK, "quantize_mx")
    T, H = x_TH.shape
    q_TH = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=x.device)
    s_TB = torch.empty(T, H // MX_BLOCK, dtype=torch.uint8, device=x.device)
    if T:
        bh = 128
        _quant_mx_kernel[(triton.cdiv(T, 32), triton.cdiv(H, bh))](
            x_TH, q_TH, s_TB, T, H=H, BT=32, BH=bh, SOFT_CAST=_soft(soft_cast), num_warps=4)
    return q_TH.view(x.shape), s_TB.view(*x.shape[:-1], H // MX_BLOCK)
