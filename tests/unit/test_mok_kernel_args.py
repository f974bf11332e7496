"""The megakernels' arguments come from one dict per kernel (``forward_kernel_args``,
``backward_kernel_args``), which the launch passes by name and the lowering types: its keys
are the kernel's parameters, and the lowering's signature follows its values."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import mok_kernels as mk  # noqa: E402
from mok_kernels._details.lowering import kernel_args, signature  # noqa: E402
from mok_kernels._details.tl_backward import mok_backward_kernel  # noqa: E402
from mok_kernels._details.tl_mega import mok_forward_kernel  # noqa: E402

H, I = 2048, 256
KERNELS = {"forward": mok_forward_kernel, "backward": mok_backward_kernel}


def _cfg(**kw) -> mk.MoKConfig:
    return mk.MoKConfig.for_shape(H, I, minibatch=256, macrobatch=768, **kw)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("tma, shared", [(False, False), (True, True)])
def test_the_argument_dict_names_every_kernel_parameter(kernel, tma, shared):
    args = kernel_args(_cfg(tma=tma), H, I, shared=shared, kernel=kernel)
    assert list(args) == KERNELS[kernel].arg_names


def test_forward_signature_follows_the_arguments():
    args = kernel_args(_cfg(tma=True), H, I, topk=4, shared=False, comm_programs=8)
    sig, constexprs, attrs = signature(mok_forward_kernel, args)
    names = mok_forward_kernel.arg_names
    assert (sig["x_tab"], sig["p_ptr"], sig["sum_ptr"], sig["x_base"]) == (
        "*i64", "*fp32", "*i32", "*bf16")
    assert sig["w1_desc"] == "tensordesc<bf16[64, 128]>"  # [BK, BN/2]: split gate/up
    assert sig["ws1_desc"] == "constexpr" and constexprs[(names.index("ws1_desc"),)] is None
    assert sig["T"] == sig["withhold"] == "i32"
    assert constexprs[(names.index("COMM"),)] == 8 and constexprs[(names.index("K"),)] == 4
    # pointers are 16-byte aligned, and ints that 16 divides are known to be, as the launch
    # specialises them
    assert set(attrs) == {(i,) for i, n in enumerate(names) if sig[n].startswith("*")
                          or (sig[n] == "i32" and args[n] % 16 == 0)}
    assert args["T"] % 16 == 0 and attrs[(names.index("T"),)] == [["tt.divisibility", 16]]


def test_forward_without_tma_has_no_descriptors():
    sig, constexprs, _ = signature(mok_forward_kernel, kernel_args(_cfg(), H, I))
    for name in ("w1_desc", "w2_desc", "h_desc"):
        assert sig[name] == "constexpr"
        assert constexprs[(mok_forward_kernel.arg_names.index(name),)] is None


def test_backward_signature_follows_the_arguments():
    args = kernel_args(_cfg(gate_up_interleaved=True), H, I, shared=True, kernel="backward",
                       phases=5)
    sig, constexprs, _ = signature(mok_backward_kernel, args)
    names = mok_backward_kernel.arg_names
    assert (sig["p_base"], sig["drp_base"], sig["gstart_ptr"]) == ("*fp32", "*fp32", "*i32")
    assert sig["ws1_desc"] == "tensordesc<bf16[256, 64]>"  # [BN, BK], shared expert on
    assert sig["pre_a_desc"] == "tensordesc<bf16[128, 128]>"  # interleaved: both halves
    assert constexprs[(names.index("PHASES"),)] == 5


def test_an_argument_without_a_triton_type_is_an_error():
    args = dict(kernel_args(_cfg(), H, I), T=1.5)
    with pytest.raises(TypeError, match="T: no Triton type for float"):
        signature(mok_forward_kernel, args)


@pytest.mark.parametrize("skew", [False, True])
def test_forward_trace_capacity_counts_the_tiles_the_kernel_runs(skew):
    """``forward_trace_capacity``: per minibatch, its row blocks' gate+up and down items with
    the tiles per item the kernel runs (4 down tiles do not divide H / block_n = 6 here, so
    one per item; 4 gate+up tiles divide 2I / block_n = 4), ``skew_down``: one more
    minibatch's gate+up items."""
    h, i = 1536, 512  # 6 down tiles, 4 gate+up tiles of block_n 256
    cfg = mk.MoKConfig.for_shape(h, i, minibatch=256, macrobatch=768, down_tiles=4,
                                 gate_up_tiles=4, skew_down=skew)
    assert (mk.down_tiles(cfg, h), mk.gate_up_tiles(cfg, i)) == (1, 4)
    ws = mk.get_workspace(cfg, tokens=100, hidden=h, intermediate=i, local_experts=4, topk=2,
                          shared=False, device="cpu")
    minibatches = -(-ws.P // 256)
    per_mb = 2 * (1 + 6)  # two row blocks of 128: one gate+up item and six down items each
    assert mk.forward_trace_capacity(ws) == minibatches * per_mb + (2 if skew else 0)


def test_interleaved_pull_order_is_a_permutation_by_place_in_group():
    """``interleaved_block_order`` (``bwd_pull_interleave``): for each rank a permutation of
    the row blocks, every group's first block before any group's second (groups of 3, 1 and
    2 blocks: place 0, 1/3, 1/2, 2/3), blocks past the rank's total rows last, ties in row
    order; a rank whose schedule overflowed (total 0) keeps row order."""
    import torch

    from mok_kernels._details.backward import interleaved_block_order

    counts_LG = torch.tensor([[40, 16, 17], [0, 0, 0]], dtype=torch.int32)  # 16-row blocks
    total_L = torch.tensor([96, 0], dtype=torch.int32)
    order = interleaved_block_order(counts_LG, total_L, 16, 128, 16)
    assert order.dtype == torch.int32 and order.shape == (2, 8)
    # rank 0: group 0 = blocks 0-2, group 1 = block 3, group 2 = blocks 4-5; 6, 7 past total
    assert order[0].tolist() == [0, 3, 4, 1, 5, 2, 6, 7]
    assert order[1].tolist() == list(range(8))


def test_split_launches_share_the_phase_mask():
    """``bwd_split_launch``: the dgrad launch takes the A and B bits (and the A items'
    no-epilogue bit), the weight-gradient launch the Q, C and D bits (and the Q items'
    bit of their own); a launch left with no
    bit is not made; one launch otherwise, with the whole mask."""
    from mok_kernels._details.backward import split_launches

    one = mk.MoKConfig()
    split = mk.MoKConfig(bwd_split_launch=True)
    assert split_launches(one, 5) == [(0, 5)]
    assert split_launches(split) == [(1, 3), (2, 12)]
    assert split_launches(split, 17) == [(1, 17)]
    assert split_launches(split, 8) == [(2, 8)]
    assert split_launches(split, 5) == [(1, 1), (2, 4)]
    assert split_launches(split, 33) == [(1, 1), (2, 32)]  # the Q items alone
