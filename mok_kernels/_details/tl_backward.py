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
writers and readers fence the async proxy.

Work items, claimed from one ticket counter per logical rank in the global order A, B, Q
(FP8W only), C, D (``PHASES``, a bit mask, skips kinds for profiling; 15 runs all; bit 16
runs the one-tile A items without their epilogue, to time their K loop alone; the Q items run
with bit 4 or 8, or alone with bit 32, so that a profiler sees them apart from the GEMMs):
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
The A and B items are in tl_backward_dgrad, Q, C and D in tl_backward_wgrad, the pull
(kernels and items) in tl_backward_pull; this module holds the megakernel that orders them.
An item waits only on smaller tickets, so the order is deadlock free. Groups run
largest-first in C and D (the shared expert, whose rows are every token of the rank, first).
Every sum has a fixed order (no float atomics): bitwise reproducible. A group with no rows
gets zero weight gradients (its loops run zero times).

Counters of one logical rank (int32, zeroed before the launch):
    [0]            ticket
    [1 + b]        rowblock_ready[b]  (+1 per A item of block b; complete at I / DAC)
    [1 + NBMAX + g] group_ready[g]    (+1 per A item of group g)
    PULL: [1 + NBMAX + NG + b] pulled[b] (row block b's rows are in), then the pull ticket
    [1 + 2*NBMAX + NG]
    PULLG only: [2 + 2*NBMAX + NG + g] x_pulled[g] (+1 per row block of group g whose rows
    are in)
    FP8W only: [1 + NBMAX + NG + g] q_ready[g] (+1 per Q item of group g)
"""

from __future__ import annotations

import triton
import triton.language as tl

from mok_kernels._details import errors
from mok_kernels._details.tl_backward_dgrad import _dgrad_down_item, _dgrad_gate_up_item
from mok_kernels._details.tl_backward_pull import _pull_block, _pull_fp8t_rows
from mok_kernels._details.tl_backward_wgrad import (
    _wgrad_down_item,
    _wgrad_gate_up_item,
    _wgrad_quant_item,
)
from mok_kernels._details.tl_sync import (
    async_proxy_fence,
    globaltimer,
    no_error,
    record_item,
    wait_geq,
)

# The error codes of errors.py, as constexprs for the kernel.
_E_BWD_PULLED: tl.constexpr = tl.constexpr(errors.ERR_WAIT_BWD_PULLED)


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
        x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr,  # PULL: the rows' sources
        T, E, NG, P, NCTR, budget, withhold,
        H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, K: tl.constexpr,
        PROGS: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, BKW: tl.constexpr, DAC: tl.constexpr, F32_DOT: tl.constexpr,
        INTERLEAVED: tl.constexpr, PHASES: tl.constexpr, PULL: tl.constexpr,
        BR: tl.constexpr, CH: tl.constexpr, PULLERS: tl.constexpr = 0,
        DXT: tl.constexpr = 1, DAT: tl.constexpr = 1,
        DXTMA: tl.constexpr = False,
        FP8DA: tl.constexpr = False, dyq_base=None, w2q_desc=None, ws2q_desc=None,
        sw2q_ptr=None, sws2q_ptr=None, FP8DX: tl.constexpr = False, gq_ptr=None,
        w1q_desc=None, ws1q_desc=None, sw1q_ptr=None, sws1q_ptr=None, GQW: tl.constexpr = 0,
        RQC: tl.constexpr = 128, POW2: tl.constexpr = False, FP8W: tl.constexpr = False,
        hqT_ptr=None, gqT_ptr=None, srh_ptr=None, srg_ptr=None,
        hqT_desc=None, dyqT_desc=None, xqT_desc=None, gqT_desc=None, gxam_ptr=None,
        gdyam_ptr=None, BK8: tl.constexpr = 64, BKW8: tl.constexpr = 64, pre_q_desc=None,
        xqT_ptr=None, dyqT_ptr=None, PULLG: tl.constexpr = False, PBR: tl.constexpr = 16,
        PCH: tl.constexpr = 128, bmax_ptr=None, QBM: tl.constexpr = False,
        trace_ptr=None, MAXT=0, TRACE: tl.constexpr = False,
        DXBAND: tl.constexpr = 0,
        DWT: tl.constexpr = 1, DWSC: tl.constexpr = 2, DWSD: tl.constexpr = 2,
        LEAN: tl.constexpr = False, gcount_ptr=None, QCNT: tl.constexpr = False,
        SPLIT: tl.constexpr = 0, QC: tl.constexpr = 128, QR: tl.constexpr = 64,
        dw1_desc=None, dw2_desc=None, SH0=0, DWTMA: tl.constexpr = False):
    """One persistent program per SM; see the module docstring for the work order. The C
    and D items fence the async proxy after their group's acquire (they read through TMA
    rows written with plain stores). FP8DA (``bwd_fp8_da``): the A items' FP8 tiles read dY
    as FP8 rows at its home ranks (``dyq_base``, same rank offsets ``tab16`` as dY) and W_down's
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
    ``gxam_ptr`` [H]).
    PULLG (``bwd_fused_pull`` with ``bwd_fp8_da``):
    the dA items read dY at home and do not wait for the pull items; each pull item adds 1
    to its group's count and the C and D items wait for their group's row blocks instead
    (the D items for their x rows too);
    with FP8W the pull items write the FP8 transposed copies of x and dY (``xqT_ptr``,
    ``dyqT_ptr`` [L, H, P]; PBR rows by PCH columns at a time), as the separate pull kernel
    does.
    DXBAND (``bwd_dx_band``) > 1: the B items in bands of DXBAND row blocks, H tiles outer
    (``_banded``): it only reorders items of one section, whose waits all point at earlier
    ones.
    DWT (``bwd_dw_tiles``): each C and D item covers DWT adjacent H (C) or 2I (D) tiles, in
    flattened loops of DWSC and DWSD pipeline stages (``bwd_dw_stages``).
    TRACE (profiling only): every item of the main ticket order writes (start, end) in
    global-timer nanoseconds, its program within the logical rank and its kind (0 A, 1 B,
    2 Q, 3 C, 4 D) to ``trace_ptr``
    [L, MAXT, 4] int64 at its ticket; the start is taken after the ticket is claimed, so a
    wait inside an item counts as the item's time.
    LEAN (``bwd_lean_epilogue``): the A items' epilogue in fewer instructions
    (``_swiglu_bwd_half``). QCNT (``bwd_q_count_rows``): the Q items' padding
    rows from the groups' real row counts (``gcount_ptr``, int32 [L, NG]). SPLIT
    (``bwd_split_launch``): 1, this launch ends after the A and B items; 2, its tickets come
    from the counter in the last slot (``NCTR - 1``), offset by the A and B items' count, so
    it starts at the Q (or C) items. QC (``bwd_q_cols``): columns per Q item, QR rows per
    step of its loops (``backward.q_rows``). DWTMA (``bwd_dw_tma_store``): the C and D
    items store their tiles through ``dw2_desc`` / ``dw1_desc`` (the dW buffers with the
    shared expert's slots from SH0 on) instead of at ``dw*_ptr``."""
    HALF: tl.constexpr = BN // 2
    BKA: tl.constexpr = BK8 if FP8DA else BK  # reduction steps of the A, B, C and D items:
    BKX: tl.constexpr = BK8 if FP8DX else BK  # ``bwd_fp8_block_k`` (BK8, BKW8) for the FP8
    BKWF: tl.constexpr = BKW8 if FP8W else BKW  # ones
    NQ: tl.constexpr = 3 * I // QC if FP8W else 0  # Q items per group
    NA: tl.constexpr = I // (DAC * DAT)  # A items per row block
    NB: tl.constexpr = H // (BN * DXT)  # B items per row block
    NCJ: tl.constexpr = H // (BN * DWT)  # H tile groups of a C item's I tile
    NDJ: tl.constexpr = 2 * I // (BN * DWT)  # 2I tile groups of a D item's H tile
    NC: tl.constexpr = (I // HALF) * NCJ  # C items per group
    NOEPI: tl.constexpr = (PHASES & 16) != 0  # profiling: the A items without their epilogue
    ND: tl.constexpr = (H // HALF) * NDJ  # D items per group
    pid = tl.program_id(0)
    lr = pid // PROGS
    ctr = ctr_ptr + lr * NCTR
    err = err_ptr + lr * 4
    src = src_ptr + lr.to(tl.int64) * P
    grp = group_ptr + lr * (P // BM)
    total = tl.load(total_ptr + lr)
    gst = gstart_ptr + lr * (NG + 1)
    gcount = gcount_ptr + lr * NG if QCNT else gcount_ptr
    pre = pre_ptr + lr.to(tl.int64) * P * (2 * I)
    hs = hs_ptr + lr.to(tl.int64) * P * I
    gq = gq_ptr + lr.to(tl.int64) * P * GQW if FP8DX else gq_ptr
    NBMAX = P // BM
    hqT = hqT_ptr + lr.to(tl.int64) * I * P if FP8W else hqT_ptr
    gqT = gqT_ptr + lr.to(tl.int64) * (2 * I) * P if FP8W else gqT_ptr
    srh = srh_ptr + lr * NG * I if FP8W else srh_ptr
    srg = srg_ptr + lr * NG * (2 * I) if FP8W else srg_ptr
    qready = ctr + 1 + NBMAX + NG  # FP8W: [NG] Q items done per group, after PULL's counters
    if PULLG:
        qready = qready + NBMAX + 1 + NG
    nb = total // BM
    end_a = nb * NA
    end_b = end_a + nb * NB
    pulled = ctr + 1 + NBMAX + NG  # PULL: [NBMAX] flags, a pull ticket, PULLG: [NG] counts
    xgrp = pulled + NBMAX + 1
    end_q = end_b + NG * NQ
    end_c = end_q + NG * NC
    n_items = end_c + NG * ND
    tkc = ctr  # the ticket counter; SPLIT 2: a second one, its tickets offset by end_b
    tk0 = 0
    if SPLIT == 1:
        n_items = end_b
    if SPLIT == 2:
        tkc = ctr + NCTR - 1
        tk0 = end_b
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
                pt = async_proxy_fence(pt, F32_DOT)  # before the release: TMA readers follow
                tl.debug_barrier()
                if PULLG:  # counted per group: the C and D items wait for their group's
                    # (withhold 5: not for block 0, so a test sees their bounded wait expire)
                    if (withhold != 5) | (pt != 0):
                        tl.atomic_add(xgrp + tl.load(grp + pt), 1, sem="release", scope="gpu")
                else:
                    tl.atomic_add(pulled + pt, 1, sem="release", scope="gpu")
                pt = tl.atomic_add(pulled + NBMAX, 1, sem="relaxed", scope="gpu")
    tk = tl.atomic_add(tkc, 1, sem="relaxed", scope="gpu") + tk0
    while (tk < n_items) & (ok != 0):
        if TRACE:
            t0 = globaltimer(tk, F32_DOT)
        if tk < end_a:
            if PHASES & 1:
                b = tk // NA
                if PULL:  # its rows pulled by an item of this launch (plain stores; TMA here)
                    if PULLG:  # dY's rows read at home: nothing to wait for
                        pass
                    else:
                        ok = wait_geq(ctr + 1 + NBMAX + NG + b, 1, err, budget, _E_BWD_PULLED,
                                      b)
                        if ok != 0:
                            async_proxy_fence(ok, F32_DOT)
                if ok != 0:
                    _dgrad_down_item(b, tk % NA, lr, src, grp, P, pre, hs, ctr, dyg_a_desc,
                                     p_base, drp_base, tab32, w2_desc, ws2_desc, pre_a_desc, T,
                                     E, NBMAX, withhold, H, I, S, K, HAS_SHARED, BM, BN, BKA,
                                     DAC, F32_DOT, INTERLEAVED, tab16, DAT,
                                     FP8DA, dyq_base, w2q_desc, ws2q_desc, sw2q_ptr,
                                     sws2q_ptr, FP8DX, gq, GQW, RQC, POW2, QBM, bmax_ptr,
                                     NOEPI, LEAN)
        elif tk < end_b:
            i = tk - end_a
            if PHASES & 2:
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
        elif tk < end_q:
            if FP8W:  # Q items (none otherwise), largest group first
                if PHASES & 44:
                    i = tk - end_b
                    gq_i = NG - 1 - i // NQ
                    ok = _wgrad_quant_item(gq_i, i % NQ, lr, gst, total, src, P,
                                           hs_c_desc, pre_q_desc, hqT, gqT, srh, srg, ctr,
                                           err, qready, NBMAX, budget, withhold, NG, I, BM,
                                           BN, QR, DAC, F32_DOT, POW2, QBM, bmax_ptr,
                                           QCNT, gcount, QC)
        elif tk < end_c:
            if PHASES & 4:
                i = tk - end_q
                g = NG - 1 - i // NC
                c = i % NC
                ic = c // NCJ  # I tile, then H tile (group)
                jc = c % NCJ
                ok = _wgrad_down_item(g, ic, jc, lr, gst, total, P,
                                      hs_c_desc, dyg_c_desc, ctr, err, dw2_ptr, dws2_ptr,
                                      E, NBMAX, budget, H, I, HAS_SHARED, BM, BN, BKWF,
                                      DAC, F32_DOT,
                                      FP8W, qready, NQ, hqT_desc, dyqT_desc, srh, gdyam_ptr,
                                      POW2, PULLG, xgrp, DWT, DWSC, dw2_desc, SH0, DWTMA)
        else:
            if PHASES & 8:
                i = tk - end_c
                g = NG - 1 - i // ND
                d = i % ND
                ok = _wgrad_gate_up_item(g, d // NDJ, d % NDJ, lr, gst,
                                         total, P, pre_d_desc, xg_d_desc, ctr, err, dw1_ptr,
                                         dws1_ptr, E, NBMAX, budget, H, I, HAS_SHARED,
                                         BM, BN, BKWF, DAC, F32_DOT, INTERLEAVED,
                                         xgrp, PULLG, FP8W, qready, NQ, xqT_desc, gqT_desc,
                                         srg, gxam_ptr, POW2, DWT, DWSD, dw1_desc, SH0,
                                         DWTMA)
        if TRACE:
            kind = tl.where(tk < end_a, 0, tl.where(tk < end_b, 1, tl.where(
                tk < end_q, 2, tl.where(tk < end_c, 3, 4))))
            record_item(trace_ptr + lr.to(tl.int64) * MAXT * 4, tk, MAXT, t0,
                        globaltimer(tk, F32_DOT), pid - lr * PROGS, kind)
        tk = tl.atomic_add(tkc, 1, sem="relaxed", scope="gpu") + tk0


