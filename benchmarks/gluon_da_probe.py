"""Can a warp-specialised Gluon kernel hide the dA items' SwiGLU-backward epilogue behind the
next tile's MMAs on Hopper (sm_90)?

The probe times one grouped GEMM plus its epilogue, the shape of the MoE backward megakernel's
"dA items":

    dA_raw[rows of g, :] = dY_rows[rows of g] @ WdT[g*I:(g+1)*I, :]^T      (fp32 accumulation)
    sig = sigmoid(gate), silu = gate*sig, h = silu*up, da = dA_raw * r[row]
    dU = da*silu, dG = da*up*(sig + silu*(1 - sig))      -> bf16 over ``pre`` in place
    hs = bf16(h * r[row]), drp[row, I tile] = sum over the tile's columns of dA_raw*h

with ``pre`` [P, 2I] interleaving gate (column 2c) and up (column 2c+1).

Variants:
  plain           plain Triton, persistent, host TMA descriptors, tl.dot K loop, then the
                  epilogue in the same warps (the megakernel item's structure; [128, 256] tile).
  plain_noepi     the same K loop, storing only per-row sums of dA_raw (the K loop's time).
  gluon_ws        Gluon, warp-specialised ping-pong (below), [128, 128] tile per warpgroup.
  gluon_ws_noepi  the same Gluon kernel storing only the per-row sums.
  gluon_ws_gpre   gluon_ws with gate/up loaded from (and dG/dU stored to) global memory in the
                  epilogue instead of through TMA'd smem slabs (PRE_TMA=False; 4 stages).
  gluon_coop_noepi  Gluon, warp-specialised cooperative: plain_noepi's [128, 256] tile and
                  4-stage ring, the TMA loads issued by a producer warp, each consumer
                  warpgroup [64, 256] of the tile; the warpgroups meet only at the ring's
                  mbarriers (per K step: 2 barriers of one warpgroup's 128 threads, where the
                  plain loop has 4 of all 256; benchmarks/kloop_sass.py). Row sums only.

The answer is whether gluon_ws approaches plain_noepi while plain does not; and
gluon_coop_noepi against plain_noepi says what Triton's CTA-wide barriers in the plain K loop
cost.

Gluon design (ping-pong, CUTLASS "KernelTmaWarpSpecializedPingpong"-like):
  * 1 producer warp (worker, few registers): TMA loads of dY [BM, BK] and WdT [BN, BK] into a
    STAGES-deep ring (ready/empty mbarriers, expect-tx bytes), and, one tile ahead, the tile's
    gate/up slab pre[BM, 2*BN] into that tile's warpgroup's own buffer (pre_ready/pre_empty).
  * 2 consumer warpgroups (the default partition and a 4-warp worker) take the CTA's tiles in
    turn (tile i goes to warpgroup i % 2). An mbarrier pair ("turn") orders their K loops:
    warpgroup w issues its wgmma chain only after the other finished issuing its previous
    tile's, so the tensor cores run one K loop at a time, and warpgroup w's epilogue runs while
    the other's K loop owns the tensor cores.
  * The epilogue works in column quarters of the accumulator (reshape/permute/split on its
    register bits: no data moves, no convert_layout in the TTGIR), so one quarter's gate/up
    and temporaries fit beside the accumulator (without the quarters ptxas spilled ~2.5 KB
    per thread). Gate/up come out of shared memory (the bf16 slab reinterpreted as i32
    [BM, BN], one (gate, up) pair per i32, gate in the low half, loaded straight in the
    accumulator's layout), the packed (dG, dU) pairs go back into the same slab, which is
    TMA-stored over ``pre``; hs and drp are plain global stores. The plain kernel's epilogue
    uses the same quarters and the same i32 packing (the megakernel loads gate/up through a
    TMA descriptor instead), so the two differ in overlap, not in epilogue code.
Why ping-pong rather than an MMA partition + epilogue partition: on Hopper the wgmma
accumulator lives in the issuing warpgroup's registers, so handing it to another partition
costs a [BM, BN] fp32 round trip through shared memory (64 KB per 128x128 tile) on the MMA
warps' critical path and smem the ring needs; with ping-pong the accumulator never moves.
A [128, 128] fp32 accumulator is 128 registers per thread, and the i32 gate/up tile another
128 at most, within the ~232 each consumer warpgroup gets (setmaxnreg) beside a ~40-register
producer. Shared memory: ring STAGES x (16 + 16) KB + 2 x 64 KB gate/up slabs = 224 KB for
STAGES = 3, under sm_90's 227 KB (4 stages do not fit with the slabs; PRE_TMA=False drops the
slabs and loads gate/up from global memory in the epilogue instead, allowing 4 stages).

Run (from the repository root):
    python benchmarks/gluon_da_probe.py --check         # small shapes, all variants vs torch
    python benchmarks/gluon_da_probe.py --time          # Kimi K2 shape, ms and TFLOP/s
    python benchmarks/gluon_da_probe.py --compile-only  # sm_90 compile, no GPU, no torch

--compile-only compiles every kernel for sm_90 with the Kimi shape's constexprs and prints
shared memory bytes and ptxas -v's register/spill line (Triton's bundled ptxas, -arch=sm_90a).
Needs Triton 3.6 (Gluon's Hopper API as of that release).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# ---------------------------------------------------------------------------------------------
# Shapes and tiles
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """G experts of R rows each (P = G*R rows), hidden H, intermediate I."""

    G: int
    R: int
    H: int
    I: int

    @property
    def P(self) -> int:
        return self.G * self.R

    def flops(self) -> float:
        return 2.0 * self.P * self.H * self.I


KIMI = Shape(G=48, R=2816, H=7168, I=2048)
SMALL = Shape(G=3, R=256, H=512, I=512)

BM, BK = 128, 64
PLAIN_BN, PLAIN_WARPS, PLAIN_STAGES = 256, 8, 3
WS_BN, WS_STAGES, WS_STAGES_NO_PRE = 128, 3, 4
WS_PRODUCER_REGS, WS_CONSUMER_REGS = 40, 232
COOP_STAGES = 4  # 4 x 48 KB of ring, as the megakernel's backward runs
SM90_SMEM_LIMIT = 232448


def num_tiles(s: Shape, bn: int) -> int:
    return (s.P // BM) * (s.I // bn)


# ---------------------------------------------------------------------------------------------
# (a), (b): plain Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _plain_epi_quarter(acc_MQ, rows_M, c0, pre_i32_PI, hs_PI, r_P, I: tl.constexpr,
                       BN: tl.constexpr):
    """SwiGLU backward of columns c0 .. c0 + BN/4 (gate/up read as one i32 per pair, gate in
    the low half; dG/dU written back the same way); returns sum over them of dA_raw*h."""
    cols_Q = c0 + tl.arange(0, BN // 4)
    offs_MQ = rows_M[:, None] * I + cols_Q[None, :]
    gu_MQ = tl.load(pre_i32_PI + offs_MQ)
    gate = (gu_MQ << 16).to(tl.float32, bitcast=True)
    up = (gu_MQ & -65536).to(tl.float32, bitcast=True)
    r_M1 = tl.load(r_P + rows_M)[:, None]
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    h = silu * up
    da = acc_MQ * r_M1
    du = da * silu
    dg = da * up * (sig + silu * (1.0 - sig))
    dg_bits = dg.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 65535
    du_bits = du.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    tl.store(pre_i32_PI + offs_MQ, dg_bits | du_bits)
    tl.store(hs_PI + offs_MQ, (h * r_M1).to(tl.bfloat16))
    return tl.sum(acc_MQ * h, axis=1)


@triton.jit
def plain_da_kernel(dy_desc, wdt_desc, pre_i32_PI, hs_PI, r_P, drp_PT, n_tiles,
                    I: tl.constexpr, H: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, EPI: tl.constexpr,
                    STAGES: tl.constexpr):
    """Persistent: tile t = (row block t // (I/BN), I tile t % (I/BN)); K loop of tl.dot over
    TMA loads; then the SwiGLU-backward epilogue (EPI) or only the per-row sums of dA_raw."""
    NT: tl.constexpr = I // BN
    MB: tl.constexpr = R // BM
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for tile in range(pid, n_tiles, nprog):
        n = tile % NT
        mb = tile // NT
        off_m = mb * BM
        w_row = (mb // MB) * I + n * BN
        acc_MN = tl.zeros([BM, BN], dtype=tl.float32)
        for k in tl.range(0, H, BK, num_stages=STAGES):
            a_MK = dy_desc.load([off_m, k])
            b_NK = wdt_desc.load([w_row, k])
            acc_MN = tl.dot(a_MK, b_NK.T, acc_MN)
        rows_M = off_m + tl.arange(0, BM)
        if EPI:  # column quarters, one after another, as the megakernel's dA items do
            acc_4 = tl.permute(tl.reshape(acc_MN, (BM, 2, 2, BN // 4)), (0, 3, 1, 2))
            acc_lo, acc_hi = tl.split(acc_4)
            q0, q2 = tl.split(acc_lo)
            q1, q3 = tl.split(acc_hi)
            part_M = _plain_epi_quarter(q0, rows_M, n * BN, pre_i32_PI, hs_PI, r_P, I, BN)
            part_M += _plain_epi_quarter(q1, rows_M, n * BN + BN // 4, pre_i32_PI, hs_PI, r_P,
                                         I, BN)
            part_M += _plain_epi_quarter(q2, rows_M, n * BN + BN // 2, pre_i32_PI, hs_PI, r_P,
                                         I, BN)
            part_M += _plain_epi_quarter(q3, rows_M, n * BN + 3 * BN // 4, pre_i32_PI, hs_PI,
                                         r_P, I, BN)
            tl.store(drp_PT + rows_M * NT + n, part_M)
        else:
            tl.store(drp_PT + rows_M * NT + n, tl.sum(acc_MN, axis=1))


# ---------------------------------------------------------------------------------------------
# (c), (d): Gluon, warp-specialised ping-pong
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _ws_tile(tile, NT: gl.constexpr, MB: gl.constexpr, I: gl.constexpr, BM: gl.constexpr,
             BN: gl.constexpr):
    """(first row, I-tile index, first WdT row) of tile ``tile``; the I tile varies fastest, so
    the CTAs running at once share one row block's dY and one expert's WdT tiles in L2."""
    n = tile % NT
    mb = tile // NT
    return mb * BM, n, (mb // MB) * I + n * BN


@gluon.jit
def _ring_fill(dy_desc, wdt_desc, a_ring, b_ring, ready, empty, off_m, w_row, c0,
               KSTEPS: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One tile's K steps into the ring: step c = c0 + kk fills slot c % STAGES in round
    c // STAGES once its consumers have released it (a fresh ``empty`` barrier passes the
    wait on parity 1), with the dY and WdT boxes counted on ``ready``."""
    ab_bytes: gl.constexpr = dy_desc.block_type.nbytes + wdt_desc.block_type.nbytes
    for kk in range(KSTEPS):
        c = c0 + kk
        s = c % STAGES
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), ab_bytes)
        tma.async_copy_global_to_shared(dy_desc, [off_m, kk * BK], ready.index(s),
                                        a_ring.index(s))
        tma.async_copy_global_to_shared(wdt_desc, [w_row, kk * BK], ready.index(s),
                                        b_ring.index(s))


@gluon.jit
def _ws_producer(dy_desc, wdt_desc, pre_desc, a_ring, b_ring, pre_slabs, ready, empty,
                 pre_ready, pre_empty, n_tiles, NT: gl.constexpr, MB: gl.constexpr,
                 I: gl.constexpr, H: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, EPI: gl.constexpr,
                 PRE_TMA: gl.constexpr):
    """1 warp: the CTA's tiles in order; per tile first its gate/up slab (buffer i % 2, the
    warpgroup that owns the tile), then its K steps through the ring. Counters: K step c
    (over all the CTA's tiles) uses slot c % STAGES in round c // STAGES; slab u = i // 2."""
    KSTEPS: gl.constexpr = H // BK
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    i = 0
    for tile in range(pid, n_tiles, nprog):
        off_m, n, w_row = _ws_tile(tile, NT, MB, I, BM, BN)
        if EPI and PRE_TMA:
            buf = i % 2
            u = i // 2
            # Fresh barrier: waiting on parity 1 passes (the "previous" phase counts as done).
            mbarrier.wait(pre_empty.index(buf), (u & 1) ^ 1)
            mbarrier.expect(pre_ready.index(buf), pre_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(pre_desc, [off_m, 2 * n * BN], pre_ready.index(buf),
                                            pre_slabs.index(buf))
        _ring_fill(dy_desc, wdt_desc, a_ring, b_ring, ready, empty, off_m, w_row, i * KSTEPS,
                   KSTEPS, BK, STAGES)
        i += 1


@gluon.jit
def _ws_epi_quarter(acc_MQ, q: gl.constexpr, gu_smem, off_m, n, pre_i32_PI, hs_PI, r_P,
                    I: gl.constexpr, BN: gl.constexpr, PRE_TMA: gl.constexpr):
    """SwiGLU backward of columns [q*BN/4, (q+1)*BN/4) of the tile: gate/up from the smem slab
    (PRE_TMA; dG/dU written back there) or global memory; hs stored; returns the rows'
    partial sums of dA_raw*h. The arithmetic of ``_plain_epi_quarter``, written again: a
    Gluon kernel cannot call a ``triton.jit`` function, and the layouts here are explicit."""
    Q: gl.constexpr = BN // 4
    layout: gl.constexpr = acc_MQ.type.layout
    rows_M = off_m + gl.arange(0, acc_MQ.shape[0], layout=gl.SliceLayout(1, layout))
    cols_Q = n * BN + q * Q + gl.arange(0, Q, layout=gl.SliceLayout(0, layout))
    offs_MQ = gl.expand_dims(rows_M, 1) * I + gl.expand_dims(cols_Q, 0)
    if PRE_TMA:
        gu_MQ = gu_smem.slice(q * Q, Q, dim=1).load(layout)
    else:
        gu_MQ = gl.load(pre_i32_PI + offs_MQ)
    gate = (gu_MQ << 16).to(gl.float32, bitcast=True)  # gate in the low half, up in the high
    up = (gu_MQ & -65536).to(gl.float32, bitcast=True)
    r_M1 = gl.expand_dims(gl.load(r_P + rows_M), 1)
    sig = 1.0 / (1.0 + gl.exp(-gate))
    silu = gate * sig
    h = silu * up
    da = acc_MQ * r_M1
    du = da * silu
    dg = da * up * (sig + silu * (1.0 - sig))
    dg_bits = dg.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 65535
    du_bits = du.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) << 16
    if PRE_TMA:
        gu_smem.slice(q * Q, Q, dim=1).store(dg_bits | du_bits)
    else:
        gl.store(pre_i32_PI + offs_MQ, dg_bits | du_bits)
    gl.store(hs_PI + offs_MQ, (h * r_M1).to(gl.bfloat16))
    return gl.sum(acc_MQ * h, axis=1)


@gluon.jit
def _ws_consumer(WG: gl.constexpr, pre_desc, a_ring, b_ring, pre_slabs, ready, empty,
                 pre_ready, pre_empty, turn, pre_i32_PI, hs_PI, r_P, drp_PT, n_tiles,
                 NT: gl.constexpr, MB: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                 EPI: gl.constexpr, PRE_TMA: gl.constexpr):
    """One warpgroup: the CTA's tiles WG, WG+2, ...; per tile wait for its turn, run the K loop
    (async wgmma, one in flight, each finished slot released), pass the turn, epilogue."""
    KSTEPS: gl.constexpr = H // BK
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    gu_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                        element_bitwidth=32, rank=2)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    j = 0  # this warpgroup's tile count; the CTA's local tile index is i = 2*j + WG
    for tile in range(pid + WG * nprog, n_tiles, 2 * nprog):
        i = 2 * j + WG
        off_m, n, w_row = _ws_tile(tile, NT, MB, I, BM, BN)
        # turn[WG] completes once per K loop of the other warpgroup; WG 0 goes first (parity
        # 1 of a fresh barrier passes), WG 1 waits for WG 0's j-th K loop (parity j & 1).
        mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        acc_MN = gl.zeros([BM, BN], gl.float32, acc_layout)
        c0 = i * KSTEPS
        for kk in range(KSTEPS):
            c = c0 + kk
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            acc_MN = warpgroup_mma(a_ring.index(s), b_ring.index(s).permute((1, 0)), acc_MN,
                                   is_async=True)
            acc_MN, _, _ = warpgroup_mma_wait(num_outstanding=1,
                                              deps=(acc_MN, a_ring.index(s), b_ring.index(s)))
            # The wgmma of step c - 1 has finished: its slot may be refilled.
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
        mbarrier.arrive(turn.index(1 - WG))  # the other warpgroup's wgmmas queue behind ours
        acc_MN = warpgroup_mma_wait(num_outstanding=0, deps=(acc_MN, ))
        mbarrier.arrive(empty.index((c0 + KSTEPS - 1) % STAGES))

        if EPI:
            if PRE_TMA:
                mbarrier.wait(pre_ready.index(WG), j & 1)
                gu_smem = pre_slabs.index(WG)._reinterpret(gl.int32, [BM, BN], gu_smem_layout)
            else:
                gu_smem = pre_slabs  # unused placeholder
            # Four column quarters, one after the other, so that the accumulator (128
            # registers) plus one quarter's gate/up and temporaries fit the register budget.
            # Splitting on the accumulator's register bits moves no data.
            acc_4 = acc_MN.reshape([BM, 2, 2, BN // 4]).permute((0, 3, 1, 2))
            acc_lo, acc_hi = acc_4.split()  # column bit BN/4 (last dim) first
            q0, q2 = acc_lo.split()  # then column bit BN/2
            q1, q3 = acc_hi.split()
            d0 = _ws_epi_quarter(q0, 0, gu_smem, off_m, n, pre_i32_PI, hs_PI, r_P, I, BN,
                                 PRE_TMA)
            d1 = _ws_epi_quarter(q1, 1, gu_smem, off_m, n, pre_i32_PI, hs_PI, r_P, I, BN,
                                 PRE_TMA)
            d2 = _ws_epi_quarter(q2, 2, gu_smem, off_m, n, pre_i32_PI, hs_PI, r_P, I, BN,
                                 PRE_TMA)
            d3 = _ws_epi_quarter(q3, 3, gu_smem, off_m, n, pre_i32_PI, hs_PI, r_P, I, BN,
                                 PRE_TMA)
            drp_M = (d0 + d1) + (d2 + d3)
            rows_M = off_m + gl.arange(0, BM, layout=drp_M.type.layout)
            gl.store(drp_PT + rows_M * NT + n, drp_M)
            if PRE_TMA:
                fence_async_shared()
                tma.async_copy_shared_to_global(pre_desc, [off_m, 2 * n * BN],
                                                pre_slabs.index(WG))
                tma.store_wait(pendings=0)  # the slab is read out: the producer may refill it
                gl.thread_barrier()
                mbarrier.arrive(pre_empty.index(WG))
        else:
            rows_M = off_m + gl.arange(0, BM, layout=row_layout)
            gl.store(drp_PT + rows_M * NT + n, gl.sum(acc_MN, axis=1))
        j += 1


@gluon.jit
def gluon_ws_da_kernel(dy_desc, wdt_desc, pre_desc, pre_i32_PI, hs_PI, r_P, drp_PT, n_tiles,
                       I: gl.constexpr, H: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                       BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       EPI: gl.constexpr, PRE_TMA: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr):
    """Persistent warp-specialised dA GEMM + SwiGLU backward (see the module docstring).
    Launch with num_warps=4 (the default partition is consumer warpgroup 0)."""
    NT: gl.constexpr = I // BN
    MB: gl.constexpr = R // BM
    a_ring = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BM, BK], dy_desc.layout)
    b_ring = gl.allocate_shared_memory(wdt_desc.dtype, [STAGES, BN, BK], wdt_desc.layout)
    if EPI and PRE_TMA:
        pre_slabs = gl.allocate_shared_memory(pre_desc.dtype, [2, BM, 2 * BN], pre_desc.layout)
    else:  # unused placeholder (keeps one argument list)
        pre_slabs = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pre_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pre_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for b in gl.static_range(2):
        mbarrier.init(pre_ready.index(b), count=1)
        mbarrier.init(pre_empty.index(b), count=1)
        mbarrier.init(turn.index(b), count=1)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_ws_consumer, (0, pre_desc, a_ring, b_ring, pre_slabs, ready, empty, pre_ready,
                            pre_empty, turn, pre_i32_PI, hs_PI, r_P, drp_PT, n_tiles, NT, MB,
                            I, H, BM, BN, BK, STAGES, EPI, PRE_TMA)),
            (_ws_consumer, (1, pre_desc, a_ring, b_ring, pre_slabs, ready, empty, pre_ready,
                            pre_empty, turn, pre_i32_PI, hs_PI, r_P, drp_PT, n_tiles, NT, MB,
                            I, H, BM, BN, BK, STAGES, EPI, PRE_TMA)),
            (_ws_producer, (dy_desc, wdt_desc, pre_desc, a_ring, b_ring, pre_slabs, ready,
                            empty, pre_ready, pre_empty, n_tiles, NT, MB, I, H, BM, BN, BK,
                            STAGES, EPI, PRE_TMA)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------------
# (e): Gluon, warp-specialised cooperative main loop (no epilogue)
# ---------------------------------------------------------------------------------------------


@gluon.jit
def _coop_producer(dy_desc, wdt_desc, a_ring, b_ring, ready, empty, n_tiles,
                   NT: gl.constexpr, MB: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr):
    """1 warp: the CTA's tiles in order, each tile's K steps through the ring. K step c (over
    all the CTA's tiles) fills slot c % STAGES in round c // STAGES, once both consumer
    warpgroups have released it (``empty`` counts two arrivals)."""
    KSTEPS: gl.constexpr = H // BK
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    i = 0
    for tile in range(pid, n_tiles, nprog):
        off_m, n, w_row = _ws_tile(tile, NT, MB, I, BM, BN)
        _ring_fill(dy_desc, wdt_desc, a_ring, b_ring, ready, empty, off_m, w_row, i * KSTEPS,
                   KSTEPS, BK, STAGES)
        i += 1


@gluon.jit
def _coop_consumer(WG: gl.constexpr, a_ring, b_ring, ready, empty, drp_PT, n_tiles,
                   NT: gl.constexpr, MB: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr):
    """One warpgroup: rows WG*BM/2 .. of every tile of the CTA ([BM/2, BN] fp32 accumulator,
    128 registers a thread at [64, 256]); per K step wait for the slot, async wgmma on its
    half of the dY box and the whole WdT box, one in flight, release the previous slot. No
    CTA-wide barrier: the warpgroups meet only at the ring's mbarriers."""
    KSTEPS: gl.constexpr = H // BK
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    i = 0
    for tile in range(pid, n_tiles, nprog):
        off_m, n, w_row = _ws_tile(tile, NT, MB, I, BM, BN)
        acc_MN = gl.zeros([HM, BN], gl.float32, acc_layout)
        c0 = i * KSTEPS
        for kk in range(KSTEPS):
            c = c0 + kk
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a_half = a_ring.index(s).slice(WG * HM, HM, dim=0)
            acc_MN = warpgroup_mma(a_half, b_ring.index(s).permute((1, 0)), acc_MN,
                                   is_async=True)
            acc_MN, _, _ = warpgroup_mma_wait(num_outstanding=1,
                                              deps=(acc_MN, a_half, b_ring.index(s)))
            # The wgmma of step c - 1 has finished: this warpgroup is done with its slot.
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
        acc_MN = warpgroup_mma_wait(num_outstanding=0, deps=(acc_MN, ))
        mbarrier.arrive(empty.index((c0 + KSTEPS - 1) % STAGES))
        rows_M = off_m + WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, acc_layout))
        gl.store(drp_PT + rows_M * NT + n, gl.sum(acc_MN, axis=1))
        i += 1


@gluon.jit
def gluon_coop_da_kernel(dy_desc, wdt_desc, pre_desc, pre_i32_PI, hs_PI, r_P, drp_PT, n_tiles,
                         I: gl.constexpr, H: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                         BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                         EPI: gl.constexpr, PRE_TMA: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """The plain kernel's K loop ([BM, BN] tile, STAGES-deep TMA ring) with the loads issued
    by a producer warp and the two consumer warpgroups meeting only at mbarriers, where
    Triton's plain loop puts four CTA-wide barriers in each K step (benchmarks/kloop_sass.py).
    Stores the per-row sums of dA_raw only (as plain_noepi); ``pre_desc``, ``pre_i32_PI``,
    ``hs_PI``, ``r_P``, ``EPI`` and ``PRE_TMA`` unused (the probe's one argument list).
    Launch with num_warps=4 (the default partition is consumer warpgroup 0)."""
    NT: gl.constexpr = I // BN
    MB: gl.constexpr = R // BM
    a_ring = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BM, BK], dy_desc.layout)
    b_ring = gl.allocate_shared_memory(wdt_desc.dtype, [STAGES, BN, BK], wdt_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()

    gl.warp_specialize(
        [
            (_coop_consumer, (0, a_ring, b_ring, ready, empty, drp_PT, n_tiles, NT, MB, I, H,
                              BM, BN, BK, STAGES)),
            (_coop_consumer, (1, a_ring, b_ring, ready, empty, drp_PT, n_tiles, NT, MB, I, H,
                              BM, BN, BK, STAGES)),
            (_coop_producer, (dy_desc, wdt_desc, a_ring, b_ring, ready, empty, n_tiles, NT,
                              MB, I, H, BM, BN, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------------
# Variants: launch parameters shared by the GPU paths and --compile-only
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    gluon: bool
    epi: bool
    bn: int
    stages: int
    pre_tma: bool = True
    coop: bool = False  # gluon: the cooperative main loop (e) instead of the ping-pong

    @property
    def num_warps(self) -> int:
        return 4 if self.gluon else PLAIN_WARPS

    def constexprs(self, s: Shape) -> dict[str, Any]:
        c: dict[str, Any] = dict(I=s.I, H=s.H, R=s.R, BM=BM, BN=self.bn, BK=BK,
                                 STAGES=self.stages, EPI=self.epi)
        if self.gluon:
            c.update(PRE_TMA=self.pre_tma, PRODUCER_REGS=WS_PRODUCER_REGS,
                     CONSUMER_REGS=WS_CONSUMER_REGS)
        return c


# Simplest first: a Gluon variant that hangs (a wrong mbarrier phase) then costs only itself
# and those after it, and the ones before have printed their lines.
VARIANTS = [
    Variant("plain", gluon=False, epi=True, bn=PLAIN_BN, stages=PLAIN_STAGES),
    Variant("plain_noepi", gluon=False, epi=False, bn=PLAIN_BN, stages=PLAIN_STAGES),
    Variant("gluon_ws_noepi", gluon=True, epi=False, bn=WS_BN, stages=WS_STAGES_NO_PRE),
    Variant("gluon_ws_gpre", gluon=True, epi=True, bn=WS_BN, stages=WS_STAGES_NO_PRE,
            pre_tma=False),
    Variant("gluon_ws", gluon=True, epi=True, bn=WS_BN, stages=WS_STAGES),
    Variant("gluon_coop_noepi", gluon=True, epi=False, bn=PLAIN_BN, stages=COOP_STAGES,
            coop=True),
]


def variant_kernel(v: Variant) -> Any:
    """The jitted kernel that runs variant ``v``."""
    if not v.gluon:
        return plain_da_kernel
    return gluon_coop_da_kernel if v.coop else gluon_ws_da_kernel


def _gl_layout(block: list[int]) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def _desc_blocks(v: Variant) -> dict[str, list[int]]:
    """TMA blocks; the gate/up slab's [BM, 2 BN] block only where the kernel loads it (else a
    small one in its place, so that a variant without it runs even if that block fails)."""
    pre = [BM, 2 * v.bn] if v.epi and v.pre_tma else [BM, BK]
    return {"dy_desc": [BM, BK], "wdt_desc": [v.bn, BK], "pre_desc": pre}


# ---------------------------------------------------------------------------------------------
# GPU paths (torch imported lazily so --compile-only runs without it)
# ---------------------------------------------------------------------------------------------


def make_inputs(s: Shape, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    return dict(
        dy_rows_PH=torch.randn(s.P, s.H, device="cuda", dtype=bf, generator=g),
        wdt_GIH=(torch.randn(s.G * s.I, s.H, device="cuda", dtype=bf, generator=g)
                 * s.H ** -0.5).to(bf),
        pre_PF=torch.randn(s.P, 2 * s.I, device="cuda", dtype=bf, generator=g),
        r_P=torch.rand(s.P, device="cuda", dtype=torch.float32, generator=g),
    )


class Launch:
    """One variant's launch over fixed buffers (descriptors built once, outside timing)."""

    def __init__(self, v: Variant, s: Shape, inp: dict[str, Any], pre_PF: Any,
                 programs: int | None = None) -> None:
        import torch

        if s.P * max(s.H, 2 * s.I) >= 2**31:
            raise ValueError("int32 offsets in the epilogue would overflow")
        if s.R % BM or s.I % v.bn or s.H % BK:
            raise ValueError(f"shape {s} not a multiple of the tiles of {v.name}")
        self.v, self.s = v, s
        self.pre_PF = pre_PF
        self.hs_PI = torch.empty(s.P, s.I, device="cuda", dtype=torch.bfloat16)
        self.drp_PT = torch.empty(s.P, s.I // v.bn, device="cuda", dtype=torch.float32)
        self.r_P = inp["r_P"]
        props = torch.cuda.get_device_properties(0)
        self.tiles = num_tiles(s, v.bn)
        self.grid = (min(programs or props.multi_processor_count, self.tiles),)
        blocks = _desc_blocks(v)
        tensors = {"dy_desc": inp["dy_rows_PH"], "wdt_desc": inp["wdt_GIH"], "pre_desc": pre_PF}
        if v.gluon:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GlDesc

            self.descs = [GlDesc.from_tensor(tensors[k], blocks[k], _gl_layout(blocks[k]))
                          for k in ("dy_desc", "wdt_desc", "pre_desc")]
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor

            self.descs = [TensorDescriptor.from_tensor(tensors[k], blocks[k])
                          for k in ("dy_desc", "wdt_desc")]

    def __call__(self) -> None:
        import torch

        v, s = self.v, self.s
        pre_i32 = self.pre_PF.view(torch.int32)  # [P, I]: one (gate, up) pair per element
        args = (*self.descs, pre_i32, self.hs_PI, self.r_P, self.drp_PT, self.tiles)
        if v.gluon:
            variant_kernel(v)[self.grid](*args, **v.constexprs(s), num_warps=4)
        else:
            plain_da_kernel[self.grid](*args, **v.constexprs(s), num_warps=v.num_warps)


def reference(s: Shape, inp: dict[str, Any], bn: int) -> dict[str, Any]:
    """torch float32: dG/dU interleaved as ``pre`` is, hs, drp [P, I/bn], and the row sums of
    dA_raw per I tile (what the noepi variants store)."""
    import torch

    dy = inp["dy_rows_PH"].float().view(s.G, s.R, s.H)
    w = inp["wdt_GIH"].float().view(s.G, s.I, s.H)
    da_raw = torch.bmm(dy, w.transpose(1, 2)).reshape(s.P, s.I)
    pre = inp["pre_PF"].float()
    gate, up = pre[:, 0::2], pre[:, 1::2]
    r = inp["r_P"][:, None]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    h = silu * up
    da = da_raw * r
    du = da * silu
    dg = da * up * (sig + silu * (1 - sig))
    out = torch.empty(s.P, 2 * s.I, device=pre.device)
    out[:, 0::2], out[:, 1::2] = dg, du
    return dict(pre=out, hs=h * r, drp=(da_raw * h).view(s.P, -1, bn).sum(-1),
                rowsum=da_raw.view(s.P, -1, bn).sum(-1))


def rel_err(got: Any, ref: Any) -> float:
    """max |got - ref| / max |ref|; inf where got has a NaN or inf."""
    import torch

    got = got.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_check(variants: list[Variant]) -> int:
    import torch

    s, tol = SMALL, 1e-2
    inp = make_inputs(s)
    refs: dict[int, dict[str, Any]] = {}
    failed = 0
    # Full grid (one or two tiles per CTA), then 3 CTAs: many tiles per CTA, so both
    # warpgroups, the ring's and the gate/up slabs' phase wraps and the turn order all run.
    for v, programs in ((v, p) for v in variants for p in (None, 3)):
        name = f"{v.name}/{'full' if programs is None else programs}"
        ref = refs.setdefault(v.bn, reference(s, inp, v.bn))
        pre = inp["pre_PF"].clone()
        try:
            launch = Launch(v, s, inp, pre, programs)
            launch()
            torch.cuda.synchronize()
        except Exception as exc:  # report and go on to the next variant
            print(f"{name:22s} FAIL (did not run: {type(exc).__name__}: {exc})")
            failed += 1
            continue
        if v.epi:
            errs = {"dG/dU": rel_err(pre, ref["pre"]), "hs": rel_err(launch.hs_PI, ref["hs"]),
                    "drp": rel_err(launch.drp_PT, ref["drp"])}
        else:
            errs = {"rowsum": rel_err(launch.drp_PT, ref["rowsum"])}
        ok = all(e <= tol for e in errs.values())  # NaN/inf -> inf -> FAIL
        failed += not ok
        detail = "  ".join(f"{k} {e:.2e}" for k, e in errs.items())
        print(f"{name:22s} {'PASS' if ok else 'FAIL'}  {detail}")
    return 1 if failed else 0


def run_time(warmup: int, iters: int, variants: list[Variant], back_to_back: int = 1) -> int:
    """Median ms per launch of each variant at the Kimi K2 shape. back_to_back 1: one launch
    per sample, the GPU idle around it (fresh gate/up copied in before it); N > 1: N launches
    per sample with nothing between them, the time divided by N, as the megakernel's items
    run (a sustained load: the power limit may lower the clocks; the epilogue variants then
    rework gate/up already reworked, the same work on other values)."""
    import torch

    s = KIMI
    inp = make_inputs(s)
    work = inp["pre_PF"].clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print(f"shape G={s.G} R={s.R} H={s.H} I={s.I} (P={s.P}); {torch.cuda.get_device_name()}; "
          f"{back_to_back} launch(es) per sample")
    results: dict[str, float] = {}
    for v in variants:
        try:
            launch = Launch(v, s, inp, work)
            samples = []
            for it in range(warmup + iters):
                work.copy_(inp["pre_PF"])  # fresh gate/up, outside the timed region
                start.record()
                for _ in range(back_to_back):
                    launch()
                end.record()
                end.synchronize()  # after the timed region
                if it >= warmup:
                    samples.append(start.elapsed_time(end) / back_to_back)
        except Exception as exc:
            print(f"{v.name:16s} did not run: {type(exc).__name__}: {exc}")
            continue
        ms = statistics.median(samples)
        results[v.name] = ms
        print(f"{v.name:16s} {ms:8.3f} ms  {s.flops() / ms / 1e9:7.1f} TFLOP/s"
              f"  (min {min(samples):.3f}, max {max(samples):.3f})")
    for full, noepi in (("plain", "plain_noepi"), ("gluon_ws", "gluon_ws_noepi"),
                        ("gluon_ws_gpre", "gluon_ws_noepi")):
        if full in results and noepi in results:
            extra = results[full] - results[noepi]
            print(f"{full} - {noepi}: {extra:.3f} ms ({100 * extra / results[full]:.1f}% of "
                  f"{full})")
    for name in ("gluon_ws", "gluon_coop_noepi"):
        if name in results and "plain_noepi" in results:
            print(f"{name} / plain_noepi: {results[name] / results['plain_noepi']:.3f}")
    return 0


# ---------------------------------------------------------------------------------------------
# --compile-only (no GPU, no torch)
# ---------------------------------------------------------------------------------------------


def _signature(v: Variant) -> dict[str, str]:
    blocks = _desc_blocks(v)
    sig: dict[str, str] = {}
    names = ["dy_desc", "wdt_desc"] + (["pre_desc"] if v.gluon else [])
    for name in names:
        rows, cols = blocks[name]
        layout = f",{_gl_layout(blocks[name])!r}" if v.gluon else ""
        sig[name] = f"tensordesc<bf16[{rows}, {cols}]{layout}>"
    sig.update(pre_i32_PI="*i32", hs_PI="*bf16", r_P="*fp32", drp_PT="*fp32", n_tiles="i32")
    return sig


def _ptxas_path() -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except ImportError:
        from triton import knobs

        return knobs.nvidia.ptxas.path


def build_variant(v: Variant, s: Shape) -> Any:
    """Triton's sm_90 build of variant ``v`` at shape ``s`` (its ``asm`` holds the TTGIR,
    PTX and cubin), as the launch would compile it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = variant_kernel(v)
    sig = _signature(v)
    consts = v.constexprs(s)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
             for k in ("pre_i32_PI", "hs_PI", "r_P", "drp_PT")}
    src_cls = GluonASTSource if v.gluon else ASTSource
    src = src_cls(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts: dict[str, Any] = {"num_warps": v.num_warps}
    if not v.gluon:
        opts["num_stages"] = v.stages
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)


def compile_variant(v: Variant, s: Shape) -> tuple[int, str, str]:
    """(shared bytes, ptxas -v register/spill lines, setmaxnreg values in the PTX)."""
    c = build_variant(v, s)
    ptx = c.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.ptx"
        f.write_text(ptx)
        out = subprocess.run([_ptxas_path(), "-arch=sm_90a", "-v", str(f), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log[-2000:]}")
    lines = [ln.strip() for ln in log.splitlines()
             if re.search(r"registers|spill|stack frame|C75\d\d", ln)]
    maxnreg = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    return int(c.metadata.shared), "\n    ".join(lines), ", ".join(maxnreg) or "none"


def run_compile_only(variants: list[Variant]) -> int:
    s = KIMI
    print(f"triton {triton.__version__}; sm_90, shape G={s.G} R={s.R} H={s.H} I={s.I}")
    failed = 0
    for v in variants:
        try:
            shared, lines, maxnreg = compile_variant(v, s)
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            print(f"{v.name:16s} FAILED to compile: {type(exc).__name__}: "
                  + "\n    ".join(msg[-12:]))
            failed += 1
            continue
        over = "  OVER THE sm_90 LIMIT" if shared > SM90_SMEM_LIMIT else ""
        print(f"{v.name:16s} BN={v.bn} stages={v.stages} warps={v.num_warps}"
              f" shared={shared} B{over}  setmaxnreg: {maxnreg}\n    {lines}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="small shapes vs torch reference")
    mode.add_argument("--time", action="store_true", help="Kimi K2 shape timings")
    mode.add_argument("--compile-only", action="store_true", help="sm_90 compile, no GPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", default="", metavar="NAMES",
                    help="comma-separated variants to run (default all: "
                         + ", ".join(v.name for v in VARIANTS) + ")")
    ap.add_argument("--back-to-back", type=int, default=1, metavar="N",
                    help="--time: N launches per timed sample, nothing between them")
    ap.add_argument("--plain-stages", type=int, default=PLAIN_STAGES, metavar="N",
                    help=f"pipeline stages of the plain Triton variants (default {PLAIN_STAGES};"
                         " the megakernel's backward runs 4)")
    a = ap.parse_args()
    try:
        variants = select_variants(a.only, a.plain_stages)
    except ValueError as exc:
        ap.error(str(exc))
    if a.back_to_back < 1:
        ap.error(f"--back-to-back: got {a.back_to_back}; allowed an integer >= 1")
    if a.compile_only:
        return run_compile_only(variants)
    if a.check:
        return run_check(variants)
    return run_time(a.warmup, a.iters, variants, a.back_to_back)


def select_variants(only: str, plain_stages: int = PLAIN_STAGES) -> list[Variant]:
    """VARIANTS named in ``only`` (comma-separated; empty: all), in VARIANTS' order, the plain
    ones at ``plain_stages`` pipeline stages (2 to 4: 4 x 48 KB of ring is what sm_90's
    shared memory holds)."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [v.name for v in VARIANTS]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"--only: unknown variant {bad[0]!r}; allowed {', '.join(known)}")
    if not 2 <= plain_stages <= 4:
        raise ValueError(f"--plain-stages: got {plain_stages}; allowed 2, 3 or 4")
    return [v if v.gluon else replace(v, stages=plain_stages)
            for v in VARIANTS if not names or v.name in names]


if __name__ == "__main__":
    sys.exit(main())
