"""GEMM tiles of the expert FFN: gate+up with SwiGLU fused in the epilogue, and down.

Legend: BM rows of one row block (one expert), H hidden, I intermediate, F = 2*I, BN output
columns of a tile, BK reduction step. Weights are in the canonical math layout (y = x @ w):
w1 [H, F] with gate columns [0, I) and up columns [I, 2I); w2 [I, H].

A gate+up tile covers BN/2 gate columns c..c+BN/2 and the *matching* up columns I+c..: two
dots share the A tile, so one tile holds everything SwiGLU needs and the F-wide
pre-activation never reaches memory. Row pointers come in as a [BM] tensor, so the same tile
reads either contiguous ring rows or rows gathered from (peer) token buffers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tma_store_halves(desc, row0, acc, col_a, col_b, HALF: tl.constexpr,
                     INTERLEAVED: tl.constexpr):
    """Store an fp32 tile [rows, 2 HALF] as bf16 through two [rows, HALF] boxes of ``desc``
    at (row0, col_a) and (row0, col_b): its gate and up columns (INTERLEAVED: they
    alternate) or its left and right halves. In a pipelined loop Triton waits only for a
    box's shared buffer to be read before it is written again, so the stores overlap what
    follows (``bwd_dw_tma_store``, ``pre_tma_store``)."""
    R: tl.constexpr = acc.shape[0]
    if INTERLEAVED:
        a, b = tl.split(tl.reshape(acc, (R, HALF, 2)))
    else:
        a, b = tl.split(tl.permute(tl.reshape(acc, (R, 2, HALF)), (0, 2, 1)))
    desc.store([row0, col_a], a.to(tl.bfloat16))
    desc.store([row0, col_b], b.to(tl.bfloat16))


@triton.jit
def mma(a, b, acc, F32_DOT: tl.constexpr):
    """acc += a @ b. F32_DOT only for TRITON_INTERPRET on CPU, whose bf16 dot multiplies the
    raw 16-bit integers (Triton 3.6 interpreter); on GPUs bf16 operands go to the tensor cores."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def sigmoid(x, PTX: tl.constexpr):
    """1 / (1 + exp(-x)) in fp32. PTX: one inline-PTX sequence, ``ex2.approx.ftz`` of -x log2(e)
    and ``rcp.approx.ftz`` of 1 + that (two MUFU and two FP32 instructions; an error of a few
    ulp, as ``div.full``'s; x > 87 gives exactly 1, x < -88 exactly 0, NaN stays NaN), where
    Triton's lowering of the formula adds subnormal fix-ups to both (eleven instructions, four
    of them predicated, on sm_90). Without PTX (the interpreter) the formula."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t;"
            " add.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def held_with(x16, anchor, PTX: tl.constexpr):
    """``x16`` (bf16), unchanged, through an inline-PTX move that also takes ``anchor`` (fp32,
    same shape, unused), e.g. an MMA accumulator tile. Where a value is needed in two register
    layouts, Triton's layout pass may recompute its producers in the second layout rather than
    convert it (the dA epilogue's sigmoid was computed twice so, once for the r h store); it
    cannot recompute past the MMA that made ``anchor``, so the value is computed once and
    converted (a shared-memory round trip of two bytes an element). ptxas drops the move.
    Without PTX (the interpreter) x16 itself."""
    if PTX:
        return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h,r", [x16, anchor],
                                         dtype=tl.bfloat16, is_pure=True, pack=1)
    return x16


@triton.jit
def quant_hook(v, QUANT: tl.constexpr):
    """Fused-quantisation hook on the data path (dispatch, after SwiGLU). QUANT=0 passes the
    bf16 values through; an FP8 path (block scales on Hopper, MXFP8 on Blackwell) goes here."""
    tl.static_assert(QUANT == 0, "fused FP8 quantisation is not implemented yet")
    return v


@triton.jit
def _a_tile(a_row_ptrs, a_mask, k, offs_k, MASK_A: tl.constexpr):
    """The [BM, BK] A tile at reduction offset k from per-row pointers (masked rows read 0)."""
    ptrs = a_row_ptrs[:, None] + (k + offs_k)[None, :]
    if MASK_A:
        return tl.load(ptrs, mask=a_mask[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def gate_up_swiglu_tiles(a_row_ptrs, a_mask, w1, j0, h_row_ptrs, w1_desc, w_row0,
                         pre_row_ptrs, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, GJ: tl.constexpr,
                         QUANT: tl.constexpr, MASK_A: tl.constexpr, F32_DOT: tl.constexpr,
                         TMA: tl.constexpr, INTERLEAVED: tl.constexpr,
                         SAVE_PRE: tl.constexpr, pre_desc=None, pre_row0=0,
                         PRE_TMA: tl.constexpr = False):
    """h[rows, j*BN/2 : (j+1)*BN/2] = silu(A @ Wg) * (A @ Wu) for one BM-row block and the GJ
    column tiles j = j0 .. j0+GJ-1.

    a_row_ptrs: [BM] pointers to the first element of each A row (H elements, bf16);
    a_mask: [BM] rows to read (others read as 0; used when MASK_A);
    h_row_ptrs: [BM] pointers to h rows (I wide).
    TMA: weight tiles come through ``w1_desc`` (a [experts*H, F] descriptor, this expert's
    rows from ``w_row0``) instead of pointer loads from ``w1``.
    INTERLEAVED: w1's columns alternate gate c, up c (``interleave_gate_up``), so one
    [BK, BN] weight tile and one dot give both halves, split apart in registers in the
    epilogue; otherwise gate columns [0, I) and up columns [I, 2I), two [BK, BN/2] tiles
    and two dots sharing the A tile.
    The tile loop and the K loop are one flattened loop, so the software pipeline keeps
    loading (the next tile's first K steps) across a tile's SwiGLU epilogue.
    SAVE_PRE (training forward): also store the gate and up pre-activations in bf16 to
    ``pre_row_ptrs`` ([BM] pointers to 2I-wide rows, in w1's column layout), which the
    SwiGLU backward reads. PRE_TMA (``pre_tma_store``): through ``pre_desc`` instead (the
    pre-activations as [L*P, 2I], [BM, BN/2] boxes; the block's rows from ``pre_row0``),
    two TMA stores a tile in place of the plain store's layout conversion and per-thread
    stores.
    """
    HALF: tl.constexpr = BN // 2
    F: tl.constexpr = 2 * I
    offs_k = tl.arange(0, BK)
    for jj in tl.range(0, GJ, flatten=True):
        cols = (j0 + jj) * HALF + tl.arange(0, HALF)
        if INTERLEAVED:
            wcols = (j0 + jj) * BN + tl.arange(0, BN)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, H, BK):
                a = _a_tile(a_row_ptrs, a_mask, k, offs_k, MASK_A)
                if TMA:
                    b = w1_desc.load([w_row0 + k, (j0 + jj) * BN])
                else:
                    b = tl.load(w1 + (k + offs_k)[:, None].to(tl.int64) * F + wcols[None, :])
                acc = mma(a, b, acc, F32_DOT)
            if SAVE_PRE:
                if PRE_TMA:  # the tile's left and right column halves, layout as stored
                    tma_store_halves(pre_desc, pre_row0, acc, (j0 + jj) * BN,
                                     (j0 + jj) * BN + HALF, HALF, False)
                else:
                    tl.store(pre_row_ptrs[:, None] + wcols[None, :], acc.to(tl.bfloat16))
            acc_g, acc_u = tl.split(tl.reshape(acc, (BM, HALF, 2)))
        else:
            acc_g = tl.zeros((BM, HALF), dtype=tl.float32)
            acc_u = tl.zeros((BM, HALF), dtype=tl.float32)
            for k in range(0, H, BK):
                a = _a_tile(a_row_ptrs, a_mask, k, offs_k, MASK_A)
                if TMA:
                    bg = w1_desc.load([w_row0 + k, (j0 + jj) * HALF])
                    bu = w1_desc.load([w_row0 + k, I + (j0 + jj) * HALF])
                else:
                    b_ptrs = w1 + (k + offs_k)[:, None].to(tl.int64) * F + cols[None, :]
                    bg = tl.load(b_ptrs)
                    bu = tl.load(b_ptrs + I)
                acc_g = mma(a, bg, acc_g, F32_DOT)
                acc_u = mma(a, bu, acc_u, F32_DOT)
            if SAVE_PRE:
                if PRE_TMA:
                    pre_desc.store([pre_row0, (j0 + jj) * HALF], acc_g.to(tl.bfloat16))
                    pre_desc.store([pre_row0, I + (j0 + jj) * HALF], acc_u.to(tl.bfloat16))
                else:
                    tl.store(pre_row_ptrs[:, None] + cols[None, :], acc_g.to(tl.bfloat16))
                    tl.store(pre_row_ptrs[:, None] + (I + cols)[None, :],
                             acc_u.to(tl.bfloat16))
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        h = quant_hook(h.to(tl.bfloat16), QUANT)
        tl.store(h_row_ptrs[:, None] + cols[None, :], h)


@triton.jit
def down_tiles(h_row_ptrs, w2, j0, h_desc, h_row0, w2_desc, w_row0, dst_row_ptrs, dst_mask,
               I: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, DT: tl.constexpr, F32_DOT: tl.constexpr, TMA: tl.constexpr):
    """dst[rows, j*BN : (j+1)*BN] = (h[rows, :] @ w2)[:, j*BN : (j+1)*BN] in bf16 for the DT
    column tiles j = j0 .. j0+DT-1; h rows are I wide, dst rows H wide (masked by dst_mask).
    TMA: the (contiguous) h rows come through ``h_desc`` from row ``h_row0`` and the weight
    tiles through ``w2_desc`` ([experts*I, H]) from row ``w_row0``. One flattened loop, as in
    the gate+up tiles."""
    offs_k = tl.arange(0, BK)
    for jj in tl.range(0, DT, flatten=True):
        cols = (j0 + jj) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, I, BK):
            if TMA:
                a = h_desc.load([h_row0, k])
                b = w2_desc.load([w_row0 + k, (j0 + jj) * BN])
            else:
                a = tl.load(h_row_ptrs[:, None] + (k + offs_k)[None, :])
                b = tl.load(w2 + (k + offs_k)[:, None].to(tl.int64) * H + cols[None, :])
            acc = mma(a, b, acc, F32_DOT)
        tl.store(dst_row_ptrs[:, None] + cols[None, :], acc.to(tl.bfloat16),
                 mask=dst_mask[:, None])
