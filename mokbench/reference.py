"""The MoE layer in plain PyTorch with float32 math: ground truth for every backend.

Legend: T tokens per rank, W ranks, N = W*T tokens of all ranks, H hidden, I intermediate,
F = 2*I, K top-k, E local experts.

The layer (per token t with routed experts e_k and router weights p_k):
    y_t = sum_k p_k * FFN_{e_k}(x_t) + FFN_shared(x_t),  FFN(x) = (silu(x W_g) * (x W_u)) W_d.

Distributed form, using only simple collectives: every rank all-gathers x, routing and dy,
computes the contributions of its own experts for all N tokens, and an all-reduce sums the
contributions of all ranks. Gradients follow from autograd on that float32 graph, expert by
expert so that memory stays at one expert's float32 weights at a time.

Reference weight gradients are kept for at most ``max_checked_experts`` local experts (evenly
spaced, first and last included): at full size the float32 copies of every expert's gradient
would not fit next to the backend's own state.

One process holding every token and every expert (one rank, or loopback ranks, as the kernel
tests run them) uses :func:`reference_all_experts`, the same per-expert loop without
collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mokbench.inputs import MoEInputs, MoEWeights


@dataclass
class ReferenceResult:
    """Float32 reference outputs for this rank (``reference_all_experts``: for all N tokens)."""

    y_TH: torch.Tensor
    dx_TH: torch.Tensor | None = None
    dprobs_TK: torch.Tensor | None = None
    # weight name -> float32 gradient; expert-indexed names hold only ``checked_experts``.
    dweights: dict[str, torch.Tensor] | None = None
    checked_experts: list[int] | None = None


def checked_expert_ids(num_local: int, max_checked: int) -> list[int]:
    """Evenly spaced local expert ids, first and last included, at most ``max_checked``."""
    if num_local <= max_checked:
        return list(range(num_local))
    step = (num_local - 1) / (max_checked - 1)
    return sorted({round(i * step) for i in range(max_checked)})


def swiglu_ffn(x_MH: torch.Tensor, w1_HF: torch.Tensor, w2_IH: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert: silu(x W_gate) * (x W_up), then W_down. Works in the dtype it is given."""
    h_MF = x_MH @ w1_HF
    inter = w2_IH.shape[0]
    return (F.silu(h_MF[:, :inter]) * h_MF[:, inter:]) @ w2_IH


def _all_gather_cat(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A float32 copy of ``t`` that autograd treats as an input."""
    return t.detach().to(torch.float32, copy=True).requires_grad_(requires_grad)


def _routed_experts(x_NH: torch.Tensor, idx_NK: torch.Tensor, p_NK: torch.Tensor,
                    w1_EHF: torch.Tensor, w2_EIH: torch.Tensor, dy_NH: torch.Tensor | None,
                    grad_experts: list[int]
                    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The routed experts in float32, one expert at a time (one expert's float32 weights in
    memory at once): y [N, H]. ``idx_NK`` indexes ``w1_EHF`` / ``w2_EIH``; ids outside
    [0, E) (other ranks' experts) are skipped. With ``dy_NH``, each expert's rows are
    back-propagated as they are computed (into ``x_NH.grad`` and ``p_NK.grad``), and the
    float32 weight gradients of the experts in ``grad_experts`` are returned, in that order."""
    backward = dy_NH is not None
    E, K = w1_EHF.shape[0], idx_NK.shape[1]
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(-1, E).add(1), minlength=E + 2)[1:E + 1].tolist()
    start = int((flat < 0).sum())  # slots of experts below ours sort first (negative ids)
    dw1: list[torch.Tensor] = []
    dw2: list[torch.Tensor] = []
    y_NH = torch.zeros_like(x_NH, dtype=torch.float32).detach()

    for e in range(E):
        slots = order[start:start + counts[e]]
        start += counts[e]
        tok, kk = slots // K, slots % K
        w1 = w1_EHF[e].float().requires_grad_(backward and e in grad_experts)
        w2 = w2_EIH[e].float().requires_grad_(backward and e in grad_experts)
        with torch.set_grad_enabled(backward):
            out = swiglu_ffn(x_NH[tok], w1, w2) * p_NK[tok, kk].unsqueeze(1)
            y_NH.index_add_(0, tok, out.detach())
            if backward and len(tok) > 0:
                (out * dy_NH[tok]).sum().backward()
        if backward and e in grad_experts:
            dw1.append(w1.grad if w1.grad is not None else torch.zeros_like(w1))
            dw2.append(w2.grad if w2.grad is not None else torch.zeros_like(w2))
    return y_NH, dw1, dw2


def _shared_expert(x_NH: torch.Tensor, rows: slice, ws1_HF: torch.Tensor, ws2_IH: torch.Tensor,
                   dy_NH: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The shared expert in float32 on ``x_NH[rows]``: (y, dws1, dws2); with ``dy_NH`` its
    backward runs too (into ``x_NH.grad``) and the weight gradients are returned."""
    backward = dy_NH is not None
    ws1 = ws1_HF.float().requires_grad_(backward)
    ws2 = ws2_IH.float().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        out = swiglu_ffn(x_NH[rows], ws1, ws2)
        if backward:
            (out * dy_NH[rows]).sum().backward()
    return out.detach(), ws1.grad, ws2.grad


def reference_all_experts(x_NH: torch.Tensor, topk_idx_NK: torch.Tensor,
                          router_weights_NK: torch.Tensor, w1_EHF: torch.Tensor,
                          w2_EIH: torch.Tensor, ws1_HF: torch.Tensor | None = None,
                          ws2_IH: torch.Tensor | None = None, *,
                          dy_NH: torch.Tensor | None = None) -> ReferenceResult:
    """The layer in one process over all N tokens and all E experts (one rank, or loopback
    ranks with rank-major rows): ``topk_idx_NK`` holds global expert ids into
    ``w1_EHF`` [E, H, 2I] / ``w2_EIH`` [E, I, H]; ``ws1_HF`` / ``ws2_IH`` the shared expert
    or None. Returns y [N, H] float32 and, with ``dy_NH``, dx [N, H], the router-weight
    gradient [N, K] and every weight gradient (float32, names as ``MoEWeights.tensors``,
    all E experts) through float32 autograd."""
    backward = dy_NH is not None
    x = _leaf(x_NH, backward)
    p = _leaf(router_weights_NK, backward)
    dy = dy_NH.float() if backward else None
    experts = list(range(w1_EHF.shape[0]))
    y, dw1, dw2 = _routed_experts(x, topk_idx_NK, p, w1_EHF, w2_EIH, dy, experts)
    dweights: dict[str, torch.Tensor] = {}
    if backward:
        dweights["w1_EHF"], dweights["w2_EIH"] = torch.stack(dw1), torch.stack(dw2)
    if ws1_HF is not None:
        shared, dws1, dws2 = _shared_expert(x, slice(None), ws1_HF, ws2_IH, dy)
        y += shared
        if backward:
            dweights["ws1_HF"], dweights["ws2_IH"] = dws1, dws2
    if not backward:
        return ReferenceResult(y)
    dx = x.grad if x.grad is not None else torch.zeros_like(x)
    dp = p.grad if p.grad is not None else torch.zeros_like(p)
    return ReferenceResult(y, dx, dp, dweights, experts)


def reference_layer(inputs: MoEInputs, weights: MoEWeights, *, rank: int = 0,
                    group: dist.ProcessGroup | None = None, backward: bool = True,
                    max_checked_experts: int = 16) -> ReferenceResult:
    """Float32 forward (and backward with upstream gradient ``inputs.dy_TH``) for this rank:
    the routed experts of this rank over the whole group's tokens, summed over the group,
    then the shared expert on this rank's tokens."""
    T = inputs.x_TH.shape[0]
    E = weights.w1_EHF.shape[0]
    x_NH = _leaf(_all_gather_cat(inputs.x_TH, group), backward)
    idx_NK = _all_gather_cat(inputs.topk_idx_TK, group)
    p_NK = _leaf(_all_gather_cat(inputs.topk_weights_TK.float(), group), backward)
    dy_NH = _all_gather_cat(inputs.dy_TH, group).float() if backward else None
    checked = checked_expert_ids(E, max_checked_experts)
    y_NH, dw1, dw2 = _routed_experts(x_NH, idx_NK - weights.first_expert, p_NK, weights.w1_EHF,
                                     weights.w2_EIH, dy_NH, checked)
    y_NH = _all_reduce(y_NH, group)
    mine = slice(rank * T, (rank + 1) * T)
    y_TH = y_NH[mine].clone()
    dweights: dict[str, torch.Tensor] = {}
    if backward:
        dweights["w1_EHF"] = torch.stack(dw1)
        dweights["w2_EIH"] = torch.stack(dw2)
    if weights.ws1_HF is not None:
        shared_TH, dws1, dws2 = _shared_expert(x_NH, mine, weights.ws1_HF, weights.ws2_IH, dy_NH)
        y_TH += shared_TH
        if backward:
            dweights["ws1_HF"], dweights["ws2_IH"] = dws1, dws2
    if not backward:
        return ReferenceResult(y_TH)
    dx_NH = _all_reduce(x_NH.grad, group)
    dp_NK = _all_reduce(p_NK.grad, group)
    return ReferenceResult(y_TH, dx_NH[mine].clone(), dp_NK[mine].clone(), dweights, checked)
