"""Megatron adapters on CPU: reasons, TransformerConfig arguments, the router stand-in's output
format, fc1 GLU layout both ways, the dropless check, and the whole adapter (router override,
weight copy, [seq, batch, hidden] input, weight grads) against the float32 reference through a
small fake ``megatron.core`` whose MoELayer follows Megatron's conventions."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from baselines import hybridep_megatron as hm
from baselines.common import canonical_layout, out_in_layout
from mokbench.backend import RunContext
from mokbench.check import check_backward, check_forward
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.scenario import Scenario, preset


def test_reasons():
    r = hm.megatron_reason
    assert r(1, hybridep=False, has_megatron=False, has_te=True).startswith(
        "package 'megatron.core' is not installed (pip install 'mokbench[megatron]')")
    assert "'transformer_engine'" in r(1, hybridep=False, has_megatron=True, has_te=False)
    assert r(1, hybridep=False, has_megatron=True, has_te=True) is None
    assert "HybridEPBuffer" in r(4, hybridep=True, has_megatron=True, has_te=True)
    assert r(1, hybridep=True, has_megatron=True, has_te=True, has_hybridep=True) == \
        "HybridEP needs at least 2 GPUs (world size 1)"
    assert r(8, hybridep=True, has_megatron=True, has_te=True, has_hybridep=True) is None
    why = hm.HybridEPMegatronBackend().unavailable_reason(RunContext(), None)
    if not hm.installed("megatron.core"):
        assert "megatron.core" in why


def test_config_kwargs():
    sc = Scenario(preset("tiny"), tokens_per_rank=8, world_size=2)
    kw = hm.config_kwargs(sc, "hybridep", num_sms=16)
    assert kw["moe_token_dispatcher_type"] == "flex"
    assert kw["moe_flex_dispatcher_backend"] == "hybridep"
    assert kw["moe_flex_dispatcher_num_sms"] == 16
    assert kw["activation_func"] is F.silu and kw["gated_linear_unit"]
    assert kw["moe_expert_capacity_factor"] is None and kw["moe_router_dtype"] == "fp32"
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_permute_fusion"]
    assert kw["expert_model_parallel_size"] == 2 and kw["num_moe_experts"] == 8
    assert kw["moe_shared_expert_intermediate_size"] == sc.shape.intermediate
    a2a = hm.config_kwargs(sc.with_(shared_expert=False), "alltoall")
    assert a2a["moe_token_dispatcher_type"] == "alltoall"
    assert "moe_flex_dispatcher_backend" not in a2a
    assert a2a["moe_shared_expert_intermediate_size"] is None
    with pytest.raises(ValueError, match="dispatcher"):
        hm.config_kwargs(sc, "deepep")
    assert "fp8" not in a2a
    fp8 = sc.with_(precision="fp8")
    kw8 = hm.config_kwargs(fp8, "alltoall", fp8_recipe="Float8BlockScaling")
    assert kw8["fp8"] == "e4m3" and kw8["fp8_recipe"] == "blockwise"
    mx = hm.config_kwargs(fp8, "alltoall", fp8_recipe="MXFP8BlockScaling")
    assert mx["fp8_recipe"] == "mxfp8"
    with pytest.raises(ValueError, match="fp8_recipe=None is invalid"):
        hm.config_kwargs(fp8, "alltoall")
    kept, dropped = hm.known_kwargs({"a": 1, "b": 2}, {"a"})
    assert kept == {"a": 1} and dropped == ["b"]


def test_preset_router_outputs():
    idx = torch.tensor([[2, 0], [1, 3]])
    w = torch.tensor([[0.75, 0.25], [0.5, 0.5]], requires_grad=True)
    probs, rmap = hm.preset_router_outputs(idx, w, 4)
    assert probs.dtype == torch.float32 and rmap.dtype == torch.bool
    assert rmap.tolist() == [[True, False, True, False], [False, True, False, True]]
    assert probs.tolist() == [[0.25, 0, 0.75, 0], [0, 0.5, 0, 0.5]]
    (probs * torch.arange(4.0)).sum().backward()
    assert w.grad.tolist() == [[2, 0], [1, 3]]  # grad reaches the right top-k slot


def test_fc1_glu_layout_round_trip():
    E, H, I = 2, 8, 4
    w1, w2 = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    fc1, fc2 = out_in_layout(w1), out_in_layout(w2)
    x = torch.randn(3, H)
    gate, linear = torch.chunk(x @ fc1[1].t(), 2, dim=-1)  # Megatron's GLU split
    torch.testing.assert_close(gate, x @ w1[1][:, :I])
    torch.testing.assert_close(linear, x @ w1[1][:, I:])
    assert fc2[0].shape == (H, I)
    b1, b2 = canonical_layout(list(fc1)), canonical_layout(list(fc2))  # grads: one per GEMM
    assert torch.equal(b1, w1) and torch.equal(b2, w2)


def test_dropped_tokens():
    assert hm.dropped_tokens([3, 2], [3, 2]) == 0
    assert hm.dropped_tokens([3, 2], [1, 2]) == 2
    with pytest.raises(ValueError):
        hm.dropped_tokens([3, 2], [4, 2])
    with pytest.raises(ValueError):
        hm.dropped_tokens([3, 2], [3])


# ---- a fake megatron.core, enough for the adapter -------------------------------------------

@dataclasses.dataclass
class FakeConfig:
    hidden_size: int = 0
    num_moe_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int | None = None
    moe_token_dispatcher_type: str = "allgather"
    activation_func: object = None
    params_dtype: torch.dtype = torch.float32


class _Grouped(torch.nn.Module):
    def __init__(self, n, fin, fout, dtype):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(fout, fin,
                                                                                 dtype=dtype)))


class FakeMoELayer(torch.nn.Module):
    """route -> experts(x, tokens_per_expert, probs) with GLU chunk(2) and probs after the
    activation -> sum, plus the shared expert, on [seq, batch, hidden] (Megatron's order)."""

    def __init__(self, config, submodules=None):
        super().__init__()
        c, H, I = config, config.hidden_size, config.moe_ffn_hidden_size
        self.config, self.router = c, torch.nn.Linear(H, c.num_moe_experts)  # a learned gate
        E = c.num_moe_experts
        self.experts = torch.nn.Module()
        self.experts.linear_fc1 = _Grouped(E, H, 2 * I, c.params_dtype)
        self.experts.linear_fc2 = _Grouped(E, I, H, c.params_dtype)
        self.experts.forward = self._experts
        self.shared_experts = None
        if c.moe_shared_expert_intermediate_size:
            self.shared_experts = torch.nn.Module()
            self.shared_experts.linear_fc1 = torch.nn.Linear(H, 2 * I, bias=False,
                                                             dtype=c.params_dtype)
            self.shared_experts.linear_fc2 = torch.nn.Linear(I, H, bias=False,
                                                             dtype=c.params_dtype)

    def _glu(self, h):
        gate, linear = torch.chunk(h, 2, dim=-1)
        return self.config.activation_func(gate) * linear

    def _experts(self, x_MH, tokens_per_expert, probs_M):
        outs, parts = [], torch.split(x_MH, tokens_per_expert.tolist())
        for e, xs in enumerate(parts):
            h = self._glu(xs @ getattr(self.experts.linear_fc1, f"weight{e}").t())
            w = probs_M[sum(len(p) for p in parts[:e]):][:len(xs), None]
            outs.append((h * w).to(h.dtype))  # Megatron casts back after the probs
        return torch.cat([o @ getattr(self.experts.linear_fc2, f"weight{e}").t()
                          for e, o in enumerate(outs)]).to(x_MH.dtype), None

    def forward(self, hidden_SBH):
        S, B, H = hidden_SBH.shape
        x_TH = hidden_SBH.reshape(-1, H)
        probs_TG, rmap_TG = self.router(hidden_SBH, None)
        tok = torch.cat([rmap_TG[:, e].nonzero().flatten() for e in range(rmap_TG.shape[1])])
        exp = torch.cat([torch.full((int(rmap_TG[:, e].sum()),), e)
                         for e in range(rmap_TG.shape[1])])
        out, _ = self.experts(x_TH[tok], rmap_TG.sum(0), probs_TG[tok, exp])
        y = torch.zeros_like(x_TH).index_add(0, tok, out)
        if self.shared_experts is not None:
            s = self.shared_experts
            y = y + s.linear_fc2(self._glu(s.linear_fc1(x_TH)))
        return y.view(S, B, H), None


@pytest.fixture
def fake_megatron(monkeypatch):
    log: dict = {"init": 0, "destroy": 0}
    ps = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: log["init"] > log["destroy"],
        initialize_model_parallel=lambda **kw: log.update(init=log["init"] + 1, ps_kw=kw),
        destroy_model_parallel=lambda: log.update(destroy=log["destroy"] + 1))
    mods = {
        "megatron": types.ModuleType("megatron"),
        "megatron.core": types.ModuleType("megatron.core"),
        "megatron.core.tensor_parallel": types.ModuleType("megatron.core.tensor_parallel"),
        "megatron.core.tensor_parallel.random": types.ModuleType("r"),
        "megatron.core.transformer": types.ModuleType("megatron.core.transformer"),
        "megatron.core.transformer.transformer_config": types.ModuleType("tc"),
        "megatron.core.models": types.ModuleType("megatron.core.models"),
        "megatron.core.models.gpt": types.ModuleType("megatron.core.models.gpt"),
        "megatron.core.models.gpt.moe_module_specs": types.ModuleType("specs"),
    }
    mods["megatron.core"].parallel_state = ps
    mods["megatron.core.tensor_parallel.random"].model_parallel_cuda_manual_seed = \
        lambda seed: log.update(seed=seed)
    mods["megatron.core.transformer.transformer_config"].TransformerConfig = FakeConfig

    def get_moe_module_spec(use_te, num_experts, moe_grouped_gemm):
        log["spec"] = (use_te, num_experts, moe_grouped_gemm)
        return functools.partial(FakeMoELayer, submodules="te-grouped")

    mods["megatron.core.models.gpt.moe_module_specs"].get_moe_module_spec = get_moe_module_spec
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return log


@pytest.mark.parametrize("shared", [True, False])
def test_alltoall_adapter_matches_reference(fake_megatron, shared):
    sc = Scenario(preset("tiny"), tokens_per_rank=16, world_size=1, shared_expert=shared)
    weights, inputs = make_weights(sc, 0, "cpu"), make_inputs(sc, 0, "cpu")
    ref = reference_layer(inputs, weights)
    be = hm.MegatronAlltoallBackend()
    be.setup(sc, RunContext(), weights)
    assert fake_megatron["ps_kw"]["expert_model_parallel_size"] == 1
    assert fake_megatron["spec"] == (True, 8, True) and fake_megatron["seed"] == sc.seed
    assert isinstance(be.layer.router, hm.PresetRouter)
    assert be.variant.startswith("dispatcher=alltoall,dropped_config=")  # fake lacks fields
    x = inputs.x_TH.clone().requires_grad_(True)
    p = inputs.topk_weights_TK.clone().requires_grad_(True)
    y = be.forward(x, inputs.topk_idx_TK, p)
    fwd = check_forward(y, ref, "bf16")
    assert fwd.ok, fwd.reason()
    be.zero_grad()
    y.backward(inputs.dy_TH)
    bwd = check_backward(x.grad, p.grad, be.weight_grads(), ref, "bf16")
    assert bwd.ok, bwd.reason()
    be.check()  # every routed slot reached the experts
    be.rows_E = be.rows_E - torch.eye(1, len(be.rows_E), dtype=be.rows_E.dtype)[0]
    with pytest.raises(RuntimeError, match="dropped 1"):
        be.check()
    be.teardown()
    assert fake_megatron["destroy"] == 1


def test_fp8_shared_expert_needs_aligned_tokens():
    from baselines.hybridep_megatron import fp8_shared_tokens_reason

    def sc(tokens, shared=True):
        return Scenario(preset("qwen3-30b-a3b"), tokens_per_rank=tokens, world_size=1,
                        precision="fp8", shared_expert=shared)

    why = fp8_shared_tokens_reason(sc(1000), (9, 0))
    assert "tokens_per_rank=1000" in why and "multiple of 16" in why
    assert fp8_shared_tokens_reason(sc(1008), (9, 0)) is None
    assert "multiple of 32" in fp8_shared_tokens_reason(sc(1008), (10, 0))
    assert fp8_shared_tokens_reason(sc(1000, shared=False), (9, 0)) is None
