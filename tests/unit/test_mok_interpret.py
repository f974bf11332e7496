"""The megakernel's data path on CPU through TRITON_INTERPRET (skipped without triton).

The interpreter runs programs one after another, so only the mode without communication
programs can run there (program 0 claims every ticket in order, so each wait is already met).
Both weight paths run: pointer loads and TMA tensor descriptors (``tma``), with one and with
two tiles per work item (``down_tiles``, ``gate_up_tiles``: the flattened tile loops), and
with the gate/up columns interleaved (``gate_up_interleaved``: one dot, split in registers),
with the next ticket claimed early (``prefetch_ticket``), and with the router-weighted sum
inside the kernel (``fused_sum``).
The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), hence the looser bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.unit.interpreted import run_interpreted  # noqa: E402

SCRIPT = textwrap.dedent("""
    import torch
    import mok_kernels as mk
    from mokbench.reference import reference_all_experts

    cases = [(1, 24, 4, 2, True), (2, 13, 3, 2, True), (3, 8, 2, 1, False)]
    knobs = [(False, 1, False, False, False), (True, 1, False, False, False),
             (False, 2, False, False, False), (True, 2, False, True, False),
             (False, 1, True, True, False), (True, 2, True, False, False),
             (False, 1, False, False, True), (True, 2, True, False, True)]
    for (L, T, E, K, shared), (tma, nt, il, pf, fs) in [(c, kn) for kn in knobs for c in cases]:
        torch.manual_seed(L)
        H, I = 64, 32
        cfg = mk.MoKConfig(minibatch=32, macrobatch=64, block_m=16, block_n=32, block_k=16,
                           num_warps=4, num_stages=1, spin_budget=1000, tma=tma,
                           down_tiles=nt, gate_up_tiles=nt, gate_up_interleaved=il,
                           prefetch_ticket=pf, fused_sum=fs)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        x = torch.randn(L * T, H).bfloat16()
        idx = torch.stack([torch.randperm(L * E)[:K] for _ in range(L * T)])
        p = torch.softmax(torch.randn(L * T, K), 1)
        w1 = (torch.randn(L * E, H, 2 * I) * H ** -0.5).bfloat16()
        w2 = (torch.randn(L * E, I, H) * I ** -0.5).bfloat16()
        ws1 = (torch.randn(H, 2 * I) * H ** -0.5).bfloat16() if shared else None
        ws2 = (torch.randn(I, H) * I ** -0.5).bfloat16() if shared else None
        lay = mk.interleave_gate_up if il else (lambda w: w)
        y = mk.forward(cfg, ws, mk.build_schedule(ws, idx), x, p, lay(w1), w2,
                       lay(ws1) if shared else None, ws2)
        mk.check_errors(ws)
        r = reference_all_experts(x, idx, p, w1, w2, ws1, ws2).y_TH
        err = ((y.float() - r).norm() / r.norm()).item()
        assert err < 2e-2, (L, tma, nt, il, pf, fs, err)
        if fs:  # every token's every column tile was summed exactly once
            assert (ws.sums_LTJ[:, :, :H // 32 // nt] == K + int(shared)).all(), ws.sums_LTJ
        print("ok", L, tma, nt, il, pf, fs, err)
""")


def test_forward_in_interpreter_matches_reference():
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 24


LAYER = textwrap.dedent("""
    def layer(L, T, E, K, H, I, shared, lay):
        # x, routing, router weights and weights (gate+up in lay's layout) of a random
        # layer on L loopback ranks, drawn in a fixed order
        x = torch.randn(L * T, H).bfloat16()
        idx = torch.stack([torch.randperm(L * E)[:K] for _ in range(L * T)])
        p = torch.softmax(torch.randn(L * T, K), 1)
        w1 = lay((torch.randn(L * E, H, 2 * I) * H ** -0.5).bfloat16())
        w2 = (torch.randn(L * E, I, H) * I ** -0.5).bfloat16()
        ws1 = lay((torch.randn(H, 2 * I) * H ** -0.5).bfloat16()) if shared else None
        ws2 = (torch.randn(I, H) * I ** -0.5).bfloat16() if shared else None
        return x, idx, p, w1, w2, ws1, ws2
""")

SKEW_SCRIPT = textwrap.dedent("""
    import torch
    import mok_kernels as mk
""") + LAYER + textwrap.dedent("""

    H, I = 64, 32
    for L, T, E, K, shared, slots, fs in [(1, 40, 4, 2, True, 2, False),
                                         (2, 29, 3, 2, False, 3, False),
                                         (1, 40, 4, 2, True, 2, True)]:
        torch.manual_seed(L + slots)
        kw = dict(minibatch=32, macrobatch=32 * slots, block_m=16, block_n=32, block_k=16,
                  num_warps=4, num_stages=1, spin_budget=1000, tma=True,
                  gate_up_interleaved=True, fused_sum=fs)
        x, idx, p, w1, w2, ws1, ws2 = layer(L, T, E, K, H, I, shared,
                                            mk.interleave_gate_up)
        out = {}
        for skew in (False, True):
            cfg = mk.MoKConfig(skew_down=skew, **kw)
            ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                                  topk=K, shared=shared, device="cpu", loopback_ranks=L)
            sched = mk.build_schedule(ws, idx)
            tr = torch.full((L, mk.forward_trace_capacity(ws), 4), -1, dtype=torch.int64)
            y, _ = mk.forward_train(cfg, ws, sched, x, p, w1, w2, ws1, ws2, _trace=tr)
            mk.check_errors(ws)
            out[skew] = (y, tr)
        assert torch.equal(out[True][0], out[False][0]), (L, slots, fs)
        # the kinds in ticket order: G0 G1 D0 G2 D1 ... ; per minibatch n1 G and n2 D items
        n1, n2 = 2 * (I // 16), 2 * (H // 32)
        nmb = (sched.tensors.total_L + 31) // 32
        for l in range(L):
            n = int(nmb[l])
            want = [0] * n1
            for m in range(n):
                want += [0] * n1 + [1] * n2
            kinds = out[True][1][l, :, 3]
            assert kinds[:len(want)].tolist() == want, (l, kinds[:len(want)].tolist())
            assert (kinds[len(want):] < 0).all(), l
            plain = out[False][1][l, :, 3]
            assert (plain >= 0).sum() == n * (n1 + n2) and n >= 3, (l, n)
        print("skew ok", L, slots, fs)
    try:
        mk.MoKConfig(minibatch=32, macrobatch=32, block_m=16, skew_down=True)
    except mk.MoKConfigError as e:
        assert "skew_down" in str(e) and "macrobatch" in str(e), e
        print("refused")
""")


def test_skewed_down_items_in_interpreter_give_the_same_output_bitwise():
    """``skew_down``: the tickets run [G0][G1][D0][G2][D1]...[D last] (the trace's kinds in
    ticket order), the output bitwise the plain order's, with two and three ring slots and
    with the fused sum; one ring slot is refused by name."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    out = subprocess.run([sys.executable, "-c", SKEW_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("skew ok") == 3 and "refused" in out.stdout, out.stdout


PRE_SCRIPT = textwrap.dedent("""
    import torch
    import mok_kernels as mk
""") + LAYER + textwrap.dedent("""

    H, I = 64, 32
    for L, T, E, K, shared, il, nt in [(1, 40, 4, 2, True, True, 2),
                                       (2, 29, 3, 2, False, False, 1),
                                       (2, 21, 3, 2, True, False, 2)]:
        torch.manual_seed(L + nt)
        kw = dict(minibatch=32, macrobatch=64, block_m=16, block_n=32, block_k=16,
                  num_warps=4, num_stages=1, spin_budget=1000, tma=True,
                  gate_up_interleaved=il, gate_up_tiles=nt, down_tiles=nt)
        lay = mk.interleave_gate_up if il else (lambda w: w)
        x, idx, p, w1, w2, ws1, ws2 = layer(L, T, E, K, H, I, shared, lay)
        out = {}
        for tma_pre in (False, True):
            cfg = mk.MoKConfig(pre_tma_store=tma_pre, **kw)
            ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                                  topk=K, shared=shared, device="cpu", loopback_ranks=L)
            sched = mk.build_schedule(ws, idx)
            y, ctx = mk.forward_train(cfg, ws, sched, x, p, w1, w2, ws1, ws2)
            mk.check_errors(ws)
            total = sched.tensors.total_L
            live = [ctx.pre_LPF[l, :int(total[l])] for l in range(L)]
            out[tma_pre] = (y, live)
        assert torch.equal(out[True][0], out[False][0]), (L, il, nt)
        for a, b in zip(out[True][1], out[False][1]):
            assert a.numel() > 0 and torch.equal(a, b), (L, il, nt)
        print("pre ok", L, il, nt)
    for bad in (dict(tma=False), dict(tma=True, fp8="rowwise"),
                dict(tma=True, gate_up_tiles=4, num_stages=4)):
        try:
            mk.MoKConfig(pre_tma_store=True, **bad)
        except mk.MoKConfigError as e:
            assert "pre_tma_store" in str(e) and ("tma =" in str(e) or "num_stages" in str(e)), e
            print("refused")
""")


def test_pre_activations_through_tma_equal_the_plain_stores_bitwise():
    """``pre_tma_store``: the training forward's pre-activations (every schedule row in use)
    and y are bitwise those of the plain stores, gate/up interleaved or not, one and two
    tiles per item, one and two logical ranks; without tma, with FP8, or four stages deep
    with several tiles per item (its shared memory) it is refused by name."""
    out = run_interpreted(PRE_SCRIPT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("pre ok") == 3 and out.stdout.count("refused") == 3, out.stdout
