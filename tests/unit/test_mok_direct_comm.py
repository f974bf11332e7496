"""``dispatch_remote_only`` and ``combine_direct`` on CPU through TRITON_INTERPRET: the whole
forward with communication programs, two and three loopback ranks, bf16 and FP8 rows.

The interpreter runs programs one after another, so a forward with communication programs
runs there only where no program waits on a later one: with ``combine_direct`` the
communication programs only dispatch, and with a ring as large as the schedule their
dispatch never waits for a free slot, so they run first and the compute programs after
them. The output must equal the forward without communication programs bit for bit (the
same rows, the same tiles), and with ``dispatch_remote_only`` the ring rows of each rank's
own tokens must stay as poisoned before the launch (the gate+up tiles read those rows from
the token buffer; a NaN read from the ring would reach y)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.unit.interpreted import run_interpreted  # noqa: E402

SCRIPT = r'''
import torch
import mok_kernels as mk

for L, T, E, K, shared, fp8 in [(2, 21, 3, 2, True, False), (3, 13, 2, 2, False, False),
                                (2, 13, 2, 2, True, True)]:
    torch.manual_seed(10 + L)
    H, I = (256, 128) if fp8 else (64, 32)
    tiles = dict(block_n=256, block_k=128, fp8="rowwise_all") if fp8 else dict(block_n=32,
                                                                              block_k=16)
    x = torch.randn(L * T, H).bfloat16()
    idx = torch.stack([torch.randperm(L * E)[:K] for _ in range(L * T)])
    p = torch.softmax(torch.randn(L * T, K), 1)
    w1 = mk.interleave_gate_up((torch.randn(L * E, H, 2 * I) * H ** -0.5).bfloat16())
    w2 = (torch.randn(L * E, I, H) * I ** -0.5).bfloat16()
    ws1 = (mk.interleave_gate_up((torch.randn(H, 2 * I) * H ** -0.5).bfloat16())
           if shared else None)
    ws2 = (torch.randn(I, H) * I ** -0.5).bfloat16() if shared else None
    out = {}
    for comm, ronly, direct in [(0, False, False), (1, False, True), (1, True, True),
                                (2, True, True)]:
        cfg = mk.MoKConfig(minibatch=32, macrobatch=32 * 16, block_m=16, num_warps=4,
                           num_stages=1, spin_budget=1000, tma=True, gate_up_interleaved=True,
                           fwd_comm_sms=comm * L, dispatch_remote_only=ronly,
                           combine_direct=direct, **tiles)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        sched = mk.build_schedule(ws, idx)
        total = sched.tensors.total_L
        assert int(total.max()) <= cfg.macrobatch  # one ring slot per minibatch: no wait
        if comm:
            ws.ring_LQH.fill_(float("nan"))
        wts = mk.quantize_weights(cfg, w1, w2, ws1, ws2) if fp8 else (w1, w2, ws1, ws2)
        y = mk.forward(cfg, ws, sched, x, p, *wts)
        mk.check_errors(ws)
        assert torch.isfinite(y.float()).all(), (L, comm, ronly)
        out[(comm, ronly)] = y
        if comm:  # rows of the rank's own tokens unwritten with ronly, every row without
            src = sched.tensors.src_LP
            for l in range(L):
                n = int(total[l])
                s = src[l, :n].long()
                own = (s >= 0) & ((s.clamp(min=0) // (K + int(shared))) // T == l)
                unwritten = torch.isnan(ws.ring_LQH[l, :n].float()).all(1)  # FP8: a written
                # row's e4m3 bytes never pair into a bf16 NaN (no 0x7f or 0xff byte: e4m3 NaNs)
                assert torch.equal(unwritten, own if ronly else torch.zeros_like(own)), l
                assert bool(own.any()) and bool((~own).any())
        print("ran", L, comm, ronly, direct)
    base = out[(0, False)]
    for key, y in out.items():
        assert torch.equal(y.view(torch.int16), base.view(torch.int16)), (L, key)
    print("direct comm ok", L, fp8)
'''


def test_remote_only_dispatch_and_direct_combine_equal_the_plain_forward_bitwise():
    out = run_interpreted(SCRIPT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("direct comm ok") == 3, out.stdout
