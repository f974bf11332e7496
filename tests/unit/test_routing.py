"""Seeded routing: shapes, normalisation, determinism, imbalance."""

import torch

from mokbench.routing import expert_load_E, load_imbalance, make_routing
from mokbench.scenario import Scenario, preset


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
