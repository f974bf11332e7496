"""mok backward on one GPU (and real EP over two GPUs when there are two): every gradient
against the float32 autograd reference, edge routings, loopback EP, bitwise reruns, CUDA-graph
replay of forward + backward, the bounded-wait timeout, and the backend's autograd path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

import mok_kernels as mk  # noqa: E402
from mokbench.reference import reference_all_experts  # noqa: E402
from tests.gpu.test_mok_forward import make_layer  # noqa: E402

DEV = "cuda"
TOL = 1e-2  # bf16 against float32, Frobenius-relative (mokbench.check)


def reference_grads(x, idx, p, w, dy):
    """The float32 reference over all tokens and experts (any loopback size), under the
    names of :func:`grads_of`."""
    r = reference_all_experts(x, idx, p, *w, dy_NH=dy)
    d = r.dweights
    return {"y": r.y_TH, "dx": r.dx_TH, "dp": r.dprobs_TK, "dw1": d["w1_EHF"],
            "dw2": d["w2_EIH"], "dws1": d.get("ws1_HF"), "dws2": d.get("ws2_IH")}


def run_train(cfg, L, x, idx, p, w, E, dy, withhold=0):
    """Training forward + backward on L loopback ranks; weights in the config's layout, with
    the FP8 weight copies the config's backward reads (None in a bf16 backward)."""
    T = x.shape[0] // L
    ws = mk.get_workspace(cfg, tokens=T, hidden=x.shape[1], intermediate=w[1].shape[1],
                          local_experts=E, topk=idx.shape[1], shared=w[2] is not None,
                          device=DEV, loopback_ranks=L)
    lay = mk.interleave_gate_up if cfg.gate_up_interleaved else (lambda t: t)
    wk = (lay(w[0]), w[1], lay(w[2]) if w[2] is not None else None, w[3])
    y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *wk)
    fp8_weights = mk.quantize_backward_weights(cfg, wk[1], wk[3], wk[0], wk[2])
    g = mk.backward(cfg, ws, saved, dy, *wk, fp8_weights=fp8_weights, _withhold=withhold)
    return y, g, ws


def grads_of(y, g):
    return {"y": y, "dx": g.dx_TH, "dp": g.d_router_weights_TK, "dw1": g.w_gate_up,
            "dw2": g.w_down, "dws1": g.shared_gate_up, "dws2": g.shared_down}


def check(cfg, L, T, H, I, E, K, shared=True, idx=None, seed=0):
    x, idx, p, w = make_layer(L, T, H, I, E, K, shared, seed, idx)
    dy = torch.randn(L * T, H, device=DEV, generator=torch.Generator(DEV).manual_seed(seed + 1)
                     ).bfloat16()
    y, g, ws = run_train(cfg, L, x, idx, p, w, E, dy)
    mk.check_errors(ws)
    ref = reference_grads(x, idx, p, w, dy)
    out = grads_of(y, g)
    for name, r in ref.items():
        if r is None:
            assert out[name] is None
            continue
        o = out[name]
        assert o.shape == r.shape, (name, o.shape, r.shape)
        assert torch.isfinite(o.float()).all(), name
        err = ((o.float() - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < TOL, (name, err)
    return out, ref


def cfg_for(H, I, **kw):
    base = dict(minibatch=256, macrobatch=768, tma=True, num_stages=4)
    base.update(kw)
    return mk.MoKConfig.for_shape(H, I, **base)


@pytest.mark.parametrize("hidden", [2048, 4096, 7168])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients_match_reference(hidden, interleaved):
    check(cfg_for(hidden, 512, gate_up_interleaved=interleaved), 1, 384, hidden, 512, 8, 4)


@pytest.mark.parametrize("wide", [False, True])
def test_wide_da_items_match_reference(wide):
    """bwd_wide_da: dA items of block_n columns, the epilogue in four quarters."""
    check(cfg_for(7168, 1024, gate_up_interleaved=True, bwd_wide_da=wide), 2, 256, 7168, 1024,
          6, 8)


def test_lean_da_epilogue_and_the_plain_one_both_match_reference():
    """``bwd_lean_epilogue`` (the default) and the plain epilogue: each within the bf16
    tolerance of the float32 reference, and within a few bf16 ulps of each other (their
    sigmoids and dG factors differ by a few fp32 ulps, which moves a rounding now and then)."""
    outs = [check(cfg_for(7168, 1024, gate_up_interleaved=True, bwd_lean_epilogue=lean), 2,
                  256, 7168, 1024, 6, 8)[0] for lean in (True, False)]
    for name, a in outs[0].items():
        if a is None:
            continue
        b = outs[1][name]
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
        assert err < 1e-3, (name, err)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("rows", [{"bwd_fused_pull": True},
                                  {"bwd_fused_pull": True, "bwd_pull_programs": 32},
                                  {"bwd_da_tiles": 4},
                                  {"bwd_dx_tma": True},
                                  {"bwd_dx_tma": True, "bwd_dx_tiles": 4},
                                  {"bwd_pull_dedup": True},
                                  {"bwd_dx_band": 16, "bwd_dx_tma": True},
                                  {"bwd_dx_band": 3},
                                  {"bwd_pull_by_token": True},
                                  {"bwd_pull_by_token": True, "bwd_pull_cols": 256},
                                  {"bwd_pull_cols": 256},
                                  {"bwd_dw_tiles": 4},
                                  {"bwd_dw_tiles": 2},
                                  {"bwd_dw_tiles": 4, "bwd_dw_stages": 4},
                                  {"bwd_dx_band": 16, "bwd_dx_tma": True, "bwd_dx_tiles": 4,
                                   "bwd_dw_tiles": 4, "bwd_dw_stages": 4},
                                  {"bwd_dx_band": 16, "bwd_dx_tma": True, "bwd_dx_tiles": 4,
                                   "bwd_dw_tiles": 4, "bwd_dw_stages": 4,
                                   "bwd_pull_by_token": True},
                                  {"bwd_split_launch": True},
                                  {"bwd_split_launch": True, "bwd_fused_pull": True},
                                  {"bwd_dw_tiles": 4, "bwd_dw_stages": 4,
                                   "bwd_dw_tma_store": True},
                                  {"bwd_dx_gluon": True},
                                  {"bwd_dx_gluon": True, "bwd_dx_band": 3},
                                  {"bwd_dx_gluon": True, "bwd_split_launch": True,
                                   "bwd_pull_by_token": True},
                                  {"bwd_dw_gluon": True},
                                  {"bwd_dw_gluon": True, "bwd_split_launch": True},
                                  {"bwd_dw_gluon": True, "bwd_dx_gluon": True,
                                   "bwd_pull_by_token": True},
                                  {"bwd_dx_gluon": True, "bwd_dx_rows": True},
                                  {"bwd_dx_gluon": True, "bwd_dx_rows": True,
                                   "bwd_dw_gluon": True, "bwd_pull_by_token": True},
                                  {"bwd_stages": 3},
                                  {"bwd_stages": 3, "bwd_dx_gluon": True, "bwd_dx_rows": True,
                                   "bwd_dx_band": 16, "bwd_dx_tma": True, "bwd_dx_tiles": 4,
                                   "bwd_dw_tiles": 4, "bwd_dw_stages": 4,
                                   "bwd_pull_by_token": True},
                                  {"pre_tma_store": True}],
                         ids=lambda rows: "+".join(f"{k}={v}" for k, v in rows.items()))
def test_backward_variants_match_the_default_bitwise(ranks, rows):
    """bwd_fused_pull: the pull items inside the backward megakernel (rows written with plain
    stores, read through TMA after a proxy fence; by every program or by 32 of them),
    bwd_dx_tiles / bwd_da_tiles (several dX or dA tiles per item), bwd_dx_tma (dGU rows
    through TMA) and bwd_pull_dedup (a token's rows pulled once per rank, the others copied
    from it in a second pass) and bwd_dx_band (the dX items in bands of row blocks) and
    bwd_pull_by_token (the pull token by token,
    then zeros in the padding rows), bwd_pull_cols (either bf16 pull in 256-column steps)
    and bwd_dw_tiles (several weight-gradient tiles per item,
    two or four pipeline stages deep; bwd_dw_tma_store: their tiles stored through TMA)
    and bwd_split_launch (the dgrad and weight-gradient
    items in two launches) and bwd_dx_gluon (the dX GEMM as a warp-specialised Gluon launch
    after the megakernel's: the same wgmma steps in the same order; bwd_dx_rows: its rows
    stored in the schedule's order and gathered by the dX sum) and bwd_dw_gluon (the
    weight gradients as one, likewise) and bwd_stages (the dgrad K loops three stages deep,
    alone and with the one-Hopper-rank bf16 defaults) and pre_tma_store (the training
    forward's pre-activations stored through TMA) give the default
    backward's gradients (and the reference's), bitwise, on a rerun as well."""
    base = dict(gate_up_interleaved=True, minibatch=256, macrobatch=768, tma=True,
                num_stages=4)
    shape = (256, 7168, 1024, 8, 8)  # T, H, I, E per rank, K (K <= E even with one rank)
    fused, _ = check(mk.MoKConfig.for_shape(7168, 1024, **rows, **base), ranks, *shape)
    again, _ = check(mk.MoKConfig.for_shape(7168, 1024, **rows, **base), ranks, *shape)
    separate, _ = check(mk.MoKConfig.for_shape(7168, 1024, **base), ranks, *shape)
    for name, v in fused.items():
        if v is not None:
            assert torch.equal(v, again[name]) and torch.equal(v, separate[name]), name


@pytest.mark.parametrize("ranks", [1, 2])
def test_backward_blocks_larger_than_the_forward_blocks(ranks):
    """bwd_block_m: the forward at 64-row blocks and the backward at 128 on one schedule
    (every expert padded to 128 rows): every gradient against the reference, bitwise on a
    rerun."""
    cfg = cfg_for(7168, 1024, gate_up_interleaved=True, block_m=64, bwd_block_m=128)
    shape = (256, 7168, 1024, 8, 8)
    first, _ = check(cfg, ranks, *shape)
    again, _ = check(cfg, ranks, *shape)
    for name, v in first.items():
        if v is not None:
            assert torch.equal(v, again[name]), name


@pytest.mark.parametrize("topk, shared", [(1, True), (4, False), (10, True)])
def test_topk(topk, shared):
    check(cfg_for(2048, 256, gate_up_interleaved=True), 1, 256, 2048, 256, 16, topk, shared)


def test_empty_experts_get_zero_and_one_hot_expert():
    T, E, K = 384, 8, 4
    idx = torch.tensor([0, 5, 6, 7], device=DEV).repeat(T, 1)  # experts 1-4 get nothing
    idx[: T // 2] = torch.tensor([7, 5, 6, 0], device=DEV)  # another order, same hot experts
    out, _ = check(cfg_for(2048, 256), 1, T, 2048, 256, E, K, idx=idx)
    assert torch.count_nonzero(out["dw1"][1:5]) == 0 and torch.count_nonzero(out["dw2"][1:5]) == 0


def test_ragged_token_counts():
    check(cfg_for(2048, 256, minibatch=384), 1, 301, 2048, 256, 8, 4)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_loopback_ranks(ranks):
    check(cfg_for(2048, 256, gate_up_interleaved=True), ranks, 128, 2048, 256, 2, 4)


def test_loopback_after_forward_with_comm_programs():
    check(cfg_for(2048, 256, fwd_comm_sms=8), 2, 256, 2048, 256, 4, 4)


def test_two_runs_bitwise_equal():
    cfg = cfg_for(4096, 1024, gate_up_interleaved=True, gate_up_tiles=2, down_tiles=2)
    x, idx, p, w = make_layer(2, 384, 4096, 1024, 6, 8, seed=3)
    dy = torch.randn_like(x)
    a = grads_of(*run_train(cfg, 2, x, idx, p, w, 6, dy)[:2])
    b = grads_of(*run_train(cfg, 2, x, idx, p, w, 6, dy)[:2])
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("knobs", [{}, {
    "bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True, "bwd_fp8_block_k": 128,
    "bwd_block_m": 128, "bwd_split_launch": True, "bwd_side_sms": 8, "bwd_side_sum": True}])
def test_cuda_graph_replay_of_forward_and_backward_equals_eager(knobs):
    """Forward and backward captured as one CUDA graph, replayed on new inputs: every output
    and gradient bitwise the eager run's; also with the whole FP8 backward whose pull runs
    on a second stream beside the dgrad launch and the dX sum beside the weight-gradient
    launch (``bwd_side_sms``, ``bwd_side_sum``: forked and joined inside the capture)."""
    cfg = cfg_for(2048, 256, gate_up_interleaved=True, compile_schedule=True, **knobs)
    L, T, E, K = 2, 256, 4, 4
    x, idx, p, w = make_layer(L, T, 2048, 256, E, K, seed=4)
    dy = torch.randn_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_train(cfg, L, x, idx, p, w, E, dy)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, g, ws = run_train(cfg, L, x, idx, p, w, E, dy)
    x2, idx2, p2, _ = make_layer(L, T, 2048, 256, E, K, seed=5)
    x.copy_(x2), idx.copy_(idx2), p.copy_(p2), dy.copy_(torch.randn_like(dy))
    graph.replay()
    y2, g2, _ = run_train(cfg, L, x, idx, p, w, E, dy)
    torch.cuda.synchronize()
    mk.check_errors(ws)
    replayed, eager = grads_of(y, g), grads_of(y2, g2)
    for name in replayed:
        assert torch.equal(replayed[name], eager[name]), name


def test_withheld_signal_times_out_with_a_named_wait():
    cfg = cfg_for(2048, 256, spin_budget=20_000)
    x, idx, p, w = make_layer(1, 512, 2048, 256, 8, 4, seed=6)
    dy = torch.randn_like(x)
    _, _, ws = run_train(cfg, 1, x, idx, p, w, 8, dy, withhold=mk.WITHHOLD_DGRAD)
    torch.cuda.synchronize()  # returns: the kernel exits instead of hanging
    with pytest.raises(mk.MoKTimeoutError, match=r"wait 'backward .+' timed out"):
        mk.check_errors(ws)
    check(cfg, 1, 512, 2048, 256, 8, 4, seed=6)  # the workspace is usable again


def test_withheld_fp8_quantisation_signal_times_out_with_a_named_wait():
    """``bwd_fp8_wgrad``: a Q item's signal withheld, the C and D items' bounded wait ends in
    the named error (no hang), and the workspace runs a clean backward afterwards."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an FP8 GPU (Hopper or Blackwell)")
    cfg = cfg_for(2048, 256, spin_budget=20_000, bwd_fp8_wgrad=True)
    x, idx, p, w = make_layer(1, 512, 2048, 256, 8, 4, seed=6)
    dy = torch.randn_like(x)
    _, _, ws = run_train(cfg, 1, x, idx, p, w, 8, dy, withhold=mk.WITHHOLD_WGRAD_QUANT)
    torch.cuda.synchronize()
    with pytest.raises(mk.MoKTimeoutError, match=r"wait 'backward FP8 weight gradient <- "
                                                 r"quantise.+' timed out at expert group"):
        mk.check_errors(ws)
    _, _, ws = run_train(cfg, 1, x, idx, p, w, 8, dy)
    mk.check_errors(ws)


def test_backend_autograd_matches_reference(monkeypatch):
    """The harness path: y.backward(dy) through the backend's autograd Function."""
    from mokbench.scenario import ModelShape, Scenario
    from tests.layer_check import check_single_rank

    monkeypatch.setenv("MOKBENCH_MOK_CONFIG", '{"minibatch": 256}')
    sc = Scenario(ModelShape("t", 16, 2048, 256, 4), tokens_per_rank=500, world_size=1)
    res = check_single_rank("mok", sc, torch.device(DEV))
    assert res.forward.ok, res.forward.reason()
    assert res.backward.ok, res.backward.reason()
    assert res.backward.max_rel_err < TOL


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_all"])
def test_backend_fp8_autograd_within_the_fp8_bound(monkeypatch, recipe):
    """precision fp8 through the harness path: the FP8 forward at 64-row blocks, then the
    BF16 backward at 128-row blocks on the same schedule (``bwd_block_m``), both within the
    harness's FP8 bound of the float32 reference."""
    from mokbench.scenario import ModelShape, Scenario
    from tests.layer_check import check_single_rank

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an FP8 GPU (Hopper or Blackwell)")
    monkeypatch.setenv("MOKBENCH_MOK_CONFIG", f'{{"minibatch": 256, "fp8": "{recipe}"}}')
    sc = Scenario(ModelShape("t", 16, 2048, 512, 4), tokens_per_rank=500, world_size=1,
                  precision="fp8")
    res = check_single_rank("mok", sc, torch.device(DEV))
    assert res.forward.ok, res.forward.reason()
    assert res.backward.ok, res.backward.reason()


def _deq_rows(t):
    """t [..., K] as the FP8 dgrad items read it: e4m3 rows times their row scale."""
    from mok_kernels._details.tl_quant import quantize_rowwise

    q, sc = quantize_rowwise(t)
    return (q.float() * sc.unsqueeze(-1)).bfloat16()


def _dx_of_fp8_rows(saved, wk, L, T, E, S, H, BM):
    """dx from the dG/dU rows the backward left in ``saved.pre_LPF`` (its bf16 gradients),
    quantised as the FP8 dX items read them, against the quantised W_gate_up rows (kernel
    layout), summed over each token's slots in fp32; one row block at a time."""
    st = saved.schedule.tensors
    dx = torch.zeros(L * T, H, device=DEV)
    for lr in range(L):
        total = int(st.total_L[lr])
        for b0 in range(0, total, BM):
            g = int(st.group_LB[lr, b0 // BM])
            w = wk[2] if g == E else wk[0][lr * E + g]
            part = _deq_rows(saved.pre_LPF[lr, b0:b0 + BM]).float() @ _deq_rows(w).float().T
            src = st.src_LP[lr, b0:b0 + BM].long()
            ok = src >= 0
            dx.index_add_(0, (src[ok] // S), part[ok])
    return dx


def _fp8_backward_runs(ranks, shared, knobs, seed):
    """The layer's training forward and backward once in bf16 and twice with the FP8
    backward ``knobs`` (H 4096, I 1024, 8 experts, top-4, 1024 tokens per rank): the reruns
    bitwise equal, every FP8 gradient finite and within the FP8 bound (0.1) of the exact
    layer. Returns the inputs, both runs' gradients, and the first FP8 run's context, its
    forward's pre-activations (the backward overwrites them) and config."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an FP8 GPU (Hopper or Blackwell)")
    H, I, E, K, T = 4096, 1024, 8, 4, 1024
    x, idx, p, w = make_layer(ranks, T, H, I, E, K, shared, seed)
    dy = torch.randn(ranks * T, H, device=DEV,
                     generator=torch.Generator(DEV).manual_seed(seed + 1)).bfloat16()
    wk = (mk.interleave_gate_up(w[0]), w[1],
          mk.interleave_gate_up(w[2]) if shared else None, w[3])
    out, first = {}, None
    for key in ("bf16", "fp8", "fp8"):
        cfg = cfg_for(H, I, gate_up_interleaved=True, **(knobs if key == "fp8" else {}))
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device=DEV, loopback_ranks=ranks)
        y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *wk)
        pre_LPF = saved.pre_LPF.clone()
        g = mk.backward(cfg, ws, saved, dy, *wk,
                        fp8_weights=mk.quantize_backward_weights(cfg, wk[1], wk[3], wk[0],
                                                                 wk[2]))
        mk.check_errors(ws)
        if key in out:
            for a, b in zip(vars(out[key]).values(), vars(g).values()):
                assert (a is None and b is None) or torch.equal(a, b)
        else:
            out[key] = g
            if key == "fp8":
                first = (saved, pre_LPF, cfg)
    exact = reference_grads(x, idx, p, w, dy)
    mine = grads_of(y, out["fp8"])
    for name, r in exact.items():
        if r is not None and name != "y":
            o = mine[name].float()
            assert torch.isfinite(o).all(), name
            assert ((o - r).norm() / r.norm()).item() < 1e-1, name
    return SimpleNamespace(x=x, idx=idx, p=p, w=w, wk=wk, dy=dy, g=out["fp8"],
                           g16=out["bf16"], mine=mine, saved=first[0], pre_LPF=first[1],
                           cfg=first[2], H=H, I=I, E=E, K=K, T=T)


@pytest.mark.parametrize("knobs", [{"bwd_fp8_da": True}, {"bwd_fp8_dx": True},
                                   {"bwd_fp8_da": True, "bwd_fp8_dx": True}])
@pytest.mark.parametrize("ranks, shared", [(1, True), (2, False)])
def test_fp8_dgrad_items_match_the_quantised_reference(ranks, shared, knobs):
    """``bwd_fp8_da`` / ``bwd_fp8_dx``: dA's FP8 tiles against the reference layer on the
    dequantised dY and W_down (their exact inputs; bf16 tolerance), dX's against dx rebuilt
    from the quantised dG/dU rows and W_gate_up rows, every gradient within the FP8 bound of
    the exact layer, the gradients a knob does not touch bitwise the bf16 backward's, and
    bitwise reruns."""
    r = _fp8_backward_runs(ranks, shared, knobs, 3)
    g, g16, mine = r.g, r.g16, r.mine
    assert torch.equal(g.w_down, g16.w_down)  # the C items read bf16 dY and r*h
    if not knobs.get("bwd_fp8_da"):  # dX alone: only dx differs from the bf16 backward
        for name in ("d_router_weights_TK", "w_gate_up", "shared_gate_up"):
            a, b = getattr(g, name), getattr(g16, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        want = _dx_of_fp8_rows(r.saved, r.wk, ranks, r.T, r.E, r.K + int(shared), r.H,
                               r.cfg.block_m)
        err = ((g.dx_TH.float() - want).norm() / want.norm()).item()
        assert err < TOL, err
    if not knobs.get("bwd_fp8_dx"):  # dA alone: against the layer on the quantised inputs
        w = r.w
        quant = reference_grads(r.x, r.idx, r.p, (w[0], _deq_rows(w[1]), w[2],
                                                  _deq_rows(w[3]) if shared else None),
                                _deq_rows(r.dy))
        for name in ("dx", "dp", "dw1") + (("dws1",) if shared else ()):
            o = mine[name].float()
            err_q = ((o - quant[name]).norm() / quant[name].norm()).item()
            assert err_q < TOL, (name, err_q)


@pytest.mark.parametrize("knobs", [{}, {"bwd_fp8_da": True, "bwd_fp8_dx": True},
                                   {"bwd_fp8_da": True, "bwd_fp8_dx": True,
                                    "bwd_fp8_block_k": 128, "bwd_block_m": 128}])
@pytest.mark.parametrize("ranks, shared", [(1, True), (2, False), (2, True)])
def test_fp8_weight_gradients_match_the_quantised_reference(ranks, shared, knobs):
    """``bwd_fp8_wgrad`` (alone, with both FP8 dgrad knobs, and so with 128-deep steps,
    ``bwd_fp8_block_k``): every weight gradient
    against the same products on the operands quantised as the kernel does
    (``tests.unit.fp8_reference``; bf16 tolerance), every gradient within the FP8 bound of
    the exact layer, dx and the router gradient bitwise the bf16 backward's when only the
    weight gradients are FP8, and bitwise reruns."""
    from tests.unit.fp8_reference import wgrad_of_fp8_columns

    r = _fp8_backward_runs(ranks, shared, {"bwd_fp8_wgrad": True, **knobs}, 5)
    if not knobs:
        assert torch.equal(r.g.dx_TH, r.g16.dx_TH)
        assert torch.equal(r.g.d_router_weights_TK, r.g16.d_router_weights_TK)
    q = wgrad_of_fp8_columns(r.saved, r.pre_LPF, r.x, r.dy, r.p, ranks, r.E, r.K,
                             r.K + int(shared), r.cfg.block_m, r.I)
    for name, want in zip(("dw1", "dw2", "dws1", "dws2"), q, strict=True):
        if r.mine[name] is not None:
            err = ((r.mine[name].float() - want).norm() / want.norm()).item()
            assert err < TOL, (name, err)


def _fp8_variant_is_bitwise(ranks: int, shared: bool, knobs: dict, seed: int) -> None:
    """The whole FP8 backward (128-deep steps, 128-row blocks) with ``knobs`` gives every
    gradient bitwise the one without them (each run's reruns checked bitwise by
    ``_fp8_backward_runs``)."""
    f8 = {"bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True,
          "bwd_fp8_block_k": 128, "bwd_block_m": 128}
    plain = _fp8_backward_runs(ranks, shared, f8, seed)
    other = _fp8_backward_runs(ranks, shared, {**f8, **knobs}, seed)
    for a, b in zip(vars(plain.g).values(), vars(other.g).values()):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("ranks", [1, 2])
def test_fused_column_maxima_give_the_same_gradients_bitwise(ranks):
    """``bwd_fused_colmax``: the FP8 (rowwise_all) training forward keeps each rank's column
    max |x| from its quantisation of x (1000 tokens a rank: the quantiser's last tile of
    rows partial) and the backward takes dY's from its row quantisation; every gradient of
    the whole FP8 backward is bitwise the one with x's maxima by a pass of its own, and the
    one without the knob (both by passes of their own)."""
    from mokbench.mok_backend import fp8_config_fields

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an FP8 GPU (Hopper or Blackwell)")
    H, I, E, K, T = 4096, 1024, 8, 4, 1000
    x, idx, p, w = make_layer(ranks, T, H, I, E, K, True, 29)
    dy = torch.randn(ranks * T, H, device=DEV,
                     generator=torch.Generator(DEV).manual_seed(30)).bfloat16()
    wk = (mk.interleave_gate_up(w[0]), w[1], mk.interleave_gate_up(w[2]), w[3])
    grads = []
    for fused, drop in ((True, False), (True, True), (False, False)):
        cfg = cfg_for(H, I, **{**fp8_config_fields(90), "bwd_fp8_da": True, "bwd_fp8_dx": True,
                               "bwd_fp8_wgrad": True, "bwd_fp8_block_k": 128,
                               "bwd_fused_colmax": fused})
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=True, device=DEV, loopback_ranks=ranks)
        f8 = mk.quantize_backward_weights(cfg, wk[1], wk[3], wk[0], wk[2])
        y, saved = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p,
                                    *mk.quantize_weights(cfg, *wk))
        if fused:
            assert torch.equal(saved.x_colmax_LH, x.float().abs().view(ranks, T, H).amax(1))
        else:
            assert saved.x_colmax_LH is None
        if drop:
            saved.x_colmax_LH = None
        grads.append(mk.backward(cfg, ws, saved, dy, *wk, fp8_weights=f8))
        mk.check_errors(ws)
    for other in grads[1:]:
        for a, b in zip(vars(grads[0]).values(), vars(other).values()):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("pullers", [0, 32])
@pytest.mark.parametrize("ranks, shared", [(1, True), (2, False)])
def test_fp8_pull_items_give_the_separate_pulls_gradients_bitwise(ranks, shared, pullers):
    """The whole FP8 backward with ``bwd_fused_pull`` (pull items inside the megakernel write
    the FP8 transposed copies of x and dY; the dA items do not wait for them, the weight-
    gradient items wait for their group's rows), every program pulling or 32 of them: every
    gradient bitwise the separate pull's, on the GPU's real concurrency (programs racing for
    tickets, the waits met out of order), and reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_fused_pull": True,
                                            "bwd_pull_programs": pullers}, 7)


@pytest.mark.parametrize("ranks, shared, interleave", [(1, True, True), (2, False, False)])
def test_pull_loading_ahead_gives_the_same_gradients_bitwise(ranks, shared, interleave):
    """``bwd_pull_prefetch`` (the FP8 pull loads the next chunk of its rows before it stores
    the current one): every gradient bitwise the plain loop's, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_pull_prefetch": True,
                                            "bwd_pull_interleave": interleave}, 37)


@pytest.mark.parametrize("ranks, shared", [(1, True), (2, True)])
def test_weight_gradient_tiles_stored_through_tma_give_the_same_gradients_bitwise(ranks,
                                                                                  shared):
    """``bwd_dw_tma_store`` (four weight-gradient tiles per item, each stored as two TMA
    boxes, the shared expert's gradients after the routed experts' in one buffer) on the
    whole FP8 backward with the split launch: every gradient bitwise the plain stores' of
    one tile per item in one launch, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_dw_tiles": 4, "bwd_dw_stages": 4,
                                            "bwd_split_launch": True,
                                            "bwd_dw_tma_store": True}, 23)


@pytest.mark.parametrize("ranks, shared", [(1, True), (2, False)])
def test_block_column_maxima_give_the_two_pass_gradients_bitwise(ranks, shared):
    """``bwd_fp8_block_colmax`` (the Q items take each column's max from the row blocks'
    maxima of r h and dG/dU that the block-completing dA items stored): every gradient
    bitwise the two-pass Q items', reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_fp8_block_colmax": True}, 11)


@pytest.mark.parametrize("ranks, shared, knobs", [
    (2, True, {"bwd_dx_band": 16}),
    (1, True, {"bwd_dw_tiles": 4})])
def test_ticket_order_knobs_give_the_same_gradients_bitwise(ranks, shared, knobs):
    """``bwd_dx_band`` (the dX items reordered) and ``bwd_dw_tiles`` (four weight-gradient
    tiles per item) on the whole FP8 backward:
    every gradient bitwise the default order's, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, knobs, 17)


@pytest.mark.parametrize("ranks, shared", [(1, True), (2, False)])
def test_fp8_q_items_counting_rows_give_the_same_gradients_bitwise(ranks, shared):
    """``bwd_q_count_rows`` (the Q items' padding rows from the groups' real row counts) on
    the whole FP8 backward: every gradient bitwise the slot ids', on the GPU's real TMA
    pipelines, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_dw_tiles": 4, "bwd_q_count_rows": True}, 29)


@pytest.mark.parametrize("ranks, shared, q_cols", [(1, True, 32), (2, False, 64)])
def test_narrow_q_items_give_the_same_gradients_bitwise(ranks, shared, q_cols):
    """``bwd_q_cols`` (Q items of 32 or 64 columns instead of block_n / 2, four or two times
    as many, in 128-row steps instead of 64, the C and D items waiting for that many per
    group) on the whole FP8 backward with the split launch: every gradient bitwise the
    default's, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_dw_tiles": 4, "bwd_q_count_rows": True,
                                            "bwd_split_launch": True, "bwd_q_cols": q_cols},
                            41)


@pytest.mark.parametrize("ranks, shared, knobs", [
    (1, True, {}), (2, False, {"bwd_pull_dedup": True, "bwd_pull_interleave": True})])
def test_prequantised_pull_gives_the_same_gradients_bitwise(ranks, shared, knobs):
    """``bwd_fp8_prequant`` (each rank's x and dY quantised once per token, the pull moving
    e4m3 bytes) on the whole FP8 backward, alone and with the deduped, interleaved pull:
    every gradient bitwise the default's, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_dw_tiles": 4, "bwd_q_count_rows": True,
                                            "bwd_fp8_prequant": True, **knobs}, 43)


@pytest.mark.parametrize("ranks, shared", [(1, True), (2, False)])
def test_fp8_interleaved_pull_gives_the_same_gradients_bitwise(ranks, shared):
    """``bwd_pull_interleave`` (the FP8 pull's programs take the row blocks by their place
    in their group) on the whole FP8 backward: every gradient bitwise the row order's, on
    the GPU, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_dw_tiles": 4, "bwd_pull_interleave": True},
                            31)


@pytest.mark.parametrize("ranks, shared", [(1, True), (2, False)])
def test_fp8_split_launch_gives_the_same_gradients_bitwise(ranks, shared):
    """``bwd_split_launch`` (the dgrad launch, then the weight-gradient launch on its own
    ticket counter) on the whole FP8 backward: every gradient bitwise the one launch's, on
    the GPU, reruns bitwise equal."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_dw_tiles": 4, "bwd_q_count_rows": True,
                                            "bwd_split_launch": True}, 37)


@pytest.mark.parametrize("ranks, shared, side, ssum", [(1, True, 4, False),
                                                      (1, True, 4, True), (2, False, 16, True)])
def test_pull_beside_the_dgrad_launch_gives_the_same_gradients_bitwise(ranks, shared, side,
                                                                        ssum):
    """``bwd_side_sms`` (the dgrad launch leaves ``side`` SMs to the FP8 pull, which runs
    beside it on a second stream; the weight-gradient launch waits for it), and with
    ``bwd_side_sum`` the dX sum beside the weight-gradient launch, on the whole FP8
    backward with the split launch and the interleaved pull: every gradient bitwise the
    default's, reruns bitwise equal (a weight-gradient launch that did not wait would read
    copies the pull had not written yet; a sum that started before the dgrad launch ended,
    dX rows not yet written)."""
    _fp8_variant_is_bitwise(ranks, shared, {"bwd_dw_tiles": 4, "bwd_q_count_rows": True,
                                            "bwd_split_launch": True,
                                            "bwd_pull_interleave": True,
                                            "bwd_side_sms": side, "bwd_side_sum": ssum}, 47)


EP_SCRIPT = r"""
import os, torch, torch.distributed as dist
import mok_kernels as mk
from tests.gpu.test_mok_backward import make_layer, reference_grads, grads_of
rank = int(os.environ["RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
R, T, H, I, E, K = 2, 256, 2048, 256, 4, 4
x, idx, p, w = make_layer(R, T, H, I, E, K, seed=9)   # the whole group's data, same seed
gen = torch.Generator("cuda").manual_seed(1)
dy = torch.randn(R * T, H, device="cuda", generator=gen).bfloat16()
ref = reference_grads(x, idx, p, w, dy)
mine = slice(rank * T, (rank + 1) * T)
y_comm = None
for comm, by_token, fp8da, w8, items, pre, direct in (
        (0, False, False, False, False, False, False),
        (8, False, False, False, False, False, False),
        (8, True, False, False, False, False, False),
        (8, False, True, False, False, False, False),
        (8, False, True, True, False, False, False),
        (8, False, True, True, True, False, False),
        (8, False, True, True, False, True, False),
        (8, False, False, False, False, False, True),
        (8, True, False, False, False, False, True)):
    # items: the pull as items inside the megakernel (bwd_fused_pull, 8 pulling programs),
    # reading the peer's rows while the dA items run; by_token: bwd_pull_by_token (the
    # peer's tokens read once each, over NVLink); pre: bwd_fp8_prequant (the peer's e4m3
    # rows, quantised there, pulled as bytes); direct: dispatch_remote_only and
    # combine_direct (only the peer's rows pulled into the ring, the down tiles' rows
    # stored into the peer's combine slots): y bitwise the plain communication programs'
    cfg = mk.MoKConfig.for_shape(H, I, minibatch=256, macrobatch=768, tma=True,
                                 fwd_comm_sms=comm, dispatch_remote_only=direct,
                                 combine_direct=direct, bwd_pull_by_token=by_token,
                                 bwd_fp8_da=fp8da,
                                 bwd_fp8_dx=fp8da, dispatch_dedup=fp8da, bwd_fp8_wgrad=w8,
                                 bwd_pull_dedup=fp8da and not items, bwd_fused_pull=items,
                                 bwd_pull_programs=8 if items else 0, bwd_fp8_prequant=pre)
    ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E, topk=K,
                          shared=True, device="cuda", group=dist.group.WORLD)
    mine_e = slice(rank * E, (rank + 1) * E)
    wk = (w[0][mine_e].contiguous(), w[1][mine_e].contiguous(), w[2], w[3])
    sched = mk.build_schedule(ws, idx[mine])
    y, saved = mk.forward_train(cfg, ws, sched, x[mine], p[mine], *wk)
    g = mk.backward(cfg, ws, saved, dy[mine].contiguous(), *wk,
                    fp8_weights=mk.quantize_backward_weights(cfg, wk[1], wk[3], wk[0], wk[2]))
    mk.check_errors(ws)
    if comm and y_comm is None:
        y_comm = y.clone()
    if direct:
        assert torch.equal(y.view(torch.int16), y_comm.view(torch.int16)), (rank, by_token)
    out = grads_of(y, g)
    for name, r in ref.items():
        if name in ("dws1", "dws2"):  # each rank holds its tokens' share: sum over the group
            t = out[name].float()
            dist.all_reduce(t)
            out[name] = t
        elif name in ("y", "dx", "dp"):
            r = r[mine]
        else:
            r = r[mine_e]
        err = ((out[name].float() - r).norm() / r.norm()).item()
        # bwd_fp8_da + _dx: dY read as FP8 rows from the peer rank, dX in FP8; bwd_fp8_wgrad:
        # x and dY scaled by both ranks' column maxima: the FP8 bound
        tol = (1e-1 if (fp8da and name in ("dx", "dp", "dw1", "dws1"))
               or (w8 and name.startswith("dw")) else 1e-2)
        assert err < tol, (rank, comm, by_token, fp8da, w8, name, err)
    print("rank", rank, "comm", comm, "by_token", by_token, "fp8da", fp8da, "wgrad8", w8, "items",
          items, "pre", pre, "direct", direct, "ok")
dist.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_real_ep_over_two_gpus():
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NCCL_NVLS_ENABLE="0")
    script = Path("/tmp") / "mok_bwd_ep.py"
    script.write_text(EP_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # one line per rank and case, ending in "ok" ("by_token" holds "ok" too: count lines)
    done = [ln for ln in out.stdout.splitlines() if ln.startswith("rank ") and ln.endswith(" ok")]
    assert len(done) == 18, out.stdout[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_profiling_script_times_real_ep_over_two_gpus(tmp_path):
    """benchmarks/mok_backward_time.py under torchrun with two processes: real EP over
    symmetric memory, the FP8 cells' defaults at EP 2, each pass's median per rank and their
    max printed by rank 0, and a trace file per rank."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'benchmarks'}",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", str(root / "benchmarks" / "mok_backward_time.py"), "--hidden",
                          "1024", "--intermediate", "512", "--experts", "4", "--tokens", "1024",
                          "--iters", "2", "--warmup", "1", "--fp8", "--trace",
                          str(tmp_path / "t")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "EP 2: 4 local experts and 1024 tokens per rank" in out.stdout, out.stdout[-2000:]
    for name in ("inference", "forward_train", "backward"):
        assert re.search(rf"^{name} +per rank +[\d.]+ +[\d.]+ +max +[\d.]+ ms", out.stdout,
                         re.M), out.stdout[-2000:]
    for r in (0, 1):
        assert (tmp_path / f"t-r{r}-backward.csv").exists()


@pytest.mark.parametrize("extra", [[], ["--fp8"]])
def test_profiling_script_times_the_bf16_and_the_fp8_cells(extra):
    """benchmarks/mok_backward_time.py (the A/Bs in notes/mok-kernel.md) runs the backend's
    bf16 defaults and, with --fp8, its FP8 cells' (FP8 forward on quantised weights, FP8
    backward), and prints each pass's median."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'benchmarks'}"}
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "mok_backward_time.py"),
                          "--hidden", "1024", "--intermediate", "512", "--experts", "8",
                          "--tokens", "1024", "--iters", "2", "--warmup", "1", *extra],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("fp8='rowwise_all'" in out.stdout) == bool(extra), out.stdout[-2000:]
    for name in ("inference", "forward_train", "backward"):
        assert re.search(rf"^{name} +median +\d+\.\d+ ms", out.stdout, re.M), out.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_pre_activations_through_tma_in_the_flattened_loop_bitwise(ranks):
    """pre_tma_store with four gate+up tiles per item (the flattened loop, three stages, as
    the backend's one-Hopper-rank defaults where experts are well loaded): y and every
    gradient bitwise the plain stores', on a rerun as well."""
    base = dict(gate_up_interleaved=True, minibatch=256, macrobatch=768, tma=True,
                num_stages=3, gate_up_tiles=4, down_tiles=4)
    shape = (256, 7168, 1024, 8, 8)
    knob = mk.MoKConfig.for_shape(7168, 1024, pre_tma_store=True, **base)
    a, _ = check(knob, ranks, *shape)
    b, _ = check(knob, ranks, *shape)
    c, _ = check(mk.MoKConfig.for_shape(7168, 1024, **base), ranks, *shape)
    for name, v in a.items():
        if v is not None:
            assert torch.equal(v, b[name]) and torch.equal(v, c[name]), name
