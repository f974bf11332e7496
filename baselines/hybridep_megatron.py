"""Megatron-Core MoELayer baselines: HybridEP flex dispatcher, and the alltoall dispatcher.

Legend: T tokens on this rank, K top-k, H hidden, I intermediate, F = 2*I, W ranks (= EP size),
E local experts, G = W*E global experts.

Built standalone as Megatron's own MoE unit tests build it: ``initialize_model_parallel(
expert_model_parallel_size=W)`` on the existing default process group,
``model_parallel_cuda_manual_seed``, a ``TransformerConfig`` (SwiGLU, no bias, bf16, fp32 router,
no load-balancing loss, fused permute, no capacity factor: dropless), and the layer from
``get_moe_module_spec(use_te=True, num_experts=G, moe_grouped_gemm=True)`` (TEGroupedMLP
experts). Input is [seq=T, batch=1, H]. Precision fp8: ``fp8="e4m3"`` with the block-scaled
recipe of the GPU (``blockwise`` = Float8BlockScaling on SM90, ``mxfp8`` on SM100), the layer
run inside Megatron's ``get_fp8_context(config)``.

Routing: Megatron computes its router from a learned gate; every backend here must see the
scenario's seeded routing, so ``layer.router`` is replaced by :class:`PresetRouter`, which
returns Megatron's router output format, dense probs [T, G] (fp32, zero off the top-k) and a
routing map [T, G] (bool), built from the given top-k. Gradients reach the router weights
through those probs.

Weights (``common.out_in_layout``): TEGroupedMLP ``linear_fc1.weight{e}`` is [F, H] with the
gate rows first (Megatron's GLU splits fc1's output with ``chunk(2)``: gate, then linear),
``linear_fc2.weight{e}`` is [H, I]; the shared expert's ``linear_fc1.weight`` /
``linear_fc2.weight`` likewise.

``check()`` (called by the worker outside the timed region) asserts that no token was dropped:
the rows Megatron handed the experts (``tokens_per_expert``, the experts' second argument) equal
the routed slots of all ranks for this rank's experts. With HybridEP at fp8 those counts are
already padded per expert to the FP8 GEMM alignment (HybridEP pads in its permute, and
TEGroupedMLP then skips its own padding), so they are compared with the routed slots rounded up.
Megatron's parallel state is global: set up once per process, destroyed in ``teardown``.

HybridEP (Megatron-Core 0.19.2 ``fused_a2a``, DeepEP branch hybrid-ep): Megatron builds one
``HybridEPBuffer`` lazily at the first dispatch (max tokens per rank = that call's tokens), with
``moe_flex_dispatcher_num_sms`` SMs for dispatch and for combine ($MOKBENCH_HYBRIDEP_SMS, default
24, HybridEP's own intranode default; the row's variant records it) and 108 for its metadata
preprocessing; it dispatches bf16 only (fp8 here means FP8 expert GEMMs). HybridEP compiles its
kernels at run time with ``$CUDA_HOME/bin/nvcc`` (it reads ``CUDA_HOME`` only), so ``setup`` sets
``CUDA_HOME`` from torch's ``cpp_extension.CUDA_HOME`` when it is unset; the first forward (the
check, outside the timed region) pays the compilation. Its kernels need hidden a multiple of 16 and
(local experts x ranks in the NVLink domain) a multiple of 4. A ``hybrid_ep_cpp`` that links
the C++ runtime statically crashes in ``HybridEPBuffer``'s constructor unless the shared
libstdc++ is preloaded (``native_libs``): the cell is then skipped with that fix as its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from typing import Any

import torch

from baselines.common import canonical_layout, out_in_layout
from baselines.deepep import BUILD_SCRIPT, build_recipe
from baselines.native_libs import elf_needed, static_cxx_runtime_reason
from baselines.transformer_engine import fp8_align, fp8_recipe_name, te_reason
from mokbench.backend import BackendBase, Capabilities, RunContext

INSTALL_HINT = "pip install 'mokbench[megatron]'"
HYBRIDEP_HINT = f"not on PyPI: build DeepEP's branch hybrid-ep with {BUILD_SCRIPT}"
SMS_ENV = "MOKBENCH_HYBRIDEP_SMS"
DEFAULT_SMS = 24  # HybridEP's Configurer default for dispatch and combine within one node
MAX_NVL_DOMAIN = 8  # GPUs of one H200/B200 node: the ranks HybridEP reaches over NVLink


def hybridep_sms(env: dict[str, str] | None = None) -> int:
    """SMs for HybridEP's dispatch and for its combine kernels (Megatron's
    ``moe_flex_dispatcher_num_sms``): $MOKBENCH_HYBRIDEP_SMS, default 24."""
    raw = (os.environ if env is None else env).get(SMS_ENV, "")
    try:
        n = int(raw) if raw.strip() else DEFAULT_SMS
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{SMS_ENV}={raw!r} is invalid: allowed a positive integer")
    return n


def hybridep_shape_reason(world_size: int, hidden: int, num_experts: int) -> str | None:
    """HybridEP's buffer-config checks for bf16 tokens (``BufferConfig.is_valid``): hidden a
    multiple of 16 (TMA rows) and local experts x ranks per NVLink domain a multiple of 4. Pure."""
    if hidden % 16:
        return f"HybridEP needs hidden a multiple of 16; hidden is {hidden}"
    local = num_experts // max(world_size, 1)
    ranks = min(world_size, MAX_NVL_DOMAIN)
    if (local * ranks) % 4:
        return (f"HybridEP needs local experts x ranks per node a multiple of 4; "
                f"{local} x {ranks} is not")
    return None


def jit_cuda_home(env: dict[str, str] | None = None) -> str | None:
    """The CUDA toolkit HybridEP's run-time compiler will use: $CUDA_HOME, else torch's guess
    (``torch.utils.cpp_extension.CUDA_HOME``: $CUDA_PATH, ``nvcc`` on PATH, /usr/local/cuda)."""
    env = os.environ if env is None else env
    if env.get("CUDA_HOME"):
        return env["CUDA_HOME"]
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME


def nvcc_reason(cuda_home: str | None, nvcc_exists: bool) -> str | None:
    """Why HybridEP cannot compile its kernels at run time (None when it can). Pure."""
    if not cuda_home:
        return ("HybridEP compiles its kernels at run time with $CUDA_HOME/bin/nvcc; no CUDA "
                "toolkit found (set CUDA_HOME)")
    if not nvcc_exists:
        return f"HybridEP compiles its kernels at run time; {cuda_home}/bin/nvcc does not exist"
    return None


def cpath_with(cpath: str | None, include_dir: str) -> str:
    """``cpath`` (a $CPATH value) with ``include_dir`` appended unless already there. Pure."""
    parts = [d for d in (cpath or "").split(os.pathsep) if d]
    return os.pathsep.join(parts if include_dir in parts else [*parts, include_dir])


def ensure_jit_nvcc() -> None:
    """Export ``CUDA_HOME`` for HybridEP's compiler (which reads only that variable) or raise a
    one-line RuntimeError naming what is missing. Where CUDA 13 keeps CCCL apart
    (``include/cccl``, with ``<cuda/ptx>`` that HybridEP's kernels include), that folder joins
    $CPATH too, as for building DeepEP: harmless where nvcc finds it by itself."""
    home = jit_cuda_home()
    why = nvcc_reason(home, bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc")))
    if why:
        raise RuntimeError(why)
    os.environ.setdefault("CUDA_HOME", home)
    cccl = os.path.join(home, "include", "cccl")
    if os.path.isdir(cccl):
        os.environ["CPATH"] = cpath_with(os.environ.get("CPATH"), cccl)


def installed(module: str) -> bool:
    """Whether ``module`` (dotted names too) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def hybridep_import_error() -> str | None:
    """Why ``from deep_ep import HybridEPBuffer`` (what Megatron's ``fused_a2a`` imports) fails:
    None when it works, "" when ``deep_ep`` is not installed or lacks HybridEPBuffer, else the
    import's one-line error (a broken build: missing ``hybrid_ep_cpp``, undefined symbols)."""
    if not installed("deep_ep"):
        return ""
    try:
        import deep_ep
    except Exception as exc:  # noqa: BLE001 - any failure to import is the reason
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}"
    return None if hasattr(deep_ep, "HybridEPBuffer") else ""


def hybridep_runtime_reason(env: dict[str, str] | None = None) -> str | None:
    """Why the installed ``hybrid_ep_cpp`` would crash in this process (a build that linked
    the C++ runtime statically, without the shared one preloaded: ``native_libs``), or None
    (also when it cannot be found or read). ``env``: default ``os.environ``."""
    try:
        spec = importlib.util.find_spec("hybrid_ep_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    env = os.environ if env is None else env
    return static_cxx_runtime_reason(elf_needed(spec.origin), env.get("LD_PRELOAD"))


def hybridep_installed() -> bool:
    """Whether the installed ``deep_ep`` has ``HybridEPBuffer`` (DeepEP's hybrid-ep branch)."""
    return hybridep_import_error() is None


def megatron_reason(world_size: int, *, hybridep: bool, has_megatron: bool, has_te: bool,
                    has_hybridep: bool = False, hybridep_error: str = "") -> str | None:
    """Why a Megatron baseline cannot run this cell (None when it can). Pure: facts passed in;
    ``hybridep_error``: why ``deep_ep`` with HybridEPBuffer failed to import, if it did."""
    if not has_megatron:
        return f"package 'megatron.core' is not installed ({INSTALL_HINT})"
    if not has_te:
        return ("package 'transformer_engine' is not installed (Megatron's grouped experts need "
                f"it; {INSTALL_HINT})")
    if hybridep:
        if not has_hybridep:
            if hybridep_error:
                return f"package 'deep_ep' does not import: {hybridep_error}"
            return f"package 'deep_ep' with HybridEPBuffer is not installed ({HYBRIDEP_HINT})"
        if world_size < 2:
            return f"HybridEP needs at least 2 GPUs (world size {world_size})"
    return None


FP8_RECIPES = {"Float8BlockScaling": "blockwise", "MXFP8BlockScaling": "mxfp8"}


def config_kwargs(scenario: Any, dispatcher: str, num_sms: int | None = None,
                  fp8_recipe: str | None = None) -> dict[str, Any]:
    """TransformerConfig arguments for one scenario. ``dispatcher``: "hybridep" (flex) or
    "alltoall". Dropless (no capacity factors), no aux loss, bf16 with an fp32 router.
    ``fp8_recipe`` (a TE recipe name, for precision fp8): Megatron's e4m3 training with that
    recipe; the grouped experts pad each expert's rows to the recipe's alignment themselves."""
    import torch.nn.functional as F

    s = scenario.shape
    kw: dict[str, Any] = dict(
        num_layers=1, hidden_size=s.hidden, num_attention_heads=1, ffn_hidden_size=s.intermediate,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=scenario.world_size,
        num_moe_experts=s.num_experts, moe_router_topk=s.topk, moe_ffn_hidden_size=s.intermediate,
        moe_grouped_gemm=True, moe_permute_fusion=True, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        moe_shared_expert_intermediate_size=s.intermediate if scenario.shared_expert else None,
        moe_shared_expert_overlap=False,
    )
    if scenario.precision == "fp8":
        if fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe={fp8_recipe!r} is invalid: allowed "
                             f"{' | '.join(FP8_RECIPES)}")
        kw.update(fp8="e4m3", fp8_recipe=FP8_RECIPES[fp8_recipe])
    if dispatcher == "hybridep":
        kw.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                  moe_expert_rank_capacity_factor=None)
        if num_sms is not None:
            kw["moe_flex_dispatcher_num_sms"] = num_sms
    elif dispatcher == "alltoall":
        kw["moe_token_dispatcher_type"] = "alltoall"
    else:
        raise ValueError(f"dispatcher={dispatcher!r} is invalid: allowed hybridep | alltoall")
    return kw


def known_kwargs(kwargs: dict[str, Any], field_names: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Split ``kwargs`` into those TransformerConfig has and the names it lacks (fields move
    between Megatron releases; a missing optional knob is dropped rather than fatal)."""
    kept = {k: v for k, v in kwargs.items() if k in field_names}
    return kept, sorted(set(kwargs) - set(kept))


def preset_router_outputs(topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                          num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's router output from a given top-k: (probs_TG fp32 dense, routing_map_TG bool).
    Differentiable in ``topk_weights_TK``."""
    T = topk_idx_TK.shape[0]
    zeros = torch.zeros(T, num_experts, dtype=torch.float32, device=topk_idx_TK.device)
    probs_TG = zeros.scatter(1, topk_idx_TK, topk_weights_TK.float())
    routing_map_TG = torch.zeros(T, num_experts, dtype=torch.bool, device=topk_idx_TK.device)
    return probs_TG, routing_map_TG.scatter_(1, topk_idx_TK, True)


def padded_rows(rows: int, pad_multiple: int) -> int:
    """``rows`` rounded up to a multiple of ``pad_multiple`` (0 stays 0), as HybridEP pads each
    expert's rows for FP8 GEMMs."""
    return -(-rows // pad_multiple) * pad_multiple


def dropped_tokens(expected_E: list[int], got_E: list[int], pad_multiple: int = 1) -> int:
    """Routed slots the experts did not receive (0 when dropless); a mismatch in the number of
    experts or extra rows is an error too, reported as a ValueError. ``pad_multiple`` > 1: the
    counts ``got_E`` include padding up to that multiple, and a missing slot can only be seen
    where it lowers the padded count."""
    want_E = [padded_rows(e, pad_multiple) for e in expected_E]
    if len(want_E) != len(got_E) or any(g > w for w, g in zip(want_E, got_E)):
        raise ValueError(f"rows per local expert {got_E} do not match the routing {expected_E}"
                         + (f" padded to {pad_multiple}" if pad_multiple > 1 else ""))
    return sum(w - g for w, g in zip(want_E, got_E))


def fp8_shared_tokens_reason(scenario, cc: tuple[int, int] | None) -> str | None:
    """Megatron's shared expert runs on all tokens of the rank, unpadded; TE's block-scaled
    GEMMs need the reduction dimension divisible by 16 (32 for MXFP8), and in the shared
    expert's weight-gradient GEMM that is the token count ("Caller must pad" from TE)."""
    if not scenario.shared_expert:
        return None
    align = fp8_align(fp8_recipe_name(cc))
    if scenario.tokens_per_rank % align:
        return (f"tokens_per_rank={scenario.tokens_per_rank} with the shared expert at fp8: "
                f"allowed a multiple of {align} (TE's block-scaled GEMMs; Megatron does not "
                "pad the shared expert's tokens)")
    return None


class PresetRouter(torch.nn.Module):
    """Stands in for Megatron's TopKRouter: returns the probs/routing map set by ``set``."""

    def __init__(self) -> None:
        super().__init__()
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None

    def set(self, probs_TG: torch.Tensor, routing_map_TG: torch.Tensor) -> None:
        self.out = (probs_TG, routing_map_TG)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Any = None):
        assert self.out is not None and self.out[0].shape[0] == hidden_states.numel() // \
            hidden_states.shape[-1], "routing was not set for this input"
        return self.out

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number


def _build_layer(config: Any, num_experts: int) -> Any:
    """The MoELayer from Megatron's TE MoE spec (a partial in 0.19, a ModuleSpec before)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=True, num_experts=num_experts, moe_grouped_gemm=True)
    if callable(spec):
        return spec(config=config)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(spec, config=config)


class HybridEPMegatronBackend(BackendBase):
    """Megatron-Core MoELayer, flex dispatcher with the HybridEP backend."""

    name = "hybridep_megatron"
    dispatcher = "hybridep"
    capabilities = Capabilities(
        precisions=("bf16", "fp8"), world_sizes=None, min_cc=(9, 0), needs_gpu=True,
        notes="Megatron-Core MoELayer, flex/HybridEP dispatcher, TEGroupedMLP; preset routing")

    def unavailable_reason(self, ctx: RunContext | None, scenario=None) -> str | None:
        ws = scenario.world_size if scenario is not None else (ctx.world_size if ctx else 1)
        hybridep = self.dispatcher == "hybridep"
        error = hybridep_import_error() if hybridep else ""
        why = megatron_reason(ws, hybridep=hybridep, has_megatron=installed("megatron.core"),
                              has_te=installed("transformer_engine"),
                              has_hybridep=hybridep and error is None,
                              hybridep_error=error or "")
        if why is None and hybridep:
            why = hybridep_runtime_reason()
            if why is None:
                home = jit_cuda_home()
                why = nvcc_reason(home, bool(home) and os.path.isfile(os.path.join(home, "bin",
                                                                                   "nvcc")))
            if why is None and scenario is not None:
                s = scenario.shape
                why = hybridep_shape_reason(ws, s.hidden, s.num_experts)
        if why is None and scenario is not None and scenario.precision == "fp8":
            cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
            s = scenario.shape
            why = te_reason("fp8", cc, s.hidden, s.intermediate, installed=True)
            why = why or fp8_shared_tokens_reason(scenario, cc)
        return why or super().unavailable_reason(ctx, scenario)

    def install_hint(self) -> str | None:
        """The build recipe while HybridEP is missing (whatever else is), else None."""
        if self.dispatcher != "hybridep" or hybridep_installed():
            return None
        return build_recipe("hybrid-ep", "HybridEPBuffer and the V1 Buffer")

    def setup(self, scenario, ctx, weights) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                expert_model_parallel_size=ctx.world_size)
        model_parallel_cuda_manual_seed(scenario.seed)
        hybridep = self.dispatcher == "hybridep"
        sms = hybridep_sms() if hybridep else None
        if hybridep:
            ensure_jit_nvcc()
        recipe = (fp8_recipe_name(torch.cuda.get_device_capability())
                  if scenario.precision == "fp8" else None)
        kw = config_kwargs(scenario, self.dispatcher, sms, recipe)
        kw, dropped = known_kwargs(kw, {f.name for f in dataclasses.fields(TransformerConfig)})
        G = scenario.shape.num_experts
        self.config = TransformerConfig(**kw)
        self.layer = _build_layer(self.config, G)
        self.layer.router = PresetRouter()
        self.G, self.E, self.first = G, scenario.local_experts, weights.first_expert
        # HybridEP pads each expert's rows for FP8 GEMMs (Megatron's
        # get_align_size_for_quantization: 16, 32 for MXFP8); alltoall pads inside the experts.
        self.pad_multiple = fp8_align(recipe) if hybridep and recipe else 1
        self._copy_weights(weights)
        self.rows_E: Any = None
        self.last_idx: torch.Tensor | None = None
        self.layer.experts.register_forward_pre_hook(self._record_rows)
        self.variant = (f"dispatcher={self.dispatcher}" + (f",sms={sms}" if sms else "")
                        + (f",recipe={recipe}" if recipe else "")
                        + (f",dropped_config={'/'.join(dropped)}" if dropped else ""))

    def _record_rows(self, module: Any, args: tuple) -> None:
        """Keep the experts' tokens_per_expert (no host sync here; read in ``check``)."""
        self.rows_E = args[1]

    def _copy_weights(self, weights) -> None:
        fc1, fc2 = out_in_layout(weights.w1_EHF), out_in_layout(weights.w2_EIH)
        ex = self.layer.experts
        with torch.no_grad():
            for e in range(self.E):
                getattr(ex.linear_fc1, f"weight{e}").copy_(fc1[e])
                getattr(ex.linear_fc2, f"weight{e}").copy_(fc2[e])
            if weights.ws1_HF is not None:
                self.layer.shared_experts.linear_fc1.weight.copy_(out_in_layout(weights.ws1_HF))
                self.layer.shared_experts.linear_fc2.weight.copy_(out_in_layout(weights.ws2_IH))

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        T, H = x_TH.shape
        self.layer.router.set(*preset_router_outputs(topk_idx_TK, topk_weights_TK, self.G))
        self.last_idx = topk_idx_TK
        with self._fp8_context():
            out_SBH, _bias = self.layer(x_TH.view(T, 1, H))
        return out_SBH.view(T, H)

    def _fp8_context(self) -> Any:
        """Megatron's own FP8 autocast for this config (a null context in bf16)."""
        if not getattr(self.config, "fp8", None):
            return contextlib.nullcontext()
        from megatron.core.fp8_utils import get_fp8_context

        return get_fp8_context(self.config)

    def check(self) -> None:
        """Raise if Megatron dropped any routed token-slot on this rank's experts."""
        import torch.distributed as dist

        if self.last_idx is None or self.rows_E is None:
            return
        counts_G = torch.bincount(self.last_idx.reshape(-1), minlength=self.G)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts_G)
        expected = counts_G[self.first:self.first + self.E].tolist()
        rows = self.rows_E
        got = rows.tolist() if isinstance(rows, torch.Tensor) else [int(r) for r in rows]
        n = dropped_tokens(expected, got, getattr(self, "pad_multiple", 1))
        if n:
            raise RuntimeError(f"Megatron dropped {n} routed token-slots on rank's experts")

    def weight_grads(self) -> dict[str, torch.Tensor]:
        ex = self.layer.experts
        g1 = [getattr(ex.linear_fc1, f"weight{e}").grad for e in range(self.E)]
        g2 = [getattr(ex.linear_fc2, f"weight{e}").grad for e in range(self.E)]
        out: dict[str, torch.Tensor] = {}
        if all(g is not None for g in g1 + g2):
            out["w1_EHF"], out["w2_EIH"] = canonical_layout(g1), canonical_layout(g2)
        shared = getattr(self.layer, "shared_experts", None)
        if shared is not None and shared.linear_fc1.weight.grad is not None:
            out["ws1_HF"] = canonical_layout(shared.linear_fc1.weight.grad)
            out["ws2_IH"] = canonical_layout(shared.linear_fc2.weight.grad)
        return out

    def zero_grad(self) -> None:
        for p in self.layer.parameters():
            p.grad = None

    def teardown(self) -> None:
        from megatron.core import parallel_state

        if self.dispatcher == "hybridep":
            try:
                from megatron.core.transformer.moe.fused_a2a import reset_hybrid_ep_buffer
            except ImportError:
                reset_hybrid_ep_buffer = None
            if reset_hybrid_ep_buffer is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # no HybridEP kernel may still use its buffers
                reset_hybrid_ep_buffer()  # drops Megatron's global HybridEPBuffer (frees it)
        self.layer = None
        parallel_state.destroy_model_parallel()
        super().teardown()


class MegatronAlltoallBackend(HybridEPMegatronBackend):
    """The same MoELayer with Megatron's alltoall dispatcher: runs on any world size, one GPU
    included, and where HybridEP is not installed."""

    name = "megatron_alltoall"
    dispatcher = "alltoall"
    capabilities = Capabilities(
        precisions=("bf16", "fp8"), min_cc=(8, 0), needs_gpu=True,
        notes="Megatron-Core MoELayer, alltoall dispatcher, TEGroupedMLP; preset routing")
