"""Seeded router outputs, identical for every backend.

Legend: T tokens on this rank, E experts (global), K top-k.

- ``uniform`` (as published): logits ~ randn(T, E) with seed ``seed + rank``; top-k of the
  logits; router weights = softmax over the top-k values.
- ``imbalanced``: expert e has popularity p_e proportional to 1 / (1 + r_e)^s (Zipf, exponent
  ``zipf_s``, r_e a seeded permutation of experts, the same on every rank, so the hot experts are
  global). Top-k of ``log p_e + Gumbel noise`` samples k distinct experts without replacement with
  probabilities proportional to p_e; the router weights are the softmax of those scores over the
  top-k.
- ``rank_local``: each token draws one EP rank (uniformly, seeded), then scores ~ randn over
  that rank's experts only (global ids rank * E/W + j); top-k and softmax as ``uniform``. All
  of a token's experts sit on one rank, so a dispatch that moves a token once per destination
  rank moves at most one row per token, and one that moves a row per (token, k) slot k.

Routing is generated on the CPU with a torch.Generator and then moved, so it does not depend on
the device kind.
"""

from __future__ import annotations

import torch

from mokbench.scenario import Scenario


def zipf_log_popularity_E(num_experts: int, zipf_s: float, seed: int) -> torch.Tensor:
    """log p_e (unnormalised) for each expert; the hottest expert is a seeded choice."""
    gen = torch.Generator().manual_seed(seed + 999_983)
    rank_of_expert_E = torch.randperm(num_experts, generator=gen).to(torch.float64)
    return (-zipf_s * torch.log1p(rank_of_expert_E)).to(torch.float32)


def make_routing(scenario: Scenario, rank: int,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(topk_idx_TK int64, topk_weights_TK float32)`` for this rank."""
    s = scenario.shape
    T, E, K = scenario.tokens_per_rank, s.num_experts, s.topk
    gen = torch.Generator().manual_seed(scenario.seed + rank)
    if scenario.routing == "uniform":
        scores_TE = torch.randn(T, E, generator=gen)
    elif scenario.routing == "rank_local":
        W, L = scenario.world_size, scenario.local_experts
        home_T = torch.randint(W, (T,), generator=gen)
        local_TL = torch.randn(T, L, generator=gen)
        scores_TE = torch.full((T, E), float("-inf"))
        cols_TL = home_T[:, None] * L + torch.arange(L)[None, :]
        scores_TE.scatter_(1, cols_TL, local_TL)
    else:
        u_TE = torch.rand(T, E, generator=gen).clamp_(1e-12, 1 - 1e-7)
        gumbel_TE = -torch.log(-torch.log(u_TE))
        scores_TE = zipf_log_popularity_E(E, scenario.zipf_s, scenario.seed) + gumbel_TE
    top_vals_TK, topk_idx_TK = torch.topk(scores_TE, K, dim=1)
    topk_weights_TK = torch.softmax(top_vals_TK, dim=1)
    return topk_idx_TK.to(device), topk_weights_TK.to(device)


def expert_load_E(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token-slots per expert on this rank (int64 [E])."""
    return torch.bincount(topk_idx_TK.reshape(-1), minlength=num_experts)


def load_imbalance(tokens_per_expert_E: torch.Tensor) -> float:
    """Max over mean of the per-expert load: 1.0 is perfectly balanced."""
    load = tokens_per_expert_E.to(torch.float64)
    return float(load.max() / load.mean().clamp_min(1e-12))
