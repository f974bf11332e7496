"""The persistent forward megakernel: pull dispatch, grouped SwiGLU FFN, push combine.

Legend: L logical ranks in the launch (program l // PROGS serves logical rank l), R EP ranks,
T tokens per rank, S combine slots per token, P schedule rows, Q ring rows (macrobatch),
MB minibatch rows, BM/BN/BK tiles, N1 = I/(BN/2) gate+up tiles and N2 = H/BN down tiles per
row block, NBM = MB/BM row blocks per minibatch, MMAX = P/MB minibatches at most.

With FUSED_SUM (one process, COMM = 0) each down item also counts, per (token, column
item), how many of the token's S slots have arrived (``sums``, zeroed before the launch); the
item whose increment completes a count sums the token's S slots in fixed k order for its
columns and writes y, so the router-weighted sum needs no pass of its own.

Counters of one logical rank (int32, zeroed before the launch):
    [0]                   compute ticket
    [1 + m]               dispatch_done[m]  (+1 per communication program)
    [1 + MMAX + m]        out_ready[m]      (+1 per down tile, added DT at a time)
    [1 + 2*MMAX + m]      combine_done[m]   (+1 per communication program)
    [1 + 3*MMAX + b]      rowblock_ready[b] (+1 per gate+up tile)

Work order (deadlock freedom): compute programs claim tickets in the global order
[gate+up tiles of minibatch 0][down tiles of 0][gate+up of 1][down of 1]...; a ticket waits only
on dispatch (which waits only on combines of older minibatches) or on smaller tickets. SKEW
(``skew_down``): [gate+up of 0][gate+up of 1][down of 0][gate+up of 2][down of 1]...[down of
the last]; a gate+up item of minibatch m waits (through its ring slot, directly or through
dispatch and combine) on the down items of minibatch m - slots <= m - 2, still smaller
tickets.
Communication program c runs steps s = 0, 1, ...: dispatch minibatch s (after the combine of
minibatch s - slots released its ring slot), then combine minibatch s - (slots - 1).
With no communication programs (COMM = 0) the gate+up tiles gather their rows straight from
the (peer) token buffers and the down tiles scatter straight into the (peer) combine
buffers; the SwiGLU ring slot is then released by the down tiles of the older minibatch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mok_kernels._details import errors
from mok_kernels._details.tl_gemm import down_tiles, gate_up_swiglu_tiles
from mok_kernels._details.tl_gemm_fp8 import (
    down_fp8_tiles,
    gate_up_fp8_tiles,
    requant_whole_rows,
)
from mok_kernels._details.tl_sync import (
    globaltimer,
    no_error,
    record_error,
    record_item,
    signal,
    wait_geq,
)

# The error codes of errors.py, as constexprs for the kernel.
_E_RING_FREE: tl.constexpr = tl.constexpr(errors.ERR_WAIT_RING_FREE)
_E_DISPATCHED: tl.constexpr = tl.constexpr(errors.ERR_WAIT_DISPATCHED)
_E_ROWBLOCK: tl.constexpr = tl.constexpr(errors.ERR_WAIT_ROWBLOCK)
_E_OUTPUT: tl.constexpr = tl.constexpr(errors.ERR_WAIT_OUTPUT)
_E_HSLOT_FREE: tl.constexpr = tl.constexpr(errors.ERR_WAIT_HSLOT_FREE)
_E_DEDUP: tl.constexpr = tl.constexpr(errors.ERR_WAIT_DEDUP)


@triton.jit
def _slot_rows(src, rows, rmask, T, S: tl.constexpr, off_tab, base, H: tl.constexpr):
    """Pointers to the (peer) buffer rows of schedule rows: base + off_tab[rank] + rem*H,
    with rem = t*S + k for combine slots or t for tokens (S = 1). Returns (ptrs, valid)."""
    s = tl.load(src + rows, mask=rmask, other=-1)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    rank = s64 // (T * S)
    rem = s64 % (T * S)
    off = tl.multiple_of(tl.load(off_tab + rank, mask=valid, other=0), 8)
    return base + off + rem * H, valid


@triton.jit
def _token_rows(src, rows, rmask, T, S: tl.constexpr, x_tab, x_base, H: tl.constexpr):
    """Pointers to the (peer) token rows of schedule rows: slot id // S = r*T + t (rank-major
    tokens), row = x_base + x_tab[r] + t*H. Returns (ptrs, valid); padding rows are invalid."""
    s = tl.load(src + rows, mask=rmask, other=-1)
    valid = s >= 0
    tok = (tl.maximum(s, 0) // S).to(tl.int64)
    off = tl.multiple_of(tl.load(x_tab + tok // T, mask=valid, other=0), 8)
    return x_base + off + (tok % T) * H, valid


@triton.jit
def _token_home(src, rows, rmask, T, S: tl.constexpr):
    """EP rank of each schedule row's token (slot id // S = r*T + t); -1 for padding rows."""
    s = tl.load(src + rows, mask=rmask, other=-1)
    return tl.where(s >= 0, (tl.maximum(s, 0) // S) // T, -1)


@triton.jit
def _copy_rows(src_rows, smask, dst_rows, dmask, H: tl.constexpr, CR: tl.constexpr,
               CH: tl.constexpr):
    """Copy CR rows of H bf16 elements in CH-column chunks (16-byte vectors per thread)."""
    for h0 in range(0, H, CH):
        cols = h0 + tl.arange(0, CH)
        cm = cols < H
        v = tl.load(src_rows[:, None] + cols[None, :], mask=smask[:, None] & cm[None, :],
                    other=0.0)
        tl.store(dst_rows[:, None] + cols[None, :], v, mask=dmask[:, None] & cm[None, :])


@triton.jit
def _wait_flags(ptrs, mask, err, budget, code, detail):
    """Wait until every ``*ptrs[i] >= 1`` where ``mask``: one acquire read each, volatile polls
    of the ones still pending (bounded by ``budget`` and the rank's error word), a last
    acquire, then a CTA barrier so every thread reads after them. Returns 1, or 0 on timeout
    (recording ``(code, detail)``) or another program's error."""
    v = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="gpu")
    pending = mask & (v < 1)
    e = tl.load(err, volatile=True)
    it = 0
    while (tl.max(pending.to(tl.int32), 0) > 0) & (e == 0) & (it < budget):
        v = tl.load(ptrs, mask=pending, other=1, volatile=True)
        pending = pending & (v < 1)
        e = tl.load(err, volatile=True)
        it += 1
    ok = (tl.max(pending.to(tl.int32), 0) == 0).to(tl.int32)
    tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="gpu")
    if ok == 0:
        if e == 0:
            record_error(err, code, detail)
    tl.debug_barrier()
    return ok


@triton.jit
def _dispatch_dedup(rows, rmask, src, first, T, S: tl.constexpr, x_tab, x_base, ring, Q,
                    tcache, tflag, me, err, budget, H: tl.constexpr, XW: tl.constexpr,
                    CH: tl.constexpr):
    """``DEDUP``: the dispatch of CR schedule rows. A row whose token lives on another rank
    and is not the token's first row here (``first``) copies the token's row from the token
    cache ``tcache`` [R*T, XW] (local memory) once its flag in ``tflag`` is set; every other
    row is pulled from the token's home rank as without DEDUP, and a first row of a remote
    token also goes to the cache, then sets the flag (release). A chunk sets its own flags
    before it waits on others', and a row waits only on a smaller row: no cycle."""
    s = tl.load(src + rows, mask=rmask, other=-1)
    valid = s >= 0
    tok = (tl.maximum(s, 0) // S).to(tl.int64)
    remote = valid & ((tok // T) != me)
    f = tl.load(first + rows, mask=rmask, other=-1)
    dup = remote & (f != rows)
    to_cache = remote & (f == rows)
    x_rows, valid = _token_rows(src, rows, rmask, T, S, x_tab, x_base, H)
    ring_rows = ring + (rows % Q).to(tl.int64) * H
    cache_rows = tcache + tok * XW
    for h0 in range(0, XW, CH):  # pull: every row but the cached copies (padding rows: 0)
        cols = h0 + tl.arange(0, CH)
        cm = (cols < XW)[None, :]
        v = tl.load(x_rows[:, None] + cols[None, :], mask=(valid & ~dup)[:, None] & cm,
                    other=0.0)
        tl.store(ring_rows[:, None] + cols[None, :], v, mask=(rmask & ~dup)[:, None] & cm)
        tl.store(cache_rows[:, None] + cols[None, :], v, mask=to_cache[:, None] & cm)
    tl.debug_barrier()  # every thread's cache stores before the flags' release
    tl.atomic_xchg(tflag + tok, 1, mask=to_cache, sem="release", scope="gpu")
    ok = _wait_flags(tflag + tok, dup, err, budget, _E_DEDUP,
                     tl.max(tl.where(dup, tok, -1)).to(tl.int32))
    for h0 in range(0, XW, CH):  # the other rows of remote tokens: from the cache
        cols = h0 + tl.arange(0, CH)
        cm = (cols < XW)[None, :]
        v = tl.load(cache_rows[:, None] + cols[None, :], mask=dup[:, None] & cm, other=0.0)
        tl.store(ring_rows[:, None] + cols[None, :], v, mask=dup[:, None] & cm)
    return ok


@triton.jit
def _dispatch(m, c, src, total, ring, ctr, err, x_base, x_tab, T, Q, MMAX, budget, withhold,
              H: tl.constexpr, XW: tl.constexpr, S: tl.constexpr, C: tl.constexpr,
              MB: tl.constexpr, CR: tl.constexpr, CH: tl.constexpr,
              DEDUP: tl.constexpr = False, first=None, tcache=None, tflag=None, me=0,
              RONLY: tl.constexpr = False, CDIRECT: tl.constexpr = False,
              BM: tl.constexpr = 1, BN: tl.constexpr = 1):
    """Pull the token rows of minibatch m into its ring slot (this program's share): the
    first XW bf16 elements of each H-element row (H for bf16; an FP8 row's e4m3 values and
    scales, about half of it). DEDUP: once per (token, this rank), ``_dispatch_dedup``.
    RONLY (``dispatch_remote_only``): only the rows of other ranks' tokens (and padding rows,
    as zeros); rank ``me``'s own rows are left unwritten (the gate+up tiles read them from
    its token buffer). The ring slot is free once the combine of minibatch m - slots pushed
    its outputs, or, CDIRECT (``combine_direct``: no combine step), once that minibatch's
    down tiles (BN columns of BM rows each) are done, its gate+up tiles having read the rows
    before them."""
    ok = 1
    slots = Q // MB
    if m >= slots:
        if CDIRECT:
            ok = wait_geq(ctr + 1 + MMAX + m - slots, (MB // BM) * (H // BN), err, budget,
                          _E_RING_FREE, m)
        else:
            ok = wait_geq(ctr + 1 + 2 * MMAX + m - slots, C, err, budget, _E_RING_FREE, m)
    if ok != 0:
        row0 = m * MB
        nrows = tl.minimum(total - row0, MB)
        for r0 in range(c * CR, nrows, C * CR):
            rr = r0 + tl.arange(0, CR)
            rmask = rr < nrows
            rows = row0 + rr
            if DEDUP:
                if ok != 0:
                    ok = _dispatch_dedup(rows, rmask, src, first, T, S, x_tab, x_base, ring, Q,
                                         tcache, tflag, me, err, budget, H, XW, CH)
            else:
                x_rows, valid = _token_rows(src, rows, rmask, T, S, x_tab, x_base, H)
                smask = valid
                dmask = rmask
                if RONLY:  # other ranks' rows (and padding rows, as zeros) only
                    smask = valid & (_token_home(src, rows, rmask, T, S) != me)
                    dmask = rmask & (smask | ~valid)
                _copy_rows(x_rows, smask, ring + (rows % Q).to(tl.int64) * H, dmask, XW, CR,
                           CH)
        if ok != 0:
            if (withhold != 1) | (m != 0):
                signal(ctr + 1 + m)
    return ok


@triton.jit
def _combine(m, c, src, total, outb, ctr, err, comb_base, comb_tab, T, Q, MMAX, budget,
             H: tl.constexpr, S: tl.constexpr, C: tl.constexpr, MB: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, CR: tl.constexpr, CH: tl.constexpr):
    """Push the expert outputs of minibatch m to their (token, k) combine slots."""
    row0 = m * MB
    nrows = tl.minimum(total - row0, MB)
    want = (nrows // BM) * (H // BN)
    ok = wait_geq(ctr + 1 + MMAX + m, want, err, budget, _E_OUTPUT, m)
    if ok != 0:
        for r0 in range(c * CR, nrows, C * CR):
            rr = r0 + tl.arange(0, CR)
            rmask = rr < nrows
            rows = row0 + rr
            dst, valid = _slot_rows(src, rows, rmask, T, S, comb_tab, comb_base, H)
            _copy_rows(outb + (rows % Q).to(tl.int64) * H, valid, dst, valid, H, CR, CH)
        signal(ctr + 1 + 2 * MMAX + m)
    return ok


@triton.jit
def _comm_loop(c, src, total, ring, outb, ctr, err, x_base, x_tab, comb_base, comb_tab,
               T, Q, MMAX, budget, withhold, H: tl.constexpr, XW: tl.constexpr,
               S: tl.constexpr, C: tl.constexpr, MB: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, CR: tl.constexpr, CH: tl.constexpr,
               DEDUP: tl.constexpr = False, first=None, tcache=None, tflag=None, me=0,
               RONLY: tl.constexpr = False, CDIRECT: tl.constexpr = False):
    """Communication program c: dispatch minibatch s, then combine minibatch s - (slots - 1),
    for s = 0, 1, ...; CDIRECT (``combine_direct``): dispatch only (the down tiles write the
    combine slots themselves)."""
    lag = Q // MB - 1
    num_mb = (total + MB - 1) // MB
    steps = num_mb + lag
    if CDIRECT:
        steps = num_mb
    ok = 1
    for step in range(0, steps):
        if (ok != 0) & (step < num_mb):
            ok = _dispatch(step, c, src, total, ring, ctr, err, x_base, x_tab, T, Q, MMAX,
                           budget, withhold, H, XW, S, C, MB, CR, CH, DEDUP, first, tcache,
                           tflag, me, RONLY, CDIRECT, BM, BN)
        if not CDIRECT:
            if (ok != 0) & (step >= lag):
                ok = _combine(step - lag, c, src, total, outb, ctr, err, comb_base, comb_tab,
                              T, Q, MMAX, budget, H, S, C, MB, BM, BN, CR, CH)


@triton.jit
def _weights(lr, g, E, w_ptr, ws_ptr, size: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Base of group g's weight matrix: routed expert lr*E + g, or the shared one (g == E)."""
    w = w_ptr + (lr * E + g).to(tl.int64) * size
    if HAS_SHARED:
        if g == E:
            w = ws_ptr
    return w


@triton.jit
def _weight_desc(lr, g, E, desc, shared_desc, rows: tl.constexpr, TMA: tl.constexpr,
                 HAS_SHARED: tl.constexpr):
    """TMA source of group g's weight tiles: (descriptor, first row), the routed experts'
    [experts*rows, cols] descriptor from row (lr*E + g)*rows, or the shared one (g == E).
    Without TMA there are no descriptors: (0, 0), unused by the tiles."""
    if TMA:
        d = desc
        row0 = (lr * E + g) * rows
        if HAS_SHARED:
            if g == E:
                d = shared_desc
                row0 = 0
        return d, row0
    else:
        return 0, 0


@triton.jit
def _gate_up_item(m, b, j, lr, src, grp, total, ring, hbuf, pre, ctr, err, x_base, x_tab,
                  w1_ptr, ws1_ptr, sw1_ptr, sws1_ptr, w1_desc, ws1_desc, T, E, Q, MMAX, budget,
                  withhold, H: tl.constexpr, I: tl.constexpr, S: tl.constexpr,
                  COMM: tl.constexpr, HAS_SHARED: tl.constexpr, MB: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GJ: tl.constexpr,
                  QUANT: tl.constexpr, POW2: tl.constexpr, SW1: tl.constexpr,
                  F32_DOT: tl.constexpr, TMA: tl.constexpr,
                  INTERLEAVED: tl.constexpr, SAVE_PRE: tl.constexpr,
                  RONLY: tl.constexpr = False, me=0, pre_desc=None, pre_row0=0,
                  PRE_TMA: tl.constexpr = False):
    """GJ consecutive gate+up tiles (column tiles j*GJ ..) of row block b: one wait, one
    signal (+GJ) for all of them. QUANT > 0: the FP8 tiles (token and h rows are FP8 rows in
    bf16-row storage; w1 / sw1 e4m3 weights and their scales, SW1 scales per expert).
    RONLY (``dispatch_remote_only``): the rows of rank ``me``'s own tokens straight from its
    token buffer (filled before the launch), the others from the ring. PRE_TMA
    (``pre_tma_store``): the pre-activations stored through ``pre_desc`` ([L*P, 2I], this
    logical rank's rows from ``pre_row0``)."""
    GATHER: tl.constexpr = COMM == 0
    ok = 1
    slots = Q // MB
    if COMM > 0:
        ok = wait_geq(ctr + 1 + m, COMM, err, budget, _E_DISPATCHED, m)
    else:
        if m >= slots:  # the down tiles of minibatch m - slots still read this SwiGLU slot
            ok = wait_geq(ctr + 1 + MMAX + m - slots, (MB // BM) * (H // BN), err, budget,
                          _E_HSLOT_FREE, m)
    if ok != 0:
        g = tl.load(grp + b)
        rows = b * BM + tl.arange(0, BM)
        qrows = (rows % Q).to(tl.int64)
        w1 = _weights(lr, g, E, w1_ptr, ws1_ptr, H * 2 * I, HAS_SHARED)
        if COMM > 0:
            a_rows = ring + qrows * H
            a_valid = rows >= 0
            if RONLY:
                x_rows, x_valid = _token_rows(src, rows, a_valid, T, S, x_tab, x_base, H)
                own = x_valid & (_token_home(src, rows, a_valid, T, S) == me)
                a_rows = tl.where(own, x_rows, a_rows)
        else:  # gather straight from the (peer) token buffers
            a_rows, a_valid = _token_rows(src, rows, rows >= 0, T, S, x_tab, x_base, H)
        # rows per expert of the descriptor's 2-D view: H of [H, 2I], 2I of FP8's K-major [2I, H]
        W1_ROWS: tl.constexpr = 2 * I if QUANT > 0 else H
        d1, w_row0 = _weight_desc(lr, g, E, w1_desc, ws1_desc, W1_ROWS, TMA, HAS_SHARED)
        h_rows = hbuf + qrows * I
        pre_rows = pre + rows.to(tl.int64) * (2 * I)
        if QUANT > 0:
            sw1 = _weights(lr, g, E, sw1_ptr, sws1_ptr, SW1, HAS_SHARED)
            gate_up_fp8_tiles(a_rows, a_valid, w1, sw1, j * GJ, h_rows, pre_rows, d1, w_row0,
                              H, I, BM, BN, BK, GJ, QUANT, POW2, F32_DOT, SAVE_PRE, TMA)
        else:
            gate_up_swiglu_tiles(a_rows, a_valid, w1, j * GJ, h_rows, d1, w_row0, pre_rows, H,
                                 I, BM, BN, BK, GJ, QUANT, GATHER, F32_DOT, TMA, INTERLEAVED,
                                 SAVE_PRE, pre_desc, pre_row0 + b * BM, PRE_TMA)
        if (withhold != 2) | (b != 0):
            if QUANT == 4:  # ROWWISE_ALL: the item that completes the row block requantises
                # its h rows (a row's scale needs all its columns), then adds the +1 the down
                # items wait for beyond the tiles
                NT: tl.constexpr = I // (BN // 2)
                tl.debug_barrier()
                old = tl.atomic_add(ctr + 1 + 3 * MMAX + b, GJ, sem="acq_rel", scope="gpu")
                tl.debug_barrier()  # every thread reads after the acquire of that add
                if old + GJ == NT:
                    requant_whole_rows(h_rows, I, BM, POW2, F32_DOT)
                    signal(ctr + 1 + 3 * MMAX + b, 1)
            else:
                signal(ctr + 1 + 3 * MMAX + b, GJ)
    return ok


@triton.jit
def _sum_arrived(src, rows, rmask, jd, comb_base, comb_tab, y_ptr, p_ptr, sums, T,
                 H: tl.constexpr, S: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, DT: tl.constexpr):
    """After a down item stored its rows' columns [jd*DT*BN, (jd+1)*DT*BN) into their combine
    slots: count each row's arrival for its token (acq_rel, after a CTA barrier so every
    thread's stores come first); for the rows whose arrival was the token's S-th, sum the
    token's S slots in k order (fp32; the shared slot unweighted) and write those y columns.
    Tokens are numbered n = r*T + t over the launch's ranks; slot (n, k) is comb row
    comb_tab[r] + (t*S + k)*H, as in ``_slot_rows``."""
    NJ: tl.constexpr = H // BN  # row stride of sums ([L*T, H/BN]; items use the first H/BN/DT)
    SUB: tl.constexpr = 64 if BN > 64 else BN  # columns summed at once (register pressure)
    s = tl.load(src + rows, mask=rmask, other=-1)
    valid = s >= 0
    n = (tl.maximum(s, 0) // S).to(tl.int64)
    tl.debug_barrier()
    old = tl.atomic_add(sums + n * NJ + jd, 1, mask=valid, sem="acq_rel", scope="gpu")
    last = valid & (old == S - 1)
    tl.debug_barrier()  # the loads below come after the acquiring thread's atomic
    if tl.max(last.to(tl.int32), 0) > 0:
        off = tl.load(comb_tab + n // T, mask=last, other=0)
        slot0 = comb_base + off + (n % T) * (S * H)
        for c0 in tl.static_range(0, DT * BN, SUB):
            cols = jd * (DT * BN) + c0 + tl.arange(0, SUB)
            acc = tl.zeros((BM, SUB), dtype=tl.float32)
            for k in range(K):  # not unrolled: one slot's loads in flight (registers)
                pk = tl.load(p_ptr + n * K + k, mask=last, other=0.0)
                v = tl.load(slot0[:, None] + k * H + cols[None, :], mask=last[:, None],
                            other=0.0, cache_modifier=".cg")
                acc += pk[:, None] * v.to(tl.float32)
            if S > K:
                acc += tl.load(slot0[:, None] + K * H + cols[None, :], mask=last[:, None],
                               other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(y_ptr + n[:, None] * H + cols[None, :], acc.to(tl.bfloat16),
                     mask=last[:, None])


@triton.jit
def _down_item(m, b, jd, lr, src, grp, hbuf, outb, ctr, err, comb_base, comb_tab, w2_ptr,
               ws2_ptr, sw2_ptr, sws2_ptr, h_desc, w2_desc, ws2_desc, y_ptr, p_ptr, sums, T, E,
               Q, MMAX, budget, H: tl.constexpr, I: tl.constexpr, S: tl.constexpr,
               K: tl.constexpr, COMM: tl.constexpr, HAS_SHARED: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, QUANT: tl.constexpr,
               SW2: tl.constexpr, F32_DOT: tl.constexpr, TMA: tl.constexpr,
               FUSED_SUM: tl.constexpr, CDIRECT: tl.constexpr = False):
    """DT consecutive down tiles (column tiles jd*DT ..) of row block b: one wait, one
    signal for all of them (the fixed per-item cost is a few L2 round trips). Without
    communication programs, or CDIRECT (``combine_direct``), the tiles go straight to the
    rows' (peer) combine slots, else to the output ring that the communication programs
    push."""
    # every gate+up tile of the row block (ROWWISE_ALL: then its requantisation, +1)
    ok = wait_geq(ctr + 1 + 3 * MMAX + b, I // (BN // 2) + (QUANT == 4), err, budget,
                  _E_ROWBLOCK, b)
    if ok != 0:
        g = tl.load(grp + b)
        rows = b * BM + tl.arange(0, BM)
        qrows = (rows % Q).to(tl.int64)
        w2 = _weights(lr, g, E, w2_ptr, ws2_ptr, I * H, HAS_SHARED)
        h_rows = hbuf + qrows * I
        h_row0 = lr * Q + (b * BM) % Q  # row block b's h rows are contiguous
        W2_ROWS: tl.constexpr = H if QUANT > 0 else I  # FP8 w2 is K-major [H, I]
        d2, w_row0 = _weight_desc(lr, g, E, w2_desc, ws2_desc, W2_ROWS, TMA, HAS_SHARED)
        if (COMM == 0) or CDIRECT:  # scatter straight into the (peer) combine slots
            dst, valid = _slot_rows(src, rows, rows >= 0, T, S, comb_tab, comb_base, H)
        else:  # the output ring; the communication programs push it
            dst = outb + qrows * H
            valid = rows >= 0
        if QUANT > 0:
            sw2 = _weights(lr, g, E, sw2_ptr, sws2_ptr, SW2, HAS_SHARED)
            down_fp8_tiles(h_rows, w2, sw2, jd * DT, dst, valid, d2, w_row0, I, H, BM, BN, BK,
                           DT, QUANT, F32_DOT, TMA)
        else:
            down_tiles(h_rows, w2, jd * DT, h_desc, h_row0, d2, w_row0, dst, valid, I, H, BM,
                       BN, BK, DT, F32_DOT, TMA)
        if FUSED_SUM:
            _sum_arrived(src, rows, rows >= 0, jd, comb_base, comb_tab, y_ptr, p_ptr, sums, T,
                         H, S, K, BM, BN, DT)
        signal(ctr + 1 + MMAX + m, DT)
    return ok


@triton.jit
def _compute_loop(lr, src, grp, total, ring, hbuf, pre, outb, ctr, err, x_base, x_tab,
                  comb_base, comb_tab, w1_ptr, w2_ptr, ws1_ptr, ws2_ptr, sw1_ptr, sw2_ptr,
                  sws1_ptr, sws2_ptr, w1_desc, w2_desc, ws1_desc, ws2_desc, h_desc, y_ptr,
                  p_ptr, sums, T, E, Q, MMAX, budget, withhold,
                  H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, K: tl.constexpr,
                  COMM: tl.constexpr, HAS_SHARED: tl.constexpr, MB: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                  GJ: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr,
                  SW1: tl.constexpr, SW2: tl.constexpr, F32_DOT: tl.constexpr,
                  TMA: tl.constexpr, INTERLEAVED: tl.constexpr, PREFETCH: tl.constexpr,
                  FUSED_SUM: tl.constexpr, SAVE_PRE: tl.constexpr, trace=None, MAXT=0,
                  lp=0, TRACE: tl.constexpr = False, SKEW: tl.constexpr = False,
                  RONLY: tl.constexpr = False, CDIRECT: tl.constexpr = False, me=0,
                  pre_desc=None, pre_row0=0, PRE_TMA: tl.constexpr = False):
    """Claim tickets until the work of this logical rank is done (or an error is set).
    TRACE (profiling only): each item writes (start, end) in global-timer nanoseconds,
    program ``lp`` and its kind (0 gate+up, 1 down) at its ticket in ``trace`` [MAXT, 4].

    PREFETCH: claim the next ticket when an item starts, so the atomic's round trip to L2
    overlaps the item instead of sitting between two items. Still deadlock-free: the smallest
    unfinished ticket is never one that is only claimed, since its holder is then running a
    smaller, unfinished one; so it is running, and waits only on smaller (finished) tickets."""
    N1: tl.constexpr = I // (BN // 2) // GJ  # gate+up items (GJ tiles each) per row block
    N2: tl.constexpr = H // BN // DT  # down items (DT tiles each) per row block
    NBM: tl.constexpr = MB // BM
    PER_MB: tl.constexpr = NBM * (N1 + N2)
    NG1: tl.constexpr = NBM * N1  # gate+up items per minibatch
    # SKEW: one more (empty) gate+up section, of the minibatch after the last
    n_items = (total + MB - 1) // MB * PER_MB + (NG1 if SKEW else 0)
    ok = no_error(err)
    tk = tl.atomic_add(ctr, 1, sem="relaxed", scope="gpu")
    while (tk < n_items) & (ok != 0):
        if TRACE:
            t0 = globaltimer(tk, F32_DOT)
        if PREFETCH:
            tk_next = tl.atomic_add(ctr, 1, sem="relaxed", scope="gpu")
        if SKEW:  # [G 0] then per m: [G m + 1][D m] (G past the last: skipped below)
            u = tl.maximum(tk - NG1, 0)
            m = u // PER_MB
            i = u % PER_MB
            if tk < NG1:
                m = 0
                i = tk
            elif i < NG1:
                m = m + 1
        else:
            m = tk // PER_MB
            i = tk % PER_MB
        if i < NG1:
            b = m * NBM + i // N1
            if b * BM < total:
                ok = _gate_up_item(m, b, i % N1, lr, src, grp, total, ring, hbuf, pre, ctr,
                                   err, x_base, x_tab, w1_ptr, ws1_ptr, sw1_ptr, sws1_ptr,
                                   w1_desc, ws1_desc, T, E, Q, MMAX, budget, withhold, H, I, S,
                                   COMM, HAS_SHARED, MB, BM, BN, BK, GJ, QUANT, POW2, SW1,
                                   F32_DOT, TMA, INTERLEAVED, SAVE_PRE, RONLY, me,
                                   pre_desc, pre_row0, PRE_TMA)
        else:
            i2 = i - NG1
            b = m * NBM + i2 // N2
            if b * BM < total:
                ok = _down_item(m, b, i2 % N2, lr, src, grp, hbuf, outb, ctr, err, comb_base,
                                comb_tab, w2_ptr, ws2_ptr, sw2_ptr, sws2_ptr, h_desc, w2_desc,
                                ws2_desc, y_ptr, p_ptr, sums, T, E, Q, MMAX, budget, H, I, S, K,
                                COMM, HAS_SHARED, BM, BN, BK, DT, QUANT, SW2, F32_DOT, TMA,
                                FUSED_SUM, CDIRECT)
        if TRACE:
            record_item(trace, tk, MAXT, t0, globaltimer(tk, F32_DOT), lp, i >= NG1)
        if PREFETCH:
            tk = tk_next
        else:
            tk = tl.atomic_add(ctr, 1, sem="relaxed", scope="gpu")


@triton.jit
def mok_forward_kernel(
        x_base, x_tab, comb_base, comb_tab,  # own token / combine buffer; [R] int64 offsets
        src_ptr, group_ptr, total_ptr,  # schedule: [L, P] int32, [L, P/BM] int32, [L] int32
        ring_ptr, h_ptr, out_ptr,  # [L, Q, H], [L, Q, I], [L, Q, H] bf16
        pre_ptr,  # SAVE_PRE: gate/up pre-activations [L, P, 2I] bf16
        ctr_ptr, err_ptr,  # [L, NCTR] int32 counters, [L, 4] int32 error words
        y_ptr, p_ptr, sum_ptr,  # FUSED_SUM: y [L*T, H] bf16, p [L*T, K] fp32, [L*T, H/BN] i32
        w1_ptr, w2_ptr, ws1_ptr, ws2_ptr,  # [L*E, H, 2I], [L*E, I, H], [H, 2I], [I, H] bf16
        sw1_ptr, sw2_ptr, sws1_ptr, sws2_ptr,  # QUANT > 0: their scales (w*_ptr are e4m3)
        w1_desc, w2_desc, ws1_desc, ws2_desc, h_desc,  # TMA descriptors (None unless TMA)
        T, E, P, Q, NCTR, MMAX, budget, withhold,
        H: tl.constexpr, I: tl.constexpr, XW: tl.constexpr, S: tl.constexpr,
        PROGS: tl.constexpr, COMM: tl.constexpr, HAS_SHARED: tl.constexpr, MB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
        GJ: tl.constexpr, CR: tl.constexpr,
        CH: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr, SW1: tl.constexpr,
        SW2: tl.constexpr, F32_DOT: tl.constexpr, TMA: tl.constexpr,
        INTERLEAVED: tl.constexpr, PREFETCH: tl.constexpr, K: tl.constexpr,
        FUSED_SUM: tl.constexpr, SAVE_PRE: tl.constexpr, DEDUP: tl.constexpr = False,
        first_ptr=None, tcache_ptr=None, tflag_ptr=None, rank0=0, NTOK=0, trace_ptr=None,
        MAXT=0, TRACE: tl.constexpr = False, SKEW: tl.constexpr = False,
        RONLY: tl.constexpr = False, CDIRECT: tl.constexpr = False, pre_desc=None,
        PRE_TMA: tl.constexpr = False):
    """One persistent program per SM. x_tab/comb_tab hold, for every EP rank r, the element
    offset of rank r's token / combine buffer from x_base / comb_base (peer memory). DEDUP
    (``dispatch_dedup``): ``first_ptr`` [L, P] each row's token's first row here,
    ``tcache_ptr`` [L, NTOK, XW] the token cache, ``tflag_ptr`` [L, NTOK] its flags (zeroed
    before the launch), ``rank0`` the EP rank of logical rank 0 (also with RONLY). RONLY
    (``dispatch_remote_only``): the communication programs pull only other ranks' rows, the
    gate+up tiles read their own rank's from its token buffer. CDIRECT (``combine_direct``):
    the down tiles write the (peer) combine slots, the communication programs only
    dispatch. PRE_TMA (``pre_tma_store``, with SAVE_PRE): ``pre_desc`` is a TMA descriptor
    over the pre-activations as [L*P, 2I] with [BM, BN/2] boxes. TRACE (profiling only):
    the compute programs' items at ``trace_ptr`` [L, MAXT, 4] (``_compute_loop``)."""
    pid = tl.program_id(0)
    lr = pid // PROGS
    lp = pid % PROGS
    ctr = ctr_ptr + lr * NCTR
    err = err_ptr + lr * 4
    src = src_ptr + lr.to(tl.int64) * P
    grp = group_ptr + lr * (P // BM)
    total = tl.load(total_ptr + lr)
    ring = ring_ptr + lr.to(tl.int64) * Q * H
    hbuf = h_ptr + lr.to(tl.int64) * Q * I
    pre = pre_ptr + lr.to(tl.int64) * P * (2 * I)
    outb = out_ptr + lr.to(tl.int64) * Q * H
    if COMM > 0:
        if lp < COMM:
            if DEDUP:
                _comm_loop(lp, src, total, ring, outb, ctr, err, x_base, x_tab, comb_base,
                           comb_tab, T, Q, MMAX, budget, withhold, H, XW, S, COMM, MB, BM, BN,
                           CR, CH, DEDUP, first_ptr + lr.to(tl.int64) * P,
                           tcache_ptr + lr.to(tl.int64) * NTOK * XW,
                           tflag_ptr + lr.to(tl.int64) * NTOK, rank0 + lr, RONLY, CDIRECT)
            else:
                _comm_loop(lp, src, total, ring, outb, ctr, err, x_base, x_tab, comb_base,
                           comb_tab, T, Q, MMAX, budget, withhold, H, XW, S, COMM, MB, BM, BN,
                           CR, CH, False, None, None, None, rank0 + lr, RONLY, CDIRECT)
        else:
            _compute_loop(lr, src, grp, total, ring, hbuf, pre, outb, ctr, err, x_base, x_tab,
                          comb_base, comb_tab, w1_ptr, w2_ptr, ws1_ptr, ws2_ptr, sw1_ptr,
                          sw2_ptr, sws1_ptr, sws2_ptr, w1_desc, w2_desc, ws1_desc, ws2_desc,
                          h_desc, y_ptr, p_ptr, sum_ptr, T, E, Q, MMAX, budget, withhold, H, I,
                          S, K, COMM, HAS_SHARED, MB, BM, BN, BK, DT, GJ, QUANT, POW2, SW1,
                          SW2, F32_DOT, TMA, INTERLEAVED, PREFETCH, FUSED_SUM, SAVE_PRE,
                          trace_ptr + lr.to(tl.int64) * MAXT * 4 if TRACE else trace_ptr, MAXT,
                          lp, TRACE, SKEW, RONLY, CDIRECT, rank0 + lr, pre_desc, lr * P,
                          PRE_TMA)
    else:
        _compute_loop(lr, src, grp, total, ring, hbuf, pre, outb, ctr, err, x_base, x_tab,
                      comb_base, comb_tab, w1_ptr, w2_ptr, ws1_ptr, ws2_ptr, sw1_ptr, sw2_ptr,
                      sws1_ptr, sws2_ptr, w1_desc, w2_desc, ws1_desc, ws2_desc, h_desc, y_ptr,
                      p_ptr, sum_ptr, T, E, Q, MMAX, budget, withhold, H, I, S, K, COMM,
                      HAS_SHARED, MB, BM, BN, BK, DT, GJ, QUANT, POW2, SW1, SW2, F32_DOT, TMA,
                      INTERLEAVED, PREFETCH, FUSED_SUM, SAVE_PRE,
                      trace_ptr + lr.to(tl.int64) * MAXT * 4 if TRACE else trace_ptr, MAXT, lp,
                      TRACE, SKEW, False, False, 0, pre_desc, lr * P, PRE_TMA)


@triton.jit
def weighted_sum_kernel(comb_ptr, p_ptr, y_ptr, H: tl.constexpr, K: tl.constexpr,
                        S: tl.constexpr, BH: tl.constexpr):
    """y[n, :] = sum_k p[n, k] * comb[n, k, :] (+ comb[n, K, :], the shared expert), fp32
    accumulation in fixed k order: bitwise reproducible."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cm = cols < H
    base = comb_ptr + n * S * H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k in tl.static_range(K):
        p = tl.load(p_ptr + n * K + k)
        acc += p * tl.load(base + k * H + cols, mask=cm, other=0.0).to(tl.float32)
    if S > K:
        acc += tl.load(base + K * H + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(y_ptr + n * H + cols, acc.to(tl.bfloat16), mask=cm)


@triton.jit
def gather_sum_kernel(rows_ptr, inv_ptr, y_ptr, H: tl.constexpr, S: tl.constexpr,
                      BH: tl.constexpr):
    """y[n, :] = sum_s rows[inv[n * S + s], :] over the S slots of token n (``bwd_dx_rows``:
    the dX rows in the schedule's order, ``inv`` the schedule row of every (token, slot)),
    fp32 accumulation in fixed slot order: bitwise ``weighted_sum_kernel`` with unit
    weights over the combine slots (1 * v + acc rounds as v + acc)."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cm = cols < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for s in tl.static_range(S):
        r = tl.load(inv_ptr + n * S + s).to(tl.int64)
        acc += tl.load(rows_ptr + r * H + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(y_ptr + n * H + cols, acc.to(tl.bfloat16), mask=cm)
