"""Pieces several baselines share: the weight layout of their GEMMs, expert weights as
parameters, the grouped SwiGLU FFN, and the token-slot count exchange of an all-to-all layer.

Legend: M rows grouped by expert, T tokens on this rank, K top-k, H hidden, I intermediate,
F = 2*I, W ranks, E local experts, G = W*E global experts, R rows received.

Weights: the canonical (math) layout is [in, out] per GEMM (y = x @ w: w1_EHF, w2_EIH); the
libraries' GEMMs hold [out, in] (torch.nn.Linear, TransformerEngine's GroupedLinear and
Linear, Megatron's TEGroupedMLP, and the "K-major" layout the Hopper/Blackwell grouped GEMM
reads fastest). :func:`out_in_layout` converts one way, :func:`canonical_layout` back (also
for gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mokbench.inputs import MoEWeights


def out_in_layout(w_in_out: torch.Tensor) -> torch.Tensor:
    """A canonical weight [..., in, out] as [..., out, in], contiguous: w1_EHF -> [E, F, H]
    (gate rows first, then up), w2_EIH -> [E, H, I], shared [F, H] / [H, I]."""
    return w_in_out.transpose(-1, -2).contiguous()


def canonical_layout(w_out_in: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`out_in_layout` (a view), for weights and their gradients; a sequence
    of per-expert [out, in] tensors is stacked first."""
    if not isinstance(w_out_in, torch.Tensor):
        w_out_in = torch.stack(list(w_out_in))
    return w_out_in.transpose(-1, -2)


def expert_params(weights: MoEWeights) -> dict[str, torch.nn.Parameter]:
    """Trainable copies in the [out, in] layout: w1_EFH [E, F, H], w2_EHI [E, H, I], shared
    ws1_FH, ws2_HI."""
    p = {"w1_EFH": out_in_layout(weights.w1_EHF), "w2_EHI": out_in_layout(weights.w2_EIH)}
    if weights.ws1_HF is not None:
        p["ws1_FH"] = out_in_layout(weights.ws1_HF)
        p["ws2_HI"] = out_in_layout(weights.ws2_IH)
    return {k: torch.nn.Parameter(v) for k, v in p.items()}


_CANONICAL = {"w1_EFH": "w1_EHF", "w2_EHI": "w2_EIH", "ws1_FH": "ws1_HF", "ws2_HI": "ws2_IH"}


def canonical_grads(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Grads of ``expert_params`` in the canonical (math) layout."""
    return {_CANONICAL[k]: canonical_layout(p.grad) for k, p in params.items()
            if p.grad is not None}


class SlotCounts(NamedTuple):
    """Token-slot counts of one all-to-all layer step on this rank.

    recv_WE: slots each source rank sends to each local expert (device tensor [W, E]);
    send / recv: slots this rank sends to / receives from each rank (host lists, the split
    sizes of ``all_to_all_single``).
    """

    recv_WE: torch.Tensor
    send: list[int]
    recv: list[int]


def exchange_slot_counts(topk_idx_TK: torch.Tensor, num_experts: int, world_size: int,
                         group: dist.ProcessGroup | None) -> SlotCounts:
    """Count this rank's token-slots per global expert, ``all_to_all_single`` the counts (a
    copy on one rank), and read the split sizes on the host (one host sync, as every
    all-to-all EP layer does). Experts are rank-major: global expert g lives on rank g // E."""
    W, E = world_size, num_experts // world_size
    counts_G = torch.bincount(topk_idx_TK.reshape(-1), minlength=num_experts)
    recv_G = torch.empty_like(counts_G)
    if W > 1:
        dist.all_to_all_single(recv_G, counts_G, group=group)
    else:
        recv_G.copy_(counts_G)
    recv_WE = recv_G.view(W, E)
    return SlotCounts(recv_WE, counts_G.view(W, E).sum(1).tolist(), recv_WE.sum(1).tolist())


def received_local_experts(recv_WE: torch.Tensor) -> torch.Tensor:
    """Local expert of every received row [R], rows ordered [source rank][local expert] (as
    ``all_to_all_single`` delivers slots sorted by global expert)."""
    W, E = recv_WE.shape
    return torch.repeat_interleave(torch.arange(E, device=recv_WE.device).repeat(W),
                                   recv_WE.reshape(-1))


def swiglu(h_MF: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with gate = first half of the columns, up = second half."""
    gate, up = h_MF.chunk(2, dim=-1)
    return F.silu(gate) * up


def shared_expert(x_TH: torch.Tensor, ws1_FH: torch.Tensor, ws2_HI: torch.Tensor) -> torch.Tensor:
    return swiglu(x_TH @ ws1_FH.t()) @ ws2_HI.t()


def grouped_mm(x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
               counts: list[int] | None) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ w[e].T. ``torch._grouped_mm`` on CUDA (fast path for
    bf16 on SM90/SM100); a per-expert loop elsewhere, where grouped_mm has no fast path
    (``counts`` must then be the host list of rows per expert)."""
    if x_MK.is_cuda:
        return torch._grouped_mm(x_MK, w_ENK.transpose(-2, -1), offs=offs_E)
    assert counts is not None, "CPU grouped_mm needs host-side counts"
    outs = [xs @ w_ENK[e].t() for e, xs in enumerate(torch.split(x_MK, counts))]
    return torch.cat(outs) if outs else x_MK.new_empty(0, w_ENK.shape[1])


def grouped_swiglu_ffn(x_MH: torch.Tensor, counts_E: torch.Tensor, w1_EFH: torch.Tensor,
                       w2_EHI: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
    """Expert FFN over rows grouped by expert; ``counts_E`` rows per expert (device tensor)."""
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    h_MF = grouped_mm(x_MH, w1_EFH, offs_E, counts)
    return grouped_mm(swiglu(h_MF), w2_EHI, offs_E, counts)
