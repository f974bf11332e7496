"""The helpers the baselines share (baselines/common.py): the weight-layout converter and the
token-slot count exchange of an all-to-all layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from baselines.common import (
    canonical_layout,
    exchange_slot_counts,
    out_in_layout,
    received_local_experts,
)


def test_out_in_layout_is_each_gemms_weight_and_canonical_layout_inverts_it():
    E, H, I = 3, 8, 4
    w1, w2, ws1 = torch.randn(E, H, 2 * I), torch.randn(E, I, H), torch.randn(H, 2 * I)
    fc1, fc2, s1 = out_in_layout(w1), out_in_layout(w2), out_in_layout(ws1)
    assert fc1.shape == (E, 2 * I, H) and fc2.shape == (E, H, I) and s1.shape == (2 * I, H)
    assert fc1.is_contiguous() and fc2.is_contiguous() and s1.is_contiguous()
    x = torch.randn(5, H)
    linear = torch.nn.functional.linear  # y = x W^T, as every library's GEMM weight
    torch.testing.assert_close(linear(x, fc1[2]), x @ w1[2])
    torch.testing.assert_close(linear(x, s1), x @ ws1)
    assert torch.equal(fc1[0][:I], w1[0][:, :I].t())  # gate rows first, then up
    assert torch.equal(canonical_layout(fc1), w1) and torch.equal(canonical_layout(s1), ws1)
    assert torch.equal(canonical_layout(list(fc2)), w2)  # per-expert list: stacked


def test_slot_counts_on_one_rank_need_no_collective(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("no collective on one rank")

    monkeypatch.setattr(dist, "all_to_all_single", fail)
    idx = torch.tensor([[0, 2], [2, 3], [1, 2]])
    c = exchange_slot_counts(idx, 4, 1, None)
    assert c.recv_WE.tolist() == [[1, 1, 3, 1]]
    assert c.send == c.recv == [6]
    assert received_local_experts(c.recv_WE).tolist() == [0, 1, 2, 2, 2, 3]


def test_slot_counts_over_two_ranks(monkeypatch):
    """Rank 0 of 2 with 2 experts each: it sends its counts of experts 2-3 to rank 1 and gets
    rank 1's counts of experts 0-1 (here [4, 0]) back from the exchange."""
    peer = torch.tensor([4, 0, 7, 7])  # rank 1's counts per global expert

    def all_to_all_single(out, inp, group=None):
        assert group == "g" and inp.tolist() == [1, 2, 2, 1]
        out.copy_(torch.cat([inp[:2], peer[:2]]))

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3]])  # global ids; experts 2-3 live on rank 1
    c = exchange_slot_counts(idx, 4, 2, "g")
    assert c.recv_WE.tolist() == [[1, 2], [4, 0]]  # [source rank][local expert]
    assert c.send == [3, 3] and c.recv == [3, 4]
    # rows arrive [source rank][local expert]: 1 + 2 from rank 0, then 4 of expert 0 from rank 1
    assert received_local_experts(c.recv_WE).tolist() == [0, 1, 1, 0, 0, 0, 0]
