"""The backward's dX GEMM as a warp-specialised Gluon launch (``bwd_dx_gluon``, Hopper, bf16).

    dX[slot of row p] = dGU[p, :] @ W_gate_up[group of p]^T    dGU [L*P, 2I], W [H, 2I] a group

The megakernel's B items run this GEMM in Triton's plain software pipeline, whose K loop
puts four CTA-wide barriers in each 64-wide step (benchmarks/kloop_sass.py). Under the
GPU's power limit the loop's speed is its clock, and a loop that spends fewer instructions a
step runs at a higher one: the cooperative form below (a producer warp issuing the TMA loads
into a ring, two consumer warpgroups each computing half of a [128, 256] tile, meeting only
at the ring's mbarriers) ran the dA GEMM's loop 7-11% faster than Triton's
(benchmarks/gluon_da_probe.py, notes/mok-kernel.md). Gluon kernels cannot share a launch
with Triton ones, so with the knob the megakernel's launches skip their B items and this
launch follows them (dGU is complete once they end): no host sync, no cross-CTA waits.

Tiles: [BM, BN] = [128, 256] of (row block, H tile), in bands of BAND row blocks with the H
tile outer (``bwd_dx_band``'s order: the CTAs at work share a band's dGU rows and one
group's weight tiles in L2), per logical rank ``lr`` of the launch (loopback ranks side by
side). Row blocks at or past the rank's rows in use (``total_L``, read on the device) are
skipped by the producer and the consumers alike. Each consumer stores its [64, 256] half
through its own shared buffer, half by half ([64, 128] bf16), read back a row-contiguous
16 bytes a thread, so every store is a whole 256-byte piece of a slot row (Triton does the
same for the B items' ``tl.store``; straight from the accumulator's registers it would be
4-byte stores). Padding rows (``src`` < 0) store nothing. Every output row is written once,
by one thread group: deterministic. The only waits are the CTA's own ring mbarriers (as in
Triton's software pipeline); nothing waits on another CTA or rank.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mok_kernels._details.gl_common import barrier as _barrier
from mok_kernels._details.gl_common import nvmma_layout, ring_barriers, stage_halves
from mok_kernels._details.gl_common import tma_load as _tma_load
from mok_kernels._details.gl_common import tma_store as _tma_store

BM, BN, BK = 128, 256, 64  # tile rows, tile H columns, K step over 2I
STAGES = 4  # 4 x 48 KB of ring + 2 x 16 KB of store buffers: under sm_90's 227 KB
STAGES_ROWS = 3  # ROWS: 3 x 48 KB of ring + 4 x 16 KB of TMA store buffers
PRODUCER_REGS, CONSUMER_REGS = 40, 232


@gluon.jit
def _tile(t, NBMAX: gl.constexpr, NJ: gl.constexpr, BAND: gl.constexpr):
    """(logical rank, row block, H tile) of static tile ``t``: per rank, bands of BAND row
    blocks (the last one shorter), H tile outer within a band, row block inner."""
    per_rank: gl.constexpr = NBMAX * NJ
    lr = t // per_rank
    u = t % per_rank
    band = u // (BAND * NJ)
    size = gl.minimum(NBMAX - band * BAND, BAND)
    v = u - band * (BAND * NJ)
    return lr, band * BAND + v % size, v // size


@gluon.jit
def _producer(a_desc, w_desc, ws_desc, a_ring, b_ring, ready, empty, grp_ptr, total_ptr,
              n_tiles, E, P: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
              NBMAX: gl.constexpr, NJ: gl.constexpr, BAND: gl.constexpr,
              HAS_SHARED: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: the CTA's live tiles in order, each tile's K steps into the ring; step c (over
    the CTA's live tiles) fills slot c % STAGES in round c // STAGES once both consumer
    warpgroups released it (a fresh ``empty`` passes the wait on parity 1)."""
    KSTEPS: gl.constexpr = 2 * I // BK
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    c = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        lr, b, jn = _tile(t, NBMAX, NJ, BAND)
        if b * BM < gl.load(total_ptr + lr):
            g = gl.load(grp_ptr + lr * NBMAX + b)
            shared = False
            if HAS_SHARED:
                shared = g == E
            row_a = lr * P + b * BM
            row_w = (lr * E + g) * H + jn * BN
            for kk in range(KSTEPS):
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [row_a, kk * BK], ready.index(s), a_ring.index(s))
                if shared:
                    _tma_load(ws_desc, [jn * BN, kk * BK], ready.index(s), b_ring.index(s))
                else:
                    _tma_load(w_desc, [row_w, kk * BK], ready.index(s), b_ring.index(s))
                c += 1


@gluon.jit
def _store_half(half, epi, dst, valid, col0, H: gl.constexpr):
    """One [64, BN/2] bf16 half of a warpgroup's tile to its slot rows through ``epi``:
    written in the accumulator's layout, read back 8 bf16 a thread along a row."""
    HN: gl.constexpr = half.shape[1]
    row_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8],
                                                threads_per_warp=[2, 16],
                                                warps_per_cta=[4, 1], order=[1, 0])
    _barrier()  # this warpgroup's reads of the previous half are done
    epi.store(half)
    _barrier()
    vals = epi.load(row_layout)
    rows = gl.convert_layout(dst, gl.SliceLayout(1, row_layout))
    ok = gl.convert_layout(valid, gl.SliceLayout(1, row_layout))
    cols = col0 + gl.arange(0, HN, layout=gl.SliceLayout(0, row_layout))
    gl.store(gl.expand_dims(rows, 1) + gl.expand_dims(cols, 0), vals,
             mask=gl.expand_dims(ok, 1))


@gluon.jit
def _consumer(WG: gl.constexpr, a_ring, b_ring, ready, empty, epi, epi_hi, out_desc, src_ptr,
              total_ptr, comb_base, comb_tab, n_tiles, T, P: gl.constexpr, H: gl.constexpr,
              I: gl.constexpr, S: gl.constexpr, NBMAX: gl.constexpr, NJ: gl.constexpr,
              BAND: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, ROWS: gl.constexpr):
    """One warpgroup: rows WG*BM/2 .. of each live tile ([BM/2, BN] fp32, 128 registers a
    thread) from its half of the dGU box and the whole weight box, one wgmma group in flight,
    each slot released once its wgmma has finished; then those rows' store: to their slots
    through ``epi``, or ROWS, to the same rows of ``out_desc`` ([L*P, H]) as two
    [BM/2, BN/2] boxes through ``epi`` and ``epi_hi`` and TMA stores, waited for only before
    this warpgroup's next tile's write."""
    KSTEPS: gl.constexpr = 2 * I // BK
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    c = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        lr, b, jn = _tile(t, NBMAX, NJ, BAND)
        if b * BM < gl.load(total_ptr + lr):
            acc = gl.zeros([HM, BN], gl.float32, acc_layout)
            for kk in range(KSTEPS):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                a_half = a_ring.index(s).slice(WG * HM, HM, dim=0)
                acc = warpgroup_mma(a_half, b_ring.index(s).permute((1, 0)), acc,
                                    is_async=True)
                acc, _, _ = warpgroup_mma_wait(num_outstanding=1,
                                               deps=(acc, a_half, b_ring.index(s)))
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
                c += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
            if ROWS:  # the schedule's row order: whole boxes (padding rows too, never read)
                tma.store_wait(0)  # this warpgroup's previous tile has left its buffers
                stage_halves(acc.to(gl.bfloat16), epi, epi_hi, False)
                fence_async_shared()
                row = lr * P + b * BM + WG * HM
                _tma_store(out_desc, [row, jn * BN], epi)
                _tma_store(out_desc, [row, jn * BN + BN // 2], epi_hi)
            else:
                _store_slots(acc, epi, src_ptr, comb_base, comb_tab, lr, b, jn, T, P, H, S,
                             WG, BM, BN)
    if ROWS:
        tma.store_wait(0)


@gluon.jit
def _store_slots(acc, epi, src_ptr, comb_base, comb_tab, lr, b, jn, T, P: gl.constexpr,
                 H: gl.constexpr, S: gl.constexpr, WG: gl.constexpr, BM: gl.constexpr,
                 BN: gl.constexpr):
    """A warpgroup's [BM/2, BN] rows of tile (row block b, H tile jn) to their (token, k)
    combine slots through ``epi``; padding rows (``src`` < 0) store nothing."""
    HM: gl.constexpr = BM // 2
    # Slot rows: slot id s = rank*T*S + t*S + k -> comb_base + comb_tab[rank] + rem*H.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    rows = b * BM + WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, acc_layout))
    sid = gl.load(src_ptr + lr * P + rows)
    valid = sid >= 0
    sid64 = gl.maximum(sid, 0).to(gl.int64)
    # (each rank's offset a multiple of 8 elements: buffers are carved at 1 KiB, so
    # every row starts 16-byte aligned and the row stores stay 16 bytes wide)
    off = gl.multiple_of(gl.load(comb_tab + sid64 // (T * S), mask=valid, other=0), 8)
    dst = comb_base + off + (sid64 % (T * S)) * H
    lo, hi = acc.to(gl.bfloat16).reshape([HM, 2, BN // 2]).permute((0, 2, 1)).split()
    _store_half(lo, epi, dst, valid, jn * BN, H)
    _store_half(hi, epi, dst, valid, jn * BN + BN // 2, H)


@gluon.jit
def dx_gluon_kernel(a_desc, w_desc, ws_desc, out_desc, src_ptr, grp_ptr, total_ptr, comb_base,
                    comb_tab, n_tiles, T, E, P: gl.constexpr, H: gl.constexpr,
                    I: gl.constexpr, S: gl.constexpr, BAND: gl.constexpr,
                    HAS_SHARED: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Persistent cooperative dX (module docstring); ``n_tiles`` = L * (P/BM) * (H/BN), the
    grid at most that. ROWS: each tile to its own rows of ``out_desc`` through TMA stores
    (``bwd_dx_rows``) instead of to the combine slots. Launch with num_warps=4 (the default
    partition is consumer 0)."""
    NBMAX: gl.constexpr = P // BM
    NJ: gl.constexpr = H // BN
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    epi_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM // 2, BN // 2],
                                                                     gl.bfloat16)
    NEPI: gl.constexpr = 4 if ROWS else 2  # store buffers: two a warpgroup with ROWS
    epi = gl.allocate_shared_memory(gl.bfloat16, [NEPI, BM // 2, BN // 2], epi_layout)
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize(
        [
            (_consumer, (0, a_ring, b_ring, ready, empty, epi.index(0),
                         epi.index(NEPI // 2 - 1), out_desc, src_ptr,
                         total_ptr, comb_base, comb_tab, n_tiles, T, P, H, I, S, NBMAX, NJ,
                         BAND, BM, BN, BK, STAGES, ROWS)),
            (_consumer, (1, a_ring, b_ring, ready, empty, epi.index(NEPI // 2),
                         epi.index(NEPI - 1), out_desc, src_ptr, total_ptr, comb_base,
                         comb_tab, n_tiles, T, P, H, I, S, NBMAX, NJ, BAND, BM, BN, BK,
                         STAGES, ROWS)),
            (_producer, (a_desc, w_desc, ws_desc, a_ring, b_ring, ready, empty, grp_ptr,
                         total_ptr, n_tiles, E, P, H, I, NBMAX, NJ, BAND, HAS_SHARED, BM,
                         BN, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def dx_descriptors(pre_LPF: torch.Tensor, w_gate_up: torch.Tensor,
                   shared_gate_up: torch.Tensor | None,
                   rows_LPH: torch.Tensor | None = None) -> tuple[Any, Any, Any, Any]:
    """Gluon TMA descriptors: dGU rows [L*P, 2I] in [BM, BK] boxes, the routed experts'
    W_gate_up [L*E*H, 2I] and the shared expert's [H, 2I] in [BN, BK] boxes (the routed one
    again in the shared one's place when there is none: never read), and the dX rows
    ``rows_LPH`` [L*P, H] in [BM/2, BN/2] boxes (``bwd_dx_rows``; without them the weights'
    descriptor stands in, never written)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t: torch.Tensor, box: list[int]) -> Any:  # (a view: never a silent copy)
        return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), box, nvmma_layout(box))

    w = desc(w_gate_up, [BN, BK])
    out = (desc(rows_LPH, [BM // 2, BN // 2]) if rows_LPH is not None
           else desc(w_gate_up, [BM // 2, BN // 2]))
    return (desc(pre_LPF, [BM, BK]), w,
            w if shared_gate_up is None else desc(shared_gate_up, [BN, BK]), out)


def dx_constexprs(P: int, H: int, I: int, S: int, band: int, shared: bool,
                  rows: bool = False) -> dict[str, Any]:
    """The kernel's compile-time arguments (also what ``lowering`` builds it with)."""
    return dict(P=P, H=H, I=I, S=S, BAND=max(band, 1), HAS_SHARED=shared, BM=BM, BN=BN,
                BK=BK, STAGES=STAGES_ROWS if rows else STAGES, ROWS=rows,
                PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS)


def check_shapes(P: int, H: int, I: int) -> None:
    """The tiles this launch covers exactly, else a one-line error naming the field."""
    for name, value, tile in (("rows per rank", P, BM), ("hidden", H, BN),
                              ("2 * intermediate", 2 * I, BK)):
        if value % tile:
            raise ValueError(f"bwd_dx_gluon: {name}={value} is not a multiple of {tile}")


def launch_dx(pre_LPF: torch.Tensor, w_gate_up: torch.Tensor,
              shared_gate_up: torch.Tensor | None, src_LP: torch.Tensor,
              group_LB: torch.Tensor, total_L: torch.Tensor, comb_base: torch.Tensor,
              comb_tab_R: torch.Tensor, *, T: int, E: int, H: int, I: int, S: int, band: int,
              programs: int, rows_LPH: torch.Tensor | None = None) -> None:
    """dX rows of every live row block of each logical rank into their combine slots, or
    with ``rows_LPH`` ([L, P, H], ``bwd_dx_rows``) into the same rows of it, padding rows
    included. ``pre_LPF`` [L, P, 2I] (dG/dU after the A items), ``group_LB`` int32
    [L, P/BM], ``total_L`` [L] rows in use, ``programs`` CTAs (at most one a tile)."""
    L, P = pre_LPF.shape[0], pre_LPF.shape[1]
    check_shapes(P, H, I)
    if group_LB.shape[-1] != P // BM:
        raise ValueError(f"bwd_dx_gluon: {group_LB.shape[-1]} row blocks a rank, want "
                         f"{P // BM} (bwd_block_m must be {BM})")
    n_tiles = L * (P // BM) * (H // BN)
    descs = dx_descriptors(pre_LPF, w_gate_up, shared_gate_up, rows_LPH)
    dx_gluon_kernel[(max(1, min(programs, n_tiles)),)](
        *descs, src_LP, group_LB, total_L, comb_base, comb_tab_R, n_tiles, T, E,
        **dx_constexprs(P, H, I, S, band, shared_gate_up is not None, rows_LPH is not None),
        num_warps=4)


def compile_sm90(P: int, H: int, I: int, S: int, band: int = 16, shared: bool = False,
                 rows: bool = False) -> Any:
    """Triton's sm_90 build of the launch at these sizes (no GPU needed): its ``asm`` holds
    the TTGIR, PTX and cubin, its ``metadata.shared`` the shared-memory bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    check_shapes(P, H, I)
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{nvmma_layout([BM, BK])!r}>",
           "w_desc": f"tensordesc<bf16[{BN}, {BK}],{nvmma_layout([BN, BK])!r}>",
           "ws_desc": f"tensordesc<bf16[{BN}, {BK}],{nvmma_layout([BN, BK])!r}>",
           "out_desc": (f"tensordesc<bf16[{BM // 2}, {BN // 2}],"
                        f"{nvmma_layout([BM // 2, BN // 2])!r}>"),
           "src_ptr": "*i32", "grp_ptr": "*i32", "total_ptr": "*i32", "comb_base": "*bf16",
           "comb_tab": "*i64", "n_tiles": "i32", "T": "i32", "E": "i32"}
    consts = dx_constexprs(P, H, I, S, band, shared, rows)
    sig.update({k: "constexpr" for k in consts})
    fn = dx_gluon_kernel
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
             for k in ("src_ptr", "grp_ptr", "comb_base", "comb_tab")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
