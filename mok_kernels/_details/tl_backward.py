"""The persistent backward megakernel: reverse-combine pull, dgrad, SwiGLU backward, router
gradient, reverse-dispatch push and the weight gradients, in one launch.

Legend: L logical ranks in the launch (program l // PROGS serves logical rank l), T tokens per
rank, H hidden, I intermediate, K top-k, S combine slots per token (K, +1 shared), E local
experts, G = E (+1 shared) GEMM groups, P schedule rows (the forward's schedule), NB = total/BM
row blocks in use, BM/BN/BK the forward's tiles, HALF = BN/2, BKW rows per
weight-gradient reduction step.

Before the megakernel, ``pull_rows_kernel`` pulls the dY rows (reverse-combine) and the x
rows of every schedule row from the tokens' home ranks into contiguous [L, P, H] buffers, so
every GEMM operand below is a TMA tile. With ``PULL`` (``bwd_fused_pull``) the megakernel does
that itself: the first PULLERS programs of each logical rank (all of them by default) first
claim pull items (one row block each) from a ticket counter of their own, and an A item waits
for its row block's flag; the rows are written with plain stores and read through TMA, so
writers and readers fence the async proxy. With ``PA`` (``bwd_pull_ahead``) the pull runs as
items of the main ticket order instead: section A is one slot per row block s, a pull item of
block s's dY rows followed by the A items of block s - PA; section B holds, per row block, its
B items followed by a pull item of its x rows (only the D items read x); the D items also
wait for their group's x-pulled count. With ``DIRECT`` (``bwd_direct_rows``) nothing is
pulled: the A, C and D items gather the dY and x rows they need from the tokens' home ranks
(peer memory) with plain loads, as the forward's GEMM programs do.

Work items, claimed from one ticket counter per logical rank in the global order A, B, Q
(FP8W only), C, D (``PHASES``, a bit mask, skips kinds for profiling; 15 runs all; ``QI``
merges B and Q into one section, the Q items spread evenly among the B items):
    A  dgrad down, one per (row block b, DAT I tiles of DAC = BN/2 or BN columns):
       dA = dY @ W_down^T (``FP8DA``: FP8 tiles on the dY rows quantised at their home
       ranks, gathered from there, and W_down's e4m3 rows, row-wise scales); epilogue: SwiGLU
       backward from the saved gate/up pre-activations (h = silu(gate) * up recomputed),
       the router-weight partial sum_cols(dA * h) pushed to the home rank (routed rows), r * h
       stored for C, and dG, dU (scaled by the router weight) written over the
       pre-activations in place; signals the row block and the group.
    B  dgrad gate+up, one per (row block b, DXT H tiles of BN); waits for b's A items:
       dX = [dG dU] @ W_gate_up^T (one GEMM over 2I), pushed to the home rank's (token, k)
       slot (reverse-dispatch). ``FP8DX``: the A item whose add completes row block b
       quantises its dG/dU rows (one scale per row over 2I) into the FP8 scratch rows, then
       adds 1 more; the B items wait for that and run FP8 tiles with W_gate_up's e4m3 rows.
    Q  (``FP8W``, ``bwd_fp8_wgrad``, only) quantisation, one per (group g, column tile of
       HALF of r h's I, then of dG/dU's 2I); waits for every A item of g: the tile's
       columns over g's rows (read through TMA) as e4m3 with one scale per column, written
       transposed (feature-major); the C and D items then wait for all of g's Q items and
       run FP8 tiles on those and on the pull kernel's transposed copies of dY and x.
    C  weight gradient of down, one per (group g, I tile of HALF, H tile of BN); waits for
       every A item of g: dW_down[g] = (r h)[rows of g]^T @ dY[rows of g].
    D  weight gradient of gate+up, one per (group g, H tile of HALF, 2I tile of BN); waits for
       every A item of g: dW_gate_up[g] = x[rows of g]^T @ [dG dU][rows of g], written in the
       canonical layout (gate columns, then up columns).
An item waits only on smaller tickets, so the order is deadlock free. Groups run
largest-first in C and D (the shared expert, whose rows are every token of the rank, first).
Every sum has a fixed order (no float atomics): bitwise reproducible. A group with no rows
gets zero weight gradients (its loops run zero times).

Counters of one logical rank (int32, zeroed before the launch):
    [0]            ticket
    [1 + b]        rowblock_ready[b]  (+1 per A item of block b; complete at I / DAC)
    [1 + NBMAX + g] group_ready[g]    (+1 per A item of group g)
    PULL, PA: [1 + NBMAX + NG + b] pulled[b] (row block b's rows are in; PA: its dY rows),
    then the pull ticket [1 + 2*NBMAX + NG] (PULL)
    PA only: [2 + 2*NBMAX + NG + g] x_pulled[g] (+1 per row block of group g whose x rows
    are in)
    FP8W only: [1 + NBMAX + NG + g] q_ready[g] (+1 per Q item of group g)
"""

from __future__ import annotations

import triton
import triton.language as tl

from mok_kernels._details import errors
from mok_kernels._details.tl_gemm import mma
from mok_kernels._details.tl_gemm_fp8 import _dot8, fp8_row_views, fp8_tile
from mok_kernels._details.tl_mega import _slot_rows, _weight_desc
from mok_kernels._details.tl_quant import e4m3_scales, finite_amax, to_e4m3, to_f32
from mok_kernels._details.tl_sync import globaltimer, no_error, record_item, wait_geq

# The error codes of errors.py, as constexprs for the kernel.
_E_DGRAD_ROWBLOCK: tl.constexpr = tl.constexpr(errors.ERR_WAIT_DGRAD_ROWBLOCK)
_E_DGRAD_GROUP: tl.constexpr = tl.constexpr(errors.ERR_WAIT_DGRAD_GROUP)
_E_BWD_PULLED: tl.constexpr = tl.constexpr(errors.ERR_WAIT_BWD_PULLED)
_E_BWD_XPULLED: tl.constexpr = tl.constexpr(errors.ERR_WAIT_BWD_XPULLED)
_E_WGRAD_QUANT: tl.constexpr = tl.constexpr(errors.ERR_WAIT_WGRAD_QUANT)


@triton.jit
def _async_proxy_fence(v, SKIP: tl.constexpr):
    """``fence.proxy.async.global``: orders this thread's generic-proxy global accesses with
    async-proxy (TMA) ones, so rows written with plain stores by one program and read with
    TMA by another (after a release/acquire pair) are seen. SKIP under the interpreter (no
    PTX there, and no TMA proxy). Returns v (an int32 the asm threads through)."""
    if SKIP:
        return v
    return tl.inline_asm_elementwise("fence.proxy.async.global;\n mov.u32 $0, $1;", "=r,r",
                                     [v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pull_rows(rows, lr, src, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr, T, P,
               H: tl.constexpr, S: tl.constexpr, CH: tl.constexpr, WHICH: tl.constexpr = 0):
    """Reverse-combine pull of the schedule rows ``rows`` of logical rank lr (all below the
    rank's total; ``src`` is its row of the schedule): their x and dY rows (WHICH 0; 1 x
    only, 2 dY only), from the tokens' home ranks (peer memory), into the contiguous
    [L, P, H] buffers; zeros for padding rows."""
    s = tl.load(src + rows)
    valid = s >= 0
    tok = (tl.maximum(s, 0) // S).to(tl.int64)
    rank, t = tok // T, tok % T
    out = (lr.to(tl.int64) * P + rows) * H
    if WHICH != 2:  # rows start 16-byte aligned: 16-byte vector loads (see _row_sources)
        x_rows = x_base + tl.multiple_of(tl.load(x_tab + rank, mask=valid, other=0) + t * H, 8)
    if WHICH != 1:
        dy_rows = dy_base + tl.multiple_of(tl.load(tab16 + rank, mask=valid, other=0) + t * H,
                                           8)
    for h0 in range(0, H, CH):
        cols = h0 + tl.arange(0, CH)
        cm = cols < H
        m = valid[:, None] & cm[None, :]
        if WHICH != 2:
            v = tl.load(x_rows[:, None] + cols[None, :], mask=m, other=0.0)
            tl.store(xg_ptr + out[:, None] + cols[None, :], v, mask=cm[None, :])
        if WHICH != 1:
            v = tl.load(dy_rows[:, None] + cols[None, :], mask=m, other=0.0)
            tl.store(dyg_ptr + out[:, None] + cols[None, :], v, mask=cm[None, :])


@triton.jit
def _row_sources(rows, lr, src, first, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr, T, P,
                 H: tl.constexpr, S: tl.constexpr, PHASE: tl.constexpr):
    """Where the separate pull reads the x and dY rows of schedule rows ``rows`` of logical
    rank lr, and which rows it loads and writes: (x row pointers, dY row pointers, load
    mask, write mask). PHASE 0: every row from its token's home rank (peer memory), padding
    rows written 0. ``bwd_pull_dedup``: PHASE 1 the rows that are their token's first on
    this rank (``first`` [P]), from home, and the padding rows (0); PHASE 2 (a later launch)
    the other rows, from their first row's pulled copy in ``xg_ptr`` / ``dyg_ptr`` (local)."""
    s = tl.load(src + rows)
    valid = s >= 0
    tok = (tl.maximum(s, 0) // S).to(tl.int64)
    rank, t = tok // T, tok % T
    # Every row starts at a multiple of 8 elements (16 bytes: H is a multiple of 8, the rank
    # offsets are those of 16-byte aligned buffers, ``_token_source`` copies an unaligned x):
    # said, the row loads are 16-byte vectors. Unsaid, Triton loaded each bf16 alone (the
    # offsets are loaded values), and the FP8 transposing pull took most of the backward.
    x_rows = x_base + tl.multiple_of(tl.load(x_tab + rank, mask=valid, other=0) + t * H, 8)
    dy_rows = dy_base + tl.multiple_of(tl.load(tab16 + rank, mask=valid, other=0) + t * H, 8)
    # One return at the end: Triton's code generator (3.6 and 3.9) visits the statements
    # after a return under a constexpr branch, and ``first`` is None when PHASE is 0.
    if PHASE == 0:
        ld = valid
        wr = rows >= 0
    elif PHASE == 1:
        is_first = tl.load(first + rows, mask=valid, other=-1) == rows
        ld = valid & is_first
        wr = is_first | (s < 0)
    else:
        f = tl.load(first + rows, mask=valid, other=-1)
        local = tl.multiple_of((lr.to(tl.int64) * P + tl.maximum(f, 0)) * H, 8)
        x_rows = xg_ptr + local
        dy_rows = dyg_ptr + local
        ld = valid & (f != rows)
        wr = ld
    return x_rows, dy_rows, ld, wr


@triton.jit
def _pull_block(b, lr, src, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr, T, P,
                H: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
                CH: tl.constexpr, WHICH: tl.constexpr = 0):
    """In-kernel reverse-combine pull (``bwd_fused_pull``, ``bwd_pull_ahead``): row block b
    (in use, so every row is below the rank's total, which is a multiple of BM), BR rows at
    a time, as ``pull_rows_kernel`` does (WHICH as ``_pull_rows``)."""
    for r0 in range(0, BM, BR):
        _pull_rows(b * BM + r0 + tl.arange(0, BR), lr, src, x_base, x_tab, dy_base, tab16,
                   xg_ptr, dyg_ptr, T, P, H, S, CH, WHICH)


@triton.jit
def _pulled_signal(flag, v, F32_DOT: tl.constexpr):
    """After a pull item's plain stores: fence the async proxy (its rows are read through
    TMA), then release-add 1 to ``flag``; returns v."""
    v = _async_proxy_fence(v, F32_DOT)
    tl.debug_barrier()
    tl.atomic_add(flag, 1, sem="release", scope="gpu")
    return v


@triton.jit
def _row_meta(src, rows, T, S: tl.constexpr, K: tl.constexpr):
    """Per schedule row: (valid, home rank, token on that rank, slot k, routed)."""
    s = tl.load(src + rows, mask=rows >= 0, other=-1)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    tok = s64 // S
    k = s64 % S
    return valid, tok // T, tok % T, k, valid & (k < K)


@triton.jit
def _router_weight(p_base, tab32, rank, t, k, routed, K: tl.constexpr):
    """Router weight of each row's (token, k) at its home rank; 1 for the shared slot and
    padding rows."""
    off = tl.load(tab32 + rank, mask=routed, other=0)
    return tl.load(p_base + off + t * K + k, mask=routed, other=1.0)


@triton.jit
def _home_rows(base, tab, rank, t, valid, H: tl.constexpr):
    """Pointers to the [H]-wide rows of tokens t at their home ranks (``tab``: each rank's
    element offset from ``base``, peer memory in EP; a multiple of 8 elements, since buffers
    are carved at 1 KiB, which lets the gathers become 16-byte asynchronous copies); padding
    rows point at row 0 of this rank and are masked by the caller (``bwd_direct_rows``)."""
    return base + tl.multiple_of(tl.load(tab + rank, mask=valid, other=0), 8) + t * H


@triton.jit
def _swiglu_bwd_half(da_raw, c0, prow, pre_desc, pre_rows, hs_rows, r, I: tl.constexpr,
                     BM: tl.constexpr, Q: tl.constexpr, INTERLEAVED: tl.constexpr):
    """SwiGLU backward for Q columns c0.. of a row block (rows from ``prow`` in the [L*P, ...]
    views): reads gate/up through ``pre_desc``, writes dG, dU over them and r * h to
    ``hs_rows`` with plain stores (a TMA store's completion is not ordered before the
    release that lets other programs read them); returns the router-gradient partial
    sum_cols(da_raw * h) [BM]."""
    if INTERLEAVED:  # gate c at column 2c, up c at 2c + 1: one [BM, 2Q] box
        gate, up = tl.split(tl.reshape(pre_desc.load([prow, 2 * c0]).to(tl.float32),
                                       (BM, Q, 2)))
    else:  # plain loads: two TMA boxes here double the kernel's shared memory (Triton 3.6)
        qc = c0 + tl.arange(0, Q)
        gate = tl.load(pre_rows[:, None] + qc[None, :]).to(tl.float32)
        up = tl.load(pre_rows[:, None] + (I + qc)[None, :]).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    h = silu * up
    part = tl.sum(da_raw * h, axis=1)
    cols = c0 + tl.arange(0, Q)
    tl.store(hs_rows[:, None] + cols[None, :], (h * r[:, None]).to(tl.bfloat16))
    da = da_raw * r[:, None]
    d_up = (da * silu).to(tl.bfloat16)
    d_gate = (da * up * sig * (1.0 + gate * (1.0 - sig))).to(tl.bfloat16)
    if INTERLEAVED:
        wcols = 2 * c0 + tl.arange(0, 2 * Q)
        tl.store(pre_rows[:, None] + wcols[None, :],
                 tl.reshape(tl.join(d_gate, d_up), (BM, 2 * Q)))
    else:
        tl.store(pre_rows[:, None] + cols[None, :], d_gate)
        tl.store(pre_rows[:, None] + (I + cols)[None, :], d_up)
    return part


@triton.jit
def _da_tile(jt, prow, valid, dy_rows, d2, w_row0, dyg_a_desc, H: tl.constexpr,
             BM: tl.constexpr, BK: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr,
             DIRECT: tl.constexpr):
    """dA_raw [BM, DAC] = dY[rows] @ W_down[I tile jt]^T: dY rows pulled (through
    ``dyg_a_desc`` from row ``prow``) or, DIRECT, gathered from ``dy_rows``."""
    acc = tl.zeros((BM, DAC), dtype=tl.float32)
    offs_k = tl.arange(0, BK)
    for kk in range(0, H, BK):
        if DIRECT:  # dY rows [BM, BK] from the home ranks; padding rows read 0
            a = tl.load(dy_rows[:, None] + (kk + offs_k)[None, :], mask=valid[:, None],
                        other=0.0)
        else:
            a = dyg_a_desc.load([prow, kk])  # pulled dY rows [BM, BK]
        bt = d2.load([w_row0 + jt * DAC, kk])  # W_down[I tile, H step]: [DAC, BK]
        acc = mma(a, tl.trans(bt), acc, F32_DOT)
    return acc


@triton.jit
def _da_tile_fp8(jt, rank, t, valid, lr, g, E, dyq_base, tab16, w2q_desc, ws2q_desc, sw2q_ptr,
                 sws2q_ptr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                 BK: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr,
                 HAS_SHARED: tl.constexpr, prow=0, dyqr_desc=None, dyqr_ptr=None,
                 DAQR: tl.constexpr = False):
    """``FP8DA``: dA_raw [BM, DAC] of I tile jt from the FP8 dY rows of the rows' tokens at
    their home ranks (``dyq_base`` + ``tab16``: H e4m3 values, then one fp32 scale per row)
    and group g's e4m3 W_down rows (through ``w2q_desc`` / ``ws2q_desc``, one fp32 scale per
    row of W_down): a pure FP8 K loop over H, both scales applied after it (``fp8_tile``,
    ROWWISE). Padding rows read 0. DAQR (``bwd_fp8_da_rows``): the same rows, copied before
    the launch into contiguous rows of this rank's schedule (``dyqr_ptr``, row ``prow`` on),
    as TMA tiles through ``dyqr_desc``."""
    if DAQR:
        a_rows, sa_rows = fp8_row_views(
            dyqr_ptr + (prow + tl.arange(0, BM)).to(tl.int64) * H, H, 2)
    else:
        a_rows, sa_rows = fp8_row_views(_home_rows(dyq_base, tab16, rank, t, valid, H), H, 2)
    d, w_row0 = _weight_desc(lr, g, E, w2q_desc, ws2q_desc, I, True, HAS_SHARED)
    sw = sw2q_ptr + (lr * E + g).to(tl.int64) * I
    if HAS_SHARED:
        if g == E:
            sw = sws2q_ptr
    return fp8_tile(a_rows, valid, sa_rows, 0, sw, jt * DAC, H, I, BM, DAC, BK, 2, F32_DOT,
                    d, w_row0, True, dyqr_desc, prow, DAQR)


@triton.jit
def _block_col_max(src_rows, F: tl.constexpr, valid, dst, BM: tl.constexpr,
                   RQC: tl.constexpr, F32_DOT: tl.constexpr):
    """``bwd_fp8_block_colmax``: the column max |v| (NaN as +inf) over the ``valid`` ones of
    the BM bf16 rows of F values at ``src_rows``, stored at ``dst`` [F]."""
    offs = tl.arange(0, RQC)
    for c0 in tl.range(0, F, RQC):
        v = to_f32(tl.load(src_rows[:, None] + (c0 + offs)[None, :]), F32_DOT)
        tl.store(dst + c0 + offs, finite_amax(tl.where(valid[:, None], v, 0.0), 0))


@triton.jit
def _requant_dgu_rows(src_rows, dst_rows16, F: tl.constexpr, BM: tl.constexpr,
                      RQC: tl.constexpr, POW2: tl.constexpr, F32_DOT: tl.constexpr):
    """``FP8DX``: the BM bf16 dG/dU rows of F = 2I values at ``src_rows`` (written by the A
    items, acquired by the caller) as FP8 rows at ``dst_rows16`` (F e4m3 values, then one
    fp32 scale per row over all F: ``fp8_row_views``): their max |v| in RQC-column chunks,
    then the quantised chunks. The bf16 rows stay for the dW_gate_up items."""
    offs = tl.arange(0, RQC)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for c0 in tl.range(0, F, RQC):
        v = to_f32(tl.load(src_rows[:, None] + (c0 + offs)[None, :]), F32_DOT)
        amax = tl.maximum(amax, finite_amax(v, 1))
    inv, scale = e4m3_scales(amax, POW2)
    q_rows, s_rows = fp8_row_views(dst_rows16, F, 2)
    for c0 in tl.range(0, F, RQC):
        v = to_f32(tl.load(src_rows[:, None] + (c0 + offs)[None, :]), F32_DOT)
        tl.store(q_rows[:, None] + (c0 + offs)[None, :], to_e4m3(v * inv[:, None], F32_DOT))
    tl.store(s_rows, scale)


@triton.jit
def _requant_dgu_rows_tma(pre_desc, prow, dst_rows16, F: tl.constexpr, BM: tl.constexpr,
                          DQC: tl.constexpr, POW2: tl.constexpr, F32_DOT: tl.constexpr,
                          CMX: tl.constexpr = False, valid=None, bm_row=None, hs_desc=None,
                          I: tl.constexpr = 0):
    """``bwd_fp8_requant_tma``: ``_requant_dgu_rows`` with both passes reading the bf16 rows
    through ``pre_desc`` ([BM, DQC] boxes from row ``prow``; the caller fenced the async
    proxy after its acquire) as pipelined copies (``num_stages``): with plain loads each
    chunk is loaded and waited for in turn, and the block-completing item's two passes sit
    on the dA items' time. The same values and maxima, so the same bytes. CMX
    (``bwd_fp8_block_colmax``): the max pass also stores each column's max |v| over the
    ``valid`` rows at ``bm_row + I`` (dG/dU), and a pass over r h (``hs_desc``, the same
    boxes) stores its column maxima at ``bm_row`` (``_block_col_max``'s values)."""
    offs = tl.arange(0, DQC)
    amax = tl.zeros((BM,), dtype=tl.float32)
    for c0 in tl.range(0, F, DQC, num_stages=3):
        v = to_f32(pre_desc.load([prow, c0]), F32_DOT)
        amax = tl.maximum(amax, finite_amax(v, 1))
        if CMX:
            tl.store(bm_row + I + c0 + offs, finite_amax(tl.where(valid[:, None], v, 0.0), 0))
    inv, scale = e4m3_scales(amax, POW2)
    q_rows, s_rows = fp8_row_views(dst_rows16, F, 2)
    for c0 in tl.range(0, F, DQC, num_stages=3):
        v = to_f32(pre_desc.load([prow, c0]), F32_DOT)
        tl.store(q_rows[:, None] + (c0 + offs)[None, :], to_e4m3(v * inv[:, None], F32_DOT))
    tl.store(s_rows, scale)
    if CMX:
        for c0 in tl.range(0, I, DQC, num_stages=3):
            v = to_f32(hs_desc.load([prow, c0]), F32_DOT)
            tl.store(bm_row + c0 + offs, finite_amax(tl.where(valid[:, None], v, 0.0), 0))


@triton.jit
def _dx_tile_fp8(jn, gq_rows16, lr, g, E, w1q_desc, ws1q_desc, sw1q_ptr, sws1q_ptr,
                 H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, F32_DOT: tl.constexpr, HAS_SHARED: tl.constexpr):
    """``FP8DX``: dX [BM, BN] of H tile jn from the row block's FP8 dG/dU rows (one scale
    per row) and group g's e4m3 W_gate_up rows (one scale per hidden row): a pure FP8 K loop
    over 2I, both scales after it (``fp8_tile``, ROWWISE)."""
    a_rows, sa_rows = fp8_row_views(gq_rows16, 2 * I, 2)
    d, w_row0 = _weight_desc(lr, g, E, w1q_desc, ws1q_desc, H, True, HAS_SHARED)
    sw = sw1q_ptr + (lr * E + g).to(tl.int64) * H
    if HAS_SHARED:
        if g == E:
            sw = sws1q_ptr
    return fp8_tile(a_rows, tl.full((BM,), 1, tl.int1), sa_rows, 0, sw, jn * BN, 2 * I, H, BM,
                    BN, BK, 2, F32_DOT, d, w_row0, True)


@triton.jit
def _da_epilogue(acc, jt, rows, prow, pre, hs, rank, t, k, routed, p_base, drp_base, tab32,
                 pre_a_desc, I: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, DAC: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The A item's epilogue for I tile jt (see the module docstring), in column quarters of
    a [BM, BN] tile (two for DAC = BN/2, four for DAC = BN) so its fp32 temporaries fit in
    registers; ends with the router-gradient partial of the tile."""
    Q: tl.constexpr = BN // 4
    NJ: tl.constexpr = I // DAC
    r = _router_weight(p_base, tab32, rank, t, k, routed, K)
    pre_rows = pre + rows.to(tl.int64) * (2 * I)
    hs_rows = hs + rows.to(tl.int64) * I
    c0 = jt * DAC
    if DAC == 2 * Q:  # the accumulator's column quarters, one after another
        a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, Q)), (0, 2, 1)))
        part = _swiglu_bwd_half(a0, c0, prow, pre_a_desc, pre_rows, hs_rows, r, I, BM, Q,
                                INTERLEAVED)
        part += _swiglu_bwd_half(a1, c0 + Q, prow, pre_a_desc, pre_rows, hs_rows, r, I, BM, Q,
                                 INTERLEAVED)
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, 2 * Q)), (0, 2, 1)))
        a0, a1 = tl.split(tl.permute(tl.reshape(lo, (BM, 2, Q)), (0, 2, 1)))
        a2, a3 = tl.split(tl.permute(tl.reshape(hi, (BM, 2, Q)), (0, 2, 1)))
        part = _swiglu_bwd_half(a0, c0, prow, pre_a_desc, pre_rows, hs_rows, r, I, BM, Q,
                                INTERLEAVED)
        part += _swiglu_bwd_half(a1, c0 + Q, prow, pre_a_desc, pre_rows, hs_rows, r, I, BM, Q,
                                 INTERLEAVED)
        part += _swiglu_bwd_half(a2, c0 + 2 * Q, prow, pre_a_desc, pre_rows, hs_rows, r, I,
                                 BM, Q, INTERLEAVED)
        part += _swiglu_bwd_half(a3, c0 + 3 * Q, prow, pre_a_desc, pre_rows, hs_rows, r, I,
                                 BM, Q, INTERLEAVED)
    # Router-weight gradient: d r = sum_I dA_raw * h, one partial per I tile.
    drp_off = tl.load(tab32 + rank, mask=routed, other=0)
    tl.store(drp_base + drp_off + (t * K + k) * NJ + jt, part, mask=routed)


@triton.jit
def _dgrad_down_item(b, jt0, lr, src, grp, P, pre, hs, ctr, dyg_a_desc, p_base, drp_base,
                     tab32, w2_desc, ws2_desc, pre_a_desc, T, E, NBMAX, withhold,
                     H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, K: tl.constexpr,
                     HAS_SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr,
                     INTERLEAVED: tl.constexpr, dy_base=None, tab16=None,
                     DIRECT: tl.constexpr = False, DAT: tl.constexpr = 1,
                     FP8DA: tl.constexpr = False, dyq_base=None, w2q_desc=None,
                     ws2q_desc=None, sw2q_ptr=None, sws2q_ptr=None,
                     FP8DX: tl.constexpr = False, gq=None, GQW: tl.constexpr = 0,
                     RQC: tl.constexpr = 128, POW2: tl.constexpr = False,
                     QBM: tl.constexpr = False, bmax=None, RQT: tl.constexpr = False,
                     hs_a_desc=None, DAQR: tl.constexpr = False, dyqr_ptr=None):
    """A item: dA[rows of block b, I tiles jt0*DAT .. of DAC columns] and its epilogue
    (``_da_epilogue``); DAT tiles per item in one flattened loop (the next tile's loads
    overlap a tile's epilogue), and the item signals +DAT. DIRECT: the dY rows are gathered
    from their home ranks (``dy_base`` + ``tab16``) instead of read from the pulled rows.
    FP8DA: FP8 tiles (``_da_tile_fp8``) instead of the bf16 ones. QBM: the item that
    completes the block (FP8DX) also stores its column maxima of r h and dG/dU at ``bmax``
    [L, NBMAX, 3I]. RQT (``bwd_fp8_requant_tma``): that item's requantisation reads the rows
    through ``pre_a_desc`` as pipelined copies (``_requant_dgu_rows_tma``; with QBM it also
    takes the column maxima there, r h's through ``hs_a_desc``)."""
    g = tl.load(grp + b)
    rows = b * BM + tl.arange(0, BM)
    valid, rank, t, k, routed = _row_meta(src, rows, T, S, K)
    d2, w_row0 = _weight_desc(lr, g, E, w2_desc, ws2_desc, I, True, HAS_SHARED)
    prow = lr * P + b * BM
    dy_rows = _home_rows(dy_base, tab16, rank, t, valid, H) if DIRECT else 0
    if DAT == 1:  # one tile, no loop: the instructions of the GPU-tested one-tile item
        if FP8DA:
            acc = _da_tile_fp8(jt0, rank, t, valid, lr, g, E, dyq_base, tab16, w2q_desc,
                               ws2q_desc, sw2q_ptr, sws2q_ptr, H, I, BM, BK, DAC, F32_DOT,
                               HAS_SHARED, prow, dyg_a_desc, dyqr_ptr, DAQR)
        else:
            acc = _da_tile(jt0, prow, valid, dy_rows, d2, w_row0, dyg_a_desc, H, BM, BK, DAC,
                           F32_DOT, DIRECT)
        _da_epilogue(acc, jt0, rows, prow, pre, hs, rank, t, k, routed, p_base, drp_base,
                     tab32, pre_a_desc, I, K, BM, BN, DAC, INTERLEAVED)
    else:
        for jj in tl.range(0, DAT, flatten=True):
            jt = jt0 * DAT + jj
            if FP8DA:
                acc = _da_tile_fp8(jt, rank, t, valid, lr, g, E, dyq_base, tab16, w2q_desc,
                                   ws2q_desc, sw2q_ptr, sws2q_ptr, H, I, BM, BK, DAC, F32_DOT,
                                   HAS_SHARED, prow, dyg_a_desc, dyqr_ptr, DAQR)
            else:
                acc = _da_tile(jt, prow, valid, dy_rows, d2, w_row0, dyg_a_desc, H, BM, BK,
                               DAC, F32_DOT, DIRECT)
            _da_epilogue(acc, jt, rows, prow, pre, hs, rank, t, k, routed, p_base, drp_base,
                         tab32, pre_a_desc, I, K, BM, BN, DAC, INTERLEAVED)
    if (withhold != 3) | (b != 0) | (jt0 != 0):
        tl.debug_barrier()
        if FP8DX:  # the item that completes the row block quantises its dG/dU rows
            old = tl.atomic_add(ctr + 1 + b, DAT, sem="acq_rel", scope="gpu")
            if old + DAT == I // DAC:
                tl.debug_barrier()  # every thread after the acquire of the other items' rows
                bm_row = bmax + (lr * NBMAX + b).to(tl.int64) * (3 * I) if QBM else bmax
                if RQT:  # TMA reads of rows written with plain stores: fence the async proxy
                    _async_proxy_fence(old, F32_DOT)
                    tl.debug_barrier()
                    _requant_dgu_rows_tma(pre_a_desc, prow, gq + rows.to(tl.int64) * GQW, 2 * I,
                                          BM, BN // 2 if INTERLEAVED else BN // 4, POW2,
                                          F32_DOT, QBM, valid, bm_row, hs_a_desc, I)
                else:
                    _requant_dgu_rows(pre + rows.to(tl.int64) * (2 * I),
                                      gq + rows.to(tl.int64) * GQW, 2 * I, BM, RQC, POW2,
                                      F32_DOT)
                    if QBM:  # the block's column maxima of r h, then dG/dU, for the Q items:
                        # passes of their own over rows in L2 (inside the requantisation's
                        # first pass the column reduction spilled as much)
                        _block_col_max(hs + rows.to(tl.int64) * I, I, valid, bm_row, BM, RQC,
                                       F32_DOT)
                        _block_col_max(pre + rows.to(tl.int64) * (2 * I), 2 * I, valid,
                                       bm_row + I, BM, RQC, F32_DOT)
                tl.debug_barrier()
                tl.atomic_add(ctr + 1 + b, 1, sem="release", scope="gpu")
        else:
            tl.atomic_add(ctr + 1 + b, DAT, sem="release", scope="gpu")
        tl.atomic_add(ctr + 1 + NBMAX + g, DAT, sem="release", scope="gpu")


@triton.jit
def _dx_tile(jn, pre_rows, d1, w_row0, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, F32_DOT: tl.constexpr, pre_b_desc=None, prow=0,
             DXTMA: tl.constexpr = False):
    """dX [BM, BN] of H tile jn = dGU[rows] @ W_gate_up[H tile]^T: dGU rows by plain loads
    (the A items wrote them with plain stores) or, DXTMA, through ``pre_b_desc`` from row
    ``prow`` (the caller fenced the async proxy after its acquire)."""
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, 2 * I, BK):
        if DXTMA:
            a = pre_b_desc.load([prow, kk])  # dGU rows [BM, BK]
        else:
            a = tl.load(pre_rows[:, None] + (kk + offs_k)[None, :])
        bt = d1.load([w_row0 + jn * BN, kk])  # W_gate_up[H tile, 2I step]: [BN, BK]
        acc = mma(a, tl.trans(bt), acc, F32_DOT)
    return acc


@triton.jit
def _dgrad_gate_up_item(b, jn0, lr, src, grp, pre, ctr, err, comb_base, comb_tab, w1_desc,
                        ws1_desc, T, E, budget, H: tl.constexpr, I: tl.constexpr,
                        S: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, DAC: tl.constexpr,
                        F32_DOT: tl.constexpr, DXT: tl.constexpr = 1, pre_b_desc=None, P=0,
                        DXTMA: tl.constexpr = False, FP8DX: tl.constexpr = False, gq=None,
                        GQW: tl.constexpr = 0, w1q_desc=None, ws1q_desc=None, sw1q_ptr=None,
                        sws1q_ptr=None):
    """B item: dX[rows of block b, H tiles jn0*DXT ..] = dGU @ W_gate_up^T, pushed to the
    home slots. dGU and W_gate_up share one column layout, so the contraction over 2I needs
    no reordering. DXT H tiles per item in one flattened loop, so the software pipeline loads
    the next tile's first steps during a tile's store (as the forward's tiles do). DXTMA: the
    dGU rows through TMA (``pre_b_desc`` over [L*P, 2I]), after an async-proxy fence."""
    ok = wait_geq(ctr + 1 + b, I // DAC + FP8DX, err, budget, _E_DGRAD_ROWBLOCK, b)
    if ok != 0:
        if DXTMA:  # the A items' plain stores of these rows, before TMA reads them
            _async_proxy_fence(ok, F32_DOT)
        g = tl.load(grp + b)
        rows = b * BM + tl.arange(0, BM)
        pre_rows = pre + rows.to(tl.int64) * (2 * I)
        gq_rows = gq + rows.to(tl.int64) * GQW if FP8DX else 0
        prow = lr * P + b * BM
        d1, w_row0 = _weight_desc(lr, g, E, w1_desc, ws1_desc, H, True, HAS_SHARED)
        if DXT == 1:  # one tile, no loop: as the GPU-tested one-tile item (slots after the GEMM)
            if FP8DX:
                acc = _dx_tile_fp8(jn0, gq_rows, lr, g, E, w1q_desc, ws1q_desc, sw1q_ptr,
                                   sws1q_ptr, H, I, BM, BN, BK, F32_DOT, HAS_SHARED)
            else:
                acc = _dx_tile(jn0, pre_rows, d1, w_row0, I, BM, BN, BK, F32_DOT, pre_b_desc,
                               prow, DXTMA)
            dst, valid = _slot_rows(src, rows, rows >= 0, T, S, comb_tab, comb_base, H)
            cols = jn0 * BN + tl.arange(0, BN)
            tl.store(dst[:, None] + cols[None, :], acc.to(tl.bfloat16), mask=valid[:, None])
        else:
            dst, valid = _slot_rows(src, rows, rows >= 0, T, S, comb_tab, comb_base, H)
            for jj in tl.range(0, DXT, flatten=True):
                jn = jn0 * DXT + jj
                if FP8DX:
                    acc = _dx_tile_fp8(jn, gq_rows, lr, g, E, w1q_desc, ws1q_desc, sw1q_ptr,
                                       sws1q_ptr, H, I, BM, BN, BK, F32_DOT, HAS_SHARED)
                else:
                    acc = _dx_tile(jn, pre_rows, d1, w_row0, I, BM, BN, BK, F32_DOT,
                                   pre_b_desc, prow, DXTMA)
                cols = jn * BN + tl.arange(0, BN)
                tl.store(dst[:, None] + cols[None, :], acc.to(tl.bfloat16),
                         mask=valid[:, None])
    return ok


@triton.jit
def _group_rows(gst, g, total):
    """First and end (exclusive, padded) schedule row of group g, clipped to ``total``."""
    start = tl.minimum(tl.load(gst + g), total)
    end = tl.minimum(tl.load(gst + g + 1), total)
    return start, end


@triton.jit
def _group_ready(g, gst, total, ctr, err, NBMAX, budget, I: tl.constexpr, BM: tl.constexpr,
                 DAC: tl.constexpr, F32_DOT: tl.constexpr, PULL: tl.constexpr):
    """Rows of group g (first, end) and whether every A item of g is done (the C and D items
    read what they wrote). With PULL the rows were pulled in this launch with plain stores
    and are read through TMA: fence the async proxy after the acquire."""
    start, end = _group_rows(gst, g, total)
    ok = wait_geq(ctr + 1 + NBMAX + g, (end - start) // BM * (I // DAC), err, budget,
                  _E_DGRAD_GROUP, g)
    if PULL:
        if ok != 0:
            _async_proxy_fence(ok, F32_DOT)
    return start, end, ok


@triton.jit
def _quant_cols(desc, row0, dst, sc, col0, start, end, src, P, QC: tl.constexpr,
                BKW: tl.constexpr, POW2: tl.constexpr, F32_DOT: tl.constexpr,
                BMX: tl.constexpr = False, bmax=None, BM: tl.constexpr = 128,
                W: tl.constexpr = 0):
    """Columns col0 .. col0 + QC of one group's rows start..end of a [P, W] bf16 matrix (r h
    or dG/dU; read through ``desc``, [BKW, QC] boxes of this logical rank's rows from
    ``row0``) as e4m3 with one scale per column over those rows: a first pass takes the
    column max |v| (NaN read as +inf, so its column's scale turns NaN), the scales go to
    ``sc`` (+ column), a second pass writes the values transposed (feature-major, rows
    contiguous) to ``dst`` [W, P]; padding rows read 0 (they neither set a max nor add to a
    product). Both passes are pipelined TMA copies (``num_stages``): with plain loads, one
    at a time, the Q items were a large part of the FP8 backward; folding the maxima into
    the A items instead, to read once here, slowed the A items by more than it saved (both
    timed by the profiling script benchmarks/mok_backward_time.py; notes/mok-kernel.md).
    BMX (``bwd_fp8_block_colmax``): the column max from the row blocks' maxima at ``bmax``
    (these columns of block b at ``bmax + b * W``; start and end are multiples of BM)
    instead of the first pass: the same max, exactly."""
    cols = col0 + tl.arange(0, QC)
    amax = tl.zeros((QC,), dtype=tl.float32)
    if BMX:
        for b in range(start // BM, end // BM):
            amax = tl.maximum(amax, tl.load(bmax + b * W + tl.arange(0, QC)))
    else:
        for r0 in tl.range(start, end, BKW, num_stages=3):
            rows = r0 + tl.arange(0, BKW)
            live = tl.load(src + rows) >= 0
            v = tl.where(live[:, None], to_f32(desc.load([row0 + r0, col0]), F32_DOT), 0.0)
            amax = tl.maximum(amax, finite_amax(v, 0))
    inv, scale = e4m3_scales(amax, POW2)
    tl.store(sc + cols, scale)
    for r0 in tl.range(start, end, BKW, num_stages=3):
        rows = r0 + tl.arange(0, BKW)
        live = tl.load(src + rows) >= 0
        v = tl.where(live[:, None], to_f32(desc.load([row0 + r0, col0]), F32_DOT), 0.0)
        q = to_e4m3(v * inv[None, :], F32_DOT)
        tl.store(dst + cols.to(tl.int64)[None, :] * P + rows[:, None], q)


@triton.jit
def _wgrad_quant_item(g, c, lr, gst, total, src, P, hs_q_desc, pre_q_desc, hqT, gqT, srh, srg,
                      ctr, err, qready, NBMAX, budget, withhold, NG, I: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                      DAC: tl.constexpr, F32_DOT: tl.constexpr, POW2: tl.constexpr,
                      QBM: tl.constexpr = False, bmax=None):
    """Q item (``bwd_fp8_wgrad``): column tile c (BN/2 columns; r h's I / (BN/2) tiles, then
    dG/dU's 2I / (BN/2)) of group g in FP8 (``_quant_cols``), once every A item of g is done
    (they wrote r h and dG/dU with plain stores, read here through TMA: the acquire fences
    the async proxy); then fences the async proxy (the C and D items read the copies through
    TMA) and adds 1 to ``qready[g]`` (not for the first Q item, of the largest group, when
    ``withhold`` is 4: a test's way to make the C and D items' bounded wait expire)."""
    HALF: tl.constexpr = BN // 2
    NH: tl.constexpr = I // HALF
    start, end, ok = _group_ready(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC, F32_DOT,
                                  True)
    # ``_quant_cols`` stores its transposed e4m3 bytes one per thread, a warp's 32 along a
    # column's contiguous rows (whole 32-byte sectors). Saying here that start is a multiple
    # of 16 rows makes them 16-byte vectors, but the whole kernel then spilled 380 bytes
    # instead of 296 (sm_90, Kimi shape, Triton 3.9), so it is left unsaid.
    if ok != 0:
        bm = bmax + lr * NBMAX * (3 * I) + c * HALF if QBM else bmax  # r h, then dG/dU
        if c < NH:
            _quant_cols(hs_q_desc, lr * P, hqT, srh + g * I, c * HALF, start, end, src, P,
                        HALF, BKW, POW2, F32_DOT, QBM, bm, BM, 3 * I)
        else:
            _quant_cols(pre_q_desc, lr * P, gqT, srg + g * (2 * I), (c - NH) * HALF, start,
                        end, src, P, HALF, BKW, POW2, F32_DOT, QBM, bm, BM, 3 * I)
        if (withhold != 4) | (g != NG - 1) | (c != 0):
            _pulled_signal(qready + g, ok, F32_DOT)
    return ok


@triton.jit
def _pulled_rows(ok, xgrp, g, start, end, err, budget, BM: tl.constexpr,
                 F32_DOT: tl.constexpr):
    """After ``ok``: wait until every row block of group g (rows start..end) is pulled in
    this launch (``xgrp[g]``, +1 per block, release), then fence the async proxy (plain
    stores, TMA reads); returns the wait's ok."""
    if ok != 0:
        ok = wait_geq(xgrp + g, (end - start) // BM, err, budget, _E_BWD_XPULLED, g)
        if ok != 0:
            _async_proxy_fence(ok, F32_DOT)
    return ok


@triton.jit
def _wgrad_wait(g, gst, total, ctr, err, NBMAX, budget, I: tl.constexpr, BM: tl.constexpr,
                DAC: tl.constexpr, F32_DOT: tl.constexpr, PULL: tl.constexpr,
                FP8W: tl.constexpr, qready, NQ: tl.constexpr):
    """Rows of group g and whether a weight-gradient item may read them: every A item of g
    done (``_group_ready``) or, FP8W, every Q item of g (then the async proxy is fenced)."""
    if FP8W:
        start, end = _group_rows(gst, g, total)
        ok = wait_geq(qready + g, NQ, err, budget, _E_WGRAD_QUANT, g)
        if ok != 0:
            _async_proxy_fence(ok, F32_DOT)
    else:
        start, end, ok = _group_ready(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC,
                                      F32_DOT, PULL)
    return start, end, ok


@triton.jit
def _fp8_wgrad_tile(a_desc, a_row, b_desc, b_row, start, end, HALF: tl.constexpr,
                    BN: tl.constexpr, BKW: tl.constexpr, F32_DOT: tl.constexpr):
    """``FP8W``: the unscaled [HALF, BN] fp32 sum over rows start..end of A^T B, from the
    transposed e4m3 copies (feature rows ``a_row`` .. of ``a_desc``, ``b_row`` .. of
    ``b_desc``; [HALF, BKW] and [BN, BKW] boxes, K-major): a pure FP8 K loop."""
    acc = tl.zeros((HALF, BN), dtype=tl.float32)
    for r0 in range(start, end, BKW):
        a = a_desc.load([a_row, r0])
        b = b_desc.load([b_row, r0])
        acc = _dot8(a, tl.trans(b), acc, F32_DOT)
    return acc


@triton.jit
def _home_tile(src, r0, base, tab, cols, T, S: tl.constexpr, K: tl.constexpr,
               H: tl.constexpr, BKW: tl.constexpr):
    """``bwd_direct_rows``: columns ``cols`` of the BKW schedule rows from r0, gathered from
    their tokens' home ranks (``base`` + ``tab``); padding rows read 0."""
    valid, rank, t, k, routed = _row_meta(src, r0 + tl.arange(0, BKW), T, S, K)
    rows = _home_rows(base, tab, rank, t, valid, H)
    return tl.load(rows[:, None] + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _wgrad_down_item(g, it, jn, lr, gst, total, P, hs_c_desc, dyg_c_desc, ctr, err,
                     dw2, dws2, T, E, NBMAX, budget, H: tl.constexpr, I: tl.constexpr,
                     S: tl.constexpr, K: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BKW: tl.constexpr, DAC: tl.constexpr,
                     F32_DOT: tl.constexpr, PULL: tl.constexpr = False, src=None,
                     dy_base=None, tab16=None, DIRECT: tl.constexpr = False,
                     FP8W: tl.constexpr = False, qready=None, NQ: tl.constexpr = 0,
                     hqT_desc=None, dyqT_desc=None, srh=None, gdyam=None,
                     POW2: tl.constexpr = False, XW: tl.constexpr = False, xgrp=None,
                     DWT: tl.constexpr = 1, DWS: tl.constexpr = 2):
    """C item: dW_down[g][I tile it, H tiles jn * DWT ..] = sum over g's rows of (r h)^T dY;
    waits for every A item of g (they write r h). DWT tiles (``bwd_dw_tiles``) in one
    flattened loop of DWS pipeline stages, so the software pipeline loads a tile's first rows
    during the store of the one before (the K loops are short where experts are small).
    DIRECT: the dY rows
    are gathered from their home ranks instead of read from the pulled rows. FP8W: e4m3
    tiles of the transposed copies (``hqT_desc`` [L*I, P], ``dyqT_desc`` [L*H, P]: K-major,
    a pure FP8 K loop), then the column scales (r h's of group g in ``srh``, dY's from the
    global column max ``gdyam``); waits for g's Q items instead. XW: also for g's pulled
    rows (``_pulled_rows``)."""
    HALF: tl.constexpr = BN // 2
    start, end, ok = _wgrad_wait(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC, F32_DOT,
                                 PULL, FP8W, qready, NQ)
    if XW:
        ok = _pulled_rows(ok, xgrp, g, start, end, err, budget, BM, F32_DOT)
    if ok != 0:
        icols = it * HALF + tl.arange(0, HALF)
        if DWT == 1:  # one tile, no loop; the output rows after the GEMM (fewer live values)
            acc = _wgrad_down_tile(jn, it, icols, g, lr, start, end, P, hs_c_desc, dyg_c_desc,
                                   T, H, I, S, K, BN, BKW, F32_DOT, src, dy_base, tab16,
                                   DIRECT, FP8W, hqT_desc, dyqT_desc, srh, gdyam, POW2)
            out_rows = _dw_rows(dw2, dws2, lr, g, E, icols, I * H, H, HAS_SHARED)
            tl.store(out_rows + (jn * BN + tl.arange(0, BN))[None, :], acc.to(tl.bfloat16))
        else:  # one flattened loop: the next tile's loads overlap a tile's store
            out_rows = _dw_rows(dw2, dws2, lr, g, E, icols, I * H, H, HAS_SHARED)
            for jj in tl.range(0, DWT, flatten=True, num_stages=DWS):
                jt = jn * DWT + jj
                acc = _wgrad_down_tile(jt, it, icols, g, lr, start, end, P, hs_c_desc,
                                       dyg_c_desc, T, H, I, S, K, BN, BKW, F32_DOT, src,
                                       dy_base, tab16, DIRECT, FP8W, hqT_desc, dyqT_desc, srh,
                                       gdyam, POW2)
                tl.store(out_rows + (jt * BN + tl.arange(0, BN))[None, :],
                         acc.to(tl.bfloat16))
    return ok


@triton.jit
def _dw_rows(dw, dws, lr, g, E, rows, SIZE: tl.constexpr, ROW: tl.constexpr,
             HAS_SHARED: tl.constexpr):
    """Pointers to rows ``rows`` ([n, 1], ROW elements each) of group g's weight gradient
    (SIZE elements per expert in ``dw``; the shared expert's, g == E, in ``dws``)."""
    out = dw + (lr * E + g).to(tl.int64) * SIZE
    if HAS_SHARED:
        if g == E:
            out = dws + lr.to(tl.int64) * SIZE
    return out + rows.to(tl.int64)[:, None] * ROW


@triton.jit
def _wgrad_down_tile(jn, it, icols, g, lr, start, end, P, hs_c_desc, dyg_c_desc, T,
                     H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, K: tl.constexpr,
                     BN: tl.constexpr, BKW: tl.constexpr, F32_DOT: tl.constexpr, src, dy_base,
                     tab16, DIRECT: tl.constexpr, FP8W: tl.constexpr, hqT_desc, dyqT_desc, srh,
                     gdyam, POW2: tl.constexpr):
    """dW_down[g][I tile it, H tile jn] as fp32 [BN / 2, BN]: the sum over rows start..end
    of (r h)^T dY (see ``_wgrad_down_item``)."""
    HALF: tl.constexpr = BN // 2
    hcols = jn * BN + tl.arange(0, BN)
    if FP8W:  # (r h)^T and dY^T copies
        acc = _fp8_wgrad_tile(hqT_desc, lr * I + it * HALF, dyqT_desc, lr * H + jn * BN,
                              start, end, HALF, BN, BKW, F32_DOT)
        s_dy = e4m3_scales(tl.load(gdyam + hcols), POW2)[1]
        acc = acc * tl.load(srh + g * I + icols)[:, None] * s_dy[None, :]
    else:
        acc = tl.zeros((HALF, BN), dtype=tl.float32)
        for r0 in range(start, end, BKW):
            h = hs_c_desc.load([lr * P + r0, it * HALF])  # [BKW, HALF]
            if DIRECT:
                dy = _home_tile(src, r0, dy_base, tab16, hcols, T, S, K, H, BKW)
            else:
                dy = dyg_c_desc.load([lr * P + r0, jn * BN])  # [BKW, BN]
            acc = mma(tl.trans(h), dy, acc, F32_DOT)
    return acc


@triton.jit
def _wgrad_gate_up_item(g, it, jn, lr, gst, total, P, pre_d_desc, xg_d_desc, ctr, err,
                        dw1, dws1, T, E, NBMAX, budget, H: tl.constexpr, I: tl.constexpr,
                        S: tl.constexpr, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                        DAC: tl.constexpr, F32_DOT: tl.constexpr, INTERLEAVED: tl.constexpr,
                        PULL: tl.constexpr = False, src=None, x_base=None, x_tab=None,
                        DIRECT: tl.constexpr = False, xgrp=None, XW: tl.constexpr = False,
                        FP8W: tl.constexpr = False, qready=None, NQ: tl.constexpr = 0,
                        xqT_desc=None, gqT_desc=None, srg=None, gxam=None,
                        POW2: tl.constexpr = False, DWT: tl.constexpr = 1,
                        DWS: tl.constexpr = 2):
    """D item: dW_gate_up[g][H tile it, 2I tiles jn * DWT ..] = sum over g's rows of
    x^T [dG dU], DWT tiles in one flattened loop (as the C items). DIRECT: the x rows are
    gathered from the tokens' home ranks instead of the pulled rows.
    XW (``bwd_pull_ahead``, or ``bwd_fused_pull`` with dA items that do not wait for the
    pull): also waits until every row block of g has its rows pulled (``_pulled_rows``).
    FP8W: e4m3 tiles of the transposed copies (``xqT_desc`` [L*H, P], ``gqT_desc``
    [L*2I, P]), then the column scales (x's from the global column max ``gxam``, dG/dU's
    of group g in ``srg``); waits for g's Q items instead."""
    HALF: tl.constexpr = BN // 2
    start, end, ok = _wgrad_wait(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC, F32_DOT,
                                 PULL, FP8W, qready, NQ)
    if XW:
        ok = _pulled_rows(ok, xgrp, g, start, end, err, budget, BM, F32_DOT)
    if ok != 0:
        hcols = it * HALF + tl.arange(0, HALF)
        if DWT == 1:  # one tile, no loop; the output rows after the GEMM (fewer live values)
            acc = _wgrad_gate_up_tile(jn, it, hcols, g, lr, start, end, P, pre_d_desc,
                                      xg_d_desc, T, H, I, S, K, BN, BKW, F32_DOT, src, x_base,
                                      x_tab, DIRECT, FP8W, xqT_desc, gqT_desc, srg, gxam, POW2)
            out_rows = _dw_rows(dw1, dws1, lr, g, E, hcols, H * 2 * I, 2 * I, HAS_SHARED)
            _store_dw_gate_up(out_rows, acc, jn, I, BN, INTERLEAVED)
        else:  # one flattened loop: the next tile's loads overlap a tile's store
            out_rows = _dw_rows(dw1, dws1, lr, g, E, hcols, H * 2 * I, 2 * I, HAS_SHARED)
            for jj in tl.range(0, DWT, flatten=True, num_stages=DWS):
                jt = jn * DWT + jj
                acc = _wgrad_gate_up_tile(jt, it, hcols, g, lr, start, end, P, pre_d_desc,
                                          xg_d_desc, T, H, I, S, K, BN, BKW, F32_DOT, src,
                                          x_base, x_tab, DIRECT, FP8W, xqT_desc, gqT_desc, srg,
                                          gxam, POW2)
                _store_dw_gate_up(out_rows, acc, jt, I, BN, INTERLEAVED)
    return ok


@triton.jit
def _wgrad_gate_up_tile(jn, it, hcols, g, lr, start, end, P, pre_d_desc, xg_d_desc, T,
                        H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, K: tl.constexpr,
                        BN: tl.constexpr, BKW: tl.constexpr, F32_DOT: tl.constexpr, src,
                        x_base, x_tab, DIRECT: tl.constexpr, FP8W: tl.constexpr, xqT_desc,
                        gqT_desc, srg, gxam, POW2: tl.constexpr):
    """dW_gate_up[g][H tile it, 2I tile jn] as fp32 [BN / 2, BN]: the sum over rows
    start..end of x^T [dG dU] (see ``_wgrad_gate_up_item``)."""
    HALF: tl.constexpr = BN // 2
    fcols = jn * BN + tl.arange(0, BN)
    if FP8W:  # x^T and [dG dU]^T copies
        acc = _fp8_wgrad_tile(xqT_desc, lr * H + it * HALF, gqT_desc,
                              lr * (2 * I) + jn * BN, start, end, HALF, BN, BKW, F32_DOT)
        s_x = e4m3_scales(tl.load(gxam + hcols), POW2)[1]
        acc = acc * s_x[:, None] * tl.load(srg + g * (2 * I) + fcols)[None, :]
    else:
        acc = tl.zeros((HALF, BN), dtype=tl.float32)
        for r0 in range(start, end, BKW):
            if DIRECT:
                x = _home_tile(src, r0, x_base, x_tab, hcols, T, S, K, H, BKW)
            else:
                x = xg_d_desc.load([lr * P + r0, it * HALF])  # pulled x rows [BKW, HALF]
            dgu = pre_d_desc.load([lr * P + r0, jn * BN])  # [BKW, BN]
            acc = mma(tl.trans(x), dgu, acc, F32_DOT)
    return acc


@triton.jit
def _store_dw_gate_up(out_rows, acc, jn, I: tl.constexpr, BN: tl.constexpr,
                      INTERLEAVED: tl.constexpr):
    """Store a [BN / 2, BN] dW_gate_up tile of 2I tile jn as bf16 at the rows ``out_rows``;
    INTERLEAVED: its columns alternate gate c, up c, stored back in the canonical layout."""
    HALF: tl.constexpr = BN // 2
    if INTERLEAVED:
        dg, du = tl.split(tl.reshape(acc, (HALF, HALF, 2)))
        c = jn * HALF + tl.arange(0, HALF)
        tl.store(out_rows + c[None, :], dg.to(tl.bfloat16))
        tl.store(out_rows + (I + c)[None, :], du.to(tl.bfloat16))
    else:
        tl.store(out_rows + (jn * BN + tl.arange(0, BN))[None, :], acc.to(tl.bfloat16))


@triton.jit
def _banded(i, nb, NB: tl.constexpr, G: tl.constexpr):
    """(row block, tile) of item i of a section over nb row blocks of NB tiles each, in
    bands of G row blocks (the last band holds what is left): inside a band the tiles run
    outer and the band's row blocks inner (``bwd_dx_band``)."""
    band = i // (G * NB)
    rows = tl.minimum(G, nb - band * G)
    w = i - band * (G * NB)
    return band * G + w % rows, w // rows


@triton.jit
def mok_backward_kernel(
        p_base, drp_base, tab32,  # router weights, router-gradient partials; [R] fp32 offsets
        comb_base, comb_tab,  # dX slots [T, S, H] per rank (peer memory)
        src_ptr, group_ptr, total_ptr, gstart_ptr,  # schedule; gstart [L, G+1] int32
        pre_ptr, hs_ptr,  # saved [L, P, 2I] (overwritten with dG, dU); r*h scratch [L, P, I]
        ctr_ptr, err_ptr,  # [L, NCTR] int32 counters, [L, 4] int32 error words
        dw1_ptr, dw2_ptr, dws1_ptr, dws2_ptr,  # [L*E, H, 2I], [L*E, I, H], [L, H, 2I], [L, I, H]
        w1_desc, w2_desc, ws1_desc, ws2_desc,  # weight descriptors ([BN, BK] / [BN/2, BK])
        pre_a_desc, hs_c_desc, pre_d_desc, pre_b_desc,  # activation descriptors (see host)
        dyg_a_desc, dyg_c_desc, xg_d_desc,  # pulled dY and x rows [L*P, H] (see host)
        x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr,  # PULL / DIRECT: the rows' sources
        T, E, NG, P, NCTR, budget, withhold,
        H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, K: tl.constexpr,
        PROGS: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, BKW: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr,
        INTERLEAVED: tl.constexpr, PHASES: tl.constexpr, PULL: tl.constexpr,
        BR: tl.constexpr, CH: tl.constexpr, PULLERS: tl.constexpr = 0,
        DIRECT: tl.constexpr = False, DXT: tl.constexpr = 1, DAT: tl.constexpr = 1,
        DXTMA: tl.constexpr = False, PA: tl.constexpr = 0, FENCE: tl.constexpr = False,
        FP8DA: tl.constexpr = False, dyq_base=None, w2q_desc=None, ws2q_desc=None,
        sw2q_ptr=None, sws2q_ptr=None, FP8DX: tl.constexpr = False, gq_ptr=None,
        w1q_desc=None, ws1q_desc=None, sw1q_ptr=None, sws1q_ptr=None, GQW: tl.constexpr = 0,
        RQC: tl.constexpr = 128, POW2: tl.constexpr = False, FP8W: tl.constexpr = False,
        hqT_ptr=None, gqT_ptr=None, srh_ptr=None, srg_ptr=None,
        hqT_desc=None, dyqT_desc=None, xqT_desc=None, gqT_desc=None, gxam_ptr=None,
        gdyam_ptr=None, BK8: tl.constexpr = 64, BKW8: tl.constexpr = 64, pre_q_desc=None,
        xqT_ptr=None, dyqT_ptr=None, PULLG: tl.constexpr = False, PBR: tl.constexpr = 16,
        PCH: tl.constexpr = 128, bmax_ptr=None, QBM: tl.constexpr = False,
        DIRA: tl.constexpr = False, XWD: tl.constexpr = False, RQT: tl.constexpr = False,
        hs_a_desc=None, trace_ptr=None, MAXT=0, TRACE: tl.constexpr = False,
        PFT: tl.constexpr = False, QI: tl.constexpr = False, DXBAND: tl.constexpr = 0,
        CHM: tl.constexpr = False, DWT: tl.constexpr = 1, DWSC: tl.constexpr = 2,
        DWSD: tl.constexpr = 2, dyqr_ptr=None, DAQR: tl.constexpr = False):
    """One persistent program per SM; see the module docstring for the work order. FENCE:
    rows pulled in this launch (PULL or PA): the C and D items fence the async proxy after
    their group's acquire. FP8DA (``bwd_fp8_da``): the A items' FP8 tiles read dY as FP8
    rows at its home ranks (``dyq_base``, same rank offsets ``tab16`` as dY; DAQR,
    ``bwd_fp8_da_rows``: copied to contiguous rows ``dyqr_ptr`` before the launch and read
    through ``dyg_a_desc`` as TMA tiles) and W_down's
    e4m3 rows (``w2q_desc`` / ``ws2q_desc``) with their fp32 scales (``sw2q_ptr`` /
    ``sws2q_ptr``). FP8DX (``bwd_fp8_dx``): the B items' FP8 tiles on the FP8 dG/dU rows
    (``gq_ptr`` [L, P, GQW], quantised by the A item that completes a row block, RQC columns
    at a time) and W_gate_up's e4m3 rows (``w1q_desc`` / ``ws1q_desc``, scales ``sw1q_ptr`` /
    ``sws1q_ptr``). FP8W (``bwd_fp8_wgrad``): Q items after the B items quantise r h and
    dG/dU per group and column into transposed copies (``hqT_ptr`` [L, I, P], ``gqT_ptr``
    [L, 2I, P], scales ``srh_ptr`` [L, NG, I], ``srg_ptr`` [L, NG, 2I]; r h read through
    ``hs_c_desc``, dG/dU through ``pre_q_desc``);
    the C and D items run FP8 tiles on those and on the pulled copies of dY and x
    (``dyqT_desc``, ``xqT_desc``, scaled by the global column maxima ``gdyam_ptr`` /
    ``gxam_ptr`` [H]). XWD: the D items wait for their group's pulled rows (PA or PULLG).
    DIRA: the dA items gather dY's rows at home (``bwd_direct_rows`` or
    ``bwd_direct_da``). PULLG (``bwd_fused_pull`` with ``bwd_fp8_da`` or ``bwd_direct_da``):
    the dA items read dY at home and do not wait for the pull items; each pull item adds 1
    to its group's count and the C and D items wait for their group's row blocks instead;
    with FP8W the pull items write the FP8 transposed copies of x and dY (``xqT_ptr``,
    ``dyqT_ptr`` [L, H, P]; PBR rows by PCH columns at a time), as the separate pull kernel
    does. RQT (``bwd_fp8_requant_tma``): the block-completing A item's requantisation of the
    dG/dU rows reads them as pipelined TMA copies (with QBM r h's too, ``hs_a_desc``).
    PFT (``bwd_prefetch_ticket``): the next ticket is claimed when an item starts, so the
    atomic's round trip overlaps the item (deadlock free as the forward's PREFETCH: the
    smallest unfinished ticket is never one only claimed, since its holder is then running
    a smaller unfinished one). QI (``bwd_q_interleave``, FP8W without PA): the B and Q
    sections are one, the Q items spread evenly among the B items (in ascending group
    order, the order the A items finish in), so the memory-bound Q items run beside
    the B items' GEMMs instead of in a section of their own; Q still waits only on A.
    DXBAND (``bwd_dx_band``) > 1: the B items in bands of DXBAND row blocks, H tiles outer
    (``_banded``); CHM (``bwd_dw_down_h_major``): a group's C items H tile outer, I tile
    inner. Both only reorder items of one section, whose waits all point at earlier ones.
    DWT (``bwd_dw_tiles``): each C and D item covers DWT adjacent H (C) or 2I (D) tiles, in
    flattened loops of DWSC and DWSD pipeline stages (``bwd_dw_stages``).
    TRACE (profiling only): every item of the main ticket order writes (start, end) in
    global-timer nanoseconds, its program within the logical rank and its kind (0 A, 1 B,
    2 Q, 3 C, 4 D; pull items of PA count with the section they sit in) to ``trace_ptr``
    [L, MAXT, 4] int64 at its ticket; the start is taken after the ticket is claimed, so a
    wait inside an item counts as the item's time."""
    HALF: tl.constexpr = BN // 2
    BKA: tl.constexpr = BK8 if FP8DA else BK  # reduction steps of the A, B, C and D items:
    BKX: tl.constexpr = BK8 if FP8DX else BK  # ``bwd_fp8_block_k`` (BK8, BKW8) for the FP8
    BKWF: tl.constexpr = BKW8 if FP8W else BKW  # ones
    NQ: tl.constexpr = 3 * I // HALF if FP8W else 0  # Q items per group
    NA: tl.constexpr = I // (DAC * DAT)  # A items per row block
    NB: tl.constexpr = H // (BN * DXT)  # B items per row block
    NCJ: tl.constexpr = H // (BN * DWT)  # H tile groups of a C item's I tile
    NDJ: tl.constexpr = 2 * I // (BN * DWT)  # 2I tile groups of a D item's H tile
    NC: tl.constexpr = (I // HALF) * NCJ  # C items per group
    ND: tl.constexpr = (H // HALF) * NDJ  # D items per group
    pid = tl.program_id(0)
    lr = pid // PROGS
    ctr = ctr_ptr + lr * NCTR
    err = err_ptr + lr * 4
    src = src_ptr + lr.to(tl.int64) * P
    grp = group_ptr + lr * (P // BM)
    total = tl.load(total_ptr + lr)
    gst = gstart_ptr + lr * (NG + 1)
    pre = pre_ptr + lr.to(tl.int64) * P * (2 * I)
    hs = hs_ptr + lr.to(tl.int64) * P * I
    gq = gq_ptr + lr.to(tl.int64) * P * GQW if FP8DX else gq_ptr
    NBMAX = P // BM
    hqT = hqT_ptr + lr.to(tl.int64) * I * P if FP8W else hqT_ptr
    gqT = gqT_ptr + lr.to(tl.int64) * (2 * I) * P if FP8W else gqT_ptr
    srh = srh_ptr + lr * NG * I if FP8W else srh_ptr
    srg = srg_ptr + lr * NG * (2 * I) if FP8W else srg_ptr
    qready = ctr + 1 + NBMAX + NG  # FP8W: [NG] Q items done per group, after PULLG's counters
    if PULLG:
        qready = qready + NBMAX + 1 + NG
    nb = total // BM
    if PA > 0:  # a dY pull item (block s) then the A items of block s - PA, per slot s
        end_a = (nb + PA) * (NA + 1)
        end_b = end_a + nb * (NB + 1)  # the B items of a block, then its x pull item
    else:
        end_a = nb * NA
        end_b = end_a + nb * NB
    pulled = ctr + 1 + NBMAX + NG  # PULL, PA: [NBMAX] flags, a pull ticket, PA: [NG] counts
    xgrp = pulled + NBMAX + 1
    end_q = end_b + NG * NQ
    end_c = end_q + NG * NC
    n_items = end_c + NG * ND
    n_q = NG * NQ  # QI: the B and Q sections merged, n_bq items
    n_bq = tl.maximum(end_q - end_a, 1)
    ok = no_error(err)
    if PULL:  # pull items first (the first PULLERS programs), from their own ticket counter
        # they wait on nothing, so the programs that skip them to wait on row blocks
        # cannot deadlock
        if (pid - lr * PROGS) < PULLERS:
            pt = tl.atomic_add(pulled + NBMAX, 1, sem="relaxed", scope="gpu")
            while pt < nb:
                if FP8W:  # the FP8 transposed copies of x and dY (PULLG: no bf16 rows)
                    for r0 in range(0, BM, PBR):
                        _pull_fp8t_rows(pt * BM + r0 + tl.arange(0, PBR), lr, src_ptr, x_base,
                                        x_tab, dy_base, tab16, dyg_ptr, xqT_ptr, dyqT_ptr,
                                        gxam_ptr, gdyam_ptr, T, P, H, S, PCH, False, POW2,
                                        F32_DOT)
                else:
                    _pull_block(pt, lr, src, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr,
                                T, P, H, S, BM, BR, CH)
                pt = _async_proxy_fence(pt, F32_DOT)  # before the release: TMA readers follow
                tl.debug_barrier()
                if PULLG:  # counted per group: the C and D items wait for their group's
                    # (withhold 5: not for block 0, so a test sees their bounded wait expire)
                    if (withhold != 5) | (pt != 0):
                        tl.atomic_add(xgrp + tl.load(grp + pt), 1, sem="release", scope="gpu")
                else:
                    tl.atomic_add(pulled + pt, 1, sem="release", scope="gpu")
                pt = tl.atomic_add(pulled + NBMAX, 1, sem="relaxed", scope="gpu")
    tk = tl.atomic_add(ctr, 1, sem="relaxed", scope="gpu")
    while (tk < n_items) & (ok != 0):
        if TRACE:
            t0 = globaltimer(tk, F32_DOT)
        if PFT:  # the next ticket's round trip to L2 overlaps this item
            tk_next = tl.atomic_add(ctr, 1, sem="relaxed", scope="gpu")
        vt = tk  # the item this ticket stands for (QI: B and Q items interleaved)
        if QI:  # position i of the merged section holds a Q item where the count of Q
            # items before it, floor(i * n_q / n_bq), steps up: the Q items spread evenly
            if (tk >= end_a) & (tk < end_q):
                i = (tk - end_a).to(tl.int64)
                q_before = (i * n_q // n_bq).to(tl.int32)
                if ((i + 1) * n_q // n_bq).to(tl.int32) > q_before:
                    vt = end_b + q_before  # Q item q_before
                else:
                    vt = tk - q_before  # B item i - q_before
        if vt < end_a:
            if PA > 0:
                slot = vt // (NA + 1)
                j = vt % (NA + 1)
                if j == 0:  # pull item: block slot's dY rows (needed by its A items)
                    if slot < nb:
                        _pull_block(slot, lr, src, x_base, x_tab, dy_base, tab16, xg_ptr,
                                    dyg_ptr, T, P, H, S, BM, BR, CH, 2)
                        _pulled_signal(pulled + slot, slot, F32_DOT)
                elif PHASES & 1:
                    b = slot - PA
                    if b >= 0:
                        ok = wait_geq(pulled + b, 1, err, budget, _E_BWD_PULLED, b)
                        if ok != 0:
                            _async_proxy_fence(ok, F32_DOT)
                            _dgrad_down_item(b, j - 1, lr, src, grp, P, pre, hs, ctr,
                                             dyg_a_desc, p_base, drp_base, tab32, w2_desc,
                                             ws2_desc, pre_a_desc, T, E, NBMAX, withhold, H,
                                             I, S, K, HAS_SHARED, BM, BN, BKA, DAC, F32_DOT,
                                             INTERLEAVED, dy_base, tab16, DIRA, DAT, FP8DA,
                                             dyq_base, w2q_desc, ws2q_desc, sw2q_ptr,
                                             sws2q_ptr, FP8DX, gq, GQW, RQC, POW2, QBM,
                                             bmax_ptr, RQT, hs_a_desc, DAQR, dyqr_ptr)
            elif PHASES & 1:
                b = vt // NA
                if PULL:  # its rows pulled by an item of this launch (plain stores; TMA here)
                    if PULLG:  # dY's rows read at home: nothing to wait for
                        pass
                    else:
                        ok = wait_geq(ctr + 1 + NBMAX + NG + b, 1, err, budget, _E_BWD_PULLED,
                                      b)
                        if ok != 0:
                            _async_proxy_fence(ok, F32_DOT)
                if ok != 0:
                    _dgrad_down_item(b, vt % NA, lr, src, grp, P, pre, hs, ctr, dyg_a_desc,
                                     p_base, drp_base, tab32, w2_desc, ws2_desc, pre_a_desc, T,
                                     E, NBMAX, withhold, H, I, S, K, HAS_SHARED, BM, BN, BKA,
                                     DAC, F32_DOT, INTERLEAVED, dy_base, tab16, DIRA, DAT,
                                     FP8DA, dyq_base, w2q_desc, ws2q_desc, sw2q_ptr,
                                     sws2q_ptr, FP8DX, gq, GQW, RQC, POW2, QBM, bmax_ptr,
                                     RQT, hs_a_desc, DAQR, dyqr_ptr)
        elif vt < end_b:
            i = vt - end_a
            if PA > 0:
                b = i // (NB + 1)
                j = i % (NB + 1)
                if j == NB:  # pull item: block b's x rows (read by the D items only)
                    _pull_block(b, lr, src, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr,
                                T, P, H, S, BM, BR, CH, 1)
                    _pulled_signal(xgrp + tl.load(grp + b), b, F32_DOT)
                elif PHASES & 2:
                    ok = _dgrad_gate_up_item(b, j, lr, src, grp, pre, ctr, err, comb_base,
                                             comb_tab, w1_desc, ws1_desc, T, E, budget, H, I,
                                             S, HAS_SHARED, BM, BN, BKX, DAC, F32_DOT, DXT,
                                             pre_b_desc, P, DXTMA,
                                             FP8DX, gq, GQW, w1q_desc, ws1q_desc, sw1q_ptr,
                                             sws1q_ptr)
            elif PHASES & 2:
                bx = i // NB
                jx = i % NB
                if DXBAND > 1:
                    bx, jx = _banded(i, nb, NB, DXBAND)
                ok = _dgrad_gate_up_item(bx, jx, lr, src, grp, pre, ctr, err,
                                         comb_base, comb_tab, w1_desc, ws1_desc, T, E, budget,
                                         H, I, S, HAS_SHARED, BM, BN, BKX, DAC, F32_DOT, DXT,
                                         pre_b_desc, P, DXTMA,
                                         FP8DX, gq, GQW, w1q_desc, ws1q_desc, sw1q_ptr,
                                         sws1q_ptr)
        elif vt < end_q:
            if FP8W:  # Q items (none otherwise), largest group first (QI: ascending)
                if PHASES & 12:
                    i = vt - end_b
                    gq_i = i // NQ if QI else NG - 1 - i // NQ  # QI: ascending groups
                    ok = _wgrad_quant_item(gq_i, i % NQ, lr, gst, total, src, P,
                                           hs_c_desc, pre_q_desc, hqT, gqT, srh, srg, ctr,
                                           err, qready, NBMAX, budget, withhold, NG, I, BM,
                                           BN, BKW, DAC, F32_DOT, POW2, QBM, bmax_ptr)
        elif vt < end_c:
            if PHASES & 4:
                i = vt - end_q
                g = NG - 1 - i // NC
                c = i % NC
                ic = c // NCJ  # I tile, then H tile (group)
                jc = c % NCJ
                if CHM:  # H tile outer, I tile inner
                    ic = c % (I // HALF)
                    jc = c // (I // HALF)
                ok = _wgrad_down_item(g, ic, jc, lr, gst, total, P,
                                      hs_c_desc, dyg_c_desc, ctr, err, dw2_ptr, dws2_ptr, T,
                                      E, NBMAX, budget, H, I, S, K, HAS_SHARED, BM, BN, BKWF,
                                      DAC, F32_DOT, FENCE, src, dy_base, tab16, DIRECT,
                                      FP8W, qready, NQ, hqT_desc, dyqT_desc, srh, gdyam_ptr,
                                      POW2, PULLG, xgrp, DWT, DWSC)
        else:
            if PHASES & 8:
                i = vt - end_c
                g = NG - 1 - i // ND
                d = i % ND
                ok = _wgrad_gate_up_item(g, d // NDJ, d % NDJ, lr, gst,
                                         total, P, pre_d_desc, xg_d_desc, ctr, err, dw1_ptr,
                                         dws1_ptr, T, E, NBMAX, budget, H, I, S, K, HAS_SHARED,
                                         BM, BN, BKWF, DAC, F32_DOT, INTERLEAVED, FENCE, src,
                                         x_base, x_tab, DIRECT, xgrp, XWD, FP8W, qready,
                                         NQ, xqT_desc, gqT_desc, srg, gxam_ptr, POW2, DWT,
                                         DWSD)
        if TRACE:
            kind = tl.where(vt < end_a, 0, tl.where(vt < end_b, 1, tl.where(
                vt < end_q, 2, tl.where(vt < end_c, 3, 4))))
            record_item(trace_ptr + lr.to(tl.int64) * MAXT * 4, tk, MAXT, t0,
                        globaltimer(tk, F32_DOT), pid - lr * PROGS, kind)
        if PFT:
            tk = tk_next
        else:
            tk = tl.atomic_add(ctr, 1, sem="relaxed", scope="gpu")


@triton.jit
def pull_rows_kernel(src_ptr, total_ptr, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr, T, P,
                     H: tl.constexpr, S: tl.constexpr, BR: tl.constexpr, CH: tl.constexpr,
                     first_ptr=None, PHASE: tl.constexpr = 0, WHICH: tl.constexpr = 0):
    """Reverse-combine pull: the x and dY rows of BR schedule rows, from the tokens' home
    ranks (peer memory), into contiguous [L, P, H] buffers (zeros for padding rows), so every
    backward GEMM reads its row operands as plain tiles. Program (l, i) does rows i*BR.. of
    logical rank l; rows past the rank's total are left alone. PHASE 1 and 2
    (``bwd_pull_dedup``, two launches; ``first_ptr`` the schedule's first_LP): a token's
    first row on this rank from home, then its other rows from that row (``_row_sources``).
    WHICH (PHASE 0, as ``_pull_rows``): 2 copies the dY rows only (``bwd_fp8_da_rows``: the
    FP8 dY rows, kept in the bytes of bf16 rows, into ``dyg_ptr``)."""
    lr = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    total = tl.load(total_ptr + lr)
    if tl.program_id(1) * BR < total:
        if PHASE == 0:
            _pull_rows(rows, lr, src_ptr + lr.to(tl.int64) * P, x_base, x_tab, dy_base, tab16,
                       xg_ptr, dyg_ptr, T, P, H, S, CH, WHICH)
        else:
            x_rows, dy_rows, ld, wr = _row_sources(
                rows, lr, src_ptr + lr.to(tl.int64) * P, first_ptr + lr.to(tl.int64) * P,
                x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr, T, P, H, S, PHASE)
            out = (lr.to(tl.int64) * P + rows) * H
            for h0 in range(0, H, CH):
                cols = h0 + tl.arange(0, CH)
                cm = cols < H
                m = ld[:, None] & cm[None, :]
                mw = wr[:, None] & cm[None, :]
                v = tl.load(x_rows[:, None] + cols[None, :], mask=m, other=0.0)
                tl.store(xg_ptr + out[:, None] + cols[None, :], v, mask=mw)
                v = tl.load(dy_rows[:, None] + cols[None, :], mask=m, other=0.0)
                tl.store(dyg_ptr + out[:, None] + cols[None, :], v, mask=mw)


@triton.jit
def pull_rows_by_token_kernel(slot_rows_ptr, total_ptr, x_base, x_tab, dy_base, tab16, xg_ptr,
                              dyg_ptr, N, T, P, H: tl.constexpr, S: tl.constexpr,
                              BT: tl.constexpr, CH: tl.constexpr):
    """``bwd_pull_by_token``: the reverse-combine pull token by token. Program (l, i) reads
    the x and dY rows of the group's tokens i*BT.. once each from their home ranks and writes
    them to the rows of logical rank l's schedule that serve their S slots (``slot_rows_ptr``
    [L, N*S]; P where rank l does not serve a slot, and rows at or past the rank's total are
    left alone). In schedule order, as ``pull_rows_kernel`` goes, a token's K slots sit in K
    experts' row ranges, so its rows were read K times from HBM; here once, and then from
    L2. Padding rows: ``zero_padding_rows_kernel``. The same bytes land in the same rows as
    with ``pull_rows_kernel``."""
    lr = tl.program_id(0)
    n = tl.program_id(1) * BT + tl.arange(0, BT)
    live = n < N
    total = tl.load(total_ptr + lr)
    tok = tl.where(live, n, 0).to(tl.int64)
    rank, t = tok // T, tok % T
    slots = slot_rows_ptr + lr.to(tl.int64) * N * S + tok * S
    served = tl.zeros((BT,), dtype=tl.int1)
    for k in tl.static_range(S):
        served = served | (live & (tl.load(slots + k, mask=live, other=P) < total))
    # rows start 16-byte aligned: 16-byte vector loads (see _row_sources)
    x_rows = x_base + tl.multiple_of(tl.load(x_tab + rank, mask=served, other=0) + t * H, 8)
    dy_rows = dy_base + tl.multiple_of(tl.load(tab16 + rank, mask=served, other=0) + t * H, 8)
    out = xg_ptr + lr.to(tl.int64) * P * H
    dout = dyg_ptr + lr.to(tl.int64) * P * H
    for h0 in range(0, H, CH):
        cols = h0 + tl.arange(0, CH)
        cm = cols < H
        m = served[:, None] & cm[None, :]
        xv = tl.load(x_rows[:, None] + cols[None, :], mask=m, other=0.0)
        dv = tl.load(dy_rows[:, None] + cols[None, :], mask=m, other=0.0)
        for k in tl.static_range(S):
            r = tl.load(slots + k, mask=live, other=P)
            ok = live & (r < total)
            at = tl.multiple_of(tl.where(ok, r, 0).to(tl.int64) * H, 8)
            w = ok[:, None] & cm[None, :]
            tl.store(out + at[:, None] + cols[None, :], xv, mask=w)
            tl.store(dout + at[:, None] + cols[None, :], dv, mask=w)


@triton.jit
def zero_padding_rows_kernel(src_ptr, total_ptr, xg_ptr, dyg_ptr, P, H: tl.constexpr,
                             BR: tl.constexpr, CH: tl.constexpr):
    """Zeros in the pulled x and dY rows of the padding rows (src -1) below each logical
    rank's total, as ``pull_rows_kernel`` writes them (``pull_rows_by_token_kernel`` writes
    only rows that serve a slot). Program (l, i): rows i*BR.. of logical rank l."""
    lr = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    total = tl.load(total_ptr + lr)
    if tl.program_id(1) * BR < total:
        pad = tl.load(src_ptr + lr.to(tl.int64) * P + rows) < 0
        if tl.sum(pad.to(tl.int32), axis=0) > 0:
            out = (lr.to(tl.int64) * P + rows) * H
            zero = tl.zeros((BR, CH), dtype=xg_ptr.dtype.element_ty)
            for h0 in range(0, H, CH):
                cols = h0 + tl.arange(0, CH)
                w = pad[:, None] & (cols < H)[None, :]
                tl.store(xg_ptr + out[:, None] + cols[None, :], zero, mask=w)
                tl.store(dyg_ptr + out[:, None] + cols[None, :], zero, mask=w)


@triton.jit
def global_col_amax_kernel(xam_base, dyam_base, tab32, R, gxam_ptr, gdyam_ptr, H: tl.constexpr,
                           CH: tl.constexpr):
    """``bwd_fp8_wgrad``: the column max |v| of x and of dY over every rank's tokens [H] (the
    max of each rank's own, read at ``base + tab32[r]``, peer memory in EP), so every rank
    quantises the rows it pulls with the same per-column scales; a NaN column max stays NaN
    (its scales turn NaN, so a NaN input shows in the weight gradients)."""
    cols = tl.program_id(0) * CH + tl.arange(0, CH)
    cm = cols < H
    ax = tl.zeros((CH,), dtype=tl.float32)
    ad = tl.zeros((CH,), dtype=tl.float32)
    for r in range(R):
        off = tl.load(tab32 + r)
        ax = tl.maximum(ax, tl.load(xam_base + off + cols, mask=cm, other=0.0),
                        propagate_nan=tl.PropagateNan.ALL)
        ad = tl.maximum(ad, tl.load(dyam_base + off + cols, mask=cm, other=0.0),
                        propagate_nan=tl.PropagateNan.ALL)
    tl.store(gxam_ptr + cols, ax, mask=cm)
    tl.store(gdyam_ptr + cols, ad, mask=cm)


@triton.jit
def pull_rows_fp8t_kernel(src_ptr, total_ptr, x_base, x_tab, dy_base, tab16, dyg_ptr,
                          xqT_ptr, dyqT_ptr, gxam_ptr, gdyam_ptr, T, P, H: tl.constexpr,
                          S: tl.constexpr, BR: tl.constexpr, CH: tl.constexpr,
                          DY16: tl.constexpr, POW2: tl.constexpr, SOFT_CAST: tl.constexpr,
                          first_ptr=None, xg_ptr=None, PHASE: tl.constexpr = 0):
    """``bwd_fp8_wgrad``'s reverse-combine pull: the x and dY rows of BR schedule rows from
    the tokens' home ranks, written as e4m3 transposed copies [L, H, P] (feature-major, the
    rows contiguous: the K-major operands of the FP8 weight-gradient tiles), each column
    scaled by its global column max (``global_col_amax_kernel``); DY16 also the bf16 dY rows
    [L, P, H] (for bf16 dA items). No bf16 x rows: only the weight gradient read them.
    Padding rows write 0. PHASE 1 and 2 (``bwd_pull_dedup``, two launches, ``first_ptr``
    the schedule's first_LP): a token's first row on this rank from home (its bf16 x and dY
    rows also into ``xg_ptr`` / ``dyg_ptr``, DY16 then set), then its other rows from those
    (``_row_sources``)."""
    lr = tl.program_id(0)
    r0 = tl.program_id(1) * BR
    total = tl.load(total_ptr + lr)
    if r0 < total:
        _pull_fp8t_rows(r0 + tl.arange(0, BR), lr, src_ptr, x_base, x_tab, dy_base, tab16,
                        dyg_ptr, xqT_ptr, dyqT_ptr, gxam_ptr, gdyam_ptr, T, P, H, S, CH, DY16,
                        POW2, SOFT_CAST, first_ptr, xg_ptr, PHASE)


@triton.jit
def _pull_fp8t_rows(rows, lr, src_ptr, x_base, x_tab, dy_base, tab16, dyg_ptr, xqT_ptr,
                    dyqT_ptr, gxam_ptr, gdyam_ptr, T, P, H: tl.constexpr, S: tl.constexpr,
                    CH: tl.constexpr, DY16: tl.constexpr, POW2: tl.constexpr,
                    SOFT_CAST: tl.constexpr, first_ptr=None, xg_ptr=None,
                    PHASE: tl.constexpr = 0):
    """The body of ``pull_rows_fp8t_kernel`` for schedule rows ``rows`` of logical rank lr
    (below its total); also the in-kernel pull items' (``bwd_fused_pull`` with FP8 weight
    gradients, PHASE 0)."""
    x_rows, dy_rows, ld, wr = _row_sources(
        rows, lr, src_ptr + lr.to(tl.int64) * P,
        first_ptr + lr.to(tl.int64) * P if PHASE > 0 else first_ptr, x_base, x_tab,
        dy_base, tab16, xg_ptr, dyg_ptr, T, P, H, S, PHASE)
    if PHASE == 2:  # every valid row from its first row's copy (its own for a first)
        ld = tl.load(src_ptr + lr.to(tl.int64) * P + rows) >= 0
    xq = xqT_ptr + lr.to(tl.int64) * H * P
    dyq = dyqT_ptr + lr.to(tl.int64) * H * P
    out16 = (lr.to(tl.int64) * P + rows) * H
    for h0 in range(0, H, CH):
        cols = h0 + tl.arange(0, CH)
        cm = cols < H
        m = ld[:, None] & cm[None, :]
        mw = wr[:, None] & cm[None, :]
        # The transposed stores are masked by column only (a row mask along their
        # contiguous dimension made them byte stores): PHASE 0 and 2 write every row
        # (padding rows 0), PHASE 1 none (it writes the bf16 copies that PHASE 2 reads).
        tcols = cols.to(tl.int64)[None, :] * P + rows[:, None]
        v = tl.load(x_rows[:, None] + cols[None, :], mask=m, other=0.0)
        if PHASE == 1:  # the second pass's source
            tl.store(xg_ptr + out16[:, None] + cols[None, :], v, mask=mw)
        else:
            inv = e4m3_scales(tl.load(gxam_ptr + cols, mask=cm, other=0.0), POW2)[0]
            tl.store(xq + tcols, to_e4m3(to_f32(v, SOFT_CAST) * inv[None, :], SOFT_CAST),
                     mask=cm[None, :])
        v = tl.load(dy_rows[:, None] + cols[None, :], mask=m, other=0.0)
        if DY16:
            tl.store(dyg_ptr + out16[:, None] + cols[None, :], v, mask=mw)
        if PHASE != 1:
            inv = e4m3_scales(tl.load(gdyam_ptr + cols, mask=cm, other=0.0), POW2)[0]
            tl.store(dyq + tcols, to_e4m3(to_f32(v, SOFT_CAST) * inv[None, :], SOFT_CAST),
                     mask=cm[None, :])
