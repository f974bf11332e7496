"""The backward's reverse-combine pull (see tl_backward's module docstring): the x and dY rows
of every schedule row from the tokens' home ranks into contiguous [L, P, H] rows, as separate
kernels before the megakernel (row by row, token by token, the FP8 weight gradients' transposed
copies) or as the megakernel's pull items (``bwd_fused_pull``)."""

from __future__ import annotations

import triton
import triton.language as tl

from mok_kernels._details.tl_quant import e4m3_scales, to_e4m3, to_f32
from mok_kernels._details.tl_sync import async_proxy_fence


@triton.jit
def _pull_rows(rows, lr, src, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr, T, P,
               H: tl.constexpr, S: tl.constexpr, CH: tl.constexpr):
    """Reverse-combine pull of the schedule rows ``rows`` of logical rank lr (all below the
    rank's total; ``src`` is its row of the schedule): their x and dY rows, from the tokens'
    home ranks (peer memory), into the contiguous [L, P, H] buffers; zeros for padding
    rows."""
    s = tl.load(src + rows)
    valid = s >= 0
    tok = (tl.maximum(s, 0) // S).to(tl.int64)
    rank, t = tok // T, tok % T
    out = (lr.to(tl.int64) * P + rows) * H
    # rows start 16-byte aligned: 16-byte vector loads (see _row_sources)
    x_rows = x_base + tl.multiple_of(tl.load(x_tab + rank, mask=valid, other=0) + t * H, 8)
    dy_rows = dy_base + tl.multiple_of(tl.load(tab16 + rank, mask=valid, other=0) + t * H, 8)
    for h0 in range(0, H, CH):
        cols = h0 + tl.arange(0, CH)
        cm = cols < H
        m = valid[:, None] & cm[None, :]
        v = tl.load(x_rows[:, None] + cols[None, :], mask=m, other=0.0)
        tl.store(xg_ptr + out[:, None] + cols[None, :], v, mask=cm[None, :])
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
                CH: tl.constexpr):
    """In-kernel reverse-combine pull (``bwd_fused_pull``): row block b
    (in use, so every row is below the rank's total, which is a multiple of BM), BR rows at
    a time, as ``pull_rows_kernel`` does."""
    for r0 in range(0, BM, BR):
        _pull_rows(b * BM + r0 + tl.arange(0, BR), lr, src, x_base, x_tab, dy_base, tab16,
                   xg_ptr, dyg_ptr, T, P, H, S, CH)


@triton.jit
def _pulled_signal(flag, v, F32_DOT: tl.constexpr):
    """After a pull item's plain stores: fence the async proxy (its rows are read through
    TMA), then release-add 1 to ``flag``; returns v."""
    v = async_proxy_fence(v, F32_DOT)
    tl.debug_barrier()
    tl.atomic_add(flag, 1, sem="release", scope="gpu")
    return v


@triton.jit
def pull_rows_kernel(src_ptr, total_ptr, x_base, x_tab, dy_base, tab16, xg_ptr, dyg_ptr, T, P,
                     H: tl.constexpr, S: tl.constexpr, BR: tl.constexpr, CH: tl.constexpr,
                     first_ptr=None, PHASE: tl.constexpr = 0):
    """Reverse-combine pull: the x and dY rows of BR schedule rows, from the tokens' home
    ranks (peer memory), into contiguous [L, P, H] buffers (zeros for padding rows), so every
    backward GEMM reads its row operands as plain tiles. Program (l, i) does rows i*BR.. of
    logical rank l; rows past the rank's total are left alone. PHASE 1 and 2
    (``bwd_pull_dedup``, two launches; ``first_ptr`` the schedule's first_LP): a token's
    first row on this rank from home, then its other rows from that row (``_row_sources``)."""
    lr = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    total = tl.load(total_ptr + lr)
    if tl.program_id(1) * BR < total:
        if PHASE == 0:
            _pull_rows(rows, lr, src_ptr + lr.to(tl.int64) * P, x_base, x_tab, dy_base, tab16,
                       xg_ptr, dyg_ptr, T, P, H, S, CH)
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
def quantize_cols_kernel(v_ptr, amax_ptr, q_ptr, N, H: tl.constexpr, BR: tl.constexpr,
                         CH: tl.constexpr, POW2: tl.constexpr, SOFT_CAST: tl.constexpr):
    """``bwd_fp8_prequant``: rows [N, H] bf16 (a rank's own tokens' x or dY) as e4m3 [N, H]
    scaled per column by the global column max ``amax_ptr`` [H]: the arithmetic of
    ``_pull_fp8t_rows`` (the same scales and casts), done once per token at home instead
    of once per (token, k) row in the pull, so the pulled bytes are the same."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * CH + tl.arange(0, CH)
    rm, cm = rows < N, cols < H
    m = rm[:, None] & cm[None, :]
    at = rows.to(tl.int64)[:, None] * H + cols[None, :]
    v = tl.load(v_ptr + at, mask=m, other=0.0)
    inv = e4m3_scales(tl.load(amax_ptr + cols, mask=cm, other=0.0), POW2)[0]
    tl.store(q_ptr + at, to_e4m3(to_f32(v, SOFT_CAST) * inv[None, :], SOFT_CAST), mask=m)


@triton.jit
def pull_rows_fp8t_kernel(src_ptr, total_ptr, x_base, x_tab, dy_base, tab16, dyg_ptr,
                          xqT_ptr, dyqT_ptr, gxam_ptr, gdyam_ptr, T, P, H: tl.constexpr,
                          S: tl.constexpr, BR: tl.constexpr, CH: tl.constexpr,
                          DY16: tl.constexpr, POW2: tl.constexpr, SOFT_CAST: tl.constexpr,
                          first_ptr=None, xg_ptr=None, PHASE: tl.constexpr = 0,
                          order_ptr=None, ORDER: tl.constexpr = False,
                          PRE: tl.constexpr = False, AHEAD: tl.constexpr = False):
    """``bwd_fp8_wgrad``'s reverse-combine pull: the x and dY rows of BR schedule rows from
    the tokens' home ranks, written as e4m3 transposed copies [L, H, P] (feature-major, the
    rows contiguous: the K-major operands of the FP8 weight-gradient tiles), each column
    scaled by its global column max (``global_col_amax_kernel``); DY16 also the bf16 dY rows
    [L, P, H] (for bf16 dA items). No bf16 x rows: only the weight gradient read them.
    Padding rows write 0. PHASE 1 and 2 (``bwd_pull_dedup``, two launches, ``first_ptr``
    the schedule's first_LP): a token's first row on this rank from home (its bf16 x and dY
    rows also into ``xg_ptr`` / ``dyg_ptr``, DY16 then set), then its other rows from those
    (``_row_sources``). ORDER (``bwd_pull_interleave``): program j of rank lr takes row
    block ``order_ptr[lr, j]`` (a permutation of the P / BR blocks) instead of block j.
    PRE (``bwd_fp8_prequant``): the sources are already e4m3, quantised at home by
    ``quantize_cols_kernel`` with the same scales (x_base / dy_base their bytes [.., T, H],
    x_tab / tab16 byte offsets of the ranks' copies; ``xg_ptr`` / ``dyg_ptr`` and the
    copies byte views): every row moves as bytes, half the reads of bf16 rows. AHEAD
    (``bwd_pull_prefetch``; PHASE 0 without PRE): ``_pull_fp8t_ahead``."""
    lr = tl.program_id(0)
    if ORDER:
        r0 = tl.load(order_ptr + lr * tl.num_programs(1) + tl.program_id(1)) * BR
    else:
        r0 = tl.program_id(1) * BR
    total = tl.load(total_ptr + lr)
    if r0 < total:
        _pull_fp8t_rows(r0 + tl.arange(0, BR), lr, src_ptr, x_base, x_tab, dy_base, tab16,
                        dyg_ptr, xqT_ptr, dyqT_ptr, gxam_ptr, gdyam_ptr, T, P, H, S, CH, DY16,
                        POW2, SOFT_CAST, first_ptr, xg_ptr, PHASE, PRE, AHEAD)


@triton.jit
def _pull_fp8t_ahead(x_rows, dy_rows, ld, wr, rows, xq, dyq, gxam_ptr, gdyam_ptr, dyg_ptr, out16,
                     P, H: tl.constexpr, CH: tl.constexpr, DY16: tl.constexpr,
                     POW2: tl.constexpr, SOFT_CAST: tl.constexpr):
    """``bwd_pull_prefetch``: PHASE 0 of ``_pull_fp8t_rows`` (rows from home, padding rows
    0) with the next CH columns of the x and dY rows loaded before this chunk's are
    converted and stored, so a program has its next loads in flight while it stores (the
    plain loop loads, waits, converts, stores, then loads again: at 168 registers a thread,
    3 programs an SM on sm_90, the loads' latency is not hidden). The same values, so the
    same copies; the loads past H are masked off."""
    c = tl.arange(0, CH)
    m0 = ld[:, None] & (c < H)[None, :]
    vx = tl.load(x_rows[:, None] + c[None, :], mask=m0, other=0)
    vd = tl.load(dy_rows[:, None] + c[None, :], mask=m0, other=0)
    for h0 in range(0, H, CH):
        cols = h0 + c
        cm = cols < H
        nm = ld[:, None] & (cols + CH < H)[None, :]
        nx = tl.load(x_rows[:, None] + (cols + CH)[None, :], mask=nm, other=0)
        nd = tl.load(dy_rows[:, None] + (cols + CH)[None, :], mask=nm, other=0)
        tcols = cols.to(tl.int64)[None, :] * P + rows[:, None]
        inv = e4m3_scales(tl.load(gxam_ptr + cols, mask=cm, other=0.0), POW2)[0]
        tl.store(xq + tcols, to_e4m3(to_f32(vx, SOFT_CAST) * inv[None, :], SOFT_CAST),
                 mask=cm[None, :])
        if DY16:
            tl.store(dyg_ptr + out16[:, None] + cols[None, :], vd,
                     mask=wr[:, None] & cm[None, :])
        inv = e4m3_scales(tl.load(gdyam_ptr + cols, mask=cm, other=0.0), POW2)[0]
        tl.store(dyq + tcols, to_e4m3(to_f32(vd, SOFT_CAST) * inv[None, :], SOFT_CAST),
                 mask=cm[None, :])
        vx = nx
        vd = nd


@triton.jit
def _pull_fp8t_rows(rows, lr, src_ptr, x_base, x_tab, dy_base, tab16, dyg_ptr, xqT_ptr,
                    dyqT_ptr, gxam_ptr, gdyam_ptr, T, P, H: tl.constexpr, S: tl.constexpr,
                    CH: tl.constexpr, DY16: tl.constexpr, POW2: tl.constexpr,
                    SOFT_CAST: tl.constexpr, first_ptr=None, xg_ptr=None,
                    PHASE: tl.constexpr = 0, PRE: tl.constexpr = False,
                    AHEAD: tl.constexpr = False):
    """The body of ``pull_rows_fp8t_kernel`` for schedule rows ``rows`` of logical rank lr
    (below its total); also the in-kernel pull items' (``bwd_fused_pull`` with FP8 weight
    gradients, PHASE 0). AHEAD (PHASE 0, not PRE): ``_pull_fp8t_ahead``."""
    x_rows, dy_rows, ld, wr = _row_sources(
        rows, lr, src_ptr + lr.to(tl.int64) * P,
        first_ptr + lr.to(tl.int64) * P if PHASE > 0 else first_ptr, x_base, x_tab,
        dy_base, tab16, xg_ptr, dyg_ptr, T, P, H, S, PHASE)
    if PHASE == 2:  # every valid row from its first row's copy (its own for a first)
        ld = tl.load(src_ptr + lr.to(tl.int64) * P + rows) >= 0
    xq = xqT_ptr + lr.to(tl.int64) * H * P
    dyq = dyqT_ptr + lr.to(tl.int64) * H * P
    out16 = (lr.to(tl.int64) * P + rows) * H
    if AHEAD:
        _pull_fp8t_ahead(x_rows, dy_rows, ld, wr, rows, xq, dyq, gxam_ptr, gdyam_ptr, dyg_ptr,
                         out16, P, H, CH, DY16, POW2, SOFT_CAST)
    else:
        for h0 in range(0, H, CH):
            cols = h0 + tl.arange(0, CH)
            cm = cols < H
            m = ld[:, None] & cm[None, :]
            mw = wr[:, None] & cm[None, :]
            # The transposed stores are masked by column only (a row mask along their
            # contiguous dimension made them byte stores): PHASE 0 and 2 write every row
            # (padding rows 0), PHASE 1 none (it writes the bf16 copies that PHASE 2 reads).
            tcols = cols.to(tl.int64)[None, :] * P + rows[:, None]
            v = tl.load(x_rows[:, None] + cols[None, :], mask=m, other=0)
            if PHASE == 1:  # the second pass's source
                tl.store(xg_ptr + out16[:, None] + cols[None, :], v, mask=mw)
            elif PRE:  # e4m3 bytes already, scaled at home
                tl.store(xq + tcols, v, mask=cm[None, :])
            else:
                inv = e4m3_scales(tl.load(gxam_ptr + cols, mask=cm, other=0.0), POW2)[0]
                tl.store(xq + tcols, to_e4m3(to_f32(v, SOFT_CAST) * inv[None, :], SOFT_CAST),
                         mask=cm[None, :])
            v = tl.load(dy_rows[:, None] + cols[None, :], mask=m, other=0)
            if DY16:
                tl.store(dyg_ptr + out16[:, None] + cols[None, :], v, mask=mw)
            if PHASE != 1:
                if PRE:
                    tl.store(dyq + tcols, v, mask=cm[None, :])
                else:
                    inv = e4m3_scales(tl.load(gdyam_ptr + cols, mask=cm, other=0.0), POW2)[0]
                    tl.store(dyq + tcols, to_e4m3(to_f32(v, SOFT_CAST) * inv[None, :], SOFT_CAST),
                             mask=cm[None, :])
