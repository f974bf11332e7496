"""Counters in GPU memory: bounded acquire-waits, release-signals and the device error word.

Protocol (see docs/megakernel-notes): a producer writes its data, ``_signal`` makes every
thread's stores happen-before a release increment; a consumer polls with volatile loads
(cheap, L2 only), then issues one acquire on the counter and a CTA barrier so that all its
threads read after the observed value. Every wait is bounded by ``budget`` polls and also
stops as soon as the rank's error word is set, so one failure unwinds the whole kernel fast.

All counters here are read only by programs of the same kernel on the same GPU, hence scope
"gpu". Cross-GPU visibility (peer token buffers read by dispatch, peer combine buffers written
by combine) is ordered by the system-scope barriers before and after the kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def record_error(err_ptr, code, detail):
    """First error wins: compare-and-swap the code from 0, then store the detail."""
    old = tl.atomic_cas(err_ptr, 0, code, sem="acq_rel", scope="gpu")
    if old == 0:
        tl.store(err_ptr + 1, detail)


@triton.jit
def _spin(ctr_ptr, target, err_ptr, budget, code, detail):
    """Slow path of ``wait_geq``: volatile polls (L2 only) until the target, an error, or the
    budget; then one acquire. A timeout records ``(code, detail)``."""
    v = tl.load(ctr_ptr, volatile=True)
    e = tl.load(err_ptr, volatile=True)
    it = 0
    while (v < target) & (e == 0) & (it < budget):
        v = tl.load(ctr_ptr, volatile=True)
        e = tl.load(err_ptr, volatile=True)
        it += 1
    ok = (v >= target).to(tl.int32)
    tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    if ok == 0:
        if e == 0:
            record_error(err_ptr, code, detail)
    return ok


@triton.jit
def wait_geq(ctr_ptr, target, err_ptr, budget, code, detail):
    """Wait until ``*ctr_ptr >= target``; returns 1 on success, 0 on timeout or when another
    program already recorded an error. Fast path (already signalled): one acquire read."""
    v = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    ok = 1
    if v < target:
        ok = _spin(ctr_ptr, target, err_ptr, budget, code, detail)
    # All threads read after the acquire of the thread that saw the counter.
    tl.debug_barrier()
    return ok


@triton.jit
def signal(ctr_ptr, inc=1):
    """Release-add ``inc`` after all threads of the program issued their stores."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, inc, sem="release", scope="gpu")


@triton.jit
def no_error(err_ptr):
    """1 while the rank's error word is clear."""
    return (tl.load(err_ptr, volatile=True) == 0).to(tl.int32)


@triton.jit
def globaltimer(v, SKIP: tl.constexpr):
    """The GPU's global nanosecond timer (``%globaltimer``, one clock for every SM), threaded
    through the int32 ``v`` so the read stays where it is written; 0 under the interpreter
    (SKIP: no PTX there)."""
    if SKIP:
        return v.to(tl.int64) * 0
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [v], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def record_item(trace, tk, MAXT, t0, t1, program, kind):
    """One item of a megakernel's trace (profiling only): (start ns, end ns, program, kind)
    as int64 at row ``tk`` of ``trace`` [MAXT, 4] (this logical rank's rows); tickets past
    MAXT are not written."""
    if tk < MAXT:
        rec = trace + tk.to(tl.int64) * 4
        tl.store(rec, t0)
        tl.store(rec + 1, t1)
        tl.store(rec + 2, program.to(tl.int64))
        tl.store(rec + 3, kind.to(tl.int64))


@triton.jit
def async_proxy_fence(v, SKIP: tl.constexpr):
    """``fence.proxy.async.global``: orders this thread's generic-proxy global accesses with
    async-proxy (TMA) ones, so rows written with plain stores by one program and read with
    TMA by another (after a release/acquire pair) are seen. SKIP under the interpreter (no
    PTX there, and no TMA proxy). Returns v (an int32 the asm threads through)."""
    if SKIP:
        return v
    return tl.inline_asm_elementwise("fence.proxy.async.global;\n mov.u32 $0, $1;", "=r,r",
                                     [v], dtype=tl.int32, is_pure=False, pack=1)
