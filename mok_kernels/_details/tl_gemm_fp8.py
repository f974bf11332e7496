"""FP8 GEMM tiles of the expert FFN (the building blocks of mok's FP8 path), one per recipe,
and two standalone grouped kernels over them (gate+up with the SwiGLU epilogue quantising h
for the down GEMM; down) that tests and benchmarks run alone.

Legend: BM rows of one row block (one expert), H hidden, I intermediate, F = 2*I, BN output
columns of a tile, BK reduction step, E experts. Weights are the transposes of the math
layout (y = x @ w), K-major: w1^T [E, F, H] gate/up interleaved (row 2c gate c, 2c+1 up c:
``interleave_gate_up`` before the transpose), w2^T [E, H, I]. Every value is e4m3
(``torch.float8_e4m3fn``) with fp32 accumulation.

Recipes (``RECIPE``), each a pair of activation and weight scalings (``tl_quant``):
    1 BLOCKWISE  activations one fp32 scale per 1x128 block along K, weights one per 128x128
                 block: TransformerEngine's ``Float8BlockScaling`` on Hopper. The scales change
                 every 128 along K, so each 128-deep step's dot goes to a fresh fp32 tile that
                 is scaled and added (BK = 128): the K loop is not pure tensor-core work.
    2 ROWWISE    activations one scale per row, weights one per output column: the scales
                 factor out of the sum over K and apply once, after the loop. A row of h is
                 spread over I/(BN/2) gate+up tiles, so no tile can give it one scale: with
                 this recipe the gate+up GEMM is row-wise and the epilogue quantises h 1x128,
                 for a BLOCKWISE down GEMM (128x128 weight scales).
    3 MX         MXFP8: one e8m0 scale per 1x32 block along K for both operands
                 (``tl.dot_scaled``; block-scaled tensor-core MMAs on Blackwell, an emulation
                 elsewhere).
    4 ROWWISE_ALL both GEMMs ROWWISE, so neither K loop rescales: the gate+up GEMM as
                 ROWWISE, h one scale per row over all I columns, w2 one per output column.
                 A row's scale needs every h column: each tile's epilogue stores h in bf16
                 into the row's own storage; once a row block's tiles are all in, its rows
                 are overwritten in place with e4m3 and the row scale (the standalone
                 kernel: the one program of the row block; the megakernel: the gate+up item
                 whose tiles complete it, ``requant_whole_rows``).
The gate+up epilogue quantises h = silu(gate) * up in registers, one 1x128 block (BN = 256
interleaved columns give 128 h columns) or four 1x32 MX blocks per row and tile, so h
reaches memory already in FP8 with its scales: no separate quantisation pass (ROWWISE_ALL:
one pass over each row block's rows, after its last tile).

``F32_DOT`` (Triton's interpreter on CPU) widens the e4m3 operands to fp32 before the dot;
the products and sums are then exact up to fp32 rounding, as on the tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mok_kernels._details.tl_quant import (
    e4m3_scales,
    finite_amax,
    quant_rows_e4m3,
    quant_rows_mx,
    to_bf16,
    to_e4m3,
    to_f32,
)

BLOCKWISE, ROWWISE, MX, ROWWISE_ALL = 1, 2, 3, 4
RECIPES = {"blockwise": BLOCKWISE, "rowwise": ROWWISE, "mx": MX, "rowwise_all": ROWWISE_ALL}


def down_recipe(recipe: int) -> int:
    """How h is quantised, i.e. the down GEMM's recipe code: MX for MX, ROWWISE for
    ROWWISE_ALL, else 1x128 blocks (BLOCKWISE); 0 (bf16) for 0."""
    if recipe == 0:
        return 0
    return {MX: MX, ROWWISE_ALL: ROWWISE}.get(recipe, BLOCKWISE)


@triton.jit
def _dot8(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b for e4m3 operands, fp32 accumulation."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def fp8_tile(a_rows, a_mask, sa_rows, w_ptr, sw_ptr, n0, K: tl.constexpr, N: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RECIPE: tl.constexpr,
             F32_DOT: tl.constexpr, w_desc=None, w_row0=0, TMA: tl.constexpr = False):
    """The [BM, BN] fp32 tile dequant(A)[rows, :] @ dequant(W)[:, n0:n0+BN] of one expert.

    a_rows: [BM] pointers to e4m3 A rows (K elements); a_mask: [BM] rows to read (the others
    read 0 and give 0); sa_rows: [BM] pointers to each row's scales: K/128 fp32 (BLOCKWISE),
    one fp32 (ROWWISE), K/32 uint8 e8m0 codes (MX).
    w_ptr: this expert's e4m3 W K-major, as W^T [N, K] (``Fp8Weight``: Hopper's FP8 MMAs
    read B K-major from shared memory only, so an N-major tile would pass through registers
    every step instead of the pipelined asynchronous copies); sw_ptr: its scales:
    [K/128, N/128] fp32 (BLOCKWISE), [N] fp32 (ROWWISE), [N, K/32] uint8 (MX, the layout
    ``tl.dot_scaled`` takes).
    TMA: the [BN, BK] weight tiles come through ``w_desc`` (the e4m3 W^T of all experts as
    [experts*N, K], this expert's rows from ``w_row0``) instead of pointer loads.
    """
    offs_k = tl.arange(0, BK)
    cols = n0 + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_rows[:, None] + (k + offs_k)[None, :], mask=a_mask[:, None], other=0.0)
        if TMA:
            w_t = w_desc.load([w_row0 + n0, k])
        else:
            w_t = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + (k + offs_k)[None, :])
        w = tl.trans(w_t)  # [BK, BN], K-major in shared memory
        if RECIPE == 3:
            g = k // 32 + tl.arange(0, BK // 32)
            sa = tl.load(sa_rows[:, None] + g[None, :], mask=a_mask[:, None], other=0)
            sw = tl.load(sw_ptr + cols.to(tl.int64)[:, None] * (K // 32) + g[None, :])
            acc = tl.dot_scaled(a, sa, "e4m3", w, sw, "e4m3", acc)
        elif RECIPE == 1:
            tl.static_assert(BK == 128, "BLOCKWISE needs BK = 128 (one scale per step)")
            part = _dot8(a, w, tl.zeros((BM, BN), dtype=tl.float32), F32_DOT)
            sa = tl.load(sa_rows + k // 128, mask=a_mask, other=0.0)
            sw = tl.load(sw_ptr + (k // 128) * (N // 128) + cols // 128)
            acc += part * sa[:, None] * sw[None, :]
        else:
            acc = _dot8(a, w, acc, F32_DOT)
    if RECIPE == 2:
        sa = tl.load(sa_rows, mask=a_mask, other=0.0)
        sw = tl.load(sw_ptr + cols)
        acc = acc * sa[:, None] * sw[None, :]
    return acc


@triton.jit
def swiglu_quant_epilogue(acc, h_rows, sh_rows, j, BM: tl.constexpr, BN: tl.constexpr,
                          H_RECIPE: tl.constexpr, POW2: tl.constexpr, SOFT_CAST: tl.constexpr):
    """From an interleaved gate/up tile [BM, BN] (column 2c gate c, 2c+1 up c) of h-column
    tile j: h = silu(gate) * up, stored as e4m3 at h columns j*BN/2.. with its scales, one fp32
    per row for this 1x128 block (H_RECIPE 1; BN = 256) at ``sh_rows + j``, or BN/64 e8m0
    codes per row (H_RECIPE 3) at ``sh_rows + j*BN/64``; H_RECIPE 0 stores h in bf16."""
    HALF: tl.constexpr = BN // 2
    gate, up = tl.split(tl.reshape(acc, (BM, HALF, 2)))
    h = gate / (1.0 + tl.exp(-gate)) * up
    cols = j * HALF + tl.arange(0, HALF)
    if H_RECIPE == 0:
        tl.store(h_rows[:, None] + cols[None, :], h.to(tl.bfloat16))
    elif H_RECIPE == 3:
        q, code = quant_rows_mx(h, SOFT_CAST)
        tl.store(h_rows[:, None] + cols[None, :], q)
        g = j * (HALF // 32) + tl.arange(0, HALF // 32)
        tl.store(sh_rows[:, None] + g[None, :], code)
    else:
        tl.static_assert(HALF == 128, "1x128 h scales need BN = 256 interleaved columns")
        q, scale = quant_rows_e4m3(h, POW2, SOFT_CAST)
        tl.store(h_rows[:, None] + cols[None, :], q)
        tl.store(sh_rows + j, scale)


@triton.jit
def swiglu_bf16_epilogue(acc, hb_rows, j, BM: tl.constexpr, BN: tl.constexpr,
                         SOFT_CAST: tl.constexpr):
    """ROWWISE_ALL's epilogue of an interleaved gate/up tile [BM, BN] of h-column tile j:
    h = silu(gate) * up stored in bf16 at columns j*BN/2.. of the bf16 rows ``hb_rows``;
    returns each row's max |h| [BM] over those columns (of the bf16 values, which are what
    :func:`requant_rows` quantises; +inf for a non-finite value). (Processing the tile in
    two column halves cut the sm_90 spill at block_m 128 from 12 to 4 bytes but added 49
    registers at block_m 64 for the layout permutes: not done.)"""
    HALF: tl.constexpr = BN // 2
    gate, up = tl.split(tl.reshape(acc, (BM, HALF, 2)))
    hb = to_bf16(gate / (1.0 + tl.exp(-gate)) * up, SOFT_CAST)
    cols = j * HALF + tl.arange(0, HALF)
    tl.store(hb_rows[:, None] + cols[None, :], hb)
    return finite_amax(to_f32(hb, SOFT_CAST), 1)


@triton.jit
def requant_rows(hb_rows16, amax, I: tl.constexpr, BM: tl.constexpr, POW2: tl.constexpr,
                 SOFT_CAST: tl.constexpr):
    """Overwrite BM bf16 rows of I values (``hb_rows16``, written by this program's
    :func:`swiglu_bf16_epilogue` calls) in place with their ROWWISE FP8 form
    (``fp8_row_views``: I e4m3 values, then one fp32 scale from byte I), one scale per row
    from ``amax``. In 128-column chunks, each read by every thread before any thread writes
    its e4m3 bytes: chunk c's bytes [c, c+128) hold bf16 columns [c/2, c/2+64), already read
    (c/2 <= c), and the scale's bytes [I, I+4) hold bf16 column I/2, read before the last
    chunk's barrier."""
    C: tl.constexpr = 128
    inv, scale = e4m3_scales(amax, POW2)
    q_rows, s_rows = fp8_row_views(hb_rows16, I, 2)  # ROWWISE
    offs = tl.arange(0, C)
    tl.debug_barrier()  # every thread's bf16 stores of these rows before anyone reads them
    for c0 in tl.range(0, I, C):
        v = to_f32(tl.load(hb_rows16[:, None] + (c0 + offs)[None, :]), SOFT_CAST)
        tl.debug_barrier()  # the chunk read by every thread before its e4m3 bytes land
        tl.store(q_rows[:, None] + (c0 + offs)[None, :], to_e4m3(v * inv[:, None], SOFT_CAST))
    tl.store(s_rows, scale)


@triton.jit
def requant_whole_rows(hb_rows16, I: tl.constexpr, BM: tl.constexpr, POW2: tl.constexpr,
                       SOFT_CAST: tl.constexpr):
    """:func:`requant_rows` for BM bf16 rows of I values written by several programs (the
    megakernel's ROWWISE_ALL gate+up items, each a few column tiles of the rows): first
    their max |h| per row, read back in 128-column chunks (the same bf16 values
    :func:`swiglu_bf16_epilogue` takes its max of, so the same scales), then the in-place
    requantisation. The caller has acquired every writer's release."""
    C: tl.constexpr = 128
    offs = tl.arange(0, C)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for c0 in tl.range(0, I, C):
        v = to_f32(tl.load(hb_rows16[:, None] + (c0 + offs)[None, :]), SOFT_CAST)
        amax = tl.maximum(amax, finite_amax(v, 1))
    requant_rows(hb_rows16, amax, I, BM, POW2, SOFT_CAST)


@triton.jit
def fp8_gate_up_kernel(x_ptr, sx_ptr, grp_ptr, w1_ptr, sw1_ptr, h_ptr, sh_ptr,
                       H: tl.constexpr, I: tl.constexpr, SX: tl.constexpr, SW1: tl.constexpr,
                       SH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       RECIPE: tl.constexpr, H_RECIPE: tl.constexpr, POW2: tl.constexpr,
                       SOFT_CAST: tl.constexpr, F32_DOT: tl.constexpr):
    """Program (b, j): row block b (expert ``grp[b]``), h columns j*BN/2..: h_q, sh. Row
    strides of the scale arrays: SX per x row, SH per h row; SW1 elements per expert."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(grp_ptr + b).to(tl.int64)
    rows = (b * BM + tl.arange(0, BM)).to(tl.int64)
    acc = fp8_tile(x_ptr + rows * H, rows >= 0, sx_ptr + rows * SX, w1_ptr + e * H * (2 * I),
                   sw1_ptr + e * SW1, j * BN, H, 2 * I, BM, BN, BK, RECIPE, F32_DOT)
    swiglu_quant_epilogue(acc, h_ptr + rows * I, sh_ptr + rows * SH, j, BM, BN, H_RECIPE,
                          POW2, SOFT_CAST)


@triton.jit
def fp8_gate_up_rows_kernel(x_ptr, sx_ptr, grp_ptr, w1_ptr, sw1_ptr, h16_ptr,
                            H: tl.constexpr, I: tl.constexpr, SW1: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            POW2: tl.constexpr, SOFT_CAST: tl.constexpr, F32_DOT: tl.constexpr):
    """ROWWISE_ALL, program b: every gate+up tile of row block b (expert ``grp[b]``; x rows
    one fp32 scale each), h in bf16 into the rows of ``h16_ptr`` [T, I] bf16, then those rows
    requantised in place (``requant_rows``: I e4m3 + one fp32 scale per row)."""
    b = tl.program_id(0)
    e = tl.load(grp_ptr + b).to(tl.int64)
    rows = (b * BM + tl.arange(0, BM)).to(tl.int64)
    hb_rows = h16_ptr + rows * I
    amax = tl.zeros((BM,), dtype=tl.float32)
    for j in tl.range(0, I // (BN // 2)):
        acc = fp8_tile(x_ptr + rows * H, rows >= 0, sx_ptr + rows, w1_ptr + e * H * (2 * I),
                       sw1_ptr + e * SW1, j * BN, H, 2 * I, BM, BN, BK, 2, F32_DOT)  # ROWWISE
        amax = tl.maximum(amax, swiglu_bf16_epilogue(acc, hb_rows, j, BM, BN, SOFT_CAST))
    requant_rows(hb_rows, amax, I, BM, POW2, SOFT_CAST)


@triton.jit
def fp8_down_kernel(h_ptr, sh_ptr, grp_ptr, w2_ptr, sw2_ptr, y_ptr, H: tl.constexpr,
                    I: tl.constexpr, SH: tl.constexpr, SW2: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, RECIPE: tl.constexpr,
                    F32_DOT: tl.constexpr, ROWS16: tl.constexpr = False):
    """Program (b, j): y[rows of block b, j*BN..] = dequant(h_q) @ dequant(w2_q) in bf16.
    ROWS16: h is FP8 rows in the bytes of bf16 rows of I ([T, I] bf16, ``fp8_row_views``;
    ``sh_ptr`` unused) instead of e4m3 [T, I] plus scales [T, SH]."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(grp_ptr + b).to(tl.int64)
    rows = (b * BM + tl.arange(0, BM)).to(tl.int64)
    if ROWS16:
        h_rows, sh_rows = fp8_row_views(h_ptr + rows * I, I, RECIPE)
    else:
        h_rows, sh_rows = h_ptr + rows * I, sh_ptr + rows * SH
    acc = fp8_tile(h_rows, rows >= 0, sh_rows, w2_ptr + e * I * H,
                   sw2_ptr + e * SW2, j * BN, I, H, BM, BN, BK, RECIPE, F32_DOT)
    cols = j * BN + tl.arange(0, BN)
    tl.store(y_ptr + rows[:, None] * H + cols[None, :], acc.to(tl.bfloat16))


@triton.jit
def fp8_row_views(rows16, WIDTH: tl.constexpr, RECIPE: tl.constexpr):
    """An FP8 row kept in the bytes of a bf16 row of WIDTH elements (2*WIDTH bytes): WIDTH e4m3
    values, then the row's scales from byte WIDTH (fp32; e8m0 codes for MX). From [BM] bf16
    row pointers: ([BM] e4m3 pointers, [BM] scale pointers)."""
    q = rows16.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    if RECIPE == 3:
        s = rows16.to(tl.pointer_type(tl.uint8), bitcast=True) + WIDTH
    else:
        s = rows16.to(tl.pointer_type(tl.float32), bitcast=True) + WIDTH // 4
    return q, s


@triton.jit
def gate_up_fp8_tiles(a_rows16, a_mask, w1, sw1, j0, h_rows16, pre_row_ptrs, w1_desc, w_row0,
                      H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, GJ: tl.constexpr, RECIPE: tl.constexpr,
                      POW2: tl.constexpr, F32_DOT: tl.constexpr, SAVE_PRE: tl.constexpr,
                      TMA: tl.constexpr):
    """The megakernel's FP8 gate+up work: GJ interleaved column tiles j0.. of one row block.
    A rows and h rows are FP8 rows in bf16-row storage (:func:`fp8_row_views`); w1 / sw1 this
    group's e4m3 weights (K-major [2I, H]) and scales (``fp8_tile``). h is quantised in the epilogue
    (1x128, or MX 1x32 with the mx recipe); SAVE_PRE also stores the pre-activations in bf16
    (the backward's input, in w1's interleaved column layout)."""
    # ROWWISE_ALL: the A side is ROWWISE, and h stays bf16 (the caller requantises the whole
    # rows once every tile of the row block is in: ``requant_whole_rows``)
    A_RECIPE: tl.constexpr = 2 if RECIPE == 4 else RECIPE
    H_RECIPE: tl.constexpr = 3 if RECIPE == 3 else 1
    a_rows, sa_rows = fp8_row_views(a_rows16, H, A_RECIPE)
    h_rows, sh_rows = fp8_row_views(h_rows16, I, H_RECIPE)
    for jj in tl.range(0, GJ):
        j = j0 + jj
        acc = fp8_tile(a_rows, a_mask, sa_rows, w1, sw1, j * BN, H, 2 * I, BM, BN, BK,
                       A_RECIPE, F32_DOT, w1_desc, w_row0, TMA)
        if SAVE_PRE:
            wcols = j * BN + tl.arange(0, BN)
            tl.store(pre_row_ptrs[:, None] + wcols[None, :], acc.to(tl.bfloat16))
        if RECIPE == 4:
            swiglu_bf16_epilogue(acc, h_rows16, j, BM, BN, F32_DOT)
        else:
            swiglu_quant_epilogue(acc, h_rows, sh_rows, j, BM, BN, H_RECIPE, POW2, F32_DOT)


@triton.jit
def down_fp8_tiles(h_rows16, w2, sw2, j0, dst_row_ptrs, dst_mask, w2_desc, w_row0,
                   I: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, DT: tl.constexpr, RECIPE: tl.constexpr,
                   F32_DOT: tl.constexpr, TMA: tl.constexpr):
    """The megakernel's FP8 down work: DT column tiles j0.. of one row block from its FP8 h
    rows (1x128 blocks, MX with the mx recipe) and this group's e4m3 w2 (K-major [H, I]) + scales;
    bf16 out to dst rows (masked)."""
    H_RECIPE: tl.constexpr = 3 if RECIPE == 3 else (2 if RECIPE == 4 else 1)
    h_rows, sh_rows = fp8_row_views(h_rows16, I, H_RECIPE)
    for jj in tl.range(0, DT):
        cols = (j0 + jj) * BN + tl.arange(0, BN)
        acc = fp8_tile(h_rows, tl.full((BM,), 1, tl.int1), sh_rows, w2, sw2, (j0 + jj) * BN, I, H,
                       BM, BN, BK, H_RECIPE, F32_DOT, w2_desc, w_row0, TMA)
        tl.store(dst_row_ptrs[:, None] + cols[None, :], acc.to(tl.bfloat16),
                 mask=dst_mask[:, None])


def fp8_scale_sizes(hidden: int, intermediate: int, recipe: int) -> tuple[int, int]:
    """Scale elements per expert of w1 [H, 2I] and w2 [I, H] for a recipe code (the layouts
    ``quantize_weights`` makes): blockwise 128x128 blocks, rowwise one per w1 column (w2 stays
    128x128: h is quantised 1x128), MX one per (column, 32 rows). (0, 0) for bf16."""
    H, I = hidden, intermediate
    if recipe == MX:
        return 2 * I * (H // 32), H * (I // 32)
    if recipe == ROWWISE:
        return 2 * I, (I // 128) * (H // 128)
    if recipe == ROWWISE_ALL:
        return 2 * I, H
    if recipe == BLOCKWISE:
        return (H // 128) * (2 * I // 128), (I // 128) * (H // 128)
    return 0, 0


def fp8_row_elements(width: int, recipe: int) -> int:
    """bf16 elements an FP8 row of ``width`` values occupies at the front of its bf16 row:
    the e4m3 values and the row's scales (width/32 bytes for blockwise and MX, 4 for rowwise),
    rounded up; ``width`` for bf16 (recipe 0). What dispatch moves per row."""
    if recipe == 0:
        return width
    scale_bytes = 4 if recipe in (ROWWISE, ROWWISE_ALL) else width // 32
    return -(-(width + scale_bytes) // 2)
