"""Seeded routing: shapes, normalisation, determinism, imbalance."""

import pytest
import torch

from mokbench.routing import expert_load_E, load_imbalance, make_routing
from mokbench.scenario import Scenario, ScenarioError, preset


def _scn(**kw):
    return Scenario(preset("qwen3-30b-a3b"), 2048, 4, **kw)


def test_uniform_routing_is_valid_and_seeded_per_rank():
    s = _scn()
    idx, w = make_routing(s, rank=1)
    assert idx.shape == (2048, 8) and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.allclose(w.sum(1), torch.ones(2048))
    assert (idx.sort(1).values.diff(dim=1) > 0).all(), "experts of a token must be distinct"
    idx2, w2 = make_routing(s, rank=1)
    assert torch.equal(idx, idx2) and torch.equal(w, w2)
    idx3, _ = make_routing(s, rank=2)
    assert not torch.equal(idx, idx3)


def test_imbalanced_routing_has_hot_experts():
    uni = load_imbalance(expert_load_E(make_routing(_scn(), 0)[0], 128))
    hot = load_imbalance(expert_load_E(make_routing(_scn(routing="imbalanced", zipf_s=1.2), 0)[0],
                                       128))
    assert uni < 1.6 < hot
    # the hot experts are the same on every rank (global popularity)
    a = expert_load_E(make_routing(_scn(routing="imbalanced", zipf_s=1.2), 0)[0], 128)
    b = expert_load_E(make_routing(_scn(routing="imbalanced", zipf_s=1.2), 3)[0], 128)
    assert a.argmax() == b.argmax()


def test_zipf_zero_is_balanced():
    s = _scn(routing="imbalanced", zipf_s=0.0)
    assert load_imbalance(expert_load_E(make_routing(s, 0)[0], 128)) < 1.6


def test_rank_local_routing_keeps_a_tokens_experts_on_one_rank():
    s = _scn(routing="rank_local")  # 128 experts over 4 ranks: 32 each, top-8
    idx, w = make_routing(s, rank=2)
    home = idx // s.local_experts
    assert (home == home[:, :1]).all(), "every expert of a token on one rank"
    assert torch.bincount(home[:, 0], minlength=4).min() > 2048 // 4 * 0.8, "ranks drawn evenly"
    assert (idx.sort(1).values.diff(dim=1) > 0).all()
    assert torch.allclose(w.sum(1), torch.ones(2048))
    assert load_imbalance(expert_load_E(idx, 128)) < 1.6
    assert torch.equal(idx, make_routing(s, rank=2)[0])
    assert s.scenario_id.endswith("-ranklocal")


def test_rank_local_needs_topk_within_one_ranks_experts():
    with pytest.raises(ScenarioError, match=r"^routing='rank_local' is invalid with topk 8 > 4 "
                                            r"local experts: allowed uniform \| imbalanced$"):
        Scenario(preset("qwen3-30b-a3b"), 64, 32, routing="rank_local")
