"""Upstream MoK adapter on CPU: its limits, API lookup, weight layout both ways, and how it
builds MoK's arguments, checked with a fake ``mok`` package whose forward/backward compute the
real layer from the arguments they are given (so a wrong layout fails the reference check)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from baselines import mok_upstream as mu
from mokbench.backend import RunContext
from mokbench.check import check_backward, check_forward
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.scenario import ModelShape, Scenario


def _reason(**kw):
    args = dict(world_size=8, precision="bf16", tokens=1024, hidden=512, inter=256, topk=8,
                shared_expert=True, cc=(10, 3), installed=True)
    args.update(kw)
    return mu.mok_reason(**args)


def test_limits():
    assert _reason() is None and _reason(cc=(10, 0), precision="fp8") is None
    assert _reason(installed=False).startswith("package 'mok' is not installed (pip install")
    assert "not upstream MoK" in _reason(upstream=False)
    assert _reason(cc=(9, 0)) == "needs compute capability 10.0/10.3 (Blackwell); GPU has 9.0"
    assert "no GPU" in _reason(cc=None)
    assert _reason(world_size=2) == "needs EP 4, 8, 16, 32 or 64 (world size 2)"
    assert _reason(world_size=64) is None
    assert "at least 512" in _reason(tokens=256) and "multiple of 256" in _reason(tokens=640)
    assert "multiples of 256" in _reason(inter=128)
    assert "shared expert" in _reason(shared_expert=False)
    assert mu.MoKUpstreamBackend.capabilities.is_baseline is False


def test_reason_without_package():
    if importlib.util.find_spec("mok") is not None:
        pytest.skip("mok is installed here")
    assert "package 'mok' is not installed" in mu.MoKUpstreamBackend().unavailable_reason(None)


def test_weight_layout_round_trip():
    E, H, I = 2, 8, 4
    w1, w2 = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    ws1, ws2 = torch.randn(H, 2 * I), torch.randn(I, H)
    t = mu.mok_weights(w1, w2, ws1, ws2)
    assert t["w_gate_EIH"].shape == (E, I, H) and t["w_down_EHI"].shape == (E, H, I)
    assert torch.equal(t["w_up_EIH"][1], w1[1][:, I:].t())
    assert torch.equal(t["ws_gate_IH"], ws1[:, :I].t())
    back = mu.canonical_from_mok(t)
    for name, ref in [("w1_EHF", w1), ("w2_EIH", w2), ("ws1_HF", ws1), ("ws2_IH", ws2)]:
        assert torch.equal(back[name], ref), name


# ---- a fake ``mok`` package with upstream's call signatures -----------------------------------

def _ffn(x, gate_IH, up_IH, down_HI):
    return (F.silu(x @ gate_IH.t()) * (x @ up_IH.t())) @ down_HI.t()


def _routed(arg):
    """The bf16 weight behind a bf16 tensor or a fake MXFP8 tuple."""
    return arg[0] if isinstance(arg, tuple) else arg


def _make_fake_mok(log):
    mok = types.ModuleType("mok")
    functional = types.ModuleType("mok.functional")
    ops = types.ModuleType("mok.ops")

    class MoKConfig:
        fwd_num_comm_sms = 40

    def get_workspace(config, group, *, device, num_local_tokens, hidden_size, topk):
        log["workspace"] = dict(device=device, T=num_local_tokens, H=hidden_size, K=topk)
        return types.SimpleNamespace(topk=topk)

    def build_schedule(workspace, config, top_experts, *, num_local_experts):
        assert top_experts.dtype == torch.int64 and top_experts.is_contiguous()
        log["schedules"] = log.get("schedules", 0) + 1
        return types.SimpleNamespace(top=top_experts, E=num_local_experts)

    def layer(sched, x, w, sg, su, sd, rg, ru, rd):
        y = _ffn(x, sg, su, sd)
        for k in range(sched.top.shape[1]):
            e = sched.top[:, k]
            for ex in range(sched.E):
                m = e == ex
                y = y.index_add(0, m.nonzero().flatten(),
                                w[m, k, None] * _ffn(x[m], rg[ex], ru[ex], rd[ex]))
        return y

    def forward(config, workspace, schedule, x, router_weights, sg, su, sd, rg, ru, rd):
        assert x.dtype == torch.bfloat16 and router_weights.dtype == torch.float32
        log["fwd_routed"] = (rg, ru, rd)
        args = [t.float() for t in (x, router_weights, sg, su, sd)]
        y = layer(schedule, *args, *(_routed(a).float() for a in (rg, ru, rd)))
        return y.to(torch.bfloat16), "fctx"

    def backward(config, workspace, schedule, fctx, dy, x, w, sg, su, sd, rg, ru, rd):
        assert fctx == "fctx"
        log["bwd_routed"] = (rg, ru, rd)
        down = rd[0].transpose(1, 2) if isinstance(rd, tuple) else rd  # MXFP8: transposed down
        leaves = [t.float().requires_grad_(True) for t in (x, w, _routed(rg), _routed(ru),
                                                           down, sg, su, sd)]
        x_, w_, g_, u_, d_, sg_, su_, sd_ = leaves
        with torch.enable_grad():  # autograd runs backward functions with grad mode off
            y = layer(schedule, x_, w_, sg_, su_, sd_, g_, u_, d_)
            grads = torch.autograd.grad(y, leaves, dy.float())
        return tuple(g.to(torch.float32 if i == 1 else torch.bfloat16)
                     for i, g in enumerate(grads))

    def mxfp8_quantize(x_bf16, return_normal, return_transposed):
        assert return_normal and return_transposed
        return (x_bf16, "sc", x_bf16.transpose(-1, -2).contiguous(), "sc_t")

    functional.MoKConfig, functional.get_workspace = MoKConfig, get_workspace
    functional.build_schedule, functional.forward = build_schedule, forward
    functional.backward, ops.mxfp8_quantize = backward, mxfp8_quantize
    mok.functional, mok.ops = functional, ops
    return {"mok": mok, "mok.functional": functional, "mok.ops": ops}


@pytest.fixture
def fake_mok(monkeypatch):
    log: dict = {}
    for name, mod in _make_fake_mok(log).items():
        monkeypatch.setitem(sys.modules, name, mod)
    return log


def test_resolve_api_finds_entry_points(fake_mok):
    api = mu.resolve_api(sys.modules["mok"])
    assert api.forward is sys.modules["mok.functional"].forward
    assert api.mxfp8_quantize is sys.modules["mok.ops"].mxfp8_quantize
    with pytest.raises(ImportError, match="no backward"):
        del sys.modules["mok.functional"].backward
        mu.resolve_api(sys.modules["mok"])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_layer_through_fake_mok_matches_reference(fake_mok, precision):
    shape = ModelShape("t", num_experts=4, hidden=64, intermediate=32, topk=2)
    sc = Scenario(shape, tokens_per_rank=16, world_size=1, precision=precision)
    weights, inputs = make_weights(sc, 0, "cpu"), make_inputs(sc, 0, "cpu")
    ref = reference_layer(inputs, weights)
    be = mu.MoKUpstreamBackend()
    be.setup(sc, RunContext(), weights)
    assert fake_mok["workspace"] == dict(device=torch.device("cpu"), T=16, H=64, K=2)
    x = inputs.x_TH.clone().requires_grad_(True)
    p = inputs.topk_weights_TK.clone().requires_grad_(True)
    y = be.forward(x, inputs.topk_idx_TK, p)
    fwd = check_forward(y, ref, precision)
    assert fwd.ok, fwd.reason()
    be.zero_grad()
    y.backward(inputs.dy_TH)
    bwd = check_backward(x.grad, p.grad, be.weight_grads(), ref, precision)
    assert bwd.ok, bwd.reason()
    assert fake_mok["schedules"] == 1  # the schedule is built inside the forward
    rg, ru, rd = fake_mok["fwd_routed"]
    bg, bu, bd = fake_mok["bwd_routed"]
    if precision == "fp8":
        assert [len(a) for a in (rg, ru, rd)] == [2, 2, 2] and rg[1] == "sc"
        assert [len(a) for a in (bg, bu, bd)] == [4, 4, 2] and bd[1] == "sc_t"
        assert bd[0].shape == (4, 32, 64)  # transposed down [E, I, H]
    else:
        assert rg.shape == (4, 32, 64) and rd.shape == (4, 64, 32)
