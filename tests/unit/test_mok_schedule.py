"""The expert schedule on CPU against a plain-Python model of it (same torch ops as on GPU)."""

from __future__ import annotations

import pytest
import torch

from mok_kernels._details.errors import ERR_CAPACITY, MoKCapacityError, raise_if_errors
from mok_kernels._details.schedule import (
    build_schedule_tensors,
    compiled_schedule_builder,
    flag_capacity_errors,
    schedule_capacity,
)


def reference_schedule(idx_NK: torch.Tensor, rank: int, *, tokens: int, local_experts: int,
                       shared: bool, block_m: int) -> list[int]:
    """Plain-Python model of one rank's schedule (rows in order, -1 = padding): for each
    group in order, its slots in ascending slot id, padded to block_m. For tests."""
    N, K = idx_NK.shape
    S = K + (1 if shared else 0)
    E = local_experts
    rows: list[int] = []
    ids = idx_NK.tolist()
    for g in range(E + (1 if shared else 0)):
        mine = []
        for n in range(N):
            for k in range(S):
                if k < K and g < E and ids[n][k] - rank * E == g:
                    mine.append(n * S + k)
                elif k == K and g == E and n // tokens == rank:
                    mine.append(n * S + k)
        rows += mine + [-1] * ((-len(mine)) % block_m)
    return rows


def _routing(n: int, num_experts: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(n)])


@pytest.mark.parametrize("ranks, tokens, experts, k, shared, bm", [
    (1, 37, 4, 2, True, 8),
    (2, 19, 3, 2, False, 4),
    (4, 11, 2, 3, True, 16),
    (3, 9, 5, 1, True, 4),
])
def test_schedule_matches_model(ranks, tokens, experts, k, shared, bm):
    idx_NK = _routing(ranks * tokens, ranks * experts, k, seed=ranks * 7 + k)
    cap = schedule_capacity(tokens, ranks, k, shared, experts, bm, 4 * bm, 1.0)
    st = build_schedule_tensors(idx_NK, torch.arange(ranks), tokens=tokens,
                                local_experts=experts, shared=shared, block_m=bm, capacity=cap)
    G = experts + (1 if shared else 0)
    for r in range(ranks):
        want = reference_schedule(idx_NK, r, tokens=tokens, local_experts=experts,
                                  shared=shared, block_m=bm)
        total = int(st.total_L[r])
        assert total == len(want) and total % bm == 0 and total <= cap
        assert st.src_LP[r, :total].tolist() == want
        assert (st.src_LP[r, total:] == -1).all()
        # every block belongs to one group, in ascending group order
        S = k + (1 if shared else 0)
        for b in range(total // bm):
            g = int(st.group_LB[r, b])
            for s in st.src_LP[r, b * bm:(b + 1) * bm].tolist():
                if s >= 0:
                    n, kk = divmod(s, S)
                    assert (kk == k and g == experts) or int(idx_NK[n, kk]) - r * experts == g
        assert int(st.counts_LG[r].sum()) == sum(1 for s in want if s >= 0)
        assert st.counts_LG.shape == (ranks, G)


def test_schedule_aligned_for_larger_backward_blocks():
    """``align`` (``MoKConfig.row_align`` with ``bwd_block_m``): every group padded to twice
    the forward's block, the same rows in the same order otherwise; ``group_LB`` still per
    forward block, and each aligned block within one group."""
    ranks, tokens, experts, k, shared, bm = 2, 19, 3, 2, True, 4
    idx_NK = _routing(ranks * tokens, ranks * experts, k, seed=3)
    cap = schedule_capacity(tokens, ranks, k, shared, experts, 2 * bm, 4 * bm, 1.0)
    kw = dict(tokens=tokens, local_experts=experts, shared=shared, block_m=bm, capacity=cap)
    plain = build_schedule_tensors(idx_NK, torch.arange(ranks), **kw)
    wide = build_schedule_tensors(idx_NK, torch.arange(ranks), align=2 * bm, **kw)
    assert torch.equal(plain.counts_LG, wide.counts_LG)
    for r in range(ranks):
        total = int(wide.total_L[r])
        assert total % (2 * bm) == 0 and total >= int(plain.total_L[r])
        rows = [s for s in wide.src_LP[r, :total].tolist() if s >= 0]
        assert rows == [s for s in plain.src_LP[r].tolist() if s >= 0]
        groups = wide.group_LB[r, :total // bm].tolist()
        assert groups[0::2] == groups[1::2]  # a 2*bm block never spans two groups
        assert groups == sorted(groups)


def test_every_slot_scheduled_once_over_ranks():
    ranks, tokens, experts, k = 4, 13, 3, 2
    idx_NK = _routing(ranks * tokens, ranks * experts, k, seed=5)
    st = build_schedule_tensors(idx_NK, torch.arange(ranks), tokens=tokens,
                                local_experts=experts, shared=True, block_m=8, capacity=512)
    slots = st.src_LP[st.src_LP >= 0].tolist()
    assert sorted(slots) == list(range(ranks * tokens * (k + 1)))


def test_empty_experts_and_all_to_one_expert():
    tokens, experts = 20, 4
    idx_NK = torch.stack([torch.tensor([0, 3])] * tokens)  # experts 1 and 2 get nothing
    st = build_schedule_tensors(idx_NK, torch.arange(1), tokens=tokens, local_experts=experts,
                                shared=False, block_m=8, capacity=64)
    assert st.counts_LG[0].tolist() == [20, 0, 0, 20]
    assert int(st.total_L[0]) == 48
    assert st.group_LB[0, :6].tolist() == [0, 0, 0, 3, 3, 3]


def test_schedule_is_deterministic():
    idx_NK = _routing(64, 8, 2, seed=3)
    kw = dict(tokens=32, local_experts=4, shared=True, block_m=8, capacity=512)
    a = build_schedule_tensors(idx_NK, torch.arange(2), **kw)
    b = build_schedule_tensors(idx_NK, torch.arange(2), **kw)
    assert torch.equal(a.src_LP, b.src_LP) and torch.equal(a.group_LB, b.group_LB)


def test_compiled_schedule_equals_eager():
    """compile_schedule: the same ops through torch.compile give the same tensors."""
    idx_NK = _routing(64, 8, 2, seed=5)
    kw = dict(tokens=32, local_experts=4, shared=True, block_m=8, capacity=512)
    a = build_schedule_tensors(idx_NK, torch.arange(2), **kw)
    b = compiled_schedule_builder()(idx_NK, torch.arange(2), **kw)
    for name in ("src_LP", "group_LB", "total_L", "counts_LG", "needed_L"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_capacity_exceeded_sets_error_word_not_dropped_rows():
    ranks, tokens, experts, k = 2, 16, 2, 2
    idx_NK = torch.tensor([[0, 1]] * (ranks * tokens))  # every slot goes to rank 0
    cap = schedule_capacity(tokens, ranks, k, False, experts, 8, 8, 0.5)
    st = build_schedule_tensors(idx_NK, torch.arange(ranks), tokens=tokens,
                                local_experts=experts, shared=False, block_m=8, capacity=cap)
    assert int(st.needed_L[0]) > cap and int(st.total_L[0]) == 0  # kernel does nothing
    err = torch.zeros(ranks, 4, dtype=torch.int32)
    flag_capacity_errors(err, st, cap)
    assert int(err[0, 0]) == ERR_CAPACITY and int(err[1, 0]) == 0
    with pytest.raises(MoKCapacityError, match="capacity_mult"):
        raise_if_errors(err.tolist(), 0)


def test_default_capacity_always_fits():
    ranks, tokens, experts, k = 4, 10, 2, 3
    idx_NK = torch.tensor([[0, 1, 2]] * (ranks * tokens))
    cap = schedule_capacity(tokens, ranks, k, True, experts, 8, 8, 1.0)
    st = build_schedule_tensors(idx_NK, torch.arange(ranks), tokens=tokens,
                                local_experts=experts, shared=True, block_m=8, capacity=cap)
    assert (st.needed_L <= cap).all() and (st.total_L == st.needed_L).all()


@pytest.mark.parametrize("shared", [False, True])
def test_first_rows_name_each_tokens_first_row_on_the_rank(shared):
    """``first_rows`` (``dispatch_dedup``): every row's ``first_LP`` is the smallest row of
    its token on that logical rank (the row itself for the first), -1 for padding rows; the
    rest of the schedule is unchanged, and without it first_LP is None."""
    torch.manual_seed(3)
    R, T, E, K = 3, 11, 2, 4
    idx = torch.stack([torch.randperm(R * E)[:K] for _ in range(R * T)]).int()
    kw = dict(tokens=T, local_experts=E, shared=shared, block_m=4, capacity=256)
    st = build_schedule_tensors(idx, torch.arange(R), first_rows=True, **kw)
    plain = build_schedule_tensors(idx, torch.arange(R), **kw)
    assert plain.first_LP is None
    assert torch.equal(st.src_LP, plain.src_LP) and torch.equal(st.group_LB, plain.group_LB)
    S = K + int(shared)
    copies = 0
    for lr in range(R):
        first_of: dict[int, int] = {}
        for r, (slot, first) in enumerate(zip(st.src_LP[lr].tolist(), st.first_LP[lr].tolist())):
            if slot < 0:
                assert first == -1
                continue
            tok = slot // S
            first_of.setdefault(tok, r)
            assert first == first_of[tok], (lr, r, first, first_of[tok])
            copies += first != r
    assert copies > 0  # the case the cache serves: several rows of a token on one rank


@pytest.mark.parametrize("shared", [False, True])
def test_slot_rows_are_the_inverse_of_the_row_slots(shared):
    """``slot_rows`` (``bwd_pull_by_token``): slot j's row r on a logical rank has src[r] ==
    j, every used row of the schedule is some slot's, P marks the slots the rank does not
    serve; the rest of the schedule is unchanged, and without it slot_rows_LJ is None."""
    torch.manual_seed(5)
    R, T, E, K = 3, 11, 2, 4
    idx = torch.stack([torch.randperm(R * E)[:K] for _ in range(R * T)]).int()
    P = 256
    kw = dict(tokens=T, local_experts=E, shared=shared, block_m=4, capacity=P)
    st = build_schedule_tensors(idx, torch.arange(R), slot_rows=True, **kw)
    plain = build_schedule_tensors(idx, torch.arange(R), **kw)
    assert plain.slot_rows_LJ is None
    assert torch.equal(st.src_LP, plain.src_LP) and torch.equal(st.group_LB, plain.group_LB)
    S = K + int(shared)
    assert tuple(st.slot_rows_LJ.shape) == (R, R * T * S)
    for lr in range(R):
        rows = st.slot_rows_LJ[lr]
        served = rows < P
        assert torch.equal(st.src_LP[lr][rows[served].long()],
                           torch.arange(R * T * S, dtype=torch.int32)[served])
        used = st.src_LP[lr] >= 0
        assert int(served.sum()) == int(used.sum())
