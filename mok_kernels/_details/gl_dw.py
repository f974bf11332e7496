"""The backward's weight gradients as a warp-specialised Gluon launch (``bwd_dw_gluon``,
Hopper, bf16): the megakernel's C and D items' GEMMs.

    C  dW_down[g]    [I, H]  = (r h)[rows of g]^T @ dY[rows of g]
    D  dW_gate_up[g] [H, 2I] = x[rows of g]^T @ [dG dU][rows of g]    (canonical columns)

Both are [128, 256] tiles (M: I or H rows, N: H or 2I columns) summed over the group's
schedule rows (K) in 64-row steps, both operands read through TMA as [64, 128] and [64, 256]
boxes of row-major [L*P, cols] matrices (the A operand transposed on its way to the tensor
cores), as the C and D items read them. A producer warp feeds a three-stage ring; two
consumer warpgroups each compute [64, 256] of the tile and meet only at the ring's
mbarriers; each stores its rows as bf16 through its own shared buffer and TMA stores, waited
for only before its next tile's write, so a tile's store runs beside the next tile's K loop
(CUTLASS's Hopper GEMMs store so). On one H100 this form of the C items' GEMM ran 19%
faster than Triton's loop, on one H200 4.4% (benchmarks/gluon_wgrad_probe.py ``coop_tma``,
notes/mok-kernel.md), where Triton's own pipeline puts CTA-wide barriers in every K step.

Gluon kernels cannot share a launch with Triton ones, so with the knob the megakernel's
launches skip their C and D items and this launch follows them (r h, dG/dU and the pulled
rows are complete once they end): no host sync, no cross-CTA waits. Tiles, per logical rank
(loopback ranks side by side): the C tiles (I tile outer, H tile inner) then the D tiles (H
tile outer, 2I tile inner) of each group, the shared expert's group first, as the items run.
Group bounds are read on the device (``gstart``, clipped to the rank's rows in use); a group
with no rows stores zeros. Every output element is written once, by one thread group, its
sum in a fixed order (the K steps in row order, as the items sum them): deterministic.
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

from mok_kernels._details.gl_common import nvmma_layout, ring_barriers, stage_halves
from mok_kernels._details.gl_common import tma_load as _tma_load
from mok_kernels._details.gl_common import tma_store as _tma_store

BM, BN, BK = 128, 256, 64  # tile rows (M), tile columns (N), K step over schedule rows
STAGES = 3  # 3 x 48 KB of ring + 4 x 16 KB of store buffers: under sm_90's 227 KB
PRODUCER_REGS, CONSUMER_REGS = 40, 232


@gluon.jit
def _tile(t, per_rank, c_tiles, NG: gl.constexpr, NCT: gl.constexpr, NCJ: gl.constexpr,
          NDT: gl.constexpr, NDJ: gl.constexpr):
    """(logical rank, is a D tile, group, M tile, N tile) of static tile ``t``: per rank
    ``c_tiles`` C tiles (NCT a group, NCJ H tiles inner) then the D tiles (NDT a group, NDJ
    2I tiles inner), groups from the last (the shared expert's, when there is one) down."""
    lr = t // per_rank
    u = t % per_rank
    is_d = u >= c_tiles
    v = gl.where(is_d, u - c_tiles, u)
    per_group = gl.where(is_d, NDT, NCT)
    nj = gl.where(is_d, NDJ, NCJ)
    c = v % per_group
    return lr, is_d, NG - 1 - v // per_group, c // nj, c % nj


@gluon.jit
def _group_rows(gst_ptr, total_ptr, lr, g, NG: gl.constexpr):
    """First and end (exclusive, padded) schedule row of group g of rank lr, clipped to the
    rank's rows in use (the megakernel's ``_group_rows``)."""
    total = gl.load(total_ptr + lr)
    start = gl.minimum(gl.load(gst_ptr + lr * (NG + 1) + g), total)
    end = gl.minimum(gl.load(gst_ptr + lr * (NG + 1) + g + 1), total)
    return start, end


@gluon.jit
def _producer(hs_desc, dy_desc, x_desc, dgu_desc, a_ring, b_ring, ready, empty, gst_ptr,
              total_ptr, n_tiles, per_rank, c_tiles, P: gl.constexpr, NG: gl.constexpr,
              NCT: gl.constexpr, NCJ: gl.constexpr, NDT: gl.constexpr, NDJ: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: each of the CTA's tiles' K steps into the ring; step c (over the CTA's tiles)
    fills slot c % STAGES in round c // STAGES once both consumer warpgroups released it (a
    fresh ``empty`` passes the wait on parity 1)."""
    nbytes: gl.constexpr = hs_desc.block_type.nbytes + dy_desc.block_type.nbytes
    c = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        lr, is_d, g, mt, nt = _tile(t, per_rank, c_tiles, NG, NCT, NCJ, NDT, NDJ)
        start, end = _group_rows(gst_ptr, total_ptr, lr, g, NG)
        for r0 in range(lr * P + start, lr * P + end, BK):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            if is_d:
                _tma_load(x_desc, [r0, mt * BM], ready.index(s), a_ring.index(s))
                _tma_load(dgu_desc, [r0, nt * BN], ready.index(s), b_ring.index(s))
            else:
                _tma_load(hs_desc, [r0, mt * BM], ready.index(s), a_ring.index(s))
                _tma_load(dy_desc, [r0, nt * BN], ready.index(s), b_ring.index(s))
            c += 1


@gluon.jit
def _consumer(WG: gl.constexpr, a_ring, b_ring, ready, empty, epi_lo, epi_hi, dw2_desc,
              dw1_desc, gst_ptr, total_ptr, n_tiles, per_rank, c_tiles, E, SH0, P: gl.constexpr,
              H: gl.constexpr, I: gl.constexpr, NG: gl.constexpr, NCT: gl.constexpr,
              NCJ: gl.constexpr, NDT: gl.constexpr, NDJ: gl.constexpr,
              HAS_SHARED: gl.constexpr, INTERLEAVED: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: M rows WG*BM/2 .. of each tile ([BM/2, BN] fp32, 128 registers a
    thread), its A operand the transposed view of its BM/2 columns of the ring's A box, one
    wgmma group in flight, each slot released once its wgmma has finished; then the rows as
    two [BM/2, BN/2] bf16 boxes through ``epi_lo``, ``epi_hi`` and TMA: the C tile's two
    column halves, the D tile's gate and up columns (INTERLEAVED: they alternate in dG/dU;
    the output keeps the canonical layout)."""
    HM: gl.constexpr = BM // 2
    HN: gl.constexpr = BN // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    c = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        lr, is_d, g, mt, nt = _tile(t, per_rank, c_tiles, NG, NCT, NCJ, NDT, NDJ)
        start, end = _group_rows(gst_ptr, total_ptr, lr, g, NG)
        acc = gl.zeros([HM, BN], gl.float32, acc_layout)
        steps = (end - start) // BK
        for kk in range(steps):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a_t = a_ring.index(s).slice(WG * HM, HM, dim=1).permute((1, 0))  # [HM, BK]
            acc = warpgroup_mma(a_t, b_ring.index(s), acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_t, b_ring.index(s)))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
            c += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if steps > 0:
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        slot = lr * E + g
        if HAS_SHARED:
            if g == E:
                slot = SH0 + lr
        out = acc.to(gl.bfloat16)
        tma.store_wait(0)  # this warpgroup's previous tile has left its buffers
        col_lo = nt * BN
        col_hi = nt * BN + HN
        if is_d and INTERLEAVED:  # columns gate c, up c, ...: the gate and up columns
            stage_halves(out, epi_lo, epi_hi, True)
            col_lo = nt * HN
            col_hi = I + nt * HN
        else:  # the tile's left and right column halves
            stage_halves(out, epi_lo, epi_hi, False)
        fence_async_shared()
        if is_d:
            row = slot * H + mt * BM + WG * HM
            _tma_store(dw1_desc, [row, col_lo], epi_lo)
            _tma_store(dw1_desc, [row, col_hi], epi_hi)
        else:
            row = slot * I + mt * BM + WG * HM
            _tma_store(dw2_desc, [row, col_lo], epi_lo)
            _tma_store(dw2_desc, [row, col_hi], epi_hi)
    tma.store_wait(0)


@gluon.jit
def dw_gluon_kernel(hs_desc, dy_desc, x_desc, dgu_desc, dw2_desc, dw1_desc, gst_ptr,
                    total_ptr, n_tiles, per_rank, c_tiles, E, SH0, P: gl.constexpr,
                    H: gl.constexpr, I: gl.constexpr, NG: gl.constexpr,
                    HAS_SHARED: gl.constexpr, INTERLEAVED: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Persistent cooperative dW (module docstring): ``n_tiles`` = L * ``per_rank``, of
    which the first ``c_tiles`` of each rank are C tiles; the grid at most ``n_tiles``.
    Launch with num_warps=4 (the default partition is consumer 0)."""
    NCJ: gl.constexpr = H // BN
    NCT: gl.constexpr = (I // BM) * NCJ
    NDJ: gl.constexpr = 2 * I // BN
    NDT: gl.constexpr = (H // BM) * NDJ
    a_ring = gl.allocate_shared_memory(hs_desc.dtype, [STAGES, BK, BM], hs_desc.layout)
    b_ring = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BK, BN], dy_desc.layout)
    epi = gl.allocate_shared_memory(gl.bfloat16, [4, BM // 2, BN // 2], dw2_desc.layout)
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize(
        [
            (_consumer, (0, a_ring, b_ring, ready, empty, epi.index(0), epi.index(1), dw2_desc,
                         dw1_desc, gst_ptr, total_ptr, n_tiles, per_rank, c_tiles, E, SH0,
                         P, H, I, NG, NCT, NCJ, NDT, NDJ, HAS_SHARED, INTERLEAVED, BM, BN,
                         BK, STAGES)),
            (_consumer, (1, a_ring, b_ring, ready, empty, epi.index(2), epi.index(3), dw2_desc,
                         dw1_desc, gst_ptr, total_ptr, n_tiles, per_rank, c_tiles, E, SH0,
                         P, H, I, NG, NCT, NCJ, NDT, NDJ, HAS_SHARED, INTERLEAVED, BM, BN,
                         BK, STAGES)),
            (_producer, (hs_desc, dy_desc, x_desc, dgu_desc, a_ring, b_ring, ready, empty,
                         gst_ptr, total_ptr, n_tiles, per_rank, c_tiles, P, NG, NCT, NCJ,
                         NDT, NDJ, BM, BN, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def tiles_per_rank(H: int, I: int, groups: int, c: bool = True, d: bool = True) -> tuple[int,
                                                                                        int]:
    """(C tiles, D tiles) of one logical rank over ``groups`` groups (only the kinds asked)."""
    return (groups * (I // BM) * (H // BN) if c else 0,
            groups * (H // BM) * (2 * I // BN) if d else 0)


def dw_descriptors(hs_LPI: torch.Tensor, dyg_LPH: torch.Tensor, xg_LPH: torch.Tensor,
                   pre_LPF: torch.Tensor, dw2_all: torch.Tensor,
                   dw1_all: torch.Tensor) -> tuple[Any, ...]:
    """Gluon TMA descriptors over [rows, cols] views (never a silent copy): the A operands
    r h [L*P, I] and x [L*P, H] in [BK, BM] boxes, the B operands dY [L*P, H] and dG/dU
    [L*P, 2I] in [BK, BN] boxes, the outputs dW_down [slots*I, H] and dW_gate_up [slots*H,
    2I] in [BM/2, BN/2] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t: torch.Tensor, box: list[int]) -> Any:
        return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), box, nvmma_layout(box))

    a, b, o = [BK, BM], [BK, BN], [BM // 2, BN // 2]
    return (desc(hs_LPI, a), desc(dyg_LPH, b), desc(xg_LPH, a), desc(pre_LPF, b),
            desc(dw2_all, o), desc(dw1_all, o))


def dw_constexprs(P: int, H: int, I: int, groups: int, shared: bool,
                  interleaved: bool) -> dict[str, Any]:
    """The kernel's compile-time arguments (also what ``lowering`` builds it with)."""
    return dict(P=P, H=H, I=I, NG=groups, HAS_SHARED=shared, INTERLEAVED=interleaved, BM=BM,
                BN=BN, BK=BK, STAGES=STAGES, PRODUCER_REGS=PRODUCER_REGS,
                CONSUMER_REGS=CONSUMER_REGS)


def check_shapes(H: int, I: int, row_align: int) -> None:
    """The tiles this launch covers exactly, else a one-line error naming the field."""
    for name, value, tile in (("hidden", H, BN), ("intermediate", I, BM),
                              ("row alignment (bwd_block_m)", row_align, BK)):
        if value % tile:
            raise ValueError(f"bwd_dw_gluon: {name}={value} is not a multiple of {tile}")


def launch_dw(hs_LPI: torch.Tensor, dyg_LPH: torch.Tensor, xg_LPH: torch.Tensor,
              pre_LPF: torch.Tensor, dw2_all: torch.Tensor, dw1_all: torch.Tensor,
              gstart_LG1: torch.Tensor, total_L: torch.Tensor, *, E: int, shared: bool,
              interleaved: bool, row_align: int, programs: int, c: bool = True,
              d: bool = True) -> None:
    """Every group's dW_down (``c``) and dW_gate_up (``d``) tiles of each logical rank into
    ``dw2_all`` [L*E (+L), I, H] and ``dw1_all`` [L*E (+L), H, 2I] (the shared expert's L
    slots after the routed experts'). ``gstart_LG1`` int32 [L, G+1] the groups' first rows
    (padded to ``row_align``), ``total_L`` [L] rows in use, ``programs`` CTAs (at most one a
    tile)."""
    L, P, I = hs_LPI.shape
    H = dyg_LPH.shape[-1]
    check_shapes(H, I, row_align)
    groups = E + int(shared)
    if tuple(gstart_LG1.shape) != (L, groups + 1):
        raise ValueError(f"bwd_dw_gluon: group starts of shape {tuple(gstart_LG1.shape)}, "
                         f"want {(L, groups + 1)}")
    c_tiles, d_tiles = tiles_per_rank(H, I, groups, c, d)
    per_rank = c_tiles + d_tiles
    n_tiles = L * per_rank
    if n_tiles == 0:
        return
    descs = dw_descriptors(hs_LPI, dyg_LPH, xg_LPH, pre_LPF, dw2_all, dw1_all)
    dw_gluon_kernel[(max(1, min(programs, n_tiles)),)](
        *descs, gstart_LG1, total_L, n_tiles, per_rank, c_tiles, E, L * E,
        **dw_constexprs(P, H, I, groups, shared, interleaved), num_warps=4)


def compile_sm90(P: int, H: int, I: int, groups: int, shared: bool = False,
                 interleaved: bool = True) -> Any:
    """Triton's sm_90 build of the launch at these sizes (no GPU needed): its ``asm`` holds
    the TTGIR, PTX and cubin, its ``metadata.shared`` the shared-memory bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    check_shapes(H, I, BK)
    a, b, o = [BK, BM], [BK, BN], [BM // 2, BN // 2]
    sig = {"hs_desc": f"tensordesc<bf16[{BK}, {BM}],{nvmma_layout(a)!r}>",
           "dy_desc": f"tensordesc<bf16[{BK}, {BN}],{nvmma_layout(b)!r}>",
           "x_desc": f"tensordesc<bf16[{BK}, {BM}],{nvmma_layout(a)!r}>",
           "dgu_desc": f"tensordesc<bf16[{BK}, {BN}],{nvmma_layout(b)!r}>",
           "dw2_desc": f"tensordesc<bf16[{BM // 2}, {BN // 2}],{nvmma_layout(o)!r}>",
           "dw1_desc": f"tensordesc<bf16[{BM // 2}, {BN // 2}],{nvmma_layout(o)!r}>",
           "gst_ptr": "*i32", "total_ptr": "*i32", "n_tiles": "i32", "per_rank": "i32",
           "c_tiles": "i32", "E": "i32", "SH0": "i32"}
    consts = dw_constexprs(P, H, I, groups, shared, interleaved)
    sig.update({k: "constexpr" for k in consts})
    fn = dw_gluon_kernel
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
             for k in ("gst_ptr", "total_ptr")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
