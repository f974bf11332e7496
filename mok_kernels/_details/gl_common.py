"""What the backward's Gluon launches (``gl_dx``, ``gl_dw``) share: the names of Triton's
Gluon Hopper calls across releases, the shared layout of their TMA boxes, their ring's
mbarriers, and the staging of a [64, 256] bf16 tile into two [64, 128] shared buffers for
TMA stores."""

from __future__ import annotations

from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

# Triton 3.6 names the TMA copies async_copy_*; later releases async_load / async_store.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# ... and the barrier of the warps running a partition thread_barrier, later barrier.
barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def nvmma_layout(block: list[int]) -> Any:
    """The swizzled shared layout of a bf16 TMA box (and MMA operand) of this shape."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


@gluon.jit
def stage_halves(out, epi_lo, epi_hi, PAIRS: gl.constexpr):
    """A [M, N] bf16 tile into two [M, N/2] shared buffers: PAIRS, its even and odd columns
    (interleaved gate and up); else its left and right halves."""
    HM: gl.constexpr = out.shape[0]
    HN: gl.constexpr = out.shape[1] // 2
    if PAIRS:
        lo, hi = out.reshape([HM, HN, 2]).split()
    else:
        lo, hi = out.reshape([HM, 2, HN]).permute((0, 2, 1)).split()
    epi_lo.store(lo)
    epi_hi.store(hi)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """The (ready, empty) mbarriers of a STAGES-slot ring filled by one producer (one arrive
    with the expected bytes) and emptied by two consumer warpgroups (two arrives)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    return ready, empty
