"""The reference layer against an independent per-token float64 computation, and the
single-rank nccl_torch baseline against the reference."""

import torch
import torch.nn.functional as F

from mokbench.check import check_forward
from mokbench.inputs import MoEWeights, make_inputs, make_weights
from mokbench.reference import checked_expert_ids, reference_all_experts, reference_layer
from mokbench.scenario import Scenario, preset
from tests.layer_check import check_single_rank

CPU = torch.device("cpu")


def _naive(x, idx, p, w):
    """Per-token, per-k loop in float64 (no sorting, no index tricks)."""
    x, p = x.double(), p.double()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = x[t] @ w.w1_EHF[e].double()
            inter = w.w2_EIH.shape[1]
            y[t] += p[t, k] * ((F.silu(h[:inter]) * h[inter:]) @ w.w2_EIH[e].double())
        hs = x[t] @ w.ws1_HF.double()
        y[t] += (F.silu(hs[: w.ws2_IH.shape[0]]) * hs[w.ws2_IH.shape[0]:]) @ w.ws2_IH.double()
    return y


def test_reference_forward_and_grads_match_naive():
    s = Scenario(preset("tiny"), 24, 1, routing="imbalanced")
    w, inp = make_weights(s, 0, CPU), make_inputs(s, 0, CPU)
    ref = reference_layer(inp, w)
    x = inp.x_TH.double().requires_grad_()
    p = inp.topk_weights_TK.double().requires_grad_()
    y = _naive(x, inp.topk_idx_TK, p, w)
    assert torch.allclose(ref.y_TH.double(), y, rtol=1e-4, atol=1e-4)
    y.backward(inp.dy_TH.double())
    assert torch.allclose(ref.dx_TH.double(), x.grad, rtol=1e-4, atol=1e-4)
    assert torch.allclose(ref.dprobs_TK.double(), p.grad, rtol=1e-4, atol=1e-4)


def test_all_experts_reference_matches_naive_and_the_layer_reference():
    """One process, every expert: forward and every gradient against float64 autograd through
    the per-token loop, and bitwise equal to the layer reference on one rank."""
    s = Scenario(preset("tiny"), 24, 1, routing="imbalanced")
    w, inp = make_weights(s, 0, CPU), make_inputs(s, 0, CPU)
    args = (inp.x_TH, inp.topk_idx_TK, inp.topk_weights_TK, *w.tensors().values())
    ref = reference_all_experts(*args, dy_NH=inp.dy_TH)
    assert reference_all_experts(*args).dx_TH is None
    assert torch.equal(reference_all_experts(*args).y_TH, ref.y_TH)
    leaves = {k: t.double().requires_grad_() for k, t in w.tensors().items()}
    x = inp.x_TH.double().requires_grad_()
    p = inp.topk_weights_TK.double().requires_grad_()
    y = _naive(x, inp.topk_idx_TK, p, MoEWeights(**leaves, first_expert=0))
    y.backward(inp.dy_TH.double())
    assert torch.allclose(ref.y_TH.double(), y, rtol=1e-4, atol=1e-4)
    assert torch.allclose(ref.dx_TH.double(), x.grad, rtol=1e-4, atol=1e-4)
    assert torch.allclose(ref.dprobs_TK.double(), p.grad, rtol=1e-4, atol=1e-4)
    assert ref.dweights.keys() == leaves.keys()
    for name, leaf in leaves.items():
        assert torch.allclose(ref.dweights[name].double(), leaf.grad, rtol=1e-4, atol=1e-4), name
    layer = reference_layer(inp, w, max_checked_experts=s.local_experts)
    for field in ("y_TH", "dx_TH", "dprobs_TK"):
        assert torch.equal(getattr(ref, field), getattr(layer, field)), field
    for name in leaves:
        assert torch.equal(ref.dweights[name], layer.dweights[name]), name


def test_checked_experts_spread():
    assert checked_expert_ids(4, 16) == [0, 1, 2, 3]
    ids = checked_expert_ids(384, 16)
    assert ids[0] == 0 and ids[-1] == 383 and len(ids) == 16


def test_nccl_torch_single_rank_passes_check_and_a_wrong_layer_fails():
    res = check_single_rank("nccl_torch", Scenario(preset("tiny"), 64, 1), CPU)
    assert res.forward.ok, res.forward.reason()
    assert res.backward.ok, res.backward.reason()
    assert 0 < res.backward.max_rel_err < 1e-2
    # a layer that forgets the router weights, or leaves rows unwritten, must fail
    assert not check_forward(res.y_TH * 1.05, res.ref, "bf16").ok
    y_nan = res.y_TH.clone()
    y_nan[3] = float("nan")
    bad = check_forward(y_nan, res.ref, "bf16")
    assert not bad.ok and "non-finite" in bad.reason()
