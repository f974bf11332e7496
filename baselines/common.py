"""Pieces several baselines share: expert weights as parameters, the grouped SwiGLU FFN.

Legend: M rows grouped by expert, H hidden, I intermediate, F = 2*I, E local experts.
Parameters are stored "K-major" ([E, F, H] and [E, H, I]), the layout the Hopper/Blackwell
grouped GEMM reads fastest; ``canonical_grads`` maps their grads back to the canonical layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mokbench.inputs import MoEWeights


def expert_params(weights: MoEWeights) -> dict[str, torch.nn.Parameter]:
    """Trainable copies: w1_EFH [E, F, H], w2_EHI [E, H, I], shared ws1_FH, ws2_HI."""
    p = {
        "w1_EFH": weights.w1_EHF.transpose(1, 2).contiguous(),
        "w2_EHI": weights.w2_EIH.transpose(1, 2).contiguous(),
    }
    if weights.ws1_HF is not None:
        p["ws1_FH"] = weights.ws1_HF.t().contiguous()
        p["ws2_HI"] = weights.ws2_IH.t().contiguous()
    return {k: torch.nn.Parameter(v) for k, v in p.items()}


_CANONICAL = {"w1_EFH": "w1_EHF", "w2_EHI": "w2_EIH", "ws1_FH": "ws1_HF", "ws2_HI": "ws2_IH"}


def canonical_grads(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Grads of ``expert_params`` in the canonical (math) layout."""
    return {_CANONICAL[k]: p.grad.transpose(-1, -2) for k, p in params.items()
            if p.grad is not None}


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
