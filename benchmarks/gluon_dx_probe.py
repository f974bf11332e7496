"""Does the cooperative warp-specialised K loop (benchmarks/gluon_da_probe.py's
``gluon_coop_noepi``, 7-11% faster than Triton's plain loop on an H100) keep its lead on the
backward's dX GEMM, with the dX items' own epilogue (each row stored to its token's slot)?

The probe times the backward megakernel's B items' GEMM alone, grouped over G experts of R
rows each (P = G*R rows), at the Kimi K2 48 shape by default:

    dX[slot[p], :] = dGU[p, :] @ W_gate_up[g]^T      dGU [P, 2I], W_gate_up[g] [H, 2I]

fp32 accumulation, stored bf16, in [128, 256] tiles (row block fastest within a group, then
the H tile, then the group: the CTAs running at once share one group's weight tiles in L2),
K over 2I in 64-wide steps, both operands K-major through TMA as [128, 64] and [256, 64]
boxes (as the dA probe's). ``slot`` is a fixed random permutation of the P rows, so each tile
row lands somewhere else, as the items push dX rows to their (token, k) combine slots.

  plain          plain Triton, persistent, 8 warps, 4 stages: the B items' loop and store
                 (``tl.store`` of the tile to the slot rows; Triton routes the accumulator
                 through shared memory to store whole rows).
  coop           Gluon: a producer warp fills a 4-stage ring; each of two consumer warpgroups
                 computes [64, 256] of the tile, the two meeting only at mbarriers; stores
                 straight from the accumulator's registers (4 bytes a thread an instruction).
  coop_smem      coop storing as Triton does (and as bwd_dx_gluon's launch, whose store
                 it imports): each warpgroup writes its tile half by half
                 ([64, 128] bf16) into its own shared buffer and reads it back in a
                 row-contiguous layout (16 bytes a thread, two 256-byte half rows a warp) for
                 the row stores. 2 x 16 KB of buffers beside the 4 x 48 KB ring.
  *_nostore      the same K loop storing only each tile's row sums (the loop's time alone).

Run (from the repository root; Triton 3.6's Gluon API):
    python benchmarks/gluon_dx_probe.py --check           # small shapes against torch
    python benchmarks/gluon_dx_probe.py --time [--back-to-back N]
    python benchmarks/gluon_dx_probe.py --compile-only    # sm_90 build, no GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from gluon_da_probe import KIMI, Shape  # noqa: E402  (the dA probe's shapes)
from gluon_wgrad_probe import resource_line  # noqa: E402

from mok_kernels._details.gl_dx import _store_half  # noqa: E402  (the layer's launch's store)

BM, BN, BK = 128, 256, 64  # tile [BM rows, BN of H], K step of BK over 2I
STAGES = 4
PLAIN_WARPS = 8
PRODUCER_REGS, CONSUMER_REGS = 40, 232
SMALL = Shape(G=3, R=256, H=512, I=256)
VARIANTS = ("plain", "coop", "coop_smem", "plain_nostore", "coop_nostore")


def num_tiles(s: Shape) -> int:
    """[BM, BN] tiles of dX over all groups."""
    return s.G * (s.R // BM) * (s.H // BN)


def dx_flops(s: Shape) -> float:
    """2 * P * H * 2I: the dX GEMM's multiply-adds, twice."""
    return 4.0 * s.P * s.H * s.I


@triton.jit
def plain_dx_kernel(a_desc, w_desc, slot_P, dx_PH, n_tiles, H: tl.constexpr, I: tl.constexpr,
                    R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    STAGES: tl.constexpr, STORE: tl.constexpr):
    """Persistent: tile t = (group, H tile, row block), row block fastest. STORE False: only
    the tile's row sums go out (column jn*BN of the slot row)."""
    MB: tl.constexpr = R // BM
    NJ: tl.constexpr = H // BN
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        g = tile // (MB * NJ)
        jn = (tile // MB) % NJ
        off_m = g * R + (tile % MB) * BM
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in tl.range(0, 2 * I, BK, num_stages=STAGES):
            a = a_desc.load([off_m, k])  # dGU rows [BM, BK]
            w = w_desc.load([g * H + jn * BN, k])  # W_gate_up[g][H tile, K step]: [BN, BK]
            acc = tl.dot(a, w.T, acc)
        dst = tl.load(slot_P + off_m + tl.arange(0, BM)).to(tl.int64) * H
        if STORE:
            cols = jn * BN + tl.arange(0, BN)
            tl.store(dx_PH + dst[:, None] + cols[None, :], acc.to(tl.bfloat16))
        else:
            tl.store(dx_PH + dst + jn * BN, tl.sum(acc, axis=1).to(tl.bfloat16))


@gluon.jit
def _tile_of(tile, MB: gl.constexpr, NJ: gl.constexpr, R: gl.constexpr, H: gl.constexpr,
             BM: gl.constexpr, BN: gl.constexpr):
    """(first row, H tile, first weight row) of tile ``tile`` (plain_dx_kernel's order)."""
    g = tile // (MB * NJ)
    jn = (tile // MB) % NJ
    return g * R + (tile % MB) * BM, jn, g * H + jn * BN


@gluon.jit
def _producer(a_desc, w_desc, a_ring, b_ring, ready, empty, n_tiles, MB: gl.constexpr,
              NJ: gl.constexpr, R: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: K step c (over all the CTA's tiles) fills slot c % STAGES in round
    c // STAGES once both consumer warpgroups released it (a fresh ``empty`` passes parity 1)."""
    KSTEPS: gl.constexpr = 2 * I // BK
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    i = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        off_m, jn, w_row = _tile_of(tile, MB, NJ, R, H, BM, BN)
        for kk in range(KSTEPS):
            c = i * KSTEPS + kk
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], ready.index(s),
                                            a_ring.index(s))
            tma.async_copy_global_to_shared(w_desc, [w_row, kk * BK], ready.index(s),
                                            b_ring.index(s))
        i += 1


@gluon.jit
def _consumer(WG: gl.constexpr, a_ring, b_ring, ready, empty, epi, slot_P, dx_PH, n_tiles,
              MB: gl.constexpr, NJ: gl.constexpr, R: gl.constexpr, H: gl.constexpr,
              I: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, STORE: gl.constexpr, SMEM_STORE: gl.constexpr):
    """One warpgroup: rows WG*BM/2 .. of each tile ([BM/2, BN] fp32, 128 registers a thread)
    from its half of the dGU box and the whole weight box; then its rows' store."""
    KSTEPS: gl.constexpr = 2 * I // BK
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    i = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        off_m, jn, w_row = _tile_of(tile, MB, NJ, R, H, BM, BN)
        acc = gl.zeros([HM, BN], gl.float32, acc_layout)
        for kk in range(KSTEPS):
            c = i * KSTEPS + kk
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a_half = a_ring.index(s).slice(WG * HM, HM, dim=0)
            acc = warpgroup_mma(a_half, b_ring.index(s).permute((1, 0)), acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(num_outstanding=1,
                                           deps=(acc, a_half, b_ring.index(s)))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i * KSTEPS + KSTEPS - 1) % STAGES))
        rows = off_m + WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, acc_layout))
        dst = gl.load(slot_P + rows).to(gl.int64) * H
        if SMEM_STORE:  # as bwd_dx_gluon's launch stores (every row valid here)
            lo, hi = acc.to(gl.bfloat16).reshape([HM, 2, BN // 2]).permute((0, 2, 1)).split()
            _store_half(lo, epi, dx_PH + dst, rows >= 0, jn * BN, H)
            _store_half(hi, epi, dx_PH + dst, rows >= 0, jn * BN + BN // 2, H)
        elif STORE:
            cols = jn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            gl.store(dx_PH + gl.expand_dims(dst, 1) + gl.expand_dims(cols, 0),
                     acc.to(gl.bfloat16))
        else:
            gl.store(dx_PH + dst + jn * BN, gl.sum(acc, axis=1).to(gl.bfloat16))
        i += 1


@gluon.jit
def coop_dx_kernel(a_desc, w_desc, slot_P, dx_PH, n_tiles, H: gl.constexpr, I: gl.constexpr,
                   R: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, STORE: gl.constexpr, SMEM_STORE: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Persistent cooperative dX (see the module docstring); num_warps=4 (the default
    partition is consumer warpgroup 0)."""
    MB: gl.constexpr = R // BM
    NJ: gl.constexpr = H // BN
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    if SMEM_STORE:  # one [BM/2, BN/2] bf16 buffer a warpgroup
        epi_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM // 2, BN // 2],
                                                                         gl.bfloat16)
        epi = gl.allocate_shared_memory(gl.bfloat16, [2, BM // 2, BN // 2], epi_layout)
        epi0 = epi.index(0)
        epi1 = epi.index(1)
    else:  # unused: no shared memory beyond the ring
        epi0 = a_ring.index(0)
        epi1 = epi0
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (0, a_ring, b_ring, ready, empty, epi0, slot_P, dx_PH, n_tiles, MB,
                         NJ, R, H, I, BM, BN, BK, STAGES, STORE, SMEM_STORE)),
            (_consumer, (1, a_ring, b_ring, ready, empty, epi1, slot_P, dx_PH, n_tiles, MB,
                         NJ, R, H, I, BM, BN, BK, STAGES, STORE, SMEM_STORE)),
            (_producer, (a_desc, w_desc, a_ring, b_ring, ready, empty, n_tiles, MB, NJ, R, H,
                         I, BM, BN, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def _layout(block: list[int]) -> Any:
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def _constexprs(name: str, s: Shape) -> dict[str, Any]:
    c: dict[str, Any] = dict(H=s.H, I=s.I, R=s.R, BM=BM, BN=BN, BK=BK, STAGES=STAGES,
                             STORE=not name.endswith("_nostore"))
    if name.startswith("coop"):
        c.update(SMEM_STORE=name == "coop_smem", PRODUCER_REGS=PRODUCER_REGS,
                 CONSUMER_REGS=CONSUMER_REGS)
    return c


def build(name: str, s: Shape) -> Any:
    """Triton's sm_90 build of variant ``name`` at shape ``s``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    coop = name.startswith("coop")
    fn = coop_dx_kernel if coop else plain_dx_kernel
    lay = (lambda b: f",{_layout(b)!r}") if coop else (lambda b: "")
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}]{lay([BM, BK])}>",
           "w_desc": f"tensordesc<bf16[{BN}, {BK}]{lay([BN, BK])}>",
           "slot_P": "*i32", "dx_PH": "*bf16", "n_tiles": "i32"}
    consts = _constexprs(name, s)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in ("slot_P", "dx_PH")}
    src = (GluonASTSource if coop else ASTSource)(fn=fn, signature=sig, constexprs=consts,
                                                  attrs=attrs)
    opts: dict[str, Any] = {"num_warps": 4 if coop else PLAIN_WARPS}
    if not coop:
        opts["num_stages"] = STAGES
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)


def run_compile_only(names: list[str]) -> int:
    print(f"triton {triton.__version__}; sm_90, shape {KIMI}")
    failed = 0
    for name in names:
        try:
            c = build(name, KIMI)
        except Exception as exc:
            print(f"{name:13s} FAILED to compile: {type(exc).__name__}: "
                  + " | ".join(str(exc).strip().splitlines()[-6:]))
            failed += 1
            continue
        print(f"{name:13s} shared={c.metadata.shared} B  {resource_line(c.asm['cubin'])}")
    return 1 if failed else 0


class Launch:
    """One variant's launch over fixed buffers (descriptors built once, outside timing)."""

    def __init__(self, name: str, s: Shape, dgu_PF: Any, w_GHF: Any, slot_P: Any,
                 programs: int | None = None) -> None:
        import torch

        if s.R % BM or s.H % BN or (2 * s.I) % BK:
            raise ValueError(f"shape {s} not a multiple of the tiles")
        self.name, self.s, self.slot_P = name, s, slot_P
        self.dx_PH = torch.empty(s.P, s.H, device="cuda", dtype=torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.grid = (min(programs or sms, num_tiles(s)),)
        blocks = ((dgu_PF, [BM, BK]), (w_GHF.view(s.G * s.H, 2 * s.I), [BN, BK]))
        if name.startswith("coop"):
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as Desc

            self.descs = [Desc.from_tensor(t, b, _layout(b)) for t, b in blocks]
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor as Desc

            self.descs = [Desc.from_tensor(t, b) for t, b in blocks]

    def __call__(self) -> None:
        args = (*self.descs, self.slot_P, self.dx_PH, num_tiles(self.s))
        if self.name.startswith("coop"):
            coop_dx_kernel[self.grid](*args, **_constexprs(self.name, self.s), num_warps=4)
        else:
            plain_dx_kernel[self.grid](*args, **_constexprs(self.name, self.s),
                                       num_warps=PLAIN_WARPS)


def _inputs(s: Shape) -> tuple[Any, Any, Any]:
    """dGU [P, 2I], W_gate_up [G, H, 2I] (scaled so dX is O(1)), slot [P] a permutation."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    dgu = torch.randn(s.P, 2 * s.I, device="cuda", generator=g).bfloat16()
    w = (torch.randn(s.G, s.H, 2 * s.I, device="cuda", generator=g) * (2 * s.I) ** -0.5)
    slot = torch.randperm(s.P, device="cuda", generator=g).to(torch.int32)
    return dgu, w.bfloat16(), slot


def run_check(names: list[str]) -> int:
    import torch

    s = SMALL
    dgu, w, slot = _inputs(s)
    rows = torch.bmm(dgu.float().view(s.G, s.R, 2 * s.I), w.float().transpose(1, 2))
    ref = torch.empty(s.P, s.H, device="cuda")
    ref[slot.long()] = rows.reshape(s.P, s.H)
    failed = 0
    for name, programs in ((n, p) for n in names for p in (None, 3)):
        label = f"{name}/{'full' if programs is None else programs}"
        try:
            launch = Launch(name, s, dgu, w, slot, programs)
            launch.dx_PH.fill_(float("nan"))  # poisoned: an unwritten row fails
            launch()
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"{label:18s} FAIL (did not run: {type(exc).__name__}: {exc})")
            failed += 1
            continue
        got, want = launch.dx_PH.float(), ref
        if name.endswith("_nostore"):  # each tile's row sums in its first column
            got = got[:, ::BN]
            want = ref.view(s.P, s.H // BN, BN).sum(-1)
        err = (float((got - want).abs().max() / want.abs().max())
               if torch.isfinite(got).all() else float("inf"))
        ok = err <= 1e-2
        failed += not ok
        print(f"{label:18s} {'PASS' if ok else 'FAIL'}  max rel err {err:.2e}")
    return 1 if failed else 0


def run_time(names: list[str], warmup: int, iters: int, back_to_back: int) -> int:
    import torch

    s = KIMI
    dgu, w, slot = _inputs(s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print(f"shape {s}; {torch.cuda.get_device_name()}; {back_to_back} launch(es) per sample")
    res = {}
    for name in names:
        launch = Launch(name, s, dgu, w, slot)
        samples = []
        for it in range(warmup + iters):
            start.record()
            for _ in range(back_to_back):
                launch()
            end.record()
            end.synchronize()
            if it >= warmup:
                samples.append(start.elapsed_time(end) / back_to_back)
        res[name] = statistics.median(samples)
        print(f"{name:13s} {res[name]:8.3f} ms  {dx_flops(s) / res[name] / 1e9:7.1f} TFLOP/s"
              f"  (min {min(samples):.3f}, max {max(samples):.3f})")
    for a, b in (("coop", "plain"), ("coop_smem", "plain"), ("coop_nostore", "plain_nostore")):
        if {a, b} <= res.keys():
            print(f"{a} / {b}: {res[a] / res[b]:.3f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="small shapes against torch")
    mode.add_argument("--time", action="store_true", help="Kimi K2 48 shape timings")
    mode.add_argument("--compile-only", action="store_true", help="sm_90 build, no GPU")
    ap.add_argument("--only", default="", metavar="NAMES",
                    help=f"comma-separated variants (default all: {', '.join(VARIANTS)})")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--back-to-back", type=int, default=1, metavar="N",
                    help="--time: N launches per timed sample, nothing between them")
    a = ap.parse_args()
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(VARIANTS)
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"--only: unknown variant {bad[0]!r}; allowed {', '.join(VARIANTS)}")
    if a.back_to_back < 1:
        ap.error(f"--back-to-back: got {a.back_to_back}; allowed an integer >= 1")
    if a.compile_only:
        return run_compile_only(names)
    if a.check:
        return run_check(names)
    return run_time(names, a.warmup, a.iters, a.back_to_back)


if __name__ == "__main__":
    sys.exit(main())
