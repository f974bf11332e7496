"""The backward megakernel's weight-gradient items (see tl_backward's module docstring): Q (the
FP8 weight gradients' column quantisation), C (dW_down) and D (dW_gate_up), over each group's
rows, with the waits on the group's A items and pulled rows."""

from __future__ import annotations

import triton
import triton.language as tl

from mok_kernels._details import errors
from mok_kernels._details.tl_backward_pull import _pulled_signal
from mok_kernels._details.tl_gemm import mma, tma_store_halves
from mok_kernels._details.tl_gemm_fp8 import _dot8
from mok_kernels._details.tl_quant import e4m3_scales, finite_abs, to_e4m3, to_f32
from mok_kernels._details.tl_sync import async_proxy_fence, wait_geq

# The error codes of errors.py, as constexprs for the kernel.
_E_DGRAD_GROUP: tl.constexpr = tl.constexpr(errors.ERR_WAIT_DGRAD_GROUP)
_E_BWD_XPULLED: tl.constexpr = tl.constexpr(errors.ERR_WAIT_BWD_XPULLED)
_E_WGRAD_QUANT: tl.constexpr = tl.constexpr(errors.ERR_WAIT_WGRAD_QUANT)


@triton.jit
def _group_rows(gst, g, total):
    """First and end (exclusive, padded) schedule row of group g, clipped to ``total``."""
    start = tl.minimum(tl.load(gst + g), total)
    end = tl.minimum(tl.load(gst + g + 1), total)
    return start, end


@triton.jit
def _group_ready(g, gst, total, ctr, err, NBMAX, budget, I: tl.constexpr, BM: tl.constexpr,
                 DAC: tl.constexpr, F32_DOT: tl.constexpr):
    """Rows of group g (first, end) and whether every A item of g is done (the C and D items
    read what they wrote). The readers take those rows (r h, dG/dU, and pulled rows) through
    TMA, the async proxy, after this generic acquire: the PTX memory model asks for a proxy
    fence between the two, so one follows the acquire whatever wrote the rows."""
    start, end = _group_rows(gst, g, total)
    ok = wait_geq(ctr + 1 + NBMAX + g, (end - start) // BM * (I // DAC), err, budget,
                  _E_DGRAD_GROUP, g)
    if ok != 0:
        async_proxy_fence(ok, F32_DOT)
    return start, end, ok


@triton.jit
def _quant_cols(desc, row0, dst, sc, col0, start, end, src, P, QC: tl.constexpr,
                BKW: tl.constexpr, POW2: tl.constexpr, F32_DOT: tl.constexpr,
                BMX: tl.constexpr = False, bmax=None, BM: tl.constexpr = 128,
                W: tl.constexpr = 0, QCNT: tl.constexpr = False, live_end=0):
    """Columns col0 .. col0 + QC of one group's rows start..end of a [P, W] bf16 matrix (r h
    or dG/dU; read through ``desc``, [BKW, QC] boxes of this logical rank's rows from
    ``row0``) as e4m3 with one scale per column over those rows: a first pass takes the
    column max |v| (NaN read as +inf, so its column's scale turns NaN), the scales go to
    ``sc`` (+ column), a second pass writes the values transposed (feature-major, rows
    contiguous) to ``dst`` [W, P]; padding rows read 0 (they neither set a max nor add to a
    product). The first pass keeps an elementwise running max of |v| and reduces it over
    the rows once at its end (max is exact in any order: the same scales as a reduction per
    step, without a cross-warp reduction and its barriers in every step). Both passes are
    pipelined TMA copies (``num_stages``): with plain loads, one
    at a time, the Q items were a large part of the FP8 backward; folding the maxima into
    the A items instead, to read once here, slowed the A items by more than it saved (both
    timed by the profiling script benchmarks/mok_backward_time.py; notes/mok-kernel.md).
    BMX (``bwd_fp8_block_colmax``): the column max from the row blocks' maxima at ``bmax``
    (these columns of block b at ``bmax + b * W``; start and end are multiples of BM)
    instead of the first pass: the same max, exactly. (TMA stores of the transposed tiles
    were slower: each waited for in full before the next step, results/20261203-061457-h200-
    fp8-backward.) QCNT
    (``bwd_q_count_rows``): rows below ``live_end`` are the real ones (a group's padding
    rows come last), instead of each step's slot ids loaded from ``src``."""
    cols = col0 + tl.arange(0, QC)
    amax = tl.zeros((QC,), dtype=tl.float32)
    if BMX:
        for b in range(start // BM, end // BM):
            amax = tl.maximum(amax, tl.load(bmax + b * W + tl.arange(0, QC)))
    else:  # an elementwise running max, reduced over the rows once after the loop
        run = tl.zeros((BKW, QC), dtype=tl.float32)
        for r0 in tl.range(start, end, BKW, num_stages=3):
            rows = r0 + tl.arange(0, BKW)
            live = rows < live_end if QCNT else tl.load(src + rows) >= 0
            v = tl.where(live[:, None], to_f32(desc.load([row0 + r0, col0]), F32_DOT), 0.0)
            run = tl.maximum(run, finite_abs(v))
        amax = tl.max(run, axis=0)
    inv, scale = e4m3_scales(amax, POW2)
    tl.store(sc + cols, scale)
    for r0 in tl.range(start, end, BKW, num_stages=3):
        rows = r0 + tl.arange(0, BKW)
        live = rows < live_end if QCNT else tl.load(src + rows) >= 0
        v = tl.where(live[:, None], to_f32(desc.load([row0 + r0, col0]), F32_DOT), 0.0)
        q = to_e4m3(v * inv[None, :], F32_DOT)
        tl.store(dst + cols.to(tl.int64)[None, :] * P + rows[:, None], q)


@triton.jit
def _wgrad_quant_item(g, c, lr, gst, total, src, P, hs_q_desc, pre_q_desc, hqT, gqT, srh, srg,
                      ctr, err, qready, NBMAX, budget, withhold, NG, I: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                      DAC: tl.constexpr, F32_DOT: tl.constexpr, POW2: tl.constexpr,
                      QBM: tl.constexpr = False, bmax=None, QCNT: tl.constexpr = False,
                      gcount=None, QC: tl.constexpr = 0):
    """Q item (``bwd_fp8_wgrad``): column tile c (QC columns, ``bwd_q_cols``, 0 for BN/2;
    r h's I / QC tiles, then dG/dU's 2I / QC) of group g in FP8 (``_quant_cols``), once
    every A item of g is done (they wrote r h and dG/dU with plain stores, read here
    through TMA: the acquire fences the async proxy); then fences the async proxy (the C
    and D items read the copies through TMA) and adds 1 to ``qready[g]`` (not for the
    first Q item, of the largest group, when ``withhold`` is 4: a test's way to make the C
    and D items' bounded wait expire). QCNT: the group's real rows end at start + its
    count (``gcount[g]``)."""
    W: tl.constexpr = BN // 2 if QC == 0 else QC  # columns of this item
    NH: tl.constexpr = I // W
    start, end, ok = _group_ready(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC, F32_DOT)
    # Groups start at multiples of the backward's row block (16 rows or more): said here,
    # ``_quant_cols`` stores its transposed e4m3 bytes as 16-byte vectors along a column's
    # rows instead of one byte per thread (sm_90, Kimi shape, Triton 3.9: the Q and C items'
    # build 40 global stores instead of 100 and 4992 instructions instead of 5544; the whole
    # FP8 backward spills 336 bytes instead of 384; when the Q items still took a max per
    # row step it spilled 380 instead of 296, and the hint was left unsaid then).
    start = tl.multiple_of(start, 16)
    if ok != 0:
        bm = bmax + lr * NBMAX * (3 * I) + c * W if QBM else bmax  # r h, then dG/dU
        live_end = start + tl.load(gcount + g) if QCNT else end
        if c < NH:
            _quant_cols(hs_q_desc, lr * P, hqT, srh + g * I, c * W, start, end, src, P,
                        W, BKW, POW2, F32_DOT, QBM, bm, BM, 3 * I, QCNT, live_end)
        else:
            _quant_cols(pre_q_desc, lr * P, gqT, srg + g * (2 * I), (c - NH) * W, start,
                        end, src, P, W, BKW, POW2, F32_DOT, QBM, bm, BM, 3 * I, QCNT,
                        live_end)
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
            async_proxy_fence(ok, F32_DOT)
    return ok


@triton.jit
def _wgrad_wait(g, gst, total, ctr, err, NBMAX, budget, I: tl.constexpr, BM: tl.constexpr,
                DAC: tl.constexpr, F32_DOT: tl.constexpr, FP8W: tl.constexpr, qready,
                NQ: tl.constexpr):
    """Rows of group g and whether a weight-gradient item may read them: every A item of g
    done (``_group_ready``) or, FP8W with Q items (NQ > 0), every Q item of g (then the async
    proxy is fenced)."""
    if FP8W and NQ > 0:
        start, end = _group_rows(gst, g, total)
        ok = wait_geq(qready + g, NQ, err, budget, _E_WGRAD_QUANT, g)
        if ok != 0:
            async_proxy_fence(ok, F32_DOT)
    else:
        start, end, ok = _group_ready(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC,
                                      F32_DOT)
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
def _wgrad_down_item(g, it, jn, lr, gst, total, P, hs_c_desc, dyg_c_desc, ctr, err,
                     dw2, dws2, E, NBMAX, budget, H: tl.constexpr, I: tl.constexpr,
                     HAS_SHARED: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BKW: tl.constexpr, DAC: tl.constexpr,
                     F32_DOT: tl.constexpr, FP8W: tl.constexpr = False, qready=None,
                     NQ: tl.constexpr = 0,
                     hqT_desc=None, dyqT_desc=None, srh=None, gdyam=None,
                     POW2: tl.constexpr = False, XW: tl.constexpr = False, xgrp=None,
                     DWT: tl.constexpr = 1, DWS: tl.constexpr = 2, dw_desc=None, SH0=0,
                     DWTMA: tl.constexpr = False):
    """C item: dW_down[g][I tile it, H tiles jn * DWT ..] = sum over g's rows of (r h)^T dY;
    waits for every A item of g (they write r h). DWT tiles (``bwd_dw_tiles``) in one
    flattened loop of DWS pipeline stages, so the software pipeline loads a tile's first rows
    during the store of the one before (the K loops are short where experts are small).
    FP8W: e4m3
    tiles of the transposed copies (``hqT_desc`` [L*I, P], ``dyqT_desc`` [L*H, P]: K-major,
    a pure FP8 K loop), then the column scales (r h's of group g in ``srh``, dY's from the
    global column max ``gdyam``); waits for g's Q items instead. XW: also for g's pulled
    rows (``_pulled_rows``). DWTMA (``bwd_dw_tma_store``, with DWT > 1): the tiles stored
    through ``dw_desc`` ([slots * I, H] bf16, the shared expert's slots from SH0 on)."""
    HALF: tl.constexpr = BN // 2
    start, end, ok = _wgrad_wait(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC, F32_DOT,
                                 FP8W, qready, NQ)
    if XW:
        ok = _pulled_rows(ok, xgrp, g, start, end, err, budget, BM, F32_DOT)
    if ok != 0:
        icols = it * HALF + tl.arange(0, HALF)
        if DWT == 1:  # one tile, no loop; the output rows after the GEMM (fewer live values)
            acc = _wgrad_down_tile(jn, it, icols, g, lr, start, end, P, hs_c_desc, dyg_c_desc,
                                   H, I, BN, BKW, F32_DOT, FP8W, hqT_desc, dyqT_desc, srh,
                                   gdyam, POW2)
            out_rows = _dw_rows(dw2, dws2, lr, g, E, icols, I * H, H, HAS_SHARED)
            tl.store(out_rows + (jn * BN + tl.arange(0, BN))[None, :], acc.to(tl.bfloat16))
        else:  # one flattened loop: the next tile's loads overlap a tile's store
            out_rows = _dw_rows(dw2, dws2, lr, g, E, icols, I * H, H, HAS_SHARED)
            for jj in tl.range(0, DWT, flatten=True, num_stages=DWS):
                jt = jn * DWT + jj
                acc = _wgrad_down_tile(jt, it, icols, g, lr, start, end, P, hs_c_desc,
                                       dyg_c_desc, H, I, BN, BKW, F32_DOT, FP8W, hqT_desc,
                                       dyqT_desc, srh, gdyam, POW2)
                if DWTMA:
                    tma_store_halves(dw_desc, _dw_slot(lr, g, E, SH0, HAS_SHARED) * I
                                     + it * HALF, acc, jt * BN, jt * BN + HALF, HALF, False)
                else:
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
def _dw_slot(lr, g, E, SH0, HAS_SHARED: tl.constexpr):
    """Group g's expert slot in the weight-gradient buffers of ``bwd_dw_tma_store``: the
    routed experts' ``lr * E + g``, the shared expert's (g == E) ``SH0 + lr`` after them."""
    slot = lr * E + g
    if HAS_SHARED:
        if g == E:
            slot = SH0 + lr
    return slot


@triton.jit
def _wgrad_down_tile(jn, it, icols, g, lr, start, end, P, hs_c_desc, dyg_c_desc,
                     H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                     F32_DOT: tl.constexpr, FP8W: tl.constexpr, hqT_desc, dyqT_desc, srh,
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
            dy = dyg_c_desc.load([lr * P + r0, jn * BN])  # [BKW, BN]
            acc = mma(tl.trans(h), dy, acc, F32_DOT)
    return acc


@triton.jit
def _wgrad_gate_up_item(g, it, jn, lr, gst, total, P, pre_d_desc, xg_d_desc, ctr, err,
                        dw1, dws1, E, NBMAX, budget, H: tl.constexpr, I: tl.constexpr,
                        HAS_SHARED: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                        DAC: tl.constexpr, F32_DOT: tl.constexpr, INTERLEAVED: tl.constexpr,
                        xgrp=None, XW: tl.constexpr = False,
                        FP8W: tl.constexpr = False, qready=None, NQ: tl.constexpr = 0,
                        xqT_desc=None, gqT_desc=None, srg=None, gxam=None,
                        POW2: tl.constexpr = False, DWT: tl.constexpr = 1,
                        DWS: tl.constexpr = 2, dw_desc=None, SH0=0,
                        DWTMA: tl.constexpr = False):
    """D item: dW_gate_up[g][H tile it, 2I tiles jn * DWT ..] = sum over g's rows of
    x^T [dG dU], DWT tiles in one flattened loop (as the C items).
    XW (``bwd_fused_pull`` with dA items that do not wait for the pull): also waits until
    every row block of g has its rows pulled (``_pulled_rows``).
    FP8W: e4m3 tiles of the transposed copies (``xqT_desc`` [L*H, P], ``gqT_desc``
    [L*2I, P]), then the column scales (x's from the global column max ``gxam``, dG/dU's
    of group g in ``srg``); waits for g's Q items instead. DWTMA: the tiles stored through
    ``dw_desc`` ([slots * H, 2I] bf16), as the C items'."""
    HALF: tl.constexpr = BN // 2
    start, end, ok = _wgrad_wait(g, gst, total, ctr, err, NBMAX, budget, I, BM, DAC, F32_DOT,
                                 FP8W, qready, NQ)
    if XW:
        ok = _pulled_rows(ok, xgrp, g, start, end, err, budget, BM, F32_DOT)
    if ok != 0:
        hcols = it * HALF + tl.arange(0, HALF)
        if DWT == 1:  # one tile, no loop; the output rows after the GEMM (fewer live values)
            acc = _wgrad_gate_up_tile(jn, it, hcols, g, lr, start, end, P, pre_d_desc,
                                      xg_d_desc, H, I, BN, BKW, F32_DOT, FP8W, xqT_desc,
                                      gqT_desc, srg, gxam, POW2)
            out_rows = _dw_rows(dw1, dws1, lr, g, E, hcols, H * 2 * I, 2 * I, HAS_SHARED)
            _store_dw_gate_up(out_rows, acc, jn, I, BN, INTERLEAVED)
        else:  # one flattened loop: the next tile's loads overlap a tile's store
            out_rows = _dw_rows(dw1, dws1, lr, g, E, hcols, H * 2 * I, 2 * I, HAS_SHARED)
            for jj in tl.range(0, DWT, flatten=True, num_stages=DWS):
                jt = jn * DWT + jj
                acc = _wgrad_gate_up_tile(jt, it, hcols, g, lr, start, end, P, pre_d_desc,
                                          xg_d_desc, H, I, BN, BKW, F32_DOT, FP8W, xqT_desc,
                                          gqT_desc, srg, gxam, POW2)
                if DWTMA:
                    row0 = _dw_slot(lr, g, E, SH0, HAS_SHARED) * H + it * HALF
                    if INTERLEAVED:
                        tma_store_halves(dw_desc, row0, acc, jt * HALF, I + jt * HALF,
                                         HALF, True)
                    else:
                        tma_store_halves(dw_desc, row0, acc, jt * BN, jt * BN + HALF,
                                         HALF, False)
                else:
                    _store_dw_gate_up(out_rows, acc, jt, I, BN, INTERLEAVED)
    return ok


@triton.jit
def _wgrad_gate_up_tile(jn, it, hcols, g, lr, start, end, P, pre_d_desc, xg_d_desc,
                        H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                        F32_DOT: tl.constexpr, FP8W: tl.constexpr, xqT_desc, gqT_desc, srg,
                        gxam, POW2: tl.constexpr):
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
