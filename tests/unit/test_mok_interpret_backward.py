"""The backward megakernel's data path on CPU through TRITON_INTERPRET (skipped without
triton), against float32 autograd through the same layer: dx, the router-weight gradient and
every weight gradient, with one and several loopback ranks, with and without the shared
expert, both gate/up layouts, both dA tile widths (``bwd_wide_da``), an expert with no
tokens, the backward at twice the forward's row blocks (``bwd_block_m``); and bitwise equal
on a rerun.

The interpreter runs programs one after another (program 0 claims every ticket in order, so
each wait is already met) and truncates fp32 -> bf16, hence the looser bound than on a GPU.
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

COMMON = textwrap.dedent("""
    import torch
    import mok_kernels as mk
    from mokbench.reference import reference_all_experts

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()

    def config(il, **kw):
        return mk.MoKConfig(minibatch=32, macrobatch=64, block_m=16, block_n=32, block_k=16,
                            num_warps=4, num_stages=1, spin_budget=1000, tma=True,
                            gate_up_interleaved=il, **kw)

    def layer(L, T, E, K, shared, H, I, experts=None):
        # x, routing, router weights, weights (canonical layout) and dY; experts: route to
        # the first ones only
        x = torch.randn(L * T, H).bfloat16()
        idx = torch.stack([torch.randperm(experts or L * E)[:K] for _ in range(L * T)])
        p = torch.softmax(torch.randn(L * T, K), 1)
        w1 = (torch.randn(L * E, H, 2 * I) * H ** -0.5).bfloat16()
        w2 = (torch.randn(L * E, I, H) * I ** -0.5).bfloat16()
        ws1 = (torch.randn(H, 2 * I) * H ** -0.5).bfloat16() if shared else None
        ws2 = (torch.randn(I, H) * I ** -0.5).bfloat16() if shared else None
        return x, idx, p, w1, w2, ws1, ws2, torch.randn(L * T, H).bfloat16()

    def interleaved_case(L, T, E, K, shared, seed, H=64, I=32):
        # layer() after torch.manual_seed(seed), its weights in the interleaved gate/up
        # layout the kernel reads, and the float32 reference's gradients
        torch.manual_seed(seed)
        x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I)
        il = mk.interleave_gate_up
        W = (il(w1), w2, il(ws1) if shared else None, ws2)
        exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
        return x, idx, p, (w1, w2, ws1, ws2), W, dy, exact

    def run_fp8_pre(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy):
        # training forward and backward on cfg's workspace, the backward's FP8 weight copies
        # made as the backend makes them; (gradients, forward context, the forward's
        # pre-activations, which the backward overwrites with dG/dU)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        f8 = mk.quantize_backward_weights(cfg, W[1], W[3], W[0], W[2])
        y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
        pre_LPF = saved.pre_LPF.clone()
        g = mk.backward(cfg, ws, saved, dy, *W, fp8_weights=f8)
        mk.check_errors(ws)
        return g, saved, pre_LPF

    def run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy):
        # run_fp8_pre's (gradients, forward context)
        return run_fp8_pre(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[:2]

    def run_traced(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy):
        # as run_fp8, with the backward's item trace: (gradients, [L, tickets, 4] trace)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        w8 = mk.quantize_backward_weights(cfg, W[1], W[3], W[0], W[2])
        y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
        tr = torch.full((L, mk.backward_trace_capacity(ws), 4), -1, dtype=torch.int64)
        g = mk.backward(cfg, ws, saved, dy, *W, fp8_weights=w8, _trace=tr)
        mk.check_errors(ws)
        return g, tr

    def assert_bitwise(a, b, what):
        for u, v in zip(vars(a).values(), vars(b).values()):
            assert (u is None and v is None) or torch.equal(u, v), what

    def same_weight_gradients(base, il, shared, experts, seed, knobs, other):
        # two loopback ranks (13 tokens, 3 experts, top-2): every gradient with base, knobs
        # and other bitwise the one with base and knobs; the weight gradients near the exact
        # layer's (the FP8 bound with FP8 knobs in base); experts past `experts` got no rows:
        # zero gradients, every tile written
        L, T, E, K, H, I = 2, 13, 3, 2, 64, 32
        torch.manual_seed(seed)
        x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I, experts)
        lay = mk.interleave_gate_up if il else (lambda w: w)
        W = (lay(w1), w2, lay(ws1) if shared else None, ws2)
        exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
        out = [run_fp8(config(il, **base, **knobs, **more), L, T, E, K, shared, H, I, x,
                       idx, p, W, dy)[0] for more in ({}, other)]
        assert_bitwise(out[0], out[1], (base, il, shared, experts))
        tol = 1e-1 if base.get("bwd_fp8_wgrad") else 2e-2
        pairs = [("w_gate_up", "w1_EHF"), ("w_down", "w2_EIH")]
        if shared:
            pairs += [("shared_gate_up", "ws1_HF"), ("shared_down", "ws2_IH")]
        for got, want in pairs:
            assert rel(getattr(out[1], got), exact.dweights[want]) < tol, got
        if experts:
            assert not out[1].w_gate_up[experts:].any() and not out[1].w_down[experts:].any()

    def same_gradients_over(knob_sets, seed):
        # two loopback ranks, bf16 and the whole FP8 backward, each with every knob set of
        # knob_sets: every gradient bitwise the first set's, dx near the exact layer
        L, T, E, K, shared, H, I = 2, 13, 3, 2, True, 64, 32
        x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, seed)
        f8 = dict(bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fp8_wgrad=True)
        for base in ({}, f8):
            out = [run_fp8(config(True, **base, **knobs), L, T, E, K, shared, H, I, x, idx,
                           p, W, dy)[0] for knobs in knob_sets]
            for i in range(1, len(out)):
                assert_bitwise(out[0], out[i], (bool(base), i))
            assert rel(out[0].dx_TH, exact.dx_TH) < (1e-1 if base else 2e-2)
""")

SCRIPT = COMMON + textwrap.dedent("""

    cases = [(1, 24, 4, 2, True, False, False), (2, 13, 3, 2, True, True, False),
             (3, 8, 2, 1, False, True, True), (1, 40, 6, 3, True, True, False),
             (2, 11, 3, 2, True, False, True)]
    for L, T, E, K, shared, il, wide in cases:
        torch.manual_seed(L + T)
        H, I = 64, 32
        cfg = config(il, bwd_wide_da=wide)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        # T == 40: experts 0..4 only, so expert 5 gets no token
        x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I,
                                                5 if T == 40 else None)
        lay = mk.interleave_gate_up if il else (lambda w: w)
        W = (lay(w1), w2, lay(ws1) if shared else None, ws2)
        grads = []
        for _ in range(2):
            y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
            grads.append(mk.backward(cfg, ws, saved, dy, *W))
        mk.check_errors(ws)
        g = grads[0]
        got = {"dx_TH": g.dx_TH, "dprobs_TK": g.d_router_weights_TK, "w1_EHF": g.w_gate_up,
               "w2_EIH": g.w_down, "ws1_HF": g.shared_gate_up, "ws2_IH": g.shared_down}
        ref = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
        want = {"dx_TH": ref.dx_TH, "dprobs_TK": ref.dprobs_TK, **ref.dweights}
        for name, r in want.items():
            err = rel(got[name], r)
            assert err < 2e-2, (L, T, il, name, err)
        if T == 40:
            assert torch.count_nonzero(g.w_gate_up[5]) == 0
            assert torch.count_nonzero(g.w_down[5]) == 0
        for a, b in zip(vars(grads[0]).values(), vars(grads[1]).values()):
            assert (a is None and b is None) or torch.equal(a, b)
        print("ok", L, T, E, K, shared, il, wide)

    # bwd_fused_pull: the pull inside the megakernel gives bitwise the same gradients, with
    # every program pulling first or only the first one (bwd_pull_programs); so do two dX or
    # dA tiles per item (bwd_dx_tiles, bwd_da_tiles), the dX items' dGU rows through TMA
    # (bwd_dx_tma)
    for L, T, E, K, shared in [(1, 24, 4, 2, True), (2, 13, 3, 2, False)]:
        torch.manual_seed(7 + L)
        H, I = 64, 32
        out = []
        for pull in ({}, {"bwd_fused_pull": True},
                     {"bwd_fused_pull": True, "bwd_pull_programs": 1},
                     {"bwd_dx_tiles": 2}, {"bwd_da_tiles": 2},
                     {"bwd_dx_tma": True}, {"bwd_dx_tma": True, "bwd_dx_tiles": 2}):
            cfg = config(True, **pull)
            ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                                  topk=K, shared=shared, device="cpu", loopback_ranks=L)
            torch.manual_seed(11 + L)
            x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I)
            il = mk.interleave_gate_up
            W = (il(w1), w2, il(ws1) if shared else None, ws2)
            y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
            out.append(mk.backward(cfg, ws, saved, dy, *W))
            mk.check_errors(ws)
        for other in out[1:]:
            for a, b in zip(vars(out[0]).values(), vars(other).values()):
                assert (a is None and b is None) or torch.equal(a, b)
        print("pull ok", L, T, E, K, shared)

    # bwd_block_m: the forward at 16-row blocks, the backward at 32 on the same schedule
    # (every expert padded to 32 rows): gradients against the reference, bitwise on a rerun
    for L, T, E, K, shared in [(1, 24, 4, 2, True), (2, 13, 3, 2, False)]:
        torch.manual_seed(5 + L)
        H, I = 64, 32
        cfg = config(True, bwd_block_m=32)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I)
        il = mk.interleave_gate_up
        W = (il(w1), w2, il(ws1) if shared else None, ws2)
        grads = []
        for _ in range(2):
            sched = mk.build_schedule(ws, idx)
            assert bool((sched.tensors.total_L % 32 == 0).all())
            y, saved = mk.forward_train(cfg, ws, sched, x, p, *W)
            grads.append(mk.backward(cfg, ws, saved, dy, *W))
        mk.check_errors(ws)
        ref = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
        assert rel(y, ref.y_TH) < 2e-2
        g = grads[0]
        got = {"dx_TH": g.dx_TH, "dprobs_TK": g.d_router_weights_TK, "w1_EHF": g.w_gate_up,
               "w2_EIH": g.w_down, "ws1_HF": g.shared_gate_up, "ws2_IH": g.shared_down}
        want = {"dx_TH": ref.dx_TH, "dprobs_TK": ref.dprobs_TK, **ref.dweights}
        for name, r in want.items():
            err = rel(got[name], r)
            assert err < 2e-2, (L, T, name, err)
        for a, b in zip(vars(grads[0]).values(), vars(grads[1]).values()):
            assert (a is None and b is None) or torch.equal(a, b)
        print("block ok", L, T, E, K, shared)
""")


def _prints(out, line: str, times: int) -> None:
    """The interpreted script exited 0 and printed ``line`` ``times`` times (once per case
    it checked)."""
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(line) == times, out.stdout


def test_backward_in_interpreter_matches_autograd():
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 9 and out.stdout.count("pull ok") == 2, out.stdout
    assert out.stdout.count("block ok") == 2, out.stdout


FP8_DGRAD_SCRIPT = COMMON + textwrap.dedent("""
    from mok_kernels._details.tl_quant import quantize_rowwise

    def deq(t):  # the values the FP8 items multiply: e4m3 rows times their row scale
        q, s = quantize_rowwise(t)
        return (q.float() * s.unsqueeze(-1)).bfloat16()

    def dx_of_fp8_rows(saved, W, L, T, E, K, S, H, BM):
        # dx from the dG/dU rows the backward left in saved.pre_LPF (its bf16 gradients),
        # each row and each W_gate_up row quantised as the FP8 dX items read them, summed
        # over each token's slots in fp32
        st = saved.schedule.tensors
        dx = torch.zeros(L * T, H)
        for lr in range(L):
            for r in range(int(st.total_L[lr])):
                slot = int(st.src_LP[lr, r])
                if slot < 0:
                    continue
                g = int(st.group_LB[lr, r // BM])
                w = W[2] if g == E else W[0][lr * E + g]  # [H, 2I], the kernel's layout
                dgu = deq(saved.pre_LPF[lr, r][None]).float()
                dx[slot // S] += (dgu @ deq(w).float().T)[0]
        return dx

    for L, T, E, K, shared in [(1, 24, 4, 2, True), (2, 13, 3, 2, False)]:
        H, I = 64, 32
        x, idx, p, (w1, w2, ws1, ws2), W, dy, exact = interleaved_case(L, T, E, K, shared,
                                                                       3 + L)
        runs = {}
        for da, dx in ((False, False), (True, False), (False, True), (True, True)):
            cfg = config(True, bwd_fp8_da=da, bwd_fp8_dx=dx)
            ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                                  topk=K, shared=shared, device="cpu", loopback_ranks=L)
            f8 = mk.quantize_backward_weights(cfg, W[1], W[3], W[0], W[2])
            assert (f8 is None) == (not (da or dx))
            grads = []
            for _ in range(2):
                y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
                grads.append(mk.backward(cfg, ws, saved, dy, *W, fp8_weights=f8))
            mk.check_errors(ws)
            for a, b in zip(vars(grads[0]).values(), vars(grads[1]).values()):
                assert (a is None and b is None) or torch.equal(a, b)  # bitwise rerun
            g = runs[(da, dx)] = grads[0]
            for name, val in vars(g).items():
                assert val is None or torch.isfinite(val.float()).all(), (da, dx, name)
            if dx:  # dx against the FP8 rows' own reference (tight), and the FP8 bound
                want = dx_of_fp8_rows(saved, W, L, T, E, K, K + int(shared), H, 16)
                assert rel(g.dx_TH, want) < 2e-2, (L, da, rel(g.dx_TH, want))
            assert rel(g.dx_TH, exact.dx_TH) < 1e-1, (L, da, dx, rel(g.dx_TH, exact.dx_TH))
            if (da or dx) and f8 is not None:  # without the FP8 copies: a clear error
                y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
                try:
                    mk.backward(cfg, ws, saved, dy, *W)
                    raise SystemExit("no error without fp8_weights")
                except ValueError as e:
                    assert "quantize_backward_weights" in str(e), e
        g16 = runs[(False, False)]
        # bwd_fp8_dx alone changes dx only: every other gradient is the bf16 backward's, bit
        # for bit (the dW_gate_up items still read the bf16 dG/dU rows)
        gx = runs[(False, True)]
        for name in ("d_router_weights_TK", "w_gate_up", "w_down", "shared_gate_up",
                     "shared_down"):
            a, b = getattr(gx, name), getattr(g16, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        # bwd_fp8_da: dW_down is the bf16 C items' (bf16 dY, r*h), bitwise the bf16 one's;
        # downstream of dA against the reference on the dequantised dY and W_down (the FP8
        # dA items' exact inputs), and the exact layer within the FP8 bound
        ga = runs[(True, False)]
        assert torch.equal(ga.w_down, g16.w_down)
        q = reference_all_experts(x, idx, p, w1, deq(w2), ws1,
                                  deq(ws2) if shared else None, dy_NH=deq(dy))
        pairs = {"dx_TH": (ga.dx_TH, q.dx_TH, exact.dx_TH),
                 "dprobs_TK": (ga.d_router_weights_TK, q.dprobs_TK, exact.dprobs_TK),
                 "w1_EHF": (ga.w_gate_up, q.dweights["w1_EHF"], exact.dweights["w1_EHF"])}
        if shared:
            pairs["ws1_HF"] = (ga.shared_gate_up, q.dweights["ws1_HF"],
                               exact.dweights["ws1_HF"])
        for name, (val, want_q, want) in pairs.items():
            assert rel(val, want_q) < 2e-2, (L, name, rel(val, want_q))
            assert rel(val, want) < 1e-1, (L, name, rel(val, want))
        # with the backward's own 32-row blocks (bwd_block_m) and with two dA and two dX
        # tiles per item (the completing add is then 2 at once): the same checks
        for extra in ({"bwd_block_m": 32}, {"bwd_da_tiles": 2, "bwd_dx_tiles": 2}):
            cfg = config(True, bwd_fp8_da=True, bwd_fp8_dx=True, **extra)
            g, saved = run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)
            want = dx_of_fp8_rows(saved, W, L, T, E, K, K + int(shared), H, 16)
            assert rel(g.dx_TH, want) < 2e-2, (L, extra, rel(g.dx_TH, want))
            for name, r in (("dx", exact.dx_TH), ("dp", exact.dprobs_TK),
                            ("dw1", exact.dweights["w1_EHF"]), ("dw2", exact.dweights["w2_EIH"])):
                val = {"dx": g.dx_TH, "dp": g.d_router_weights_TK, "dw1": g.w_gate_up,
                       "dw2": g.w_down}[name]
                assert rel(val, r) < 1e-1, (L, extra, name, rel(val, r))
        print("fp8 dgrad ok", L, shared)
""")


def test_fp8_dgrad_items_in_interpreter_match_the_quantised_reference():
    """``bwd_fp8_da`` and ``bwd_fp8_dx``, alone and together: the dA items' FP8 tiles (dY
    quantised per token row at its home rank, W_down per row) against the reference layer on
    the dequantised dY and W_down, the dX items' FP8 tiles (dG/dU rows quantised by the A item
    that completes their row block, W_gate_up per row) against dx rebuilt from the same
    quantised rows (2e-2: the interpreter's bf16 truncation), and the exact layer within the
    FP8 bound (0.1); the gradients a knob does not touch bitwise the bf16 backward's; bitwise
    reruns; a clear error without the FP8 weight copies."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    out = subprocess.run([sys.executable, "-c", FP8_DGRAD_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("fp8 dgrad ok") == 2, out.stdout


FP8_WGRAD_SCRIPT = COMMON + textwrap.dedent("""
    from tests.unit.fp8_reference import trunc_bf16, wgrad_of_fp8_columns

    cases = [(1, 24, 4, 2, True, {}), (2, 13, 3, 2, False, {}),
             (1, 40, 6, 3, True, {"bwd_fp8_da": True, "bwd_fp8_dx": True}),
             (2, 13, 3, 2, True, {"bwd_block_m": 32, "bwd_fp8_da": True})]
    for L, T, E, K, shared, extra in cases:
        H, I = 64, 32
        torch.manual_seed(9 + L + T)
        x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I,
                                                5 if T == 40 else None)
        il = mk.interleave_gate_up
        W = (il(w1), w2, il(ws1) if shared else None, ws2)
        exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
        cfg = config(True, bwd_fp8_wgrad=True, **extra)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        f8 = mk.quantize_backward_weights(cfg, W[1], W[3], W[0], W[2])
        grads = []
        for _ in range(2):
            y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
            pre_LPF = saved.pre_LPF.clone()  # the backward writes dG/dU over it
            grads.append(mk.backward(cfg, ws, saved, dy, *W, fp8_weights=f8))
        mk.check_errors(ws)
        for a, b in zip(vars(grads[0]).values(), vars(grads[1]).values()):
            assert (a is None and b is None) or torch.equal(a, b)  # bitwise rerun
        g = grads[1]
        for name, val in vars(g).items():
            assert val is None or torch.isfinite(val.float()).all(), (extra, name)
        q1, q2, qs1, qs2 = wgrad_of_fp8_columns(saved, pre_LPF, x, dy, p, L, E, K,
                                                K + int(shared), cfg.block_m, I, trunc_bf16)
        pairs = {"w1": (g.w_gate_up, q1, exact.dweights["w1_EHF"]),
                 "w2": (g.w_down, q2, exact.dweights["w2_EIH"])}
        if shared:
            pairs["ws1"] = (g.shared_gate_up, qs1, exact.dweights["ws1_HF"])
            pairs["ws2"] = (g.shared_down, qs2, exact.dweights["ws2_IH"])
        for name, (val, want_q, want) in pairs.items():
            assert rel(val, want_q) < 2e-2, (L, extra, name, rel(val, want_q))
            assert rel(val, want) < 1e-1, (L, extra, name, rel(val, want))
        assert rel(g.dx_TH, exact.dx_TH) < 1e-1
        assert rel(g.d_router_weights_TK, exact.dprobs_TK) < 1e-1
        if T == 40:  # expert 5 has no token: zero weight gradients
            assert torch.count_nonzero(g.w_gate_up[5]) == 0
            assert torch.count_nonzero(g.w_down[5]) == 0
        if not extra:  # dx and the router gradient untouched: the bf16 backward's, bitwise
            cfg16 = config(True)
            ws16 = mk.get_workspace(cfg16, tokens=T, hidden=H, intermediate=I,
                                    local_experts=E, topk=K, shared=shared, device="cpu",
                                    loopback_ranks=L)
            y, saved = mk.forward_train(cfg16, ws16, mk.build_schedule(ws16, idx), x, p, *W)
            g16 = mk.backward(cfg16, ws16, saved, dy, *W)
            assert torch.equal(g.dx_TH, g16.dx_TH)
            assert torch.equal(g.d_router_weights_TK, g16.d_router_weights_TK)
        print("fp8 wgrad ok", L, T, extra)

    # split gate/up columns, and power-of-two scales: the exact layer within the FP8 bound
    for il, extra in ((False, {}), (True, {"fp8_pow2_scales": True})):
        L, T, E, K, shared = 2, 13, 3, 2, True
        torch.manual_seed(21)
        x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, 64, 32)
        exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
        lay = mk.interleave_gate_up if il else (lambda w: w)
        W = (lay(w1), w2, lay(ws1), ws2)
        cfg = config(il, bwd_fp8_wgrad=True, **extra)
        ws = mk.get_workspace(cfg, tokens=T, hidden=64, intermediate=32, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
        g = mk.backward(cfg, ws, saved, dy, *W)
        mk.check_errors(ws)
        for val, name in ((g.w_gate_up, "w1_EHF"), (g.w_down, "w2_EIH"),
                          (g.shared_gate_up, "ws1_HF"), (g.shared_down, "ws2_IH")):
            assert rel(val, exact.dweights[name]) < 1e-1, (il, extra, name)
        print("fp8 wgrad layout ok", il, extra)

    # a NaN in dY reaches the weight gradients (the column scales turn NaN): never hidden
    L, T, E, K, shared = 1, 24, 4, 2, True
    torch.manual_seed(1)
    x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, 64, 32)
    dy[3, 5] = float("nan")
    il = mk.interleave_gate_up
    W = (il(w1), w2, il(ws1), ws2)
    cfg = config(True, bwd_fp8_wgrad=True)
    ws = mk.get_workspace(cfg, tokens=T, hidden=64, intermediate=32, local_experts=E, topk=K,
                          shared=shared, device="cpu", loopback_ranks=L)
    y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
    g = mk.backward(cfg, ws, saved, dy, *W)
    assert torch.isnan(g.shared_down.float()).any() and torch.isnan(g.w_down.float()).any()
    print("fp8 wgrad nan ok")

    # a Q item's signal withheld: the weight-gradient items' bounded wait ends in the named
    # error (the largest group first: the shared expert's, group E), and the workspace runs
    # a clean backward afterwards
    dy[3, 5] = 0.0
    y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
    mk.backward(cfg, ws, saved, dy, *W, _withhold=mk.WITHHOLD_WGRAD_QUANT)
    try:
        mk.check_errors(ws)
        raise SystemExit("no error with a withheld Q signal")
    except mk.MoKTimeoutError as e:
        assert "backward FP8 weight gradient <- quantise" in str(e), e
        assert f"expert group {E}" in str(e), e
    y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
    g = mk.backward(cfg, ws, saved, dy, *W)
    mk.check_errors(ws)
    assert torch.isfinite(g.w_down.float()).all()
    print("fp8 wgrad withheld ok")
""")


def test_fp8_weight_gradients_in_interpreter_match_the_quantised_reference():
    """``bwd_fp8_wgrad``, alone and with the FP8 dgrad items and the backward's own row
    blocks: dW_down and dW_gate_up (routed and shared) against the same products on the
    operands quantised as the kernel does (x, dY per column over every token; r h, dG/dU
    per column over the expert's rows) within 2e-2 (the interpreter's bf16 truncation), the
    exact layer within the FP8 bound (0.1), also with split gate/up columns and
    power-of-two scales; zero gradients for an expert with no tokens;
    dx and the router gradient bitwise the bf16 backward's; bitwise reruns; a NaN in dY
    shows in the weight gradients; a withheld quantisation signal ends in the named
    timeout, not a hang."""
    out = run_interpreted(FP8_WGRAD_SCRIPT)
    _prints(out, "fp8 wgrad ok", 4)
    assert out.stdout.count("fp8 wgrad layout ok") == 2, out.stdout
    assert "fp8 wgrad nan ok" in out.stdout, out.stdout
    assert "fp8 wgrad withheld ok" in out.stdout, out.stdout


FP8_BLOCK_K_SCRIPT = COMMON + textwrap.dedent("""
    from tests.unit.fp8_reference import trunc_bf16, wgrad_of_fp8_columns

    # the whole FP8 backward with 128-deep reduction steps (bwd_fp8_block_k; 128-row
    # backward blocks, so the weight-gradient items also step 128 rows) against the same
    # backward at 64 and against the references
    L, T, E, K, shared, H, I = 1, 40, 3, 2, True, 128, 64
    torch.manual_seed(5)
    x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I)
    il = mk.interleave_gate_up
    W = (il(w1), w2, il(ws1), ws2)
    exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
    runs = {}
    for bk8 in (64, 128):
        cfg = mk.MoKConfig(minibatch=128, macrobatch=256, block_m=16, block_n=32, block_k=16,
                           num_warps=4, num_stages=1, spin_budget=1000, tma=True,
                           gate_up_interleaved=True, bwd_block_m=128, bwd_fp8_da=True,
                           bwd_fp8_dx=True, bwd_fp8_wgrad=True, bwd_fp8_block_k=bk8)
        g, saved, pre_LPF = run_fp8_pre(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)
        runs[bk8] = g
        q1, q2, qs1, qs2 = wgrad_of_fp8_columns(saved, pre_LPF, x, dy, p, L, E, K, K + 1,
                                                cfg.block_m, I, trunc_bf16)
        for val, want_q, name in ((g.w_gate_up, q1, "w1_EHF"), (g.w_down, q2, "w2_EIH"),
                                  (g.shared_gate_up, qs1, "ws1_HF"),
                                  (g.shared_down, qs2, "ws2_IH")):
            assert rel(val, want_q) < 2e-2, (bk8, name, rel(val, want_q))
            assert rel(val, exact.dweights[name]) < 1e-1, (bk8, name)
        assert rel(g.dx_TH, exact.dx_TH) < 1e-1, (bk8, rel(g.dx_TH, exact.dx_TH))
        assert rel(g.d_router_weights_TK, exact.dprobs_TK) < 1e-1, bk8
    for name, a in vars(runs[128]).items():  # same quantisation, other summation order
        b = getattr(runs[64], name)
        assert (a is None and b is None) or rel(a, b.float()) < 1e-2, (name, rel(a, b.float()))
    print("fp8 block_k 128 ok")
""")


def test_fp8_backward_with_128_deep_steps_matches_the_64_deep_one():
    """``bwd_fp8_block_k=128`` (all three FP8 knobs, 128-row backward blocks): the weight
    gradients against the quantised reference (2e-2), every gradient against the exact layer
    within the FP8 bound (0.1) and within 1e-2 of the same backward at 64-deep steps."""
    out = run_interpreted(FP8_BLOCK_K_SCRIPT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fp8 block_k 128 ok" in out.stdout, out.stdout


PULL_DEDUP_SCRIPT = COMMON + textwrap.dedent("""
    for L, T, E, K, shared in [(1, 24, 4, 2, True), (2, 13, 3, 2, False), (3, 9, 2, 2, True)]:
        H, I = 64, 32
        x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 3 + L)
        for base in ({}, {"bwd_fp8_wgrad": True}, {"bwd_fp8_wgrad": True, "bwd_fp8_da": True}):
            out = []
            for dedup in (True, False):  # dedup first: its scratch cannot hold the plain run's
                cfg = config(True, bwd_pull_dedup=dedup, **base)
                g, saved = run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)
                if dedup:  # some rows of a token come from its first row on the rank
                    first = saved.schedule.tensors.first_LP
                    rows = torch.arange(first.shape[1])
                    assert int(((first >= 0) & (first != rows)).sum()) > 0
                out.append(g)
            assert_bitwise(out[0], out[1], (L, base))
            tol = 1e-1 if base else 2e-2
            assert rel(out[0].w_down, exact.dweights["w2_EIH"]) < tol
            assert rel(out[0].dx_TH, exact.dx_TH) < tol
            print("pull dedup ok", L, base)
""")


def test_pull_dedup_gives_the_plain_pulls_gradients_bitwise():
    """``bwd_pull_dedup`` (one, two and three loopback ranks; bf16, with the FP8 weight
    gradients, and with the FP8 dA items too, whose bf16 dY rows are then pulled only as the
    second pass's source): every gradient bitwise the plain pull's, with rows that do come
    from their token's first row (a second pass that wrote nothing would leave them
    unwritten and the check fails)."""
    _prints(run_interpreted(PULL_DEDUP_SCRIPT), "pull dedup ok", 9)


FUSED_FP8_PULL_SCRIPT = COMMON + textwrap.dedent("""
    for L, T, E, K, shared in [(1, 24, 4, 2, True), (2, 13, 3, 2, False)]:
        H, I = 64, 32
        x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 5 + L)
        for base in ({"bwd_fp8_da": True}, {"bwd_fp8_da": True, "bwd_fp8_wgrad": True}):
            out = []
            # the pull items first: their scratch cannot hold the separate pull's rows
            for pull in ({"bwd_fused_pull": True}, {"bwd_fused_pull": True,
                                                    "bwd_pull_programs": 1}, {}):
                cfg = config(True, **base, **pull)
                out.append(run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[0])
            for other in out[:-1]:
                assert_bitwise(other, out[-1], (L, base))
            assert rel(out[0].w_down, exact.dweights["w2_EIH"]) < 1e-1
            assert rel(out[0].w_gate_up, exact.dweights["w1_EHF"]) < 1e-1
            print("fused fp8 pull ok", L, base)

    # a pull item's signal withheld: the weight-gradient items' bounded wait for their
    # group's rows ends in the named error, and the workspace runs a clean backward after
    L, T, E, K, shared = 1, 24, 4, 2, True
    x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 6)
    cfg = config(True, bwd_fp8_da=True, bwd_fp8_wgrad=True, bwd_fused_pull=True)
    ws = mk.get_workspace(cfg, tokens=T, hidden=64, intermediate=32, local_experts=E, topk=K,
                          shared=shared, device="cpu", loopback_ranks=L)
    f8 = mk.quantize_backward_weights(cfg, W[1], W[3], W[0], W[2])
    y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
    mk.backward(cfg, ws, saved, dy, *W, fp8_weights=f8, _withhold=mk.WITHHOLD_PULLED)
    try:
        mk.check_errors(ws)
        raise SystemExit("no error with a withheld pull signal")
    except mk.MoKTimeoutError as e:
        assert "backward weight gradient <- pull: expert's rows pulled" in str(e), e
        assert "expert group" in str(e), e
    g, _ = run_fp8(cfg, L, T, E, K, shared, 64, 32, x, idx, p, W, dy)
    assert torch.isfinite(g.w_down.float()).all()
    print("fused fp8 pull withheld ok")
""")


def test_pull_items_with_fp8_da_give_the_separate_pulls_gradients_bitwise():
    """``bwd_fused_pull`` with ``bwd_fp8_da`` (the dA items read dY's FP8 rows at home and do
    not wait for the pull; the weight-gradient items wait for their group's pulled rows),
    with bf16 and with FP8 weight gradients (the pull items then write the FP8 transposed
    copies of x and dY), every program pulling or one: every gradient bitwise the separate
    pull's, one and two loopback ranks (pull items that wrote nothing would leave the
    scratch unwritten and fail the check); a withheld pull signal ends the weight-gradient
    items' bounded wait in the named error, not a hang."""
    out = run_interpreted(FUSED_FP8_PULL_SCRIPT)
    _prints(out, "fused fp8 pull ok", 4)
    assert "fused fp8 pull withheld ok" in out.stdout, out.stdout


BLOCK_COLMAX_SCRIPT = COMMON + textwrap.dedent("""
    for L, T, E, K, shared in [(1, 24, 4, 2, True), (2, 13, 3, 2, False)]:
        H, I = 64, 32
        x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 9 + L)
        out = []
        for colmax in (True, False):
            cfg = config(True, bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fp8_wgrad=True,
                         bwd_fp8_block_colmax=colmax)
            out.append(run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[0])
        assert_bitwise(out[0], out[1], L)
        assert rel(out[0].w_gate_up, exact.dweights["w1_EHF"]) < 1e-1
        print("block colmax ok", L)
""")


def test_block_column_maxima_give_the_two_pass_gradients_bitwise():
    """``bwd_fp8_block_colmax`` (the block-completing dA item keeps each row block's column
    maxima of r h and dG/dU; the Q items take the group's max from them instead of a first
    pass over the rows): every gradient bitwise the two-pass Q items', one and two loopback
    ranks (without the r h maxima, or with them halved, the check fails)."""
    _prints(run_interpreted(BLOCK_COLMAX_SCRIPT), "block colmax ok", 2)


COLUMN_MAXIMA_SCRIPT = COMMON + textwrap.dedent("""
    # an FP8 (rowwise_all) training forward with the whole FP8 backward, two loopback ranks
    # of 13 tokens (row tiles of 16 straddle the ranks)
    L, T, E, K, shared, H, I = 2, 13, 2, 2, True, 256, 128
    torch.manual_seed(5)
    x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I)
    x[3, 7] = 40.0  # one column's max far above the rest
    il = mk.interleave_gate_up
    W = (il(w1), w2, il(ws1), ws2)

    def cfg_of(**kw):
        return mk.MoKConfig(minibatch=32, macrobatch=64, block_m=16, block_n=256, block_k=128,
                            num_warps=4, num_stages=1, spin_budget=1000, tma=True,
                            gate_up_interleaved=True, fp8="rowwise_all", bwd_fp8_wgrad=True,
                            **kw)

    def run(cfg, drop=False):
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        f8 = mk.quantize_backward_weights(cfg, W[1], W[3], W[0], W[2])
        y, ctx = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p,
                                  *mk.quantize_weights(cfg, *W))
        cm = ctx.x_colmax_LH
        if drop:  # the backward then takes x's maxima in a pass of its own
            ctx.x_colmax_LH = None
        g = mk.backward(cfg, ws, ctx, dy, *W, fp8_weights=f8)
        mk.check_errors(ws)
        return g, cm

    full = cfg_of(bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fused_colmax=True)
    g, cm = run(full)
    assert torch.equal(cm, x.float().abs().view(L, T, H).amax(1))  # each rank's own
    assert_bitwise(g, run(full, drop=True)[0], "x maxima kept by the forward")
    plain, cm0 = run(cfg_of(bwd_fp8_da=True, bwd_fp8_dx=True))  # both by passes of their own
    assert cm0 is None
    assert_bitwise(g, plain, "fused column maxima")
    # dY's maxima from its row quantisation (FP8 dA items) or from a pass of their own
    # (bf16 dA items): dW_down reads only r h's and dY's FP8 copies, so it is the same
    other = run(cfg_of(bwd_fused_colmax=True))[0]
    assert torch.equal(g.w_down, other.w_down) and torch.equal(g.shared_down, other.shared_down)
    exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
    assert rel(g.w_gate_up, exact.dweights["w1_EHF"]) < 1e-1
    assert rel(g.w_down, exact.dweights["w2_EIH"]) < 1e-1
    assert rel(g.dx_TH, exact.dx_TH) < 1e-1
    print("column maxima ok")
""")


def test_column_maxima_from_the_quantisers_give_the_same_gradients_bitwise():
    """``bwd_fused_colmax``: the FP8 weight gradients' column scales of x and dY taken from
    the row quantisations
    that read them anyway (x's by the FP8 training forward, kept in its context; dY's by the
    backward's row quantisation for the FP8 dA items): x's maxima are each rank's exact
    column max, and every gradient is bitwise the one with the maxima taken by a pass of
    their own (a max over the wrong rows or ranks changes the copies' scales)."""
    _prints(run_interpreted(COLUMN_MAXIMA_SCRIPT), "column maxima ok", 1)


PULL_PREFETCH_SCRIPT = COMMON + textwrap.dedent("""
    # H 320: the FP8 pull's 128-column chunks are 3, the last one partial; two loopback ranks
    L, T, E, K, shared, H, I = 2, 13, 3, 2, True, 320, 32
    x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 53, H=H, I=I)
    for da in (True, False):  # FP8 dA items, or bf16 ones (the pull also writes bf16 dY rows)
        out = []
        for knobs in ({}, {"bwd_pull_prefetch": True},
                      {"bwd_pull_prefetch": True, "bwd_pull_interleave": True}):
            cfg = config(True, bwd_fp8_da=da, bwd_fp8_dx=da, bwd_fp8_wgrad=True, **knobs)
            out.append(run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[0])
        for i in range(1, len(out)):
            assert_bitwise(out[0], out[i], (da, i))
        assert rel(out[1].w_gate_up, exact.dweights["w1_EHF"]) < 1e-1
        assert rel(out[1].w_down, exact.dweights["w2_EIH"]) < 1e-1
        print("pull prefetch ok", da)
""")


def test_pull_loading_the_next_chunk_ahead_gives_the_same_gradients_bitwise():
    """``bwd_pull_prefetch`` (the FP8 pull loads the next 128 columns of its rows before it
    converts and stores the current ones): every gradient bitwise the plain loop's, with
    FP8 and bf16 dA items (then the pull also writes the bf16 dY rows), with the
    interleaved block order, over three column chunks of which the last is partial (a chunk
    stored from the wrong columns changes the weight gradients, which read only the
    copies)."""
    _prints(run_interpreted(PULL_PREFETCH_SCRIPT), "pull prefetch ok", 2)


PULL_COLS_SCRIPT = COMMON + textwrap.dedent("""
    # H 320: the bf16 pulls' steps of 512 columns (the default) against 128 (three steps,
    # the last partial) and 64; the row pull and the pull by token; two loopback ranks
    L, T, E, K, shared, H, I = 2, 13, 3, 2, True, 320, 32
    x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 59, H=H, I=I)
    for by_token in (False, True):
        out = []
        for cols in (0, 128, 64):
            cfg = config(True, bwd_pull_by_token=by_token, bwd_pull_cols=cols)
            out.append(run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[0])
        for i in range(1, len(out)):
            assert_bitwise(out[0], out[i], (by_token, i))
        assert rel(out[0].dx_TH, exact.dx_TH) < 2e-2
        print("pull cols ok", by_token)
""")


def test_bf16_pulls_in_narrower_steps_give_the_same_gradients_bitwise():
    """``bwd_pull_cols`` (the bf16 pulls' columns per step): every gradient of the bf16
    backward bitwise the default steps', with the row pull and with the pull by token, over
    steps of which the last is partial (a step's columns written from the wrong place
    change dx and the weight gradients)."""
    _prints(run_interpreted(PULL_COLS_SCRIPT), "pull cols ok", 2)


ROWS_SCRIPT = COMMON + textwrap.dedent("""
    for L, T, E, K, shared, colmax, experts in [(1, 24, 4, 2, True, False, None),
                                                (2, 13, 3, 2, False, True, None),
                                                (2, 11, 4, 2, True, False, 2)]:
        H, I = 64, 32
        torch.manual_seed(31 + T)
        x, idx, p, w1, w2, ws1, ws2, dy = layer(L, T, E, K, shared, H, I, experts)
        il = mk.interleave_gate_up
        W = (il(w1), w2, il(ws1) if shared else None, ws2)
        exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
        out = []
        for knobs in ({}, {"bwd_q_count_rows": True}, {"bwd_pull_interleave": True},
                      {"bwd_q_cols": 8}, {"bwd_q_cols": 8, "bwd_q_count_rows": True},
                      {"bwd_fp8_prequant": True},
                      {"bwd_fp8_prequant": True, "bwd_pull_dedup": True,
                       "bwd_pull_interleave": True}):
            cfg = config(True, bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fp8_wgrad=True,
                         bwd_fp8_block_colmax=colmax, **knobs)
            out.append(run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[0])
        for i in range(1, len(out)):
            assert_bitwise(out[0], out[i], (L, colmax, experts, i))
        assert rel(out[1].w_gate_up, exact.dweights["w1_EHF"]) < 1e-1
        assert rel(out[1].w_down, exact.dweights["w2_EIH"]) < 1e-1
        if experts:  # experts 2.. got no rows: their Q items run no step, zero gradients
            assert not out[1].w_gate_up[experts:].any() and not out[1].w_down[experts:].any()
        print("rows ok", L)
""")


Q_STEP_SCRIPT = COMMON + textwrap.dedent("""
    # 128-row backward blocks (minibatch 128): the weight-gradient steps are 64 rows, and
    # bwd_q_cols 8 (of block_n / 2 = 16) makes the Q items' steps 128 rows
    from mok_kernels._details.backward import q_rows
    L, T, E, K, shared, H, I = 2, 40, 3, 2, True, 64, 32
    x, idx, p, _, W, dy, _ = interleaved_case(L, T, E, K, shared, 47)
    out = []
    for knobs in ({}, {"bwd_q_cols": 8}, {"bwd_q_cols": 8, "bwd_q_count_rows": True}):
        cfg = mk.MoKConfig(minibatch=128, macrobatch=256, block_m=16, block_n=32, block_k=16,
                           num_warps=4, num_stages=1, spin_budget=1000, tma=True,
                           gate_up_interleaved=True, bwd_block_m=128, bwd_fp8_da=True,
                           bwd_fp8_dx=True, bwd_fp8_wgrad=True, **knobs)
        print("q rows", q_rows(cfg))
        out.append(run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[0])
    for i in range(1, len(out)):
        assert_bitwise(out[0], out[i], i)
    print("q steps ok")
""")


def test_narrow_q_items_take_longer_steps_with_the_same_gradients():
    """``bwd_q_cols`` with 128-row backward blocks: Q items of 8 columns step 128 rows at a
    time (the default's 64), in twice the items; every gradient bitwise the default's, two
    loopback ranks, with and without ``bwd_q_count_rows`` (a step that ran past its group
    would take the next group's rows into a scale, or overwrite its copy)."""
    out = run_interpreted(Q_STEP_SCRIPT)
    _prints(out, "q steps ok", 1)
    assert out.stdout.count("q rows 64") == 1 and out.stdout.count("q rows 128") == 2

def test_q_items_counting_rows_and_the_interleaved_pull_give_the_same_gradients_bitwise():
    """``bwd_q_count_rows`` (the Q items tell padding rows from the group's real row count
    instead of loading each step's slot ids), ``bwd_pull_interleave`` (the FP8 pull's
    programs take the row blocks in the order of their place in their group) and
    ``bwd_q_cols`` (Q items of 8 columns instead of block_n / 2 = 16, twice the items: a
    column tile at the wrong offset, or C and D items waiting for the old count, change a
    scale or read a copy before it is written) and ``bwd_fp8_prequant`` (x and dY quantised
    once per token at home, the pull moving e4m3 bytes; alone and with the deduped,
    interleaved pull: a row from the wrong rank's copy or token changes a copy): every gradient
    bitwise the defaults', one and two loopback ranks, with and without the shared expert
    and the block maxima, with experts that get no rows (groups of row counts that are not
    multiples of the row block, so every group has padding rows: a real row taken for
    padding, or the other way round, changes a scale or a product; a block pulled twice or
    not at all changes or poisons a copy), and the weight gradients near the float32
    reference."""
    _prints(run_interpreted(ROWS_SCRIPT), "rows ok", 3)


TRACE_SCRIPT = COMMON + textwrap.dedent("""
    L, T, E, K, shared, H, I = 2, 13, 3, 2, True, 64, 32
    x, idx, p, _, W, dy, _ = interleaved_case(L, T, E, K, shared, 5)
    for fp8 in (False, True):
        cfg = config(True, bwd_fp8_da=fp8, bwd_fp8_dx=fp8, bwd_fp8_wgrad=fp8)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        f8 = mk.quantize_backward_weights(cfg, W[1], W[3], W[0], W[2])
        sched = mk.build_schedule(ws, idx)
        y, saved = mk.forward_train(cfg, ws, sched, x, p, *W)
        tr = torch.full((L, mk.backward_trace_capacity(ws), 4), -1, dtype=torch.int64)
        mk.backward(cfg, ws, saved, dy, *W, fp8_weights=f8, _trace=tr)
        mk.check_errors(ws)
        # items per kind from the module docstring: A per (block, I tile), B per (block,
        # H tile), Q per (group, half-tile of 3I), C per (group, I half-tile, H tile), D per
        # (group, H half-tile, 2I tile); BN = 32, HALF = 16, dA tiles of DAC columns
        nb = sched.tensors.total_L // cfg.bwd_bm
        ng, half, bn = E + 1, 16, 32
        for l in range(L):
            want = [int(nb[l]) * (I // cfg.da_cols(I)), int(nb[l]) * (H // bn),
                    ng * (3 * I // half) if fp8 else 0, ng * (I // half) * (H // bn),
                    ng * (H // half) * (2 * I // bn)]
            kinds = tr[l, :, 3]
            used = (kinds >= 0).nonzero().flatten()
            assert used.tolist() == list(range(sum(want))), (l, used)
            assert torch.bincount(kinds[used], minlength=5).tolist() == want, (l, want)
            progs = tr[l, used, 2]
            assert progs.min() >= 0 and progs.max() < 4 * ws.P, progs
        print("backward trace ok", fp8)
    try:
        mk.backward(cfg, ws, saved, dy, *W, fp8_weights=f8, _trace=tr[:, :-1])
        raise SystemExit("a short trace buffer was accepted")
    except ValueError as e:
        assert "_trace" in str(e), e
    # the forward's compute items: per minibatch (MB rows) and row block, I / (BN/2) gate+up
    # items, then H / BN down items (one tile each at this config)
    cfg = config(True)
    ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E, topk=K,
                          shared=shared, device="cpu", loopback_ranks=L)
    sched = mk.build_schedule(ws, idx)
    y0 = mk.forward(cfg, ws, sched, x, p, *W)
    tr = torch.full((L, mk.forward_trace_capacity(ws), 4), -1, dtype=torch.int64)
    y, _ = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W, _trace=tr)
    mk.check_errors(ws)
    assert torch.equal(y, y0)
    nmb = (sched.tensors.total_L + cfg.minibatch - 1) // cfg.minibatch
    per_mb = cfg.minibatch // cfg.block_m
    for l in range(L):
        want = [int(nmb[l]) * per_mb * (I // 16), int(nmb[l]) * per_mb * (H // 32)]
        kinds = tr[l, :, 3]
        used = (kinds >= 0).nonzero().flatten()
        assert used.tolist() == list(range(sum(want))), (l, used)
        assert torch.bincount(kinds[used], minlength=2).tolist() == want, (l, want)
    print("forward trace ok")
""")


def test_item_traces_record_every_ticket_once_with_its_kind():
    """``backward(..., _trace=...)`` and ``forward_train(..., _trace=...)`` (profiling only):
    every ticket of the main order is written once, in order, with the kind the module
    docstrings give it and a program of the logical rank, for the bf16 and the whole FP8
    backward (with Q items) and the forward's compute items, two loopback ranks; the traced
    forward's output is bitwise the untraced one's; a buffer of the wrong shape is refused
    by name."""
    out = run_interpreted(TRACE_SCRIPT)
    _prints(out, "backward trace ok", 2)
    assert "forward trace ok" in out.stdout, out.stdout


ORDER_SCRIPT = COMMON + textwrap.dedent("""
    L, T, E, K, shared, H, I = 2, 13, 3, 2, True, 64, 32
    x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 23)
    cfg = config(True, bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fp8_wgrad=True)
    g, tr = run_traced(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)
    assert rel(g.dx_TH, exact.dx_TH) < 1e-1
    for r in range(L):  # every ticket recorded once, in sections A, B, Q, C, D
        k = tr[r, :, 3]
        kinds = k[k >= 0].tolist()
        assert kinds == sorted(kinds) and set(kinds) == {0, 1, 2, 3, 4}, kinds
        assert (tr[r, :len(kinds), 1] >= tr[r, :len(kinds), 0]).all()
    print("item order ok")
""")


def test_item_trace_records_the_ticket_order_by_section():
    """The FP8 backward's item trace (two loopback ranks): every item's ticket recorded once,
    with an end after its start, the kinds in the order A, B, Q, C, D."""
    _prints(run_interpreted(ORDER_SCRIPT), "item order ok", 1)


BAND_SCRIPT = COMMON + textwrap.dedent("""
    same_gradients_over(({}, {"bwd_dx_band": 2}, {"bwd_dx_band": 3}, {"bwd_dx_band": 1024},
                         {"bwd_dx_band": 3, "bwd_dx_tiles": 2}), 29)
    print("band ok")
""")


def test_dx_bands_give_the_same_gradients_bitwise():
    """``bwd_dx_band`` (the dX items in bands of row blocks, H tiles outer; bands of 2, of
    3 with a shorter last band, one band of all; bands of items of two H tiles each,
    ``bwd_dx_tiles``, as mok's one-rank Hopper default runs them): every gradient bitwise
    the default order's, bf16 and the whole FP8 backward, two loopback ranks (an item left
    out or run twice at the wrong place leaves a dX slot or weight-gradient tile unwritten:
    a mismatch)."""
    _prints(run_interpreted(BAND_SCRIPT), "band ok", 1)


DW_TILES_SCRIPT = COMMON + textwrap.dedent("""
    f8 = dict(bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fp8_wgrad=True)
    for base, experts in (({}, None), ({}, 2), (f8, None)):
        same_weight_gradients(base, True, True, experts, 43, {}, {"bwd_dw_tiles": 2})
        print("dw tiles ok")
""")


def test_weight_gradient_items_of_several_tiles_give_the_same_gradients_bitwise():
    """``bwd_dw_tiles`` (each weight-gradient item covers two adjacent tiles in one flattened
    loop; with and without the H-major dW_down order): every gradient bitwise the one-tile
    items', bf16 and the whole FP8 backward, two loopback ranks; with experts that get no
    rows (their K loops run no step) their gradients are zero, every tile written."""
    _prints(run_interpreted(DW_TILES_SCRIPT), "dw tiles ok", 3)


DW_TMA_SCRIPT = COMMON + textwrap.dedent("""
    f8 = dict(bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fp8_wgrad=True, bwd_split_launch=True)
    for base, il, shared, experts in (({}, True, True, None), ({}, False, True, 2),
                                      ({}, True, False, None), (f8, True, True, 2)):
        same_weight_gradients({**base, "bwd_dw_tiles": 2}, il, shared, experts, 47, {},
                              {"bwd_dw_tma_store": True})
        print("dw tma ok")
""")


def test_weight_gradient_tiles_stored_through_tma_give_the_same_gradients_bitwise():
    """``bwd_dw_tma_store`` (each weight-gradient tile stored as two TMA boxes, the shared
    expert's gradients in the routed experts' buffer after them): every gradient bitwise the
    plain stores', bf16 with both gate/up layouts (the dW_gate_up tile split into its gate and
    up columns, or into halves), with and without the shared expert, and the whole FP8
    backward; two loopback ranks (a slot or column offset off by one lands a box on another
    expert's or rank's rows: a mismatch, or zeros where an expert got no rows)."""
    _prints(run_interpreted(DW_TMA_SCRIPT), "dw tma ok", 4)


SPLIT_SCRIPT = COMMON + textwrap.dedent("""
    same_gradients_over(({}, {"bwd_split_launch": True},
                         {"bwd_split_launch": True, "bwd_fused_pull": True,
                          "bwd_pull_programs": 1},
                         {"bwd_split_launch": True, "bwd_dw_tiles": 2, "bwd_dx_band": 3}), 37)
    print("split ok")
""")


def test_split_launch_gives_the_same_gradients_bitwise():
    """``bwd_split_launch`` (the dgrad items in one launch, the weight-gradient items in a
    second that takes its tickets from a counter of its own, offset on the device): every
    gradient bitwise the one launch's, bf16 and the whole FP8 backward, two loopback ranks,
    also with pull items inside the first launch and with the dX bands and two-tile
    weight-gradient items (the second launch's tickets offset by one item too many skip a
    Q or weight-gradient item: its tile is left unwritten or its scales wrong, a
    mismatch)."""
    _prints(run_interpreted(SPLIT_SCRIPT), "split ok", 1)


SIDE_SCRIPT = COMMON + textwrap.dedent("""
    from mok_kernels._details.backward import launch_programs, side_pull

    L, T, E, K, shared, H, I = 2, 13, 3, 2, True, 64, 32
    x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, 41)
    f8 = dict(bwd_fp8_da=True, bwd_fp8_dx=True, bwd_fp8_wgrad=True, bwd_split_launch=True)
    out = []
    for side, ssum in ((0, False), (2, False), (6, False), (2, True), (6, True)):
        cfg = config(True, **f8, bwd_side_sms=side, bwd_side_sum=ssum)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        assert side_pull(ws) is None  # no second stream here: the pull runs first
        # 4 programs per logical rank here; the dgrad launch leaves side // L of them, and
        # the weight-gradient launch too with bwd_side_sum
        left = {0: 4, 2: 3, 6: 1}[side]
        assert [launch_programs(ws, 4, n) for n in (1, 2)] == [left, left if ssum else 4]
        out.append(run_fp8(cfg, L, T, E, K, shared, H, I, x, idx, p, W, dy)[0])
    for i in range(1, len(out)):
        assert_bitwise(out[0], out[i], i)
    assert rel(out[0].dx_TH, exact.dx_TH) < 1e-1  # the FP8 bound
    print("side ok")
""")


def test_dgrad_launch_with_sms_left_to_the_pull_gives_the_same_gradients_bitwise():
    """``bwd_side_sms`` (the dgrad launch leaves SMs to the FP8 pull, which runs beside it on
    a GPU): with fewer dgrad programs (3, then 1 per logical rank, two loopback ranks) every
    gradient of the whole FP8 backward with the split launch is bitwise the full launch's;
    the weight-gradient launch keeps every program unless ``bwd_side_sum`` leaves the same
    SMs to the dX sum (then its fewer programs too, and the sum after it); Triton's
    interpreter runs the pull first and the sum after the launches (no second stream)."""
    _prints(run_interpreted(SIDE_SCRIPT), "side ok", 1)


BY_TOKEN_SCRIPT = COMMON + textwrap.dedent("""
    H, I = 64, 32
    for L, T, E, K, shared, seed in ((1, 24, 4, 2, True, 31), (2, 13, 3, 2, False, 37),
                                      (3, 8, 2, 1, True, 41)):
        x, idx, p, _, W, dy, exact = interleaved_case(L, T, E, K, shared, seed, H, I)
        out = []
        for knobs in ({}, {"bwd_pull_by_token": True}):
            cfg = config(True, **knobs)
            ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                                  topk=K, shared=shared, device="cpu", loopback_ranks=L)
            for _ in range(2):  # the second backward on the first one's scratch memory
                y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *W)
                out.append(mk.backward(cfg, ws, saved, dy, *W))
            mk.check_errors(ws)
        for i in (1, 2, 3):
            assert_bitwise(out[0], out[i], (L, i))
        assert rel(out[0].dx_TH, exact.dx_TH) < 2e-2
        print("by token ok")
""")


def test_pull_by_token_gives_the_row_pulls_gradients_bitwise():
    """``bwd_pull_by_token`` (each token's x and dY rows read once and written to the rows of
    its slots, then zeros in the padding rows): every gradient bitwise the row-by-row pull's,
    one to three loopback ranks (rows of other ranks' tokens), with and without the shared
    expert, reruns bitwise equal (a row it missed or a padding row left unwritten would carry
    another value)."""
    _prints(run_interpreted(BY_TOKEN_SCRIPT), "by token ok", 3)
