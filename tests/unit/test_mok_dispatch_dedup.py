"""``dispatch_dedup``'s data path on CPU through TRITON_INTERPRET: the dispatch of every
minibatch by one communication program (the interpreter runs programs one after another, so
one program, whose waits are then always on rows it has already pulled), into a ring large
enough for the whole schedule, with and without the token cache: the ring rows are the same
bit for bit, every remote token's first row is in the cache with its flag set; and a flag
nobody sets ends in the named timeout (error code and token), not a hang."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.unit.interpreted import run_interpreted  # noqa: E402

SCRIPT = r'''
import torch
import triton
import triton.language as tl
from mok_kernels._details import errors
from mok_kernels._details.schedule import build_schedule_tensors
from mok_kernels._details.tl_mega import _dispatch


@triton.jit
def dispatch_all(src, total_ptr, ring, ctr, err, x_base, x_tab, first, tcache, tflag, T, Q,
                 MMAX, budget, NMB, me, H: tl.constexpr, XW: tl.constexpr, S: tl.constexpr,
                 MB: tl.constexpr, CR: tl.constexpr, CH: tl.constexpr, DEDUP: tl.constexpr):
    total = tl.load(total_ptr)
    ok = 1
    for m in range(0, NMB):
        if ok != 0:
            ok = _dispatch(m, 0, src, total, ring, ctr, err, x_base, x_tab, T, Q, MMAX, budget,
                           0, H, XW, S, 1, MB, CR, CH, DEDUP, first, tcache, tflag, me)


torch.manual_seed(0)
R, T, E, K, H, MB = 2, 24, 3, 4, 64, 32
idx = torch.stack([torch.randperm(R * E)[:K] for _ in range(R * T)]).int()
x = torch.randn(R * T, H).bfloat16()
x_tab = torch.tensor([0, T * H], dtype=torch.int64)  # rank r's tokens from row r*T
for shared in (False, True):
    S = K + int(shared)
    for me in range(R):
        st = build_schedule_tensors(idx, torch.tensor([me]), tokens=T, local_experts=E,
                                    shared=shared, block_m=8, capacity=256, first_rows=True)
        P = st.src_LP.shape[1]
        total = int(st.total_L[0])
        nmb = -(-total // MB)

        def run(dedup, first):
            ring = torch.full((P, H), float("nan")).bfloat16()  # poisoned: unwritten rows show
            ctr = torch.zeros(1 + 3 * (P // MB), dtype=torch.int32)
            err = torch.zeros(4, dtype=torch.int32)
            tcache = torch.zeros(R * T, H).bfloat16()
            tflag = torch.zeros(R * T, dtype=torch.int32)
            dispatch_all[(1,)](st.src_LP[0], st.total_L, ring, ctr, err, x, x_tab, first, tcache,
                               tflag, T, P, P // MB, 200, nmb, me, H=H, XW=H, S=S, MB=MB, CR=4,
                               CH=64, DEDUP=dedup)
            return ring, tcache, tflag, err

        plain, _, _, err0 = run(False, st.first_LP[0])
        ring, tcache, tflag, err1 = run(True, st.first_LP[0])
        assert int(err0[0]) == 0 and int(err1[0]) == 0, (err0, err1)
        assert torch.equal(plain[:total].view(torch.int16), ring[:total].view(torch.int16))
        src = st.src_LP[0, :total].long()
        tok = torch.where(src >= 0, src // S, torch.zeros_like(src))
        remote = (src >= 0) & (tok // T != me)
        copies = remote & (st.first_LP[0, :total].long() != torch.arange(total))
        assert copies.any()  # rows the cache served
        cached = torch.unique(tok[remote])
        assert torch.equal(tflag[cached], torch.ones_like(cached, dtype=torch.int32))
        assert int(tflag.sum()) == len(cached)  # only remote tokens' flags, once each
        assert torch.equal(tcache[cached].view(torch.int16), x[cached].view(torch.int16))
        # a token's first row that never publishes it: its other rows wait, then the named
        # timeout (code and token), and the dispatch stops
        r0 = int(torch.nonzero(remote & ~copies)[0])
        bad = st.first_LP[0].clone()
        bad[r0] = -5
        _, _, _, err = run(True, bad)
        assert int(err[0]) == errors.ERR_WAIT_DEDUP, err
        waiting = tok[(st.first_LP[0, :total].long() == r0) & (torch.arange(total) != r0)]
        assert int(err[1]) in set(waiting.tolist()) | {int(tok[r0])}, (err, waiting)
        print("dedup ok", shared, me, int(copies.sum()))
'''


def test_dispatch_dedup_data_path_and_timeout_in_interpreter():
    out = run_interpreted(SCRIPT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("dedup ok") == 4, out.stdout
