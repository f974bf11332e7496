"""TransformerEngine's MoE path as its users build it, with DeepEP or NCCL all-to-all around it.

Legend: T tokens on this rank, K top-k, H hidden, I intermediate, F = 2*I, W ranks, E local
experts, G = W*E global experts, R rows this rank's experts receive, M permuted expert rows.

Per rank: communication hands the experts R rows with a routing map [R, E] (bool) and dense
probs [R, E] (fp32); TE does the rest:

    moe_permute (bf16) | moe_permute_and_pad_with_probs (fp8: rows per expert padded to the
    recipe's alignment) -> GroupedLinear gate+up -> SwiGLU -> GroupedLinear down
    -> moe_unpermute(merging_probs=probs)  (router weights applied before the combine)

Communication (the row's ``variant`` says which): ``none`` on one rank (rows = tokens);
``deepep`` (DeepEP V1 dispatch/combine, when installed and W in 2/4/8); otherwise ``nccl_a2a``
(the all-to-all of nccl_torch: one row per routed token-slot, summed over K after the return).
$MOKBENCH_TE_COMM=deepep|nccl_a2a forces one. The shared expert is two te.pytorch.Linear.

Precision: bf16; fp8 = ``te.pytorch.autocast`` with Float8BlockScaling on SM90 and
MXFP8BlockScaling on SM100 (TE's grouped FP8 GEMM needs rows per expert padded, hence the
padded permute). TE GEMM weights are [out, in] (``common.out_in_layout``): weight{e} of fc1
is w1_EHF[e].T ([F, H]), of fc2 w2_EIH[e].T ([H, I]). Under fp8 the weights are quantised
once, in the first forward after setup (an untimed check), and TE's cached FP8 copies are used
from then on (``is_first_microbatch`` True, then False: what TE offers for microbatches
between weight updates, and what Megatron's TE wrappers do after their first call), as mok
quantises its weights once at setup; the variant says ``weights=cached``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from baselines.common import (
    canonical_layout,
    exchange_slot_counts,
    out_in_layout,
    received_local_experts,
    swiglu,
)
from baselines.nccl_torch import all_to_all_rows
from mokbench.backend import BackendBase, Capabilities, RunContext

INSTALL_HINT = "pip install 'mokbench[te]'"
COMM_ENV = "MOKBENCH_TE_COMM"
COMMS = ("deepep", "nccl_a2a")


def fp8_recipe_name(cc: tuple[int, int] | None) -> str | None:
    """TE's block-scaled FP8 recipe for this GPU: Float8BlockScaling on Hopper (9.x),
    MXFP8BlockScaling on Blackwell (10.x); None where neither runs."""
    if cc is None:
        return None
    return {9: "Float8BlockScaling", 10: "MXFP8BlockScaling"}.get(cc[0])


def fp8_align(recipe: str | None) -> int:
    """Divisibility TE's block-scaled GEMMs need of each dimension (the reduction one
    included): 32 for MXFP8's 32-element blocks, 16 otherwise."""
    return 32 if (recipe or "").startswith("MXFP8") else 16


def te_reason(precision: str, cc: tuple[int, int] | None, hidden: int, inter: int, *,
              installed: bool) -> str | None:
    """Why the TE baseline cannot run this cell (None when it can). Pure: facts passed in."""
    if not installed:
        return f"package 'transformer_engine' is not installed ({INSTALL_HINT})"
    if precision == "fp8":
        recipe = fp8_recipe_name(cc)
        if recipe is None:
            have = "no GPU" if cc is None else f"GPU has {cc[0]}.{cc[1]}"
            return ("fp8 needs compute capability 9.x (Float8BlockScaling) or 10.x "
                    f"(MXFP8BlockScaling); {have}")
        align = fp8_align(recipe)
        if hidden % align or inter % align:
            return f"{recipe} needs hidden and intermediate multiples of {align}"
    return None


def choose_comm(world_size: int, deepep_reason: str | None, forced: str = "") -> str:
    """Which communication the layer uses: ``none`` on one rank; $MOKBENCH_TE_COMM when set;
    else DeepEP where it can run (``deepep_reason`` is None), NCCL all-to-all otherwise."""
    if world_size == 1:
        return "none"
    if forced:
        if forced not in COMMS:
            raise ValueError(f"{COMM_ENV}={forced!r} is invalid: allowed {' | '.join(COMMS)}")
        return forced
    return "deepep" if deepep_reason is None else "nccl_a2a"


def dense_routing(idx_RK: torch.Tensor, w_RK: torch.Tensor, num_local: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map_RE bool, probs_RE fp32) from local expert ids (-1: not routed here) and
    their weights. Differentiable in ``w_RK``; -1 goes to a spare column that is dropped."""
    R = idx_RK.shape[0]
    col_RK = torch.where(idx_RK < 0, torch.full_like(idx_RK, num_local), idx_RK)
    zeros = torch.zeros(R, num_local + 1, dtype=torch.float32, device=idx_RK.device)
    probs_RE = zeros.scatter(1, col_RK, w_RK.float())[:, :num_local]
    routing_map_RE = torch.zeros(R, num_local + 1, dtype=torch.bool, device=idx_RK.device)
    routing_map_RE.scatter_(1, col_RK, True)
    return routing_map_RE[:, :num_local].contiguous(), probs_RE.contiguous()


class NcclA2A:
    """Slot-level all-to-all (the nccl_torch pattern): one row per routed (token, k)."""

    def __init__(self, ctx: RunContext, num_experts: int) -> None:
        self.ctx, self.G = ctx, num_experts

    def dispatch(self, x_TH, topk_idx_TK, topk_weights_TK):
        group = self.ctx.group
        T, K = topk_idx_TK.shape
        recv_WE, send, recv = exchange_slot_counts(topk_idx_TK, self.G, self.ctx.world_size,
                                                   group)
        order_S = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
        x_RH = all_to_all_rows(x_TH[order_S // K], recv, send, group)
        w_R1 = all_to_all_rows(topk_weights_TK.float().reshape(-1, 1)[order_S], recv, send, group)
        local_R1 = received_local_experts(recv_WE).unsqueeze(1)
        return x_RH, w_R1, local_R1, (order_S, send, recv, T, K)

    def combine(self, y_RH, handle):
        order_S, send, recv, T, K = handle
        y_SH = all_to_all_rows(y_RH, send, recv, self.ctx.group)
        y_TKH = torch.empty_like(y_SH).index_copy(0, order_S, y_SH).view(T, K, -1)
        return y_TKH.sum(1)


class TEBackend(BackendBase):
    """TransformerEngine permute + GroupedLinear experts, DeepEP or NCCL communication."""

    name = "te"
    capabilities = Capabilities(
        precisions=("bf16", "fp8"), min_cc=(8, 0), needs_gpu=True,
        notes="TE moe_permute/GroupedLinear/moe_unpermute; comm deepep or nccl_a2a; "
              "fp8 = Float8BlockScaling (SM90) / MXFP8BlockScaling (SM100)")

    def unavailable_reason(self, ctx: RunContext | None, scenario=None) -> str | None:
        installed = importlib.util.find_spec("transformer_engine") is not None
        cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        if scenario is not None:
            s = scenario.shape
            why = te_reason(scenario.precision, cc, s.hidden, s.intermediate, installed=installed)
            if why is None and os.environ.get(COMM_ENV) == "deepep":
                from baselines.deepep import deepep_status

                why = deepep_status(scenario.world_size, "bf16", s.hidden)
        else:
            why = te_reason("bf16", cc, 16, 16, installed=installed)
        return why or super().unavailable_reason(ctx, scenario)

    def setup(self, scenario, ctx, weights) -> None:
        import transformer_engine.pytorch as te

        from baselines.deepep import deepep_status

        self.te, self.ctx = te, ctx
        s = scenario.shape
        E, H, I = scenario.local_experts, s.hidden, s.intermediate
        kw = {"bias": False, "params_dtype": torch.bfloat16, "device": ctx.device}
        self.fc1 = te.GroupedLinear(E, H, 2 * I, **kw)
        self.fc2 = te.GroupedLinear(E, I, H, **kw)
        fc1, fc2 = out_in_layout(weights.w1_EHF), out_in_layout(weights.w2_EIH)
        self.shared: tuple[Any, Any] | None = None
        with torch.no_grad():
            for e in range(E):
                getattr(self.fc1, f"weight{e}").copy_(fc1[e])
                getattr(self.fc2, f"weight{e}").copy_(fc2[e])
            if weights.ws1_HF is not None:
                self.shared = (te.Linear(H, 2 * I, **kw), te.Linear(I, H, **kw))
                self.shared[0].weight.copy_(out_in_layout(weights.ws1_HF))
                self.shared[1].weight.copy_(out_in_layout(weights.ws2_IH))
        self.E, self.first = E, weights.first_expert
        self.recipe, self.align = self._recipe(scenario.precision)
        self.comm_name = choose_comm(ctx.world_size,
                                     deepep_status(ctx.world_size, "bf16", H),
                                     os.environ.get(COMM_ENV, ""))
        if self.comm_name == "deepep":
            from baselines.deepep import DeepEPComm

            self.comm: Any = DeepEPComm(ctx.group, s.num_experts, H, fp8=False)
        elif self.comm_name == "nccl_a2a":
            self.comm = NcclA2A(ctx, s.num_experts)
        else:
            self.comm = None
        recipe = ("" if self.recipe is None
                  else f",recipe={type(self.recipe).__name__},weights=cached")
        self.variant = f"comm={self.comm_name}{recipe}"
        self._weights_quantised = False  # fp8: TE caches its FP8 weights in the first forward

    def _recipe(self, precision: str) -> tuple[Any, int]:
        """(TE recipe or None, rows-per-expert alignment of the padded permute)."""
        if precision != "fp8":
            return None, 0
        from transformer_engine.common import recipe as te_recipe

        name = fp8_recipe_name(torch.cuda.get_device_capability())
        recipe = getattr(te_recipe, name)()
        try:
            from transformer_engine.pytorch.quantization import get_align_size_for_quantization

            return recipe, get_align_size_for_quantization(recipe)
        except ImportError:
            return recipe, 32 if name.startswith("MXFP8") else 16

    def _experts(self, x_RH, routing_map_RE, probs_RE, first: bool | None):
        """TE permute -> grouped SwiGLU FFN -> unpermute merged with probs: [R, H].
        ``first``: TE's ``is_first_microbatch`` (None in bf16)."""
        te = self.te
        pad = {}
        if self.recipe is not None:
            x_MH, _, row_id_map, pad_offsets, splits_E = te.moe_permute_and_pad_with_probs(
                x_RH, probs_RE, routing_map_RE, routing_map_RE.sum(0), self.align)
            m_splits = splits_E.tolist()
            if pad_offsets is not None:
                pad["pad_offsets"] = pad_offsets
        else:
            m_splits = routing_map_RE.sum(0).tolist()  # host sync: GroupedLinear splits
            if sum(m_splits) == 0:
                return x_RH * 0
            x_MH, row_id_map = te.moe_permute(x_RH, routing_map_RE, num_out_tokens=sum(m_splits))
        h_MF = self.fc1(x_MH, m_splits, is_first_microbatch=first)
        out_MH = self.fc2(swiglu(h_MF), m_splits, is_first_microbatch=first)
        return te.moe_unpermute(out_MH, row_id_map, merging_probs=probs_RE,
                                restore_shape=x_RH.shape, **pad)

    def _layer(self, x_TH, topk_idx_TK, topk_weights_TK, first: bool | None = None):
        if self.comm is None:
            routing_map, probs = dense_routing(topk_idx_TK - self.first, topk_weights_TK, self.E)
            y_TH = self._experts(x_TH, routing_map, probs, first)
        else:
            x_RH, w_RK, idx_RK, handle = self.comm.dispatch(x_TH, topk_idx_TK, topk_weights_TK)
            routing_map, probs = dense_routing(idx_RK, w_RK, self.E)
            y_TH = self.comm.combine(self._experts(x_RH, routing_map, probs, first), handle)
        if self.shared is not None:
            y_TH = y_TH + self._shared_expert(x_TH, first)
        return y_TH

    def _shared_expert(self, x_TH, first: bool | None):
        """The shared expert on all T tokens. Under fp8 its rows are padded with zeros to the
        recipe's alignment and cut back after: TE's block-scaled GEMMs need the reduction
        dimension divisible by 16, which in the weight-gradient GEMM is the token count
        ("Caller must pad"); zero rows add nothing to the outputs or the gradients."""
        T = x_TH.shape[0]
        pad = -T % self.align if self.recipe is not None else 0
        x_PH = torch.nn.functional.pad(x_TH, (0, 0, 0, pad)) if pad else x_TH
        return self.shared[1](swiglu(self.shared[0](x_PH, is_first_microbatch=first)),
                              is_first_microbatch=first)[:T]

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        if self.recipe is None:
            return self._layer(x_TH, topk_idx_TK, topk_weights_TK)
        # FP8 weights: quantised in the first forward, TE's cached copies afterwards
        first, self._weights_quantised = not self._weights_quantised, True
        with self.te.autocast(enabled=True, recipe=self.recipe):
            return self._layer(x_TH, topk_idx_TK, topk_weights_TK, first)

    def _modules(self) -> list[Any]:
        return [self.fc1, self.fc2, *(self.shared or ())]

    def weight_grads(self) -> dict[str, torch.Tensor]:
        E = self.E
        g1 = [getattr(self.fc1, f"weight{e}").grad for e in range(E)]
        g2 = [getattr(self.fc2, f"weight{e}").grad for e in range(E)]
        out: dict[str, torch.Tensor] = {}
        if all(g is not None for g in g1 + g2):
            out["w1_EHF"], out["w2_EIH"] = canonical_layout(g1), canonical_layout(g2)
        if self.shared is not None and self.shared[0].weight.grad is not None:
            out["ws1_HF"] = canonical_layout(self.shared[0].weight.grad)
            out["ws2_IH"] = canonical_layout(self.shared[1].weight.grad)
        return out

    def zero_grad(self) -> None:
        for m in self._modules():
            for p in m.parameters():
                p.grad = None

    def teardown(self) -> None:
        if getattr(self, "comm_name", "") == "deepep":
            torch.cuda.synchronize()  # no kernel may still use DeepEP's buffer
            self.comm.teardown()
        self.comm = None
        self.fc1 = self.fc2 = self.shared = None
        super().teardown()
