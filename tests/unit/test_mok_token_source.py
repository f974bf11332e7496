"""Where the kernels read token rows from (``_token_source``): x itself where it is a
16-byte aligned contiguous bf16 tensor on the workspace's device, else a copy in the token
buffer. The pulls load rows as 16-byte vectors on the strength of that alignment. The
backward's dY (``_dy_source``) the same way on one rank; several loopback ranks read it at
the carved buffer's offsets, so it is copied there."""

from __future__ import annotations

import torch

import mok_kernels as mk
from mok_kernels._details.backward import _buffers, _dy_source
from mok_kernels._details.forward import _token_source


def _workspace(ranks: int = 2):
    cfg = mk.MoKConfig(minibatch=32, macrobatch=64, block_m=16, block_n=32, block_k=16,
                       num_warps=4, num_stages=1, spin_budget=1000)
    return mk.get_workspace(cfg, tokens=8, hidden=64, intermediate=32, local_experts=2,
                            topk=1, shared=False, device="cpu", loopback_ranks=ranks)


def test_aligned_x_is_read_in_place():
    ws = _workspace()
    x = torch.randn(16, 64).bfloat16()
    assert x.data_ptr() % 16 == 0
    assert _token_source(ws, x, fp8=False) is x


def test_unaligned_x_is_copied_into_the_token_buffer():
    ws = _workspace()
    flat = torch.randn(16 * 64 + 1).bfloat16()
    x = flat[1:].view(16, 64)  # contiguous, 2 bytes past an aligned start
    assert x.is_contiguous() and x.data_ptr() % 16 == 2
    src = _token_source(ws, x, fp8=False)
    assert src is ws.x_LTH
    assert src.data_ptr() % 16 == 0
    assert torch.equal(src.view(16, 64), x)


def test_dy_is_read_in_place_on_one_rank_only():
    one = _workspace(1)
    dy = torch.randn(8, 64).bfloat16()
    assert _dy_source(one, _buffers(one), dy) is dy
    flat = torch.randn(8 * 64 + 1).bfloat16()
    odd = flat[1:].view(8, 64)  # 2 bytes past an aligned start: copied
    bb = _buffers(one)
    assert _dy_source(one, bb, odd) is bb.dy_LTH and torch.equal(bb.dy_LTH.view(8, 64), odd)
    two = _workspace(2)
    dy2 = torch.randn(16, 64).bfloat16()
    bb2 = _buffers(two)
    assert _dy_source(two, bb2, dy2) is bb2.dy_LTH
    assert torch.equal(bb2.dy_LTH.reshape(16, 64), dy2)
