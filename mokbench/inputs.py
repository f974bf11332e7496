"""Seeded weights and activations, identical for every backend of a run.

Legend: T tokens on this rank, H hidden, I expert intermediate, F = 2*I (gate then up columns),
E experts held by this rank (local), K top-k.

Weights are drawn per *global* expert id from a generator on the target device, so expert e has
the same weights at any EP size, and every backend on the same device kind sees the same values.
Scales keep activations O(1): w1 ~ N(0, 1/H), w2 ~ N(0, 1/I).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mokbench.scenario import Scenario


@dataclass
class MoEWeights:
    """This rank's expert weights in the canonical layout (math layout: y = x @ w).

    w1_EHF[e] = [gate | up] of local expert e (global id first_expert + e);
    ws1_HF / ws2_IH are the shared expert (replicated on every rank) or None.
    """

    w1_EHF: torch.Tensor
    w2_EIH: torch.Tensor
    ws1_HF: torch.Tensor | None
    ws2_IH: torch.Tensor | None
    first_expert: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named weight tensors (the names used for weight gradients too)."""
        out = {"w1_EHF": self.w1_EHF, "w2_EIH": self.w2_EIH}
        if self.ws1_HF is not None:
            out["ws1_HF"] = self.ws1_HF
            out["ws2_IH"] = self.ws2_IH
        return out


@dataclass
class MoEInputs:
    """One rank's activations and router outputs for one scenario."""

    x_TH: torch.Tensor  # bf16
    topk_idx_TK: torch.Tensor  # int64 global expert ids
    topk_weights_TK: torch.Tensor  # fp32, sums to 1 over K
    dy_TH: torch.Tensor  # bf16 upstream gradient for the backward pass


def _randn(shape: tuple[int, ...], seed: int, device: torch.device, scale: float) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return (out * scale).to(torch.bfloat16)


def make_weights(scenario: Scenario, rank: int, device: torch.device) -> MoEWeights:
    """This rank's local experts (contiguous block of global ids) and the shared expert."""
    s = scenario.shape
    H, I, E = s.hidden, s.intermediate, scenario.local_experts
    first = rank * E
    w1 = torch.empty(E, H, 2 * I, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, I, H, dtype=torch.bfloat16, device=device)
    for e in range(E):
        g = scenario.seed * 1_000_003 + 2 * (first + e)
        w1[e] = _randn((H, 2 * I), g, device, H ** -0.5)
        w2[e] = _randn((I, H), g + 1, device, I ** -0.5)
    ws1 = ws2 = None
    if scenario.shared_expert:
        g = scenario.seed * 1_000_003 - 7
        ws1 = _randn((H, 2 * I), g, device, H ** -0.5)
        ws2 = _randn((I, H), g - 1, device, I ** -0.5)
    return MoEWeights(w1, w2, ws1, ws2, first)


def make_inputs(scenario: Scenario, rank: int, device: torch.device) -> MoEInputs:
    """Fresh seeded x, routing and dy for this rank."""
    from mokbench.routing import make_routing

    T, H = scenario.tokens_per_rank, scenario.shape.hidden
    idx, w = make_routing(scenario, rank, device)
    base = scenario.seed * 7_919 + 100 * rank
    x = _randn((T, H), base + 1, device, 1.0)
    dy = _randn((T, H), base + 2, device, 1.0)
    return MoEInputs(x, idx, w, dy)
