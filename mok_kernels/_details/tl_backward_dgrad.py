"""The backward megakernel's dgrad items (see tl_backward's module docstring): A (dA = dY @
W_down^T, its SwiGLU-backward epilogue, the router-weight partials; FP8 tiles and the dG/dU
rows' requantisation) and B (dX = [dG dU] @ W_gate_up^T, pushed to the home rank's slot)."""

from __future__ import annotations

import triton
import triton.language as tl

from mok_kernels._details import errors
from mok_kernels._details.tl_gemm import held_with, mma, sigmoid
from mok_kernels._details.tl_gemm_fp8 import fp8_row_views, fp8_tile
from mok_kernels._details.tl_mega import _slot_rows, _weight_desc
from mok_kernels._details.tl_quant import e4m3_scales, finite_amax, to_e4m3, to_f32
from mok_kernels._details.tl_sync import async_proxy_fence, wait_geq

# The error codes of errors.py, as constexprs for the kernel.
_E_DGRAD_ROWBLOCK: tl.constexpr = tl.constexpr(errors.ERR_WAIT_DGRAD_ROWBLOCK)


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
    rows point at row 0 of this rank and are masked by the caller (``bwd_fp8_da``)."""
    return base + tl.multiple_of(tl.load(tab + rank, mask=valid, other=0), 8) + t * H


@triton.jit
def _swiglu_bwd_half(da_raw, c0, prow, pre_desc, pre_rows, hs_rows, r, I: tl.constexpr,
                     BM: tl.constexpr, Q: tl.constexpr, INTERLEAVED: tl.constexpr,
                     LEAN: tl.constexpr = False, F32_DOT: tl.constexpr = False):
    """SwiGLU backward for Q columns c0.. of a row block (rows from ``prow`` in the [L*P, ...]
    views): reads gate/up through ``pre_desc``, writes dG, dU over them and r * h to
    ``hs_rows`` with plain stores; returns the router-gradient partial sum_cols(da_raw * h)
    [BM]. (TMA stores of dG/dU and r h, awaited before the release, were no faster: the
    lease of 2026-12-02 16:55, notes/mok-kernel.md.)
    LEAN (``bwd_lean_epilogue``): the same values in fewer instructions. The sigmoid by inline
    PTX (``sigmoid``; the formula under the interpreter); r h held with the accumulator
    (``held_with``), so that Triton converts it for its store instead of recomputing the
    sigmoid in the store's register layout, and stored last (its conversion then spills
    nothing); dG = dA up (sig + silu (1 - sig)), one multiply fewer than dA up sig (1 + gate
    (1 - sig)). On sm_90 (Kimi K2 48) the dA items' build falls from 7000 to 3696 SASS
    instructions, no spills."""
    if INTERLEAVED:  # gate c at column 2c, up c at 2c + 1: one [BM, 2Q] box
        gate, up = tl.split(tl.reshape(pre_desc.load([prow, 2 * c0]).to(tl.float32),
                                       (BM, Q, 2)))
    else:  # plain loads: two TMA boxes here double the kernel's shared memory (Triton 3.6)
        qc = c0 + tl.arange(0, Q)
        gate = tl.load(pre_rows[:, None] + qc[None, :]).to(tl.float32)
        up = tl.load(pre_rows[:, None] + (I + qc)[None, :]).to(tl.float32)
    if LEAN:
        sig = sigmoid(gate, not F32_DOT)
    else:
        sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    h = silu * up
    part = tl.sum(da_raw * h, axis=1)
    cols = c0 + tl.arange(0, Q)
    if not LEAN:
        tl.store(hs_rows[:, None] + cols[None, :], (h * r[:, None]).to(tl.bfloat16))
    da = da_raw * r[:, None]
    d_up = (da * silu).to(tl.bfloat16)
    if LEAN:
        d_gate = (da * up * (sig + silu * (1.0 - sig))).to(tl.bfloat16)
    else:
        d_gate = (da * up * sig * (1.0 + gate * (1.0 - sig))).to(tl.bfloat16)
    if INTERLEAVED:
        wcols = 2 * c0 + tl.arange(0, 2 * Q)
        tl.store(pre_rows[:, None] + wcols[None, :],
                 tl.reshape(tl.join(d_gate, d_up), (BM, 2 * Q)))
    else:
        tl.store(pre_rows[:, None] + cols[None, :], d_gate)
        tl.store(pre_rows[:, None] + (I + cols)[None, :], d_up)
    if LEAN:
        hr = held_with((h * r[:, None]).to(tl.bfloat16), da_raw, not F32_DOT)
        tl.store(hs_rows[:, None] + cols[None, :], hr)
    return part


@triton.jit
def _da_tile(jt, prow, d2, w_row0, dyg_a_desc, H: tl.constexpr, BM: tl.constexpr,
             BK: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr):
    """dA_raw [BM, DAC] = dY[rows] @ W_down[I tile jt]^T, the dY rows pulled (through
    ``dyg_a_desc`` from row ``prow``)."""
    acc = tl.zeros((BM, DAC), dtype=tl.float32)
    for kk in range(0, H, BK):
        a = dyg_a_desc.load([prow, kk])  # pulled dY rows [BM, BK]
        bt = d2.load([w_row0 + jt * DAC, kk])  # W_down[I tile, H step]: [DAC, BK]
        acc = mma(a, tl.trans(bt), acc, F32_DOT)
    return acc


@triton.jit
def _da_tile_fp8(jt, rank, t, valid, lr, g, E, dyq_base, tab16, w2q_desc, ws2q_desc, sw2q_ptr,
                 sws2q_ptr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                 BK: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr,
                 HAS_SHARED: tl.constexpr):
    """``FP8DA``: dA_raw [BM, DAC] of I tile jt from the FP8 dY rows of the rows' tokens at
    their home ranks (``dyq_base`` + ``tab16``: H e4m3 values, then one fp32 scale per row)
    and group g's e4m3 W_down rows (through ``w2q_desc`` / ``ws2q_desc``, one fp32 scale per
    row of W_down): a pure FP8 K loop over H, both scales applied after it (``fp8_tile``,
    ROWWISE). Padding rows read 0."""
    a_rows, sa_rows = fp8_row_views(_home_rows(dyq_base, tab16, rank, t, valid, H), H, 2)
    d, w_row0 = _weight_desc(lr, g, E, w2q_desc, ws2q_desc, I, True, HAS_SHARED)
    sw = sw2q_ptr + (lr * E + g).to(tl.int64) * I
    if HAS_SHARED:
        if g == E:
            sw = sws2q_ptr
    return fp8_tile(a_rows, valid, sa_rows, 0, sw, jt * DAC, H, I, BM, DAC, BK, 2, F32_DOT,
                    d, w_row0, True)


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
                 BN: tl.constexpr, DAC: tl.constexpr, INTERLEAVED: tl.constexpr,
                 LEAN: tl.constexpr = False, F32_DOT: tl.constexpr = False):
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
                                INTERLEAVED, LEAN, F32_DOT)
        part += _swiglu_bwd_half(a1, c0 + Q, prow, pre_a_desc, pre_rows, hs_rows, r, I, BM, Q,
                                 INTERLEAVED, LEAN, F32_DOT)
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, 2 * Q)), (0, 2, 1)))
        a0, a1 = tl.split(tl.permute(tl.reshape(lo, (BM, 2, Q)), (0, 2, 1)))
        a2, a3 = tl.split(tl.permute(tl.reshape(hi, (BM, 2, Q)), (0, 2, 1)))
        part = _swiglu_bwd_half(a0, c0, prow, pre_a_desc, pre_rows, hs_rows, r, I, BM, Q,
                                INTERLEAVED, LEAN, F32_DOT)
        part += _swiglu_bwd_half(a1, c0 + Q, prow, pre_a_desc, pre_rows, hs_rows, r, I, BM, Q,
                                 INTERLEAVED, LEAN, F32_DOT)
        part += _swiglu_bwd_half(a2, c0 + 2 * Q, prow, pre_a_desc, pre_rows, hs_rows, r, I,
                                 BM, Q, INTERLEAVED, LEAN, F32_DOT)
        part += _swiglu_bwd_half(a3, c0 + 3 * Q, prow, pre_a_desc, pre_rows, hs_rows, r, I,
                                 BM, Q, INTERLEAVED, LEAN, F32_DOT)
    # Router-weight gradient: d r = sum_I dA_raw * h, one partial per I tile.
    drp_off = tl.load(tab32 + rank, mask=routed, other=0)
    tl.store(drp_base + drp_off + (t * K + k) * NJ + jt, part, mask=routed)


@triton.jit
def _da_sums_only(acc, jt, rank, t, k, routed, drp_base, tab32, I: tl.constexpr,
                  K: tl.constexpr, DAC: tl.constexpr):
    """Profiling only (``NOEPI``): instead of the epilogue, each row's sum of the dA tile
    stored where its router-gradient partial goes, so the K loop is kept and nothing else
    runs: the K loop's time alone (the gradients are then wrong)."""
    NJ: tl.constexpr = I // DAC
    drp_off = tl.load(tab32 + rank, mask=routed, other=0)
    tl.store(drp_base + drp_off + (t * K + k) * NJ + jt, tl.sum(acc, axis=1), mask=routed)


@triton.jit
def _dgrad_down_item(b, jt0, lr, src, grp, P, pre, hs, ctr, dyg_a_desc, p_base, drp_base,
                     tab32, w2_desc, ws2_desc, pre_a_desc, T, E, NBMAX, withhold,
                     H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, K: tl.constexpr,
                     HAS_SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr,
                     INTERLEAVED: tl.constexpr, tab16=None, DAT: tl.constexpr = 1,
                     FP8DA: tl.constexpr = False, dyq_base=None, w2q_desc=None,
                     ws2q_desc=None, sw2q_ptr=None, sws2q_ptr=None,
                     FP8DX: tl.constexpr = False, gq=None, GQW: tl.constexpr = 0,
                     RQC: tl.constexpr = 128, POW2: tl.constexpr = False,
                     QBM: tl.constexpr = False, bmax=None, NOEPI: tl.constexpr = False,
                     LEAN: tl.constexpr = False):
    """A item: dA[rows of block b, I tiles jt0*DAT .. of DAC columns] and its epilogue
    (``_da_epilogue``); DAT tiles per item in one flattened loop (the next tile's loads
    overlap a tile's epilogue), and the item signals +DAT. FP8DA: FP8 tiles
    (``_da_tile_fp8``, dY's FP8 rows gathered at home through ``tab16``) instead of the bf16
    ones. QBM: the item that
    completes the block (FP8DX) also stores its column maxima of r h and dG/dU at ``bmax``
    [L, NBMAX, 3I]. NOEPI (profiling only, phase
    bit 16): the one-tile item skips its epilogue (``_da_sums_only``). LEAN
    (``bwd_lean_epilogue``): the epilogue in fewer instructions (``_swiglu_bwd_half``)."""
    g = tl.load(grp + b)
    rows = b * BM + tl.arange(0, BM)
    valid, rank, t, k, routed = _row_meta(src, rows, T, S, K)
    d2, w_row0 = _weight_desc(lr, g, E, w2_desc, ws2_desc, I, True, HAS_SHARED)
    prow = lr * P + b * BM
    if DAT == 1:  # one tile, no loop: the instructions of the GPU-tested one-tile item
        if FP8DA:
            acc = _da_tile_fp8(jt0, rank, t, valid, lr, g, E, dyq_base, tab16, w2q_desc,
                               ws2q_desc, sw2q_ptr, sws2q_ptr, H, I, BM, BK, DAC, F32_DOT,
                               HAS_SHARED)
        else:
            acc = _da_tile(jt0, prow, d2, w_row0, dyg_a_desc, H, BM, BK, DAC, F32_DOT)
        if NOEPI:
            _da_sums_only(acc, jt0, rank, t, k, routed, drp_base, tab32, I, K, DAC)
        else:
            _da_epilogue(acc, jt0, rows, prow, pre, hs, rank, t, k, routed, p_base, drp_base,
                         tab32, pre_a_desc, I, K, BM, BN, DAC, INTERLEAVED, LEAN, F32_DOT)
    else:
        for jj in tl.range(0, DAT, flatten=True):
            jt = jt0 * DAT + jj
            if FP8DA:
                acc = _da_tile_fp8(jt, rank, t, valid, lr, g, E, dyq_base, tab16, w2q_desc,
                                   ws2q_desc, sw2q_ptr, sws2q_ptr, H, I, BM, BK, DAC, F32_DOT,
                                   HAS_SHARED)
            else:
                acc = _da_tile(jt, prow, d2, w_row0, dyg_a_desc, H, BM, BK, DAC, F32_DOT)
            _da_epilogue(acc, jt, rows, prow, pre, hs, rank, t, k, routed, p_base, drp_base,
                         tab32, pre_a_desc, I, K, BM, BN, DAC, INTERLEAVED, LEAN, F32_DOT)
    if (withhold != 3) | (b != 0) | (jt0 != 0):
        tl.debug_barrier()
        if FP8DX:  # the item that completes the row block quantises its dG/dU rows
            old = tl.atomic_add(ctr + 1 + b, DAT, sem="acq_rel", scope="gpu")
            if old + DAT == I // DAC:
                tl.debug_barrier()  # every thread after the acquire of the other items' rows
                bm_row = bmax + (lr * NBMAX + b).to(tl.int64) * (3 * I) if QBM else bmax
                _requant_dgu_rows(pre + rows.to(tl.int64) * (2 * I),
                                  gq + rows.to(tl.int64) * GQW, 2 * I, BM, RQC, POW2, F32_DOT)
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
            async_proxy_fence(ok, F32_DOT)
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
