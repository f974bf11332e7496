"""Does the cooperative warp-specialised K loop (benchmarks/gluon_da_probe.py's
``gluon_coop_noepi``, 11% faster than Triton's plain loop under the power limit on an H100)
keep its lead on the weight-gradient GEMMs, whose operands are MN-major?

The probe times the backward megakernel's C items' GEMM (dW_down) alone, grouped over G
experts of R rows each (P = G*R rows):

    dW[g] = (r h)[rows of g]^T @ dY[rows of g]      [I, H], fp32 accumulation, stored bf16

in [128, 256] tiles (I tile outer, H tile inner within a group, as the C items run), K over
the group's rows in 64-row steps, both operands read through TMA as [64, 128] and [64, 256]
boxes of row-major [P, I] and [P, H] matrices (the A operand transposed on its way to the
tensor cores: MN-major):
  plain   plain Triton, persistent, ``tl.dot(tl.trans(h), dy)`` (the C items' loop).
  coop    Gluon: a producer warp fills a 4-stage ring of both boxes; each of two consumer
          warpgroups computes [64, 256] of the tile from its 64 columns of the h box
          (transposed view) and the whole dY box, the two meeting only at mbarriers.
  coop_tma  coop with the tile stored as CUTLASS's Hopper GEMMs store it: each warpgroup
          writes its [64, 256] bf16 half into its own shared buffer in the swizzled MMA-operand
          layout and one TMA store copies it out, waited for only before the next tile's
          write, so it runs beside that tile's K loop (coop stores straight from the
          accumulator's registers, 4 bytes a thread per instruction). The two 32 KB buffers
          leave room for a ring of 3 stages (STAGES_TMA), not 4.
  *_nostore  the same K loop storing only each tile's row sums: the loop's time alone.

Run (from the repository root; Triton 3.6's Gluon API):
    python benchmarks/gluon_wgrad_probe.py --check           # small shapes against torch
    python benchmarks/gluon_wgrad_probe.py --time [--back-to-back N]
    python benchmarks/gluon_wgrad_probe.py --compile-only    # sm_90 build, no GPU
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
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
from gluon_da_probe import KIMI, Shape, _ptxas_path  # noqa: E402  (the dA probe's shapes)

BM, BN, BK = 128, 256, 64  # tile [BM (I), BN (H)], K step of BK rows
STAGES = 4
STAGES_TMA = 3  # 3 x 48 KB of ring + 2 x 32 KB of store buffers, under sm_90's 227 KB
PLAIN_WARPS = 8
PRODUCER_REGS, CONSUMER_REGS = 40, 232


def num_tiles(s: Shape) -> int:
    """[BM, BN] tiles of dW over all groups."""
    return s.G * (s.I // BM) * (s.H // BN)


SMALL = Shape(G=3, R=320, H=512, I=256)


@triton.jit
def plain_wgrad_kernel(h_desc, dy_desc, dw_ptr, n_tiles, I: tl.constexpr, H: tl.constexpr,
                       R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       STAGES: tl.constexpr, STORE: tl.constexpr):
    """Persistent: tile t = (group, I tile, H tile), H tile fastest; K over the group's rows.
    STORE False: only the tile's row sums go out (its first column of dw), the K loop's time."""
    NI: tl.constexpr = I // BM
    NJ: tl.constexpr = H // BN
    pid = tl.program_id(0)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        g = tile // (NI * NJ)
        it = (tile // NJ) % NI
        jn = tile % NJ
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for r0 in tl.range(g * R, (g + 1) * R, BK, num_stages=STAGES):
            h = h_desc.load([r0, it * BM])  # [BK, BM]
            dy = dy_desc.load([r0, jn * BN])  # [BK, BN]
            acc = tl.dot(tl.trans(h), dy, acc)
        rows = it * BM + tl.arange(0, BM)
        if STORE:
            cols = jn * BN + tl.arange(0, BN)
            out = dw_ptr + g.to(tl.int64) * I * H + rows[:, None] * H + cols[None, :]
            tl.store(out, acc.to(tl.bfloat16))
        else:
            tl.store(dw_ptr + g.to(tl.int64) * I * H + rows * H + jn * BN,
                     tl.sum(acc, axis=1).to(tl.bfloat16))


@gluon.jit
def _tile_of(tile, NI: gl.constexpr, NJ: gl.constexpr):
    return tile // (NI * NJ), (tile // NJ) % NI, tile % NJ


@gluon.jit
def _producer(h_desc, dy_desc, a_ring, b_ring, ready, empty, n_tiles, NI: gl.constexpr,
              NJ: gl.constexpr, R: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: K step c (over all the CTA's tiles) fills slot c % STAGES in round
    c // STAGES once both consumer warpgroups released it (a fresh ``empty`` passes parity 1)."""
    KSTEPS: gl.constexpr = R // BK
    nbytes: gl.constexpr = h_desc.block_type.nbytes + dy_desc.block_type.nbytes
    i = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        g, it, jn = _tile_of(tile, NI, NJ)
        for kk in range(KSTEPS):
            c = i * KSTEPS + kk
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(h_desc, [g * R + kk * BK, it * BM], ready.index(s),
                                            a_ring.index(s))
            tma.async_copy_global_to_shared(dy_desc, [g * R + kk * BK, jn * BN],
                                            ready.index(s), b_ring.index(s))
        i += 1


@gluon.jit
def _consumer(WG: gl.constexpr, a_ring, b_ring, ready, empty, dw_ptr, dw_desc, epi, n_tiles,
              NI: gl.constexpr, NJ: gl.constexpr, I: gl.constexpr, H: gl.constexpr,
              R: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, STORE: gl.constexpr, TMA_STORE: gl.constexpr):
    """One warpgroup: I rows WG*BM/2 .. of each tile ([BM/2, BN] fp32, 128 registers a
    thread); its A operand the transposed view of its BM/2 columns of the h box. TMA_STORE:
    the tile leaves through ``epi`` (this warpgroup's [BM/2, BN] bf16 buffer) and ``dw_desc``
    (dW as [G*I, H], [BM/2, BN] boxes)."""
    KSTEPS: gl.constexpr = R // BK
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    i = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        g, it, jn = _tile_of(tile, NI, NJ)
        acc = gl.zeros([HM, BN], gl.float32, acc_layout)
        for kk in range(KSTEPS):
            c = i * KSTEPS + kk
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a_t = a_ring.index(s).slice(WG * HM, HM, dim=1).permute((1, 0))  # [HM, BK]
            acc = warpgroup_mma(a_t, b_ring.index(s), acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_t, b_ring.index(s)))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i * KSTEPS + KSTEPS - 1) % STAGES))
        rows = it * BM + WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, acc_layout))
        if TMA_STORE:
            tma.store_wait(0)  # the previous tile's copy has left the buffer
            epi.store(acc.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(dw_desc, [g * I + it * BM + WG * HM, jn * BN], epi)
        elif STORE:
            cols = jn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            out = (dw_ptr + g.to(gl.int64) * I * H + gl.expand_dims(rows, 1) * H
                   + gl.expand_dims(cols, 0))
            gl.store(out, acc.to(gl.bfloat16))
        else:
            gl.store(dw_ptr + g.to(gl.int64) * I * H + rows * H + jn * BN,
                     gl.sum(acc, axis=1).to(gl.bfloat16))
        i += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def coop_wgrad_kernel(h_desc, dy_desc, dw_desc, dw_ptr, n_tiles, I: gl.constexpr,
                      H: gl.constexpr, R: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                      BK: gl.constexpr, STAGES: gl.constexpr, STORE: gl.constexpr,
                      TMA_STORE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr):
    """Persistent cooperative dW_down (see the module docstring); num_warps=4 (the default
    partition is consumer warpgroup 0)."""
    NI: gl.constexpr = I // BM
    NJ: gl.constexpr = H // BN
    a_ring = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BK, BM], h_desc.layout)
    b_ring = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BK, BN], dy_desc.layout)
    if TMA_STORE:  # one [BM/2, BN] store buffer a warpgroup
        epi = gl.allocate_shared_memory(dw_desc.dtype, [2, BM // 2, BN], dw_desc.layout)
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
            (_consumer, (0, a_ring, b_ring, ready, empty, dw_ptr, dw_desc,
                         epi0, n_tiles, NI, NJ, I, H, R, BM, BN, BK, STAGES, STORE,
                         TMA_STORE)),
            (_consumer, (1, a_ring, b_ring, ready, empty, dw_ptr, dw_desc,
                         epi1, n_tiles, NI, NJ, I, H, R, BM, BN, BK, STAGES,
                         STORE, TMA_STORE)),
            (_producer, (h_desc, dy_desc, a_ring, b_ring, ready, empty, n_tiles, NI, NJ, R,
                         BM, BN, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


VARIANTS = ("plain", "coop", "coop_tma", "plain_nostore", "coop_nostore")


def _layout(block: list[int]) -> Any:
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def _constexprs(name: str, s: Shape) -> dict[str, Any]:
    tma_store = name == "coop_tma"
    c: dict[str, Any] = dict(I=s.I, H=s.H, R=s.R, BM=BM, BN=BN, BK=BK,
                             STAGES=STAGES_TMA if tma_store else STAGES,
                             STORE=not name.endswith("_nostore"))
    if name.startswith("coop"):
        c.update(TMA_STORE=tma_store, PRODUCER_REGS=PRODUCER_REGS,
                 CONSUMER_REGS=CONSUMER_REGS)
    return c


def build(name: str, s: Shape) -> Any:
    """Triton's sm_90 build of variant ``name`` at shape ``s``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    coop = name.startswith("coop")
    fn = coop_wgrad_kernel if coop else plain_wgrad_kernel
    lay = (lambda b: f",{_layout(b)!r}") if coop else (lambda b: "")
    sig = {"h_desc": f"tensordesc<bf16[{BK}, {BM}]{lay([BK, BM])}>",
           "dy_desc": f"tensordesc<bf16[{BK}, {BN}]{lay([BK, BN])}>",
           "dw_ptr": "*bf16", "n_tiles": "i32"}
    if coop:
        sig = {**dict(list(sig.items())[:2]),
               "dw_desc": f"tensordesc<bf16[{BM // 2}, {BN}]{lay([BM // 2, BN])}>",
               **dict(list(sig.items())[2:])}
    consts = _constexprs(name, s)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index("dw_ptr"),): [["tt.divisibility", 16]]}
    src = (GluonASTSource if coop else ASTSource)(fn=fn, signature=sig, constexprs=consts,
                                                  attrs=attrs)
    opts: dict[str, Any] = {"num_warps": 4 if coop else PLAIN_WARPS}
    if not coop:
        opts["num_stages"] = STAGES
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)


def resource_line(cubin: bytes) -> str:
    """cuobjdump -res-usage's REG, STACK and SHARED words for one cubin (Triton's bundled
    cuobjdump; no torch, which mok_kernels' lowering helpers import)."""
    tool = Path(_ptxas_path()).parent / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.cubin"
        f.write_bytes(cubin)
        usage = subprocess.run([str(tool), "-res-usage", str(f)], capture_output=True,
                               text=True, check=True).stdout
    return " ".join(w for w in usage.split() if w.startswith(("REG:", "STACK:", "SHARED:")))


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

    def __init__(self, name: str, s: Shape, h_PI: Any, dy_PH: Any,
                 programs: int | None = None) -> None:
        import torch

        if s.R % BK or s.I % BM or s.H % BN:
            raise ValueError(f"shape {s} not a multiple of the tiles")
        self.name, self.s = name, s
        self.dw_GIH = torch.empty(s.G, s.I, s.H, device="cuda", dtype=torch.bfloat16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.grid = (min(programs or sms, num_tiles(s)),)
        if name.startswith("coop"):
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as Desc

            dw_2d = self.dw_GIH.view(s.G * s.I, s.H)
            self.descs = [Desc.from_tensor(t, b, _layout(b))
                          for t, b in ((h_PI, [BK, BM]), (dy_PH, [BK, BN]),
                                       (dw_2d, [BM // 2, BN]))]
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor as Desc

            self.descs = [Desc.from_tensor(h_PI, [BK, BM]), Desc.from_tensor(dy_PH, [BK, BN])]

    def __call__(self) -> None:
        args = (*self.descs, self.dw_GIH, num_tiles(self.s))
        if self.name.startswith("coop"):
            coop_wgrad_kernel[self.grid](*args, **_constexprs(self.name, self.s), num_warps=4)
        else:
            plain_wgrad_kernel[self.grid](*args, **_constexprs(self.name, self.s),
                                          num_warps=PLAIN_WARPS)


def _inputs(s: Shape) -> tuple[Any, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(s.P, s.I, device="cuda", generator=g).bfloat16()
    dy = torch.randn(s.P, s.H, device="cuda", generator=g).bfloat16()
    return h, dy


def run_check(names: list[str]) -> int:
    import torch

    s = SMALL
    h, dy = _inputs(s)
    ref = torch.bmm(h.float().view(s.G, s.R, s.I).transpose(1, 2), dy.float().view(s.G, s.R, s.H))
    failed = 0
    for name, programs in ((n, p) for n in names for p in (None, 3)):
        label = f"{name}/{'full' if programs is None else programs}"
        try:
            launch = Launch(name, s, h, dy, programs)
            launch.dw_GIH.fill_(float("nan"))  # poisoned: an unwritten tile fails
            launch()
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"{label:12s} FAIL (did not run: {type(exc).__name__}: {exc})")
            failed += 1
            continue
        got = launch.dw_GIH.float()
        want = ref
        if name.endswith("_nostore"):  # each tile's row sums in its first column
            got = got[:, :, ::BN]
            want = ref.view(s.G, s.I, s.H // BN, BN).sum(-1)
        err = (float((got - want).abs().max() / want.abs().max())
               if torch.isfinite(got).all() else float("inf"))
        ok = err <= 1e-2
        failed += not ok
        print(f"{label:12s} {'PASS' if ok else 'FAIL'}  max rel err {err:.2e}")
    return 1 if failed else 0


def run_time(names: list[str], warmup: int, iters: int, back_to_back: int) -> int:
    import torch

    s = KIMI
    h, dy = _inputs(s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print(f"shape {s}; {torch.cuda.get_device_name()}; {back_to_back} launch(es) per sample")
    res = {}
    for name in names:
        launch = Launch(name, s, h, dy)
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
        print(f"{name:13s} {res[name]:8.3f} ms  {s.flops() / res[name] / 1e9:7.1f} TFLOP/s"
              f"  (min {min(samples):.3f}, max {max(samples):.3f})")
    for a, b in (("coop", "plain"), ("coop_tma", "plain"), ("coop_nostore", "plain_nostore")):
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
