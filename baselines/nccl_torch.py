"""NCCL + PyTorch baseline, built the way the published MoK benchmark built it.

Legend: T tokens on this rank, K top-k, H hidden, W ranks, E local experts, S = T*K token-slots
sent, R token-slots received.

1. count token-slots per global expert; all_to_all_single the counts (-> what each source sends
   to each local expert); host-side split sizes (one host sync, as every all-to-all EP does);
2. sort the slots by global expert (= by destination rank, then local expert) and
   all_to_all_single the token rows;
3. regroup the received rows by local expert; ``torch._grouped_mm`` fused gate+up, SwiGLU,
   ``torch._grouped_mm`` down (a per-expert loop on CPU, where grouped_mm has no fast path);
4. all_to_all_single back, unsort, router-weighted sum (bmm over K), plus the shared expert.

Backward is autograd through ``torch.distributed.nn.functional.all_to_all_single``. Runs over
NCCL on GPUs and gloo on CPU. ``nccl_torch_compile`` wraps the same forward in torch.compile.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from baselines.common import (
    canonical_grads,
    exchange_slot_counts,
    expert_params,
    grouped_swiglu_ffn,
    received_local_experts,
    shared_expert,
)
from mokbench.backend import BackendBase, Capabilities, RunContext


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all_to_all_single of rows (identity on one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    return all_to_all_single(out, x, out_splits, in_splits, group=group)


def moe_alltoall_forward(x_TH, topk_idx_TK, topk_weights_TK, params, ctx: RunContext,
                         num_experts: int) -> torch.Tensor:
    """The whole layer for one rank (autograd-capable)."""
    T, K = topk_idx_TK.shape
    group = ctx.group
    recv_counts_WE, send_splits, recv_splits = exchange_slot_counts(
        topk_idx_TK, num_experts, ctx.world_size, group)

    order_S = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
    x_sent_SH = x_TH[order_S // K]
    x_recv_RH = all_to_all_rows(x_sent_SH, recv_splits, send_splits, group)

    # Received rows are ordered [source rank][local expert]; group them by local expert.
    perm_R = torch.argsort(received_local_experts(recv_counts_WE), stable=True)
    counts_E = recv_counts_WE.sum(0)
    host_counts = counts_E.tolist() if not x_TH.is_cuda else None
    out_RH = grouped_swiglu_ffn(x_recv_RH[perm_R], counts_E, params["w1_EFH"], params["w2_EHI"],
                                host_counts)
    out_back_RH = torch.empty_like(out_RH).index_copy(0, perm_R, out_RH)
    out_SH = all_to_all_rows(out_back_RH, send_splits, recv_splits, group)
    out_TKH = torch.empty_like(out_SH).index_copy(0, order_S, out_SH).view(T, K, -1)
    y_TH = torch.bmm(topk_weights_TK.to(out_TKH.dtype).unsqueeze(1), out_TKH).squeeze(1)
    if "ws1_FH" in params:
        y_TH = y_TH + shared_expert(x_TH, params["ws1_FH"], params["ws2_HI"])
    return y_TH


class NcclTorchBackend(BackendBase):
    """Eager NCCL (or gloo) all-to-all + torch grouped GEMM."""

    name = "nccl_torch"
    capabilities = Capabilities(notes="all_to_all_single + torch._grouped_mm; gloo on CPU")

    def setup(self, scenario, ctx, weights) -> None:
        self.ctx = ctx
        self.num_experts = scenario.shape.num_experts
        self.params = expert_params(weights)
        self._fn = moe_alltoall_forward

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        return self._fn(x_TH, topk_idx_TK, topk_weights_TK, self.params, self.ctx,
                        self.num_experts)

    def weight_grads(self):
        return canonical_grads(self.params)


# torch.compile's modes (``torch.compile(mode=...)``).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode(options: dict, is_cuda: bool) -> str:
    """The compiled baseline's mode: the variant's ``mode`` option
    (``nccl_torch_compile@mode=default``), else $MOKBENCH_COMPILE_MODE, else
    max-autotune-no-cudagraphs on GPUs (the token counts change every step, so CUDA graphs
    would re-record) and default on CPU. Its autotuning can take longer than a sweep's cell
    limit at large expert counts (over 300 s per cell on one H200 at 48 experts x 16384 tokens,
    results/20261201-165800-h200-bf16-train), hence the option for a sweep file."""
    mode = options.get("mode") or os.environ.get("MOKBENCH_COMPILE_MODE") or (
        "max-autotune-no-cudagraphs" if is_cuda else "default")
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode={mode!r} is invalid: allowed {' | '.join(COMPILE_MODES)}")
    return mode


class NcclTorchCompileBackend(NcclTorchBackend):
    """The same layer under torch.compile, as its users run it (graph breaks at the host-side
    split sizes), in the mode of ``compile_mode``. The mode is the row's variant
    (``mode=...``), so runs made in different modes are told apart."""

    name = "nccl_torch_compile"
    capabilities = Capabilities(notes="torch.compile of nccl_torch; compiled before timing")

    def validate_options(self, scenario, options: dict) -> None:
        """One option, ``mode`` (one of ``COMPILE_MODES``); a one-line error otherwise."""
        for key in options:
            if key != "mode":
                raise ValueError(f"option {key!r} is unknown: allowed mode "
                                 f"({' | '.join(COMPILE_MODES)})")
        compile_mode(options, False)

    def setup(self, scenario, ctx, weights) -> None:
        super().setup(scenario, ctx, weights)
        mode = compile_mode(ctx.extra.get("options", {}), ctx.is_cuda)
        self._fn = torch.compile(moe_alltoall_forward, mode=mode, dynamic=True)
        self.variant = f"mode={mode}"
