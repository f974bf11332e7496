"""Megatron adapters on CPU: reasons, TransformerConfig arguments, the router stand-in's output
format, fc1 GLU layout both ways, the dropless check, and the whole adapter (router override,
weight copy, [seq, batch, hidden] input, weight grads) against the float32 reference through a
small fake ``megatron.core`` whose MoELayer follows Megatron's conventions."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
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
    # HybridEP at fp8: counts padded per expert (0 stays 0)
    assert hm.dropped_tokens([5, 0, 16, 17], [16, 0, 16, 32], pad_multiple=16) == 0
    assert hm.dropped_tokens([17], [16], pad_multiple=16) == 16
    with pytest.raises(ValueError, match="padded to 16"):
        hm.dropped_tokens([5], [32], pad_multiple=16)


def test_hybridep_knobs_and_reasons(tmp_path, monkeypatch):
    assert hm.hybridep_sms({}) == 24 and hm.hybridep_sms({hm.SMS_ENV: "32"}) == 32
    for bad in ("0", "-4", "x"):
        with pytest.raises(ValueError, match=hm.SMS_ENV):
            hm.hybridep_sms({hm.SMS_ENV: bad})
    assert hm.hybridep_shape_reason(2, 7168, 12) is None
    assert "multiple of 16" in hm.hybridep_shape_reason(2, 7000, 12)
    assert "3 x 2" in hm.hybridep_shape_reason(2, 7168, 6)
    assert hm.hybridep_shape_reason(4, 7168, 4) is None
    assert "set CUDA_HOME" in hm.nvcc_reason(None, False)
    assert "/x/bin/nvcc does not exist" in hm.nvcc_reason("/x", False)
    assert hm.nvcc_reason("/x", True) is None
    assert hm.jit_cuda_home({"CUDA_HOME": "/opt/cuda"}) == "/opt/cuda"
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="bin/nvcc does not exist"):
        hm.ensure_jit_nvcc()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    (tmp_path / "include" / "cccl").mkdir(parents=True)
    monkeypatch.setenv("CPATH", "/a")
    hm.ensure_jit_nvcc()
    assert os.environ["CPATH"] == f"/a:{tmp_path}/include/cccl"
    hm.ensure_jit_nvcc()  # idempotent
    assert os.environ["CPATH"] == f"/a:{tmp_path}/include/cccl"
    assert hm.cpath_with(None, "/c") == "/c" and hm.cpath_with("/c:/d", "/c") == "/c:/d"
    why = hm.megatron_reason(2, hybridep=True, has_megatron=True, has_te=True,
                             hybridep_error="ImportError: hybrid_ep_cpp")
    assert why == "package 'deep_ep' does not import: ImportError: hybrid_ep_cpp"


# ---- a fake megatron.core 0.19.2, enough for the adapter --------------------------------------

MCORE_DISPATCHERS = ("allgather", "alltoall", "flex")
MCORE_FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")
MCORE_FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")


@dataclasses.dataclass
class FakeConfig:
    """The TransformerConfig fields the adapter sets, with 0.19.2's allowed values checked."""

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: int | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False
    moe_router_dtype: str | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    gated_linear_unit: bool = False
    activation_func: object = None
    add_bias_linear: bool = True
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    fp8: str | None = None
    fp8_recipe: str = "delayed"
    moe_token_dispatcher_type: str = "allgather"
    moe_flex_dispatcher_backend: str = "deepep"
    moe_flex_dispatcher_num_sms: int | None = None
    moe_expert_rank_capacity_factor: float | None = None

    def __post_init__(self):
        assert self.moe_token_dispatcher_type in MCORE_DISPATCHERS
        assert self.moe_flex_dispatcher_backend in MCORE_FLEX_BACKENDS
        assert self.fp8 in (None, "e4m3", "hybrid") and self.fp8_recipe in MCORE_FP8_RECIPES
        assert self.moe_router_dtype in (None, "fp32", "fp64")


class _Grouped(torch.nn.Module):
    """TE GroupedLinear's parameters: weight0 .. weight{n-1}, each [out, in]."""

    def __init__(self, n, fin, fout, dtype):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(fout, fin,
                                                                                 dtype=dtype)))


def _hybridep(config) -> bool:
    return (config.moe_token_dispatcher_type == "flex"
            and config.moe_flex_dispatcher_backend == "hybridep")


class FakeMoELayer(torch.nn.Module):
    """Megatron's MoELayer order on [seq, batch, hidden]: shared expert, router(hidden,
    padding_mask) -> (probs [T, G], routing_map [T, G] bool), permute by expert, experts(x,
    tokens_per_expert, probs) -> (out, None) with GLU chunk(2) and probs after the activation,
    unpermute-sum, plus the shared expert. With the flex/HybridEP dispatcher (fp32 probs only)
    at fp8, each expert's rows are padded to the FP8 alignment (16, 32 for mxfp8) before the
    experts, as HybridEP's permute does, so tokens_per_expert counts the padding."""

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

    def _pad(self):
        if not (_hybridep(self.config) and self.config.fp8):
            return 1
        return 32 if self.config.fp8_recipe == "mxfp8" else 16

    def forward(self, hidden_SBH, padding_mask=None):
        S, B, H = hidden_SBH.shape
        x_TH = hidden_SBH.reshape(-1, H)
        y = None
        if self.shared_experts is not None:
            s = self.shared_experts
            y = s.linear_fc2(self._glu(s.linear_fc1(x_TH)))
        probs_TG, rmap_TG = self.router(hidden_SBH, padding_mask)
        assert rmap_TG.dtype == torch.bool and probs_TG.shape == rmap_TG.shape
        if _hybridep(self.config):
            assert probs_TG.dtype == torch.float32, "HybridEP only supports float32 probs"
        G, pad = rmap_TG.shape[1], self._pad()
        toks, counts = [], []
        for e in range(G):
            t = rmap_TG[:, e].nonzero().flatten()
            n = len(t)
            toks.append(t)
            counts.append(-(-n // pad) * pad)
        rows = torch.cat([torch.cat([t, t.new_full((c - len(t),), -1)])
                          for t, c in zip(toks, counts)])
        real = rows >= 0
        exp = torch.repeat_interleave(torch.arange(G), torch.tensor(counts))
        x_MH = torch.where(real[:, None], x_TH[rows.clamp(min=0)], 0)
        p_M = torch.where(real, probs_TG[rows.clamp(min=0), exp], 0)
        out, _ = self.experts(x_MH, torch.tensor(counts), p_M)
        routed = torch.zeros_like(x_TH).index_add(0, rows[real], out[real])
        y = routed if y is None else routed + y
        return y.view(S, B, H), None


@pytest.fixture
def fake_megatron(monkeypatch):
    log: dict = {"init": 0, "destroy": 0, "reset_hybrid_ep": 0, "fp8_context": 0}
    ps = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: log["init"] > log["destroy"],
        initialize_model_parallel=lambda **kw: log.update(init=log["init"] + 1, ps_kw=kw),
        destroy_model_parallel=lambda: log.update(destroy=log["destroy"] + 1))
    mods = {
        "megatron": types.ModuleType("megatron"),
        "megatron.core": types.ModuleType("megatron.core"),
        "megatron.core.fp8_utils": types.ModuleType("megatron.core.fp8_utils"),
        "megatron.core.tensor_parallel": types.ModuleType("megatron.core.tensor_parallel"),
        "megatron.core.tensor_parallel.random": types.ModuleType("r"),
        "megatron.core.transformer": types.ModuleType("megatron.core.transformer"),
        "megatron.core.transformer.transformer_config": types.ModuleType("tc"),
        "megatron.core.transformer.moe": types.ModuleType("megatron.core.transformer.moe"),
        "megatron.core.transformer.moe.fused_a2a": types.ModuleType("fused_a2a"),
        "megatron.core.models": types.ModuleType("megatron.core.models"),
        "megatron.core.models.gpt": types.ModuleType("megatron.core.models.gpt"),
        "megatron.core.models.gpt.moe_module_specs": types.ModuleType("specs"),
    }
    mods["megatron.core"].parallel_state = ps
    mods["megatron.core.tensor_parallel.random"].model_parallel_cuda_manual_seed = \
        lambda seed: log.update(seed=seed)
    mods["megatron.core.transformer.transformer_config"].TransformerConfig = FakeConfig
    mods["megatron.core.transformer.moe.fused_a2a"].reset_hybrid_ep_buffer = \
        lambda: log.update(reset_hybrid_ep=log["reset_hybrid_ep"] + 1)

    def get_fp8_context(config, layer_no=-1, is_init=False):
        log["fp8_context"] += 1
        return contextlib.nullcontext()

    mods["megatron.core.fp8_utils"].get_fp8_context = get_fp8_context

    def get_moe_module_spec(use_te=True, num_experts=None, moe_grouped_gemm=False):
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
    assert be.variant == "dispatcher=alltoall"  # every field is known to 0.19.2
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


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_hybridep_adapter_matches_reference(fake_megatron, monkeypatch, tmp_path, precision):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv(hm.SMS_ENV, "32")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    sc = Scenario(preset("tiny"), tokens_per_rank=16, world_size=1, precision=precision)
    weights, inputs = make_weights(sc, 0, "cpu"), make_inputs(sc, 0, "cpu")
    ref = reference_layer(inputs, weights)
    be = hm.HybridEPMegatronBackend()
    be.setup(sc, RunContext(), weights)
    c = be.config
    assert (c.moe_token_dispatcher_type, c.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert c.moe_flex_dispatcher_num_sms == 32 and c.moe_router_dtype == "fp32"
    fp8 = precision == "fp8"
    assert be.variant == "dispatcher=hybridep,sms=32" + (",recipe=Float8BlockScaling" if fp8
                                                         else "")
    assert be.pad_multiple == (16 if fp8 else 1)
    x = inputs.x_TH.clone().requires_grad_(True)
    p = inputs.topk_weights_TK.clone().requires_grad_(True)
    y = be.forward(x, inputs.topk_idx_TK, p)
    assert fake_megatron["fp8_context"] == int(fp8)
    fwd = check_forward(y, ref, precision)
    assert fwd.ok, fwd.reason()
    be.zero_grad()
    y.backward(inputs.dy_TH)
    bwd = check_backward(x.grad, p.grad, be.weight_grads(), ref, precision)
    assert bwd.ok, bwd.reason()
    if fp8:
        assert all(int(r) % 16 == 0 for r in be.rows_E)  # padded by the dispatcher
    be.check()  # padded counts are not drops
    be.teardown()
    assert fake_megatron["reset_hybrid_ep"] == 1 and fake_megatron["destroy"] == 1


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
