"""Knobs of the MoK megakernels (forward and backward), their validation, and the minibatch
planner.

Legend: H hidden, I expert intermediate, F = 2*I (gate then up columns), BM/BN/BK tile sizes
(rows, output columns, reduction depth) of the grouped GEMMs.

Every check raises :class:`MoKConfigError` with one line naming the field, its value and what
is allowed, so a bad sweep fails before any buffer is allocated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# "none" and the FP8 recipes, in the order of their codes in the kernels (tl_gemm_fp8).
FP8_MODES = ("none", "blockwise", "rowwise", "mx", "rowwise_all")


class MoKConfigError(ValueError):
    """A bad MoK knob; the message is one line: field, value, what is allowed."""


def _check(cond: bool, field_name: str, value: object, allowed: str) -> None:
    if not cond:
        raise MoKConfigError(f"{field_name}={value!r} is invalid: allowed {allowed}")


def _is_pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and (v & (v - 1)) == 0


@dataclass(frozen=True)
class MoKConfig:
    """Knobs of both megakernels (the backward reuses the tiles, stages and spin budget; its own
    knob is ``bwd_wide_da``).

    fwd_comm_sms: programs (one per SM) per EP rank that run pull dispatch and push combine;
        0 = no communication programs: the GEMM programs gather their rows straight from the
        (peer) token buffers and scatter results straight into the (peer) combine buffers.
    dispatch_dedup: the communication programs pull a remote token's row once per
        destination rank, for its first schedule row there, into a token cache as well as
        the ring; the token's other rows on that rank copy it from the cache (local memory)
        once a per-token flag says it is in. NVLink bytes of dispatch then go from one row
        per (token, k) slot to one per (token, destination rank), as DeepEP and HybridEP send
        (notes/mok-kernel.md, "mok at EP 2"). Needs fwd_comm_sms > 0. Off by default: at EP
        2 on two H200s the forward was slower with it in every cell timed (bf16 and FP8;
        results/20261201-102706-h200x2-mok-ep, results/20261201-101615-h200x2-fp8), by
        0.15-0.42 ms in bf16 and 0.8-2.1 ms in FP8.
    dispatch_remote_only: the communication programs pull only other ranks' token rows into
        the ring; the gate+up tiles read their own rank's rows straight from its token buffer
        (as without communication programs), so a rank's dispatch moves only the rows that
        cross NVLink (about half of them at EP 2) and no local copies. Needs fwd_comm_sms > 0
        and not dispatch_dedup. Off by default: untimed.
    combine_direct: the down tiles write their rows straight into the (peer) combine slots
        (stores over NVLink for other ranks' tokens, as without communication programs)
        instead of the output ring, and the communication programs only dispatch: no combine
        copies, and the last minibatch's combine no longer trails the GEMMs. A ring slot is
        free once the down tiles of its previous minibatch are done. Needs fwd_comm_sms > 0.
        Off by default: untimed. With dispatch_remote_only, the communication programs move
        only the remote rows of the dispatch: about a quarter of their default bytes at EP 2.
    minibatch: schedule rows (tokens x k, padded per expert to block_m) handed to the experts
        at once; a multiple of block_m.
    macrobatch: ring capacity in rows; a multiple of minibatch (ring slots = macrobatch /
        minibatch; dispatch runs up to slots - 1 minibatches ahead of compute).
    capacity_mult: worst-case fraction of all (token, k) slots of the EP group that one rank
        receives. It sizes only the schedule (4 bytes per row), so the default 1.0 never
        drops a token; a smaller value that routing exceeds sets the device error word.
    block_m/block_n/block_k: GEMM tile (block_n gate+up columns = block_n/2 gate + block_n/2
        up; the down GEMM uses the same block_n over H).
    num_warps/num_stages: Triton launch knobs of the megakernel.
    spin_budget: polls a bounded wait makes before it records a timeout and exits (about
        0.5-1 us each on H200).
    down_tiles: down-GEMM column tiles per work item (one wait and one signal for all);
        falls back to 1 where it does not divide hidden / block_n. The tiles of one item run
        as one flattened loop, software-pipelined with ``tma`` (loads continue across the
        epilogues); with pointer loads Triton 3.6 does not pipeline the flattened loop.
        Its measurements: notes/mok-kernel.md, "Why the mok backend's defaults are what
        they are".
    gate_up_tiles: gate+up column tiles per work item, the same way; falls back to 1 where
        it does not divide intermediate / (block_n / 2). Use with ``gate_up_interleaved``:
        with split gate/up columns the two accumulators' reset serialises the MMAs.
    tma: load the weight tiles (both GEMMs) and the down GEMM's SwiGLU rows through TMA
        tensor descriptors (SM90 and newer) instead of pointer loads; the gathered token rows
        of the gate+up GEMM stay pointer loads.
    gate_up_interleaved: the gate+up weights come with gate and up columns alternating
        (``interleave_gate_up``), so a gate+up tile is one [block_k, block_n] weight tile
        and one dot (one 128x256 MMA accumulator, split in registers for SwiGLU) instead of
        two half-width tiles and two dots. The caller keeps the weights in that layout.
    prefetch_ticket: a compute program claims its next work item when the current one
        starts (one L2 atomic round trip per item off the critical path).
    skew_down: the compute programs' ticket order puts the down items of minibatch m after
        the gate+up items of minibatch m + 1 ([G0][G1][D0][G2][D1]...[D last]) instead of
        right after their own ([G0][D0][G1][D1]...), so a program that claims a down item
        finds its row block's gate+up items done or running for a while, instead of
        waiting on items claimed just before it. Where a minibatch holds fewer gate+up items
        than there are compute programs (e.g. Qwen3.5 at one H200: 66 items of four tiles
        for 132 programs), half the down items otherwise wait most of a gate+up item's time
        (the item trace of ``benchmarks/mok_backward_time.py --trace``). Deadlock free with
        at least two ring slots: a gate+up item of minibatch m waits only on the down items
        of minibatch m - slots (its ring slot), which come before it.
    pre_tma_store: in the training forward, the gate+up tiles store their bf16
        pre-activations (what the backward keeps) through TMA, two [block_m, block_n / 2]
        boxes a tile, instead of plain stores. The plain store of a [128, 256] tile
        converts its layout and computes a 64-bit address per element; at Kimi K2 48 x
        16384 (sm_90, three stages, Triton 3.9) that build spills (255 registers) where
        the inference build does not, and the spill loads and stores sit in the same
        flattened loop as the MMAs. Through TMA the tile goes out from shared memory while
        the next tile's K loop runs. Needs ``tma`` and bf16 (the FP8 tiles keep their own
        store), and with several gate+up tiles per item at most three stages. The same
        bytes, so the same gradients. Off: on one H100 at Kimi K2 48 x 16384 the profiling
        script timed the training forward at 19.808 / 19.796 / 19.757 ms with it against
        19.841 / 19.417 / 19.412 without, and results/20261207-002933-h100-bf16-e48-rounds-mok
        at 19.958 against 19.920 (notes/mok-kernel.md): the spill was not what the training
        forward pays over the inference forward.
    compile_schedule: build the schedule through ``torch.compile`` (the same ops, fused into
        a few kernels instead of about fifty small launches; compiled once per shape).
    fused_sum: the router-weighted sum over k runs inside the megakernel: each down item
        counts its rows' arrivals per (token, column tile) and the item that brings a count
        to S sums that token's S slots in fixed k order and writes y, so the sum overlaps the
        GEMMs instead of running as a separate pass over [T, S, H] after them. Bitwise
        reproducible like the separate pass. Needs ``fwd_comm_sms`` 0 and one process (one
        rank or loopback ranks: every slot is in local memory). Off by default: measured
        slower on H200, the summing item's loads stall its GEMM work (notes/mok-kernel.md,
        "Why the mok backend's defaults are what they are").
    bwd_wide_da: the backward's dA items cover block_n intermediate columns (m64n256 MMAs,
        the SwiGLU-backward epilogue in four quarters) instead of block_n / 2 (m64n128, two
        halves); falls back to block_n / 2 where block_n does not divide the intermediate
        size. Off in the plain config; the mok backend turns it on for Hopper, where it
        measured as fast or faster (notes/mok-kernel.md, "Why the mok backend's
        defaults are what they are").
    bwd_fused_pull: the backward's reverse-combine pull (dY and x rows of every schedule row
        into contiguous buffers) runs inside the backward megakernel, one item per row block
        claimed before any GEMM item, instead of as a kernel of its own before it: the dA items
        of a row block start as soon as its rows are in, overlapping the rest of the pull.
        Off by default: measured no faster on one H200 with every program pulling first
        (notes/mok-kernel.md).
    bwd_pull_programs: with ``bwd_fused_pull``, how many programs per logical rank run the
        pull items (the others start on dA items at once and wait for their row blocks, so
        the memory-bound pull overlaps the compute-bound GEMMs on other SMs); 0 = every
        program pulls before its first GEMM item. With ``bwd_fp8_da`` the dA items read dY's
        FP8 rows at home and do not wait for the pull: the weight-gradient items wait for
        every row block of their group instead (a count per group), so the pull overlaps
        the dA and dX items (with ``bwd_fp8_wgrad`` the pull items write the FP8 transposed
        copies of x and dY). Slower than the separate pull in three of four FP8 scenarios
        with 32 pulling programs (results/20261201-123141-h200-fp8-backward).
    bwd_pull_dedup: the backward's separate pull fetches a token's x and dY rows from its
        home rank once per rank, for its first schedule row there, and a second pass copies
        them to the token's other rows from that local row: NVLink bytes of the
        reverse-combine pull go from one row per (token, k) slot to one per (token, rank), as
        ``dispatch_dedup`` does for the forward. Gradients bitwise the plain pull's. Needs
        the separate pull (not bwd_fused_pull); with
        ``bwd_fp8_wgrad`` it keeps the first rows' bf16 x and dY as the second pass's
        source (P x H x 2 bytes more scratch). Off here; the mok backend turns it on at EP 2
        and more, where it made the backward faster in every cell timed
        (``mokbench.mok_backend.default_config_fields``).
    bwd_dx_tiles: H tiles of block_n columns per dX (B) work item of the backward, in one
        flattened loop (the next tile's loads overlap a tile's store, as gate_up_tiles and
        down_tiles do in the forward); must divide hidden / block_n. 1 here; the mok backend
        sets 4 in bf16 cells on one Hopper rank (notes/mok-kernel.md).
    bwd_da_tiles: I tiles per dA (A) work item of the backward, in one flattened loop (the
        next tile's loads overlap a tile's SwiGLU-backward epilogue); must divide the number
        of dA tiles (intermediate / (block_n / 2), or / block_n with bwd_wide_da). 1 by
        default: four per item were slower on one H200 (benchmarks/mok_backward_time.py,
        notes/mok-kernel.md).
    bwd_dx_tma: the backward's dX (B) items load their dGU rows [block_m, block_k] through a
        TMA descriptor (after an async-proxy fence that orders the A items' plain stores of
        those rows) instead of by per-thread asynchronous copies: both GEMM operands then
        arrive by TMA, leaving registers to the [block_m, block_n] accumulator (the sm_90
        build of the B items uses 250 of 255 registers by copies). Off in the plain config;
        the mok backend turns it on for Hopper, where it measured faster (its
        ``default_config_fields``).
    bwd_lean_epilogue: the dA items' SwiGLU backward in fewer instructions, the same values
        to a few fp32 ulps: the sigmoid by inline PTX (``ex2.approx.ftz``, ``rcp.approx.ftz``)
        instead of Triton's lowering with its subnormal fix-ups; r h computed once (Triton
        otherwise recomputes the sigmoid in the r h store's register layout); dG's factor as
        sig + silu (1 - sig). On sm_90 the dA items' build falls from 7000 to 3696 SASS
        instructions (Kimi K2 48; no spills; the whole backward 8 bytes of spill stores
        against none). On by default; off, the kernel is the one before it, PTX for PTX.
    bwd_block_m: rows per row block of the backward (0 = block_m): a multiple of block_m,
        and the schedule then pads every expert's rows to it (``row_align``), so the forward
        runs its block_m-row tiles on the same schedule and the backward its own. For the FP8
        forward, whose tiles are 64 rows on Hopper, while the BF16 backward ran far faster at
        128 (Kimi 48 x 16384 on one H200: 37.186 against 48.781 ms in
        results/20261130-215158-h200-fp8).
        Costs the forward up to bwd_block_m - block_m padding rows per expert.
    bwd_fp8_da: the backward's dA items (dgrad of the down projection, dA = dY @ W_down^T,
        a sixth of the backward's FLOPs) run FP8 tiles with fp32 accumulation, row-wise
        scaled (pure tensor-core K loops, both scales applied after): dY quantised once per
        token at its home rank (one scale per row over H) and read by the dA items straight
        from there (no pull of these rows), W_down quantised once per (expert, intermediate
        row) over H (``quantize_backward_weights``, passed to ``backward``). The dG/dU rows,
        the dX and weight-gradient items stay bf16. First stage of the FP8 backward (the
        plan in notes/mok-kernel.md); off by default (the mok backend turns it on in FP8 cells
        on Hopper).
    bwd_fp8_dx: the backward's dX items (dgrad of gate+up, dX = [dG dU] @ W_gate_up^T, a
        third of the backward's FLOPs) run FP8 tiles, row-wise scaled: the dA item whose
        counter add completes a row block reads the block's dG/dU rows back (bf16, as the
        dW_gate_up items still read them), quantises them, one scale per row over 2I, into
        scratch rows, then releases the row block to its dX items; W_gate_up is quantised
        once per (expert, hidden row) over 2I (``quantize_backward_weights``). Second stage
        of the FP8 backward; off by default (on in the mok backend's FP8 cells on Hopper).
    bwd_fp8_wgrad: the backward's weight-gradient items (dW_down = (r h)^T dY and
        dW_gate_up = x^T [dG dU], K = the expert's rows: half of the backward's FLOPs) run
        FP8 tiles with fp32 accumulation and pure tensor-core K loops, each operand scaled
        per column (one scale per feature over the reduction's rows, applied after the
        loop) and held transposed (feature-major, rows contiguous: Hopper's FP8 MMAs read
        both operands K-major). x and dY: one scale per hidden column over every rank's
        tokens (each rank's column max taken at home, their max read from the peers), and
        the pull kernel writes their FP8 transposed copies instead of the bf16 x rows; r h
        and dG/dU: one scale per column over the expert's rows (quantisation items after the
        dX items take each column's max over the expert's rows, then write the transposed
        copies; the weight-gradient items wait for those). Needs the separate pull, or
        ``bwd_fused_pull`` with ``bwd_fp8_da`` (the pull items then write the FP8 copies).
        Third stage of the FP8 backward; off by default (on in the mok backend's FP8 cells
        on Hopper).
    bwd_fp8_block_colmax: with ``bwd_fp8_dx`` and ``bwd_fp8_wgrad``: the dA item that
        completes a row block (and requantises its dG/dU rows) also stores the block's column
        maxima of r h and dG/dU (fp32, P / block_m x 3I per rank; the rows are in L2 then),
        and the Q items take each column's max over the group from those instead of a first
        pass over the group's rows: half of the Q items' reads. Max is exact in any order, so
        the gradients are bitwise those without it. Off by default: in
        results/20261201-123141-h200-fp8-backward faster at two scenarios, slower at two.
    bwd_fused_colmax: with ``bwd_fp8_wgrad``: the column maxima of x and dY (the scales of
        their FP8 transposed copies) come from the row quantisations that read them anyway,
        each program of the quantiser storing its rows' column max, then one max over those:
        x's from the FP8 training forward's quantisation of x (a row-wise recipe; kept in its
        context, 4 bytes per hidden column), dY's from the backward's row quantisation for
        the FP8 dA items (``bwd_fp8_da``); instead of a reduction pass over each of them
        (torch's, about 0.2 ms for both at Kimi K2 x 16384 under torch.profiler). The maxima
        are exact, so the gradients are bitwise the same (Triton's interpreter). Off until
        timed.
    bwd_q_count_rows: with ``bwd_fp8_wgrad``: the Q items tell a group's padding rows from
        its real row count (the schedule's counts, loaded once per item: a group's real
        rows come first, its padding last) instead of loading each step's slot ids
        (an async copy of 64 int32 and its wait per step). The same rows, so the same
        gradients; off here, on in mokbench's FP8 cells on Hopper (faster at four shapes in
        results/20261204-102834-h200-fp8-backward).
    bwd_q_cols: with ``bwd_fp8_wgrad``: columns of r h and dG/dU per Q item; 0 (the
        default) block_n / 2. A Q item reads its columns twice (a column-max pass, then the
        quantising pass) over its group's rows; at block_n / 2 the items in flight at once
        hold more rows than L2 (132 items x 2730 rows x 128 columns x 2 bytes = 92 MB at
        Kimi K2 48 x 16384 against H200's 50 MB), so the second pass reads DRAM again. 32 or
        64 columns keep an item's columns in L2 between its passes (23 MB, 46 MB there),
        in four or two times the items; their steps take as many more rows as they have
        fewer columns, up to the backward's row block (``backward.q_rows``: 128 rows at
        the Kimi shape), so each step writes 128 bytes of every transposed column (an L2
        line) instead of 64 and the running max keeps its size. The same values and
        scales, so the same gradients; no faster in results/20261204-183317-h200-fp8-backward
        and by the profiling script (notes/mok-kernel.md): off.
    bwd_split_launch: the backward megakernel as two launches of one persistent grid: the
        dgrad items (A, B), then the weight-gradient items (Q, C, D), each launch built with
        only its item kinds, so each is given registers for its own items alone (at the Kimi
        shape with the FP8 backward, sm_90, Triton 3.9: 12 and 96 bytes of spill stores
        against 324 for the one launch holding all five kinds). The second launch takes its
        tickets from a counter of its own, offset by the dgrad items' count on the device
        (no host sync); its items' waits find their flags set. The same items, so the same
        gradients; costs the tail of the B items (programs that finish early wait for the
        launch to end instead of starting Q items) and one launch. Off here; the mok
        backend's FP8 default on one Hopper rank (with ``bwd_pull_interleave``) since
        results/20261204-183317-h200-fp8-backward timed the pair faster at the 48/64-expert
        shapes.
    bwd_side_sms: with ``bwd_split_launch``, ``bwd_fp8_wgrad`` and the separate pull: SMs
        that the dgrad launch leaves free (0: none) so that the FP8 pull, whose transposed
        copies only the weight-gradient launch reads, runs beside the dgrad launch on a
        second stream instead of before it (on a GPU; one after the other in Triton's
        interpreter). The dgrad launch runs that many fewer programs (per logical rank:
        ``bwd_side_sms // L``, at least 1) and the weight-gradient launch waits for the
        pull (the profiler's leads and the estimate: notes/mok-kernel.md, the lease of
        2026-12-04 18:28). The same kernels on the same inputs, so the same gradients.
        Off: within the default's spread at 4 SMs in
        results/20261204-212014-h200-fp8-backward (one H200; the pull then spans the
        whole dgrad launch), untimed at EP > 1.
    bwd_side_sum: with ``bwd_side_sms``: the weight-gradient launch leaves the same SMs
        free too, and the dX sum over each token's slots, which reads only the dgrad
        launch's dX rows, runs beside it on the second stream instead of after it (in real
        EP after a barrier that follows the dgrad launch, since peers push those rows).
        The same kernel, the same dX. Off: within the default's spread at the 48/64-expert
        shapes in results/20261204-212014-h200-fp8-backward, 1.1% slower at Kimi K2 384.
    bwd_pull_interleave: with ``bwd_fp8_wgrad`` and the separate pull: the pull's programs
        take the row blocks in the order of their place inside their group (every group's
        first block, then every group's second, ...; a stable sort of each block's
        relative position, on the device) instead of row order. A group's rows are its
        tokens in ascending order, so the blocks that run at once read the same tokens'
        x and dY rows for the k groups each token went to, and L2 serves the repeats
        instead of HBM (in row order the programs of one wave cover a few groups, so a
        token's rows are read in different waves). The same rows, so the same gradients;
        off here, the mok backend's FP8 default on one Hopper rank (``bwd_split_launch``).
    bwd_pull_cols: columns per step of the separate bf16 pulls (the row pull, and the pull
        by token of ``bwd_pull_by_token``); 0 (the default) H rounded up to a power of two,
        at most 1024; else a power of two in 64..1024. At 1024 the sm_90 build of the pull
        by token (16 tokens, x and dY rows in flight together) holds 255 registers a thread
        with 152 bytes of spill stores, one program an SM; at 256, 94 registers and no
        spills (the row pull: 198 and 64). The same rows, so the same gradients; untimed.
    bwd_pull_prefetch: with ``bwd_fp8_wgrad`` and the separate one-pass pull (not
        ``bwd_pull_dedup``, ``bwd_fp8_prequant`` or ``bwd_fused_pull``): each program of the
        FP8 pull loads the next 128 columns of its x and dY rows before it converts and
        stores the current ones, so its next loads are in flight while it stores. The plain
        loop loads, waits, converts and stores in turn, its sm_90 build holds 168 registers a
        thread (3 programs an SM), and halving its bytes (``bwd_fp8_prequant``) did not make it
        faster: its loads' latency, not the bytes, looks like its limit. The same values, so
        the same copies and gradients; untimed.
    bwd_fp8_prequant: with ``bwd_fp8_wgrad`` and ``bwd_fp8_da`` and the separate pull: each
        rank quantises its own tokens' x and dY rows once (e4m3, the global column maxima's
        scales: the pull's arithmetic) into its symmetric buffer after the column maxima,
        and the pull moves those bytes into the transposed copies instead of reading bf16
        rows and quantising each (token, k) row: half the pull's reads (and its NVLink
        bytes in EP), at the cost of T x H bytes written twice per rank and, in real EP, a
        second barrier; the bf16 copies of x and dY into the peer buffers are left out.
        The same bytes in the copies, so the same gradients; no faster in
        results/20261204-183317-h200-fp8-backward (with ``bwd_q_cols`` 64) and by the
        profiling script (notes/mok-kernel.md): off.
    bwd_dx_band: the order of the backward's dX (B) items: 0 or 1 row block by row block
        (a row block's H tiles one after another); G > 1 in bands of G row blocks, inside a
        band the H tiles outer and the row blocks inner (the last band may hold fewer). The
        items that run at once then read fewer W_gate_up column tiles: row-block-major at
        Kimi K2 48 x 16384, the 132 items in flight span about 5 row blocks and all 28 of an
        expert's W_gate_up tiles (58 MB, beyond the H200's 50 MB L2); in bands of 16 about 8
        tiles (16 MB) and 16 row blocks of dG/dU (16 MB). The same items, so the same
        gradients; a B item waits only on its row block's A items, all of which come earlier.
        0 here;
        the mok backend sets 16 on one Hopper rank, where the profiling script timed the bf16
        backward faster with it (notes/mok-kernel.md).
    bwd_pull_by_token: the backward's separate pull goes token by token: each token's x and
        dY rows are read once from home and written to every schedule row that serves one of
        its slots (the schedule then also keeps the row of every slot). Row by row, in
        schedule order, a token's K slots sit in K experts' row ranges, so its rows are read K
        times from HBM (at Kimi K2 48 x 16384 about 3.8 of the pull's 7.5 GB); token by token
        once (0.5 GB). The same bytes in the same rows, so the same gradients. Needs the bf16
        separate pull (not bwd_fused_pull, bwd_pull_dedup or bwd_fp8_wgrad). Off by default:
        no faster on one H200 at Kimi K2 48 x 16384 (the
        profiling script, notes/mok-kernel.md).
    bwd_dw_tiles: adjacent tiles per weight-gradient work item of the backward (a dW_down
        item's H tiles, a dW_gate_up item's 2I tiles), in one flattened loop, so the software
        pipeline loads the next tile's first rows while a tile is stored. Their K loop runs
        over the expert's rows: with few rows per expert (Kimi K2 384 x 4096 on one GPU: about
        85, one or two steps) an item is mostly its loads' latency and its store, one after
        the other. Must divide hidden / block_n and 2 * intermediate / block_n. The loops run
        ``bwd_dw_stages`` pipeline stages. The same sums, so the same gradients. 1 here; the
        mok backend sets 4 (with bwd_dw_stages 4) in bf16 cells on one Hopper rank (at Kimi
        K2 384 x 4096 on one H200 its backward took 28.373 ms against 32.197 with two-stage
        loops, which were slower where experts are well loaded; notes/mok-kernel.md).
    bwd_stages: pipeline stages of the backward's dA and dX K loops (and every other loop
        of the backward kernel without a depth of its own; the weight-gradient loops keep
        ``bwd_dw_stages``): 0 = ``num_stages``, the forward's, or 2, 3 or 4. With split
        gate/up columns at most 2 (see ``backward.backward_stages``). Under a 700 W limit
        the K loops run at the clock the power allows; three had the lower backward median in
        most sweep cells against four, on H200s and H100s, each inside the other's spread
        (mokbench.mok_backend.default_config_fields cites the runs and the count). 0 here;
        the mok backend sets 3 in bf16 cells on one Hopper rank.
    bwd_dw_stages: pipeline stages of the flattened weight-gradient loops (with
        bwd_dw_tiles > 1): 2, or 4 (the dW_gate_up loop at four, the dW_down loop at three).
        Two is what the tiles were first timed with; it loads only one step ahead, too little
        where an expert's K loop is long. Four and three because their buffers fit in
        sm_90's shared memory together (229408 of 232448 bytes, Triton 3.9), while two loops of
        the same depth are placed apart (294968 bytes at three and three, 393280 at four and
        four). 2 here; the mok backend sets 4 with bwd_dw_tiles: the profiling script timed
        the deeper loops faster at Kimi K2 48 x 16384, 384 x 4096 and Qwen3.5 on one H200
        (they fit there too, Triton 3.6).
    bwd_dw_tma_store: with bwd_dw_tiles > 1: the weight-gradient items store each bf16
        dW tile through TMA (two [block_n / 2, block_n / 2] boxes a tile: dG and dU halves,
        or left and right) instead of plain stores. The plain store converts the tile's
        layout through shared memory and then issues 16-byte stores from every thread, the
        tensor cores idle until it is done; in the items' flattened tile loop Triton
        pipelines a TMA store (sm_90 PTX, Triton 3.6 and 3.9: ``cp.async.bulk`` stores,
        each followed only by a wait for its shared buffer to be read, before that buffer's
        next use), so a tile's bytes go out while the next tile's K loop runs. The dW
        tiles are the items' outputs only (nothing in the kernel reads them). At Kimi K2 48
        x 16384 the dW_gate_up items run their FLOPs about a fifth slower than the dX items
        of the same FLOPs and output bytes a tile but a K loop half as long again
        (notes/mok-kernel.md): a fixed cost a tile, which the store is part of. The shared
        expert's gradients then sit after the routed experts' in one buffer per weight (the
        gradients are views of it). The same values, so the same gradients. Off here; the mok
        backend's FP8 default on one Hopper rank since
        results/20261205-015933-h200-fp8-backward timed the FP8 backward 1.9 and 1.8 ms
        faster with it at Kimi K2 48 x 16384 and Kimi K2.7 Code (the profiling script: faster
        at Qwen3.5 and Kimi K2 384 too, within noise in bf16).
    bwd_dx_gluon: the backward's dX GEMM (the B items' work) as a launch of its own, a
        warp-specialised Gluon kernel (``gl_dx``): a producer warp issues the TMA loads into
        a four-stage ring, two consumer warpgroups each compute half of a [128, 256] tile
        and meet only at the ring's mbarriers, where Triton's software pipeline puts four
        CTA-wide barriers in every K step. Under the power limit the K loop runs at the
        clock the GPU holds, and the cooperative loop spends fewer instructions a step: on
        one H100 its form of the dA GEMM's loop ran 7-11% faster than Triton's
        (benchmarks/gluon_da_probe.py, notes/mok-kernel.md). The megakernel's launches then
        skip their B items, and the Gluon launch follows them. bf16 only (not with
        bwd_fp8_dx), row blocks of 128 (bwd_block_m), not with bwd_side_sum (the dX sum
        would start before the launch); needs Triton's Gluon Hopper API and an sm_90 GPU
        (Gluon kernels do not run in Triton's interpreter). Off here; the mok backend's bf16
        default on one Hopper rank (the backward 5-6% faster at Kimi K2 48 on one H100,
        notes/mok-kernel.md, the lease of 2026-12-06 01:40).
    bwd_dx_rows: with bwd_dx_gluon: its tiles stored whole through TMA stores into a rows
        buffer in the schedule's row order (the pulled dY rows' buffer, read by then), which
        run beside the next tile's K loop, instead of row by row to each row's (token, k)
        combine slot from registers staged in shared memory; the dX sum then gathers each
        token's rows through the inverted schedule (``slot_rows``), in the same slot order:
        the same dx, bitwise. On the dX GEMM alone the store costs 3.4% of its time on one
        H200 (benchmarks/gluon_dx_probe.py, plain against plain_nostore). Within one process
        only (one rank or loopback ranks; real EP is a one-line error: a token's rows belong
        in its home rank's slots). Off here; the mok backend's bf16 default wherever
        bwd_dx_gluon is (one H100: the backward 0.56 ms faster at Kimi K2 48 x 16384 by the
        profiling script, 0.48 ms in results/20261206-061629-h100-mok-dx-rows; notes/mok-kernel.md,
        the lease of 2026-12-06 05:30).
    bwd_dw_gluon: the backward's weight gradients (the C and D items' work) as a launch of
        its own, a warp-specialised Gluon kernel (``gl_dw``): a producer warp feeding a
        three-stage TMA ring, two consumer warpgroups each computing half of a [128, 256]
        tile, each storing its rows through its own shared buffers and TMA stores that run
        beside its next tile's K loop. On the C items' GEMM alone this form ran 19% faster
        than Triton's loop on one H100 and 4.4% on one H200
        (benchmarks/gluon_wgrad_probe.py ``coop_tma``, notes/mok-kernel.md). The
        megakernel's launches then skip their C and D items, and the Gluon launch follows
        them; the same sums in the same order, so the same gradients. bf16 only (not with
        bwd_fp8_wgrad), row blocks a multiple of 64 rows (its K step), not with
        bwd_side_sum; needs Triton's Gluon Hopper API and an sm_90 GPU. Off by default:
        inside the layer, on one H100, the backward at Kimi K2 48 x 16384 took 2.1 ms longer
        with it than with the megakernel's own C and D items (notes/mok-kernel.md, the lease
        of 2026-12-06 05:30).
    bwd_fp8_block_k: the reduction step of the backward's FP8 items (with bwd_fp8_da,
        bwd_fp8_dx or bwd_fp8_wgrad): 64 (the bf16 items' step, 128 bytes of bf16 per row)
        or 128 (128 bytes of e4m3 per row, the FP8 forward's block_k: half the K-loop
        iterations and barrier waits per FLOP). 64 by default; the mok backend's FP8 cells on
        Hopper use 128 (timed faster, notes/mok-kernel.md).
    fp8: the forward's FP8 recipe (``tl_gemm_fp8``): "none" (bf16), "blockwise" (1x128
        activation and 128x128 weight scales, as TransformerEngine's Float8BlockScaling),
        "rowwise" (per row / per weight column, applied after the K loop; h still 1x128),
        "mx" (MXFP8, Blackwell) or "rowwise_all" (both GEMMs rowwise: h one scale per row
        over all its I columns, w2 one per column, so neither K loop rescales; gate+up
        items store h in bf16 in the rows' own storage, and the item that completes a row
        block reads its rows back for their max and requantises them in place before the
        down items may start). Tokens are quantised once at the source into the token
        buffer's rows (e4m3 values, then their scales, in the bytes of the bf16 row), the
        gate+up epilogue quantises h, both GEMMs run in FP8 with fp32 accumulation; combine
        and the weighted sum stay bf16/fp32. Weights come quantised (``quantize_weights``).
        Needs gate_up_interleaved, block_n 256 and block_k 128; with ``tma`` the FP8 weight
        tiles come through TMA descriptors (the token and h rows stay pointer loads).
    fp8_pow2_scales: FP8 scales rounded to powers of two (TransformerEngine's default).
    """

    fwd_comm_sms: int = 0
    dispatch_dedup: bool = False
    dispatch_remote_only: bool = False
    combine_direct: bool = False
    minibatch: int = 2048
    macrobatch: int = 6144
    capacity_mult: float = 1.0
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    spin_budget: int = 1 << 22
    down_tiles: int = 1
    gate_up_tiles: int = 1
    tma: bool = False
    gate_up_interleaved: bool = False
    prefetch_ticket: bool = False
    skew_down: bool = False
    pre_tma_store: bool = False
    compile_schedule: bool = False
    fused_sum: bool = False
    bwd_wide_da: bool = False
    bwd_fused_pull: bool = False
    bwd_pull_programs: int = 0
    bwd_pull_dedup: bool = False
    bwd_dx_tiles: int = 1
    bwd_da_tiles: int = 1
    bwd_dx_tma: bool = False
    bwd_lean_epilogue: bool = True
    bwd_block_m: int = 0
    bwd_fp8_da: bool = False
    bwd_fp8_dx: bool = False
    bwd_fp8_wgrad: bool = False
    bwd_fp8_block_k: int = 64
    bwd_fp8_block_colmax: bool = False
    bwd_dx_band: int = 0
    bwd_q_count_rows: bool = False
    bwd_fused_colmax: bool = False
    bwd_q_cols: int = 0
    bwd_pull_interleave: bool = False
    bwd_pull_prefetch: bool = False
    bwd_pull_cols: int = 0
    bwd_fp8_prequant: bool = False
    bwd_split_launch: bool = False
    bwd_side_sms: int = 0
    bwd_side_sum: bool = False
    bwd_pull_by_token: bool = False
    bwd_dw_tiles: int = 1
    bwd_dw_stages: int = 2
    bwd_dw_tma_store: bool = False
    bwd_stages: int = 0
    bwd_dx_gluon: bool = False
    bwd_dw_gluon: bool = False
    bwd_dx_rows: bool = False
    fp8: str = "none"
    fp8_pow2_scales: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.fwd_comm_sms, int) and 0 <= self.fwd_comm_sms <= 64,
               "fwd_comm_sms", self.fwd_comm_sms, "an integer in 0..64")
        _check(isinstance(self.dispatch_dedup, bool)
               and not (self.dispatch_dedup and self.fwd_comm_sms == 0), "dispatch_dedup",
               self.dispatch_dedup, "true | false; true needs fwd_comm_sms > 0 (the "
               "communication programs pull)")
        _check(isinstance(self.dispatch_remote_only, bool)
               and not (self.dispatch_remote_only
                        and (self.fwd_comm_sms == 0 or self.dispatch_dedup)),
               "dispatch_remote_only", self.dispatch_remote_only,
               "true | false; true needs fwd_comm_sms > 0 and dispatch_dedup false")
        _check(isinstance(self.combine_direct, bool)
               and not (self.combine_direct and self.fwd_comm_sms == 0), "combine_direct",
               self.combine_direct, "true | false; true needs fwd_comm_sms > 0 (without "
               "communication programs the down tiles always write the combine slots)")
        _check(self.block_m in (16, 32, 64, 128, 256), "block_m", self.block_m,
               "16 | 32 | 64 | 128 | 256")
        _check(_is_pow2(self.block_n) and 32 <= self.block_n <= 256, "block_n", self.block_n,
               "a power of two in 32..256")
        _check(_is_pow2(self.block_k) and 16 <= self.block_k <= 128, "block_k", self.block_k,
               "a power of two in 16..128")
        _check(isinstance(self.minibatch, int) and self.minibatch > 0
               and self.minibatch % self.block_m == 0, "minibatch", self.minibatch,
               f"a positive multiple of block_m ({self.block_m})")
        _check(isinstance(self.macrobatch, int) and self.macrobatch > 0
               and self.macrobatch % self.minibatch == 0, "macrobatch", self.macrobatch,
               f"a positive multiple of minibatch ({self.minibatch})")
        _check(isinstance(self.capacity_mult, (int, float)) and 0 < self.capacity_mult <= 1,
               "capacity_mult", self.capacity_mult, "a number in (0, 1]")
        _check(self.num_warps in (4, 8), "num_warps", self.num_warps, "4 | 8")
        _check(isinstance(self.num_stages, int) and 1 <= self.num_stages <= 6, "num_stages",
               self.num_stages, "an integer in 1..6")
        _check(isinstance(self.spin_budget, int) and self.spin_budget >= 1, "spin_budget",
               self.spin_budget, "an integer >= 1")
        _check(self.down_tiles in (1, 2, 4), "down_tiles", self.down_tiles, "1 | 2 | 4")
        _check(self.gate_up_tiles in (1, 2, 4), "gate_up_tiles", self.gate_up_tiles,
               "1 | 2 | 4")
        _check(isinstance(self.tma, bool), "tma", self.tma, "true | false")
        _check(isinstance(self.gate_up_interleaved, bool), "gate_up_interleaved",
               self.gate_up_interleaved, "true | false")
        _check(isinstance(self.prefetch_ticket, bool), "prefetch_ticket", self.prefetch_ticket,
               "true | false")
        _check(isinstance(self.skew_down, bool)
               and not (self.skew_down and self.macrobatch < 2 * self.minibatch), "skew_down",
               self.skew_down, "true | false; true needs macrobatch >= 2 x minibatch (two "
               "ring slots: the gate+up items of the next minibatch come before the down "
               "items that free a slot)")
        _check(isinstance(self.pre_tma_store, bool)
               and not (self.pre_tma_store and (not self.tma or self.fp8 != "none")),
               "pre_tma_store", self.pre_tma_store,
               "true | false; true needs tma = true and fp8 = none (the FP8 gate+up tiles "
               "store their pre-activations themselves)")
        _check(not (self.pre_tma_store and self.gate_up_tiles > 1 and self.num_stages > 3),
               "pre_tma_store", self.pre_tma_store,
               "false with gate_up_tiles > 1 unless num_stages <= 3 (the flattened loop keeps "
               "its stage buffers and the store's box live together: 262176 bytes of shared "
               "memory at four stages of 128 x 256 x 64 tiles, over sm_90's 232448)")
        _check(isinstance(self.compile_schedule, bool), "compile_schedule",
               self.compile_schedule, "true | false")
        _check(isinstance(self.fused_sum, bool), "fused_sum", self.fused_sum, "true | false")
        _check(isinstance(self.bwd_wide_da, bool), "bwd_wide_da", self.bwd_wide_da,
               "true | false")
        _check(not (self.fused_sum and self.fwd_comm_sms), "fused_sum", self.fused_sum,
               "false when fwd_comm_sms > 0 (the summing items are the GEMM programs')")
        _check(isinstance(self.bwd_fused_pull, bool), "bwd_fused_pull", self.bwd_fused_pull,
               "true | false")
        _check(isinstance(self.bwd_pull_programs, int)
               and not isinstance(self.bwd_pull_programs, bool)
               and 0 <= self.bwd_pull_programs <= 1024, "bwd_pull_programs",
               self.bwd_pull_programs, "an integer in 0..1024 (0 = every program)")
        _check(self.bwd_fused_pull or self.bwd_pull_programs == 0, "bwd_pull_programs",
               self.bwd_pull_programs, "0 unless bwd_fused_pull is true")
        _check(isinstance(self.bwd_dx_tiles, int) and not isinstance(self.bwd_dx_tiles, bool)
               and 1 <= self.bwd_dx_tiles <= 64, "bwd_dx_tiles", self.bwd_dx_tiles,
               "an integer in 1..64 dividing hidden / block_n")
        _check(isinstance(self.bwd_da_tiles, int) and not isinstance(self.bwd_da_tiles, bool)
               and 1 <= self.bwd_da_tiles <= 64, "bwd_da_tiles", self.bwd_da_tiles,
               "an integer in 1..64 dividing the dA tiles of the intermediate size")
        _check(isinstance(self.bwd_dx_tma, bool), "bwd_dx_tma", self.bwd_dx_tma,
               "true | false")
        _check(isinstance(self.bwd_block_m, int) and not isinstance(self.bwd_block_m, bool)
               and self.bwd_block_m in (0, 16, 32, 64, 128, 256)
               and self.bwd_block_m % self.block_m == 0
               and self.minibatch % max(self.bwd_block_m, 1) == 0, "bwd_block_m",
               self.bwd_block_m, f"0 | 16 | 32 | 64 | 128 | 256, a multiple of block_m "
               f"({self.block_m}) dividing minibatch ({self.minibatch})")
        _check(isinstance(self.bwd_fp8_da, bool), "bwd_fp8_da", self.bwd_fp8_da,
               "true | false")
        _check(isinstance(self.bwd_fp8_dx, bool), "bwd_fp8_dx", self.bwd_fp8_dx,
               "true | false")
        _check(isinstance(self.bwd_fp8_wgrad, bool), "bwd_fp8_wgrad", self.bwd_fp8_wgrad,
               "true | false")
        _check(self.bwd_fp8_block_k in (64, 128) and not isinstance(self.bwd_fp8_block_k, bool),
               "bwd_fp8_block_k", self.bwd_fp8_block_k, "64 | 128")
        _check(isinstance(self.bwd_fp8_block_colmax, bool), "bwd_fp8_block_colmax",
               self.bwd_fp8_block_colmax, "true | false")
        _check(not self.bwd_fp8_block_colmax or (self.bwd_fp8_dx and self.bwd_fp8_wgrad),
               "bwd_fp8_block_colmax", self.bwd_fp8_block_colmax,
               "false unless bwd_fp8_dx and bwd_fp8_wgrad are set (it keeps the maxima of "
               "the dX items' requantisation for the weight gradients' Q items)")
        _check(isinstance(self.bwd_dx_band, int) and not isinstance(self.bwd_dx_band, bool)
               and 0 <= self.bwd_dx_band <= 1024, "bwd_dx_band", self.bwd_dx_band,
               "an integer in 0..1024 (0 or 1 = row block by row block)")
        _check(isinstance(self.bwd_dw_tiles, int) and not isinstance(self.bwd_dw_tiles, bool)
               and 1 <= self.bwd_dw_tiles <= 64, "bwd_dw_tiles", self.bwd_dw_tiles,
               "an integer in 1..64 (a divisor of the weight gradients' tiles per row)")
        _check(self.bwd_dw_stages in (2, 4) and not isinstance(self.bwd_dw_stages, bool),
               "bwd_dw_stages", self.bwd_dw_stages, "2 | 4")
        _check(self.bwd_stages in (0, 2, 3, 4) and not isinstance(self.bwd_stages, bool),
               "bwd_stages", self.bwd_stages, "0 (num_stages) | 2 | 3 | 4")
        _check(isinstance(self.bwd_dw_tma_store, bool), "bwd_dw_tma_store",
               self.bwd_dw_tma_store, "true | false")
        _check(not self.bwd_dw_tma_store or self.bwd_dw_tiles > 1, "bwd_dw_tma_store",
               self.bwd_dw_tma_store, "false unless bwd_dw_tiles > 1 (the stores overlap "
               "the next tile only inside an item's tile loop)")
        _check(isinstance(self.bwd_dx_gluon, bool), "bwd_dx_gluon", self.bwd_dx_gluon,
               "true | false")
        _check(not self.bwd_dx_gluon or (self.bwd_bm == 128 and not self.bwd_fp8_dx
                                         and not self.bwd_side_sum),
               "bwd_dx_gluon", self.bwd_dx_gluon, "false unless the backward's row blocks "
               "are 128 rows (bwd_block_m) and neither bwd_fp8_dx nor bwd_side_sum is set")
        _check(isinstance(self.bwd_dx_rows, bool) and (self.bwd_dx_gluon
                                                        or not self.bwd_dx_rows),
               "bwd_dx_rows", self.bwd_dx_rows, "true | false; true needs bwd_dx_gluon")
        _check(isinstance(self.bwd_dw_gluon, bool), "bwd_dw_gluon", self.bwd_dw_gluon,
               "true | false")
        _check(not self.bwd_dw_gluon or (self.bwd_bm % 64 == 0 and not self.bwd_fp8_wgrad
                                         and not self.bwd_side_sum),
               "bwd_dw_gluon", self.bwd_dw_gluon, "false unless the backward's row blocks "
               "are a multiple of 64 rows (bwd_block_m) and neither bwd_fp8_wgrad nor "
               "bwd_side_sum is set")
        _check(isinstance(self.bwd_pull_by_token, bool), "bwd_pull_by_token",
               self.bwd_pull_by_token, "true | false")
        _check(not self.bwd_pull_by_token or not (
            self.bwd_fused_pull or self.bwd_pull_dedup or self.bwd_fp8_wgrad),
            "bwd_pull_by_token", self.bwd_pull_by_token, "false when bwd_fused_pull, "
            "bwd_pull_dedup or bwd_fp8_wgrad is set (it replaces the bf16 separate pull only)")
        _check(isinstance(self.bwd_pull_interleave, bool), "bwd_pull_interleave",
               self.bwd_pull_interleave, "true | false")
        _check(not self.bwd_pull_interleave or (self.bwd_fp8_wgrad
                                                and not self.bwd_fused_pull),
               "bwd_pull_interleave", self.bwd_pull_interleave,
               "false unless bwd_fp8_wgrad is set without bwd_fused_pull (it orders the "
               "separate FP8 pull)")
        cols = self.bwd_pull_cols
        _check(isinstance(cols, int) and not isinstance(cols, bool)
               and (cols == 0 or (_is_pow2(cols) and 64 <= cols <= 1024)), "bwd_pull_cols",
               cols, "0 or a power of two in 64..1024")
        _check(isinstance(self.bwd_pull_prefetch, bool), "bwd_pull_prefetch",
               self.bwd_pull_prefetch, "true | false")
        _check(not self.bwd_pull_prefetch or (self.bwd_fp8_wgrad and not (
            self.bwd_fused_pull or self.bwd_pull_dedup or self.bwd_fp8_prequant)),
               "bwd_pull_prefetch", self.bwd_pull_prefetch, "false unless bwd_fp8_wgrad is "
               "set without bwd_fused_pull, bwd_pull_dedup and bwd_fp8_prequant (it serves "
               "the one-pass FP8 pull)")
        _check(isinstance(self.bwd_fp8_prequant, bool), "bwd_fp8_prequant",
               self.bwd_fp8_prequant, "true | false")
        _check(not self.bwd_fp8_prequant or (self.bwd_fp8_wgrad and self.bwd_fp8_da
                                             and not self.bwd_fused_pull),
               "bwd_fp8_prequant", self.bwd_fp8_prequant,
               "false unless bwd_fp8_wgrad and bwd_fp8_da are set without bwd_fused_pull (it "
               "feeds the separate FP8 pull; the dA items then read dY's FP8 rows at home)")
        _check(isinstance(self.bwd_lean_epilogue, bool), "bwd_lean_epilogue",
               self.bwd_lean_epilogue, "true | false")
        _check(isinstance(self.bwd_fused_colmax, bool), "bwd_fused_colmax",
               self.bwd_fused_colmax, "true | false")
        _check(not self.bwd_fused_colmax or self.bwd_fp8_wgrad, "bwd_fused_colmax",
               self.bwd_fused_colmax, "false unless bwd_fp8_wgrad is set (it serves the weight "
               "gradients' FP8 copies of x and dY)")
        _check(isinstance(self.bwd_q_count_rows, bool), "bwd_q_count_rows",
               self.bwd_q_count_rows, "true | false")
        _check(not self.bwd_q_count_rows or self.bwd_fp8_wgrad, "bwd_q_count_rows",
               self.bwd_q_count_rows, "false unless bwd_fp8_wgrad is set (it serves the weight "
               "gradients' Q items)")
        half = self.block_n // 2
        q_cols = self.bwd_q_cols
        _check(isinstance(q_cols, int) and not isinstance(q_cols, bool)
               and (q_cols == 0 or (8 <= q_cols <= half and half % q_cols == 0)),
               "bwd_q_cols", q_cols, f"0 (block_n / 2) or a divisor of block_n / 2 ({half}) "
               "of at least 8 (a 16-byte TMA box row)")
        _check(q_cols == 0 or self.bwd_fp8_wgrad, "bwd_q_cols", q_cols,
               "0 unless bwd_fp8_wgrad is set (it sizes the weight gradients' Q items)")
        _check(isinstance(self.bwd_split_launch, bool), "bwd_split_launch",
               self.bwd_split_launch, "true | false")
        side = self.bwd_side_sms
        _check(isinstance(side, int) and not isinstance(side, bool) and 0 <= side <= 64,
               "bwd_side_sms", side, "an integer in 0..64")
        _check(side == 0 or (self.bwd_split_launch and self.bwd_fp8_wgrad
                             and not self.bwd_fused_pull), "bwd_side_sms", side,
               "0 unless bwd_split_launch and bwd_fp8_wgrad are set without bwd_fused_pull "
               "(it runs the separate FP8 pull beside the dgrad launch)")
        _check(isinstance(self.bwd_side_sum, bool), "bwd_side_sum", self.bwd_side_sum,
               "true | false")
        _check(not self.bwd_side_sum or side > 0, "bwd_side_sum", self.bwd_side_sum,
               "false unless bwd_side_sms > 0 (the SMs the sum runs on)")
        _check(isinstance(self.bwd_pull_dedup, bool), "bwd_pull_dedup", self.bwd_pull_dedup,
               "true | false")
        _check(not (self.bwd_pull_dedup and self.bwd_fused_pull),
               "bwd_pull_dedup", self.bwd_pull_dedup, "false when bwd_fused_pull is set (it "
               "dedupes the separate pull)")
        _check(not (self.bwd_fp8_wgrad and self.bwd_fused_pull and not self.bwd_fp8_da),
               "bwd_fp8_wgrad", self.bwd_fp8_wgrad, "false with bwd_fused_pull but without "
               "bwd_fp8_da (its FP8 copies "
               "of x and dY come from the separate pull, or from pull items the dA items do "
               "not wait for)")
        _check(self.fp8 in FP8_MODES, "fp8", self.fp8, " | ".join(FP8_MODES))
        _check(isinstance(self.fp8_pow2_scales, bool), "fp8_pow2_scales", self.fp8_pow2_scales,
               "true | false")
        if self.fp8 != "none":
            _check(self.gate_up_interleaved, "gate_up_interleaved", self.gate_up_interleaved,
                   f"true with fp8={self.fp8!r} (one interleaved tile gives one h block)")
            _check(self.block_n == 256, "block_n", self.block_n,
                   f"256 with fp8={self.fp8!r} (128 h columns: one 1x128 scale block)")
            _check(self.block_k == 128, "block_k", self.block_k,
                   f"128 with fp8={self.fp8!r} (one scale step per K step)")

    @property
    def quant(self) -> int:
        """The kernels' QUANT constant: 0 bf16, else the FP8 recipe's code."""
        return FP8_MODES.index(self.fp8)

    @property
    def ring_slots(self) -> int:
        return self.macrobatch // self.minibatch

    def check_shape(self, hidden: int, intermediate: int) -> None:
        """Tile alignment against a layer shape (the kernels have no ragged column tiles)."""
        half = self.block_n // 2
        _check(intermediate % half == 0, "block_n", self.block_n,
               f"2 * a divisor of intermediate ({intermediate}) (gate/up halves)")
        _check(hidden % self.block_n == 0, "block_n", self.block_n,
               f"a divisor of hidden ({hidden}) (down GEMM column tiles)")
        _check(hidden % self.block_k == 0 and intermediate % self.block_k == 0, "block_k",
               self.block_k, f"a divisor of hidden ({hidden}) and intermediate ({intermediate})")
        _check(hidden // self.block_n % self.bwd_dw_tiles == 0
               and 2 * intermediate // self.block_n % self.bwd_dw_tiles == 0, "bwd_dw_tiles",
               self.bwd_dw_tiles, "a divisor of hidden / block_n "
               f"({hidden // self.block_n}) and 2 * intermediate / block_n "
               f"({2 * intermediate // self.block_n})")
        _check(hidden // self.block_n % self.bwd_dx_tiles == 0, "bwd_dx_tiles",
               self.bwd_dx_tiles, f"a divisor of hidden / block_n ({hidden // self.block_n})")
        if self.bwd_fp8_da or self.bwd_fp8_dx:
            bk8 = self.bwd_fp8_block_k
            _check(hidden % bk8 == 0 and 2 * intermediate % bk8 == 0, "bwd_fp8_block_k", bk8,
                   f"a divisor of hidden ({hidden}) and 2 * intermediate ({2 * intermediate})"
                   " (the FP8 dgrad items' reduction steps)")
        n_da = intermediate // self.da_cols(intermediate)
        _check(n_da % self.bwd_da_tiles == 0, "bwd_da_tiles", self.bwd_da_tiles,
               f"a divisor of the dA tiles of the intermediate size ({n_da})")

    @property
    def bwd_bm(self) -> int:
        """Rows per row block of the backward (BM there): ``bwd_block_m`` or block_m."""
        return self.bwd_block_m or self.block_m

    @property
    def q_cols(self) -> int:
        """Columns of r h and dG/dU per Q item of the FP8 weight gradients (QC there):
        ``bwd_q_cols`` or block_n / 2."""
        return self.bwd_q_cols or self.block_n // 2

    @property
    def row_align(self) -> int:
        """Every expert's schedule rows are padded to a multiple of this: the backward's row
        block, a multiple of the forward's (``bwd_block_m`` is checked to be one)."""
        return self.bwd_bm

    def da_cols(self, intermediate: int) -> int:
        """Intermediate columns per dA tile of the backward (DAC): block_n with
        ``bwd_wide_da`` where it divides the intermediate size, else block_n / 2."""
        wide = self.bwd_wide_da and intermediate % self.block_n == 0
        return self.block_n if wide else self.block_n // 2

    @staticmethod
    def for_shape(hidden: int, intermediate: int, **overrides) -> MoKConfig:
        """Defaults that fit the shape: the largest block_n <= 256 and block_k <= 64 that
        divide it; explicit ``overrides`` win (and are validated)."""
        bn = 256
        while bn > 32 and (hidden % bn or intermediate % (bn // 2)):
            bn //= 2
        bk = 64
        while bk > 16 and (hidden % bk or intermediate % bk):
            bk //= 2
        known = {f.name for f in dataclasses.fields(MoKConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise MoKConfigError(f"{unknown[0]}={overrides[unknown[0]]!r} is unknown: allowed "
                                 f"{', '.join(sorted(known))}")
        fields = {"block_n": bn, "block_k": bk}
        fields.update(overrides)
        cfg = MoKConfig(**fields)
        cfg.check_shape(hidden, intermediate)
        return cfg


@dataclass(frozen=True)
class Plan:
    """The two-waves minibatch bound and the ring memory for one shape and SM split."""

    hidden: int
    intermediate: int
    num_sms: int
    comm_sms: int
    block_m: int
    block_n: int
    min_tokens: int  # two full waves of gate+up tiles (unrounded)
    minibatch: int  # min_tokens rounded up to block_m
    ring_slots: int
    macrobatch: int
    ring_bytes: int  # token ring + SwiGLU ring + output ring for one macrobatch

    def __str__(self) -> str:
        compute = self.num_sms - self.comm_sms
        tiles = 2 * self.intermediate // self.block_n
        return "\n".join([
            f"shape: hidden {self.hidden}, intermediate {self.intermediate} "
            f"({tiles} gate+up column tiles of {self.block_n})",
            f"SMs: {self.num_sms} = {compute} compute + {self.comm_sms} communication",
            f"two-waves bound: 2 x {compute} x {self.block_m} x {self.block_n} / "
            f"{2 * self.intermediate} = {self.min_tokens} tokens",
            f"minibatch >= {self.minibatch} rows (rounded to block_m {self.block_m})",
            f"macrobatch = {self.ring_slots} x minibatch = {self.macrobatch} rows; ring memory "
            f"{self.ring_bytes / 2**20:.1f} MiB per rank",
        ])


def plan(hidden: int, intermediate: int, num_sms: int, comm_sms: int = 0, block_m: int = 128,
         block_n: int = 256, ring_slots: int = 3, dtype_bytes: int = 2) -> Plan:
    """Minibatch lower bound from the two-waves rule and ring memory for a macrobatch.

    One minibatch must give the compute SMs two full waves of gate+up tiles:
    tokens >= 2 * compute_sms * block_m * block_n / (2 * intermediate). Ring memory per row:
    the dispatched token (H), its SwiGLU output (I) and its expert output (H), ``dtype_bytes``
    each (bf16: 2).
    """
    _check(isinstance(num_sms, int) and num_sms > 0, "num_sms", num_sms, "a positive integer")
    _check(isinstance(comm_sms, int) and 0 <= comm_sms < num_sms, "comm_sms", comm_sms,
           f"an integer in 0..{num_sms - 1}")
    _check(isinstance(ring_slots, int) and ring_slots >= 1, "ring_slots", ring_slots,
           "an integer >= 1")
    compute = num_sms - comm_sms
    min_tokens = math.ceil(2 * compute * block_m * block_n / (2 * intermediate))
    minibatch = math.ceil(min_tokens / block_m) * block_m
    macrobatch = ring_slots * minibatch
    ring_bytes = macrobatch * (2 * hidden + intermediate) * dtype_bytes
    return Plan(hidden, intermediate, num_sms, comm_sms, block_m, block_n, min_tokens,
                minibatch, ring_slots, macrobatch, ring_bytes)
