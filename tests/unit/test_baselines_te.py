"""TransformerEngine adapter on CPU: reasons, recipe choice, communication choice, weight layout
both ways, dense routing, and the whole layer (forward and backward) against the float32
reference with a plain-torch stand-in for ``transformer_engine.pytorch``."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import pytest
import torch
import torch.distributed as dist

from baselines import transformer_engine as tem
from baselines.common import canonical_layout, out_in_layout
from mokbench.backend import RunContext
from mokbench.check import check_backward, check_forward
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.scenario import Scenario, preset


def test_reason_names_missing_package():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    why = tem.TEBackend().unavailable_reason(RunContext(), None)
    assert why == "package 'transformer_engine' is not installed (pip install 'mokbench[te]')"


def test_reason_fp8_by_compute_capability():
    r = tem.te_reason
    assert r("bf16", (8, 0), 128, 64, installed=True) is None
    assert r("fp8", (9, 0), 128, 64, installed=True) is None
    assert r("fp8", (10, 0), 128, 64, installed=True) is None
    assert "GPU has 8.9" in r("fp8", (8, 9), 128, 64, installed=True)
    assert "multiples of 32" in r("fp8", (10, 0), 128, 48, installed=True)
    assert tem.fp8_recipe_name((9, 0)) == "Float8BlockScaling"
    assert tem.fp8_recipe_name((10, 3)) == "MXFP8BlockScaling"
    assert tem.fp8_recipe_name((12, 0)) is None


def test_choose_comm():
    assert tem.choose_comm(1, None) == "none"
    assert tem.choose_comm(8, None) == "deepep"
    assert tem.choose_comm(8, "package 'deep_ep' is not installed") == "nccl_a2a"
    assert tem.choose_comm(8, None, "nccl_a2a") == "nccl_a2a"
    with pytest.raises(ValueError, match=tem.COMM_ENV):
        tem.choose_comm(4, None, "mpi")


def test_weight_layout_round_trip():
    E, H, I = 3, 8, 4
    w1 = torch.randn(E, H, 2 * I)
    w2 = torch.randn(E, I, H)
    fc1, fc2 = out_in_layout(w1), out_in_layout(w2)
    assert fc1[1].shape == (2 * I, H) and fc2[2].shape == (H, I)
    x = torch.randn(5, H)
    torch.testing.assert_close(x @ fc1[1].t(), x @ w1[1])  # TE's y = x W^T
    assert torch.equal(fc1[0][:I], w1[0][:, :I].t())  # gate rows first
    b1, b2 = canonical_layout(list(fc1)), canonical_layout(list(fc2))  # grads: one per GEMM
    assert torch.equal(b1, w1) and torch.equal(b2, w2)


def test_dense_routing_drops_foreign_slots_and_keeps_grad():
    idx = torch.tensor([[0, -1], [2, 1], [-1, -1]])
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]], requires_grad=True)
    rmap, probs = tem.dense_routing(idx, w, 3)
    assert rmap.tolist() == [[True, False, False], [False, True, True], [False] * 3]
    assert torch.allclose(probs, torch.tensor([[0.7, 0, 0], [0, 0.4, 0.6], [0, 0, 0]]))
    probs.sum().backward()
    assert w.grad.tolist() == [[1, 0], [1, 1], [0, 0]]


# ---- a plain-torch stand-in for the TE functions the adapter calls ----------------------------

def _permute(inp, routing_map, pad_to=1):
    tok, exp = [], []
    counts = routing_map.sum(0).tolist()
    for e in range(routing_map.shape[1]):
        rows = routing_map[:, e].nonzero().flatten().tolist()
        pad = -len(rows) % pad_to
        tok += rows + [-1] * pad
        exp += [e] * (len(rows) + pad)
    tok_t = torch.tensor(tok, dtype=torch.long)
    out = torch.where((tok_t >= 0).unsqueeze(1), inp[tok_t.clamp(min=0)], 0)
    return out, (tok_t, torch.tensor(exp)), counts


class FakeTE(types.ModuleType):
    """moe_permute*, moe_unpermute, GroupedLinear, Linear and autocast in plain torch."""

    def __init__(self):
        super().__init__("transformer_engine.pytorch")
        self.autocast_recipes: list[object] = []
        self.splits: list[list[int]] = []
        self.linear_rows: list[int] = []
        self.first_microbatch: list[bool | None] = []  # per GEMM module call

    def moe_permute(self, inp, routing_map, num_out_tokens):
        out, row_id_map, counts = _permute(inp, routing_map)
        assert num_out_tokens == sum(counts)
        return out, row_id_map

    def moe_permute_and_pad_with_probs(self, inp, probs, routing_map, tokens_per_expert, align):
        out, row_id_map, counts = _permute(inp, routing_map, align)
        target = torch.tensor([c + (-c % align) for c in counts])
        return out, None, row_id_map, "pad_offsets", target

    def moe_unpermute(self, inp, row_id_map, merging_probs, restore_shape, pad_offsets=None):
        tok, exp = row_id_map
        keep = tok >= 0
        w = merging_probs[tok[keep], exp[keep]].unsqueeze(1)
        out = inp.new_zeros(restore_shape)
        return out.index_add(0, tok[keep], (inp[keep].float() * w).to(inp.dtype))

    def GroupedLinear(self, num_gemms, in_features, out_features, bias, params_dtype, device):
        te = self

        class _GL(torch.nn.Module):
            def __init__(self):
                super().__init__()
                for i in range(num_gemms):
                    self.register_parameter(f"weight{i}", torch.nn.Parameter(
                        torch.empty(out_features, in_features, dtype=params_dtype)))

            def forward(self, x, m_splits, is_first_microbatch=None):
                te.splits.append(list(m_splits))
                te.first_microbatch.append(is_first_microbatch)
                parts = torch.split(x, m_splits)
                return torch.cat([p @ getattr(self, f"weight{i}").t()
                                  for i, p in enumerate(parts)])
        return _GL()

    def Linear(self, in_features, out_features, bias, params_dtype, device):
        te = self

        class _L(torch.nn.Linear):
            def forward(self, x, is_first_microbatch=None):
                te.linear_rows.append(x.shape[0])
                te.first_microbatch.append(is_first_microbatch)
                return super().forward(x)
        return _L(in_features, out_features, bias=bias, dtype=params_dtype)

    @contextlib.contextmanager
    def autocast(self, enabled, recipe):
        self.autocast_recipes.append(recipe)
        yield


@pytest.fixture
def fake_te(monkeypatch):
    te = FakeTE()
    pkg = types.ModuleType("transformer_engine")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Float8BlockScaling = type("Float8BlockScaling", (), {})
    recipe.MXFP8BlockScaling = type("MXFP8BlockScaling", (), {})
    pkg.pytorch, pkg.common, common.recipe = te, common, recipe
    for name, mod in [("transformer_engine", pkg), ("transformer_engine.pytorch", te),
                      ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe)]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    return te


def _run(be, sc, comm=None):
    weights, inputs = make_weights(sc, 0, "cpu"), make_inputs(sc, 0, "cpu")
    ref = reference_layer(inputs, weights)
    be.setup(sc, RunContext(), weights)
    if comm is not None:
        be.comm, be.comm_name = comm, "nccl_a2a"
    x = inputs.x_TH.clone().requires_grad_(True)
    p = inputs.topk_weights_TK.clone().requires_grad_(True)
    y = be.forward(x, inputs.topk_idx_TK, p)
    fwd = check_forward(y, ref, sc.precision)
    be.zero_grad()
    y.backward(inputs.dy_TH)
    bwd = check_backward(x.grad, p.grad, be.weight_grads(), ref, sc.precision)
    return fwd, bwd


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_layer_matches_reference_with_fake_te(fake_te, precision):
    sc = Scenario(preset("tiny"), tokens_per_rank=20, world_size=1, precision=precision)
    be = tem.TEBackend()
    fwd, bwd = _run(be, sc)
    assert fwd.ok, fwd.reason()
    assert bwd.ok, bwd.reason()
    assert be.variant.startswith("comm=none")
    if precision == "fp8":
        assert be.align == 16 and "Float8BlockScaling" in be.variant
        assert type(fake_te.autocast_recipes[-1]).__name__ == "Float8BlockScaling"
        assert all(n % 16 == 0 for n in fake_te.splits[-1])  # rows per expert padded
        # 20 tokens: the shared expert's rows are padded to 32 for TE's block-scaled GEMMs
        assert fake_te.linear_rows[-2:] == [32, 32]
    else:
        assert fake_te.linear_rows[-2:] == [20, 20]
        assert fake_te.autocast_recipes == []


def test_layer_through_nccl_a2a_slots(fake_te, monkeypatch):
    """The slot-level all-to-all path on one rank (all_to_all_single is a copy there)."""
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, group=None: out.copy_(inp))
    sc = Scenario(preset("tiny"), tokens_per_rank=20, world_size=1)
    fwd, bwd = _run(tem.TEBackend(), sc, comm=tem.NcclA2A(RunContext(), sc.shape.num_experts))
    assert fwd.ok, fwd.reason()
    assert bwd.ok, bwd.reason()
    assert len(fake_te.splits[-1]) == sc.local_experts
    assert sum(fake_te.splits[-1]) == sc.tokens_per_rank * sc.shape.topk  # one row per slot


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fp8_weights_are_quantised_once(fake_te, precision):
    """fp8: every GEMM module gets is_first_microbatch=True in the first forward after setup
    (TE quantises and caches its FP8 weights) and False after (the cached copies), as mok
    quantises its weights once at setup; bf16 leaves TE's default (None)."""
    sc = Scenario(preset("tiny"), tokens_per_rank=20, world_size=1, precision=precision)
    be = tem.TEBackend()
    _run(be, sc)
    first = list(fake_te.first_microbatch)
    inputs = make_inputs(sc, 1, "cpu")  # a second forward on the same setup
    be.forward(inputs.x_TH, inputs.topk_idx_TK, inputs.topk_weights_TK)
    later = fake_te.first_microbatch[len(first):]
    assert len(first) == len(later) == 4  # fc1, fc2 and the shared expert's two Linears
    if precision == "fp8":
        assert first == [True] * 4 and later == [False] * 4
        assert be.variant.endswith(",weights=cached")
    else:
        assert first == later == [None] * 4 and "weights" not in be.variant
