"""The Gluon weight-gradient launch of ``bwd_dw_gluon`` (mok_kernels/_details/gl_dw.py) alone,
on synthetic buffers of the backward's layout, against torch: two logical ranks, ragged
groups (one empty: zero gradients), the shared expert's group, rows past a rank's rows in
use holding NaN (never read), interleaved and canonical dG/dU columns, only C or only D
tiles; every slot written (the buffers start poisoned), bitwise equal on a rerun. Skipped
without an sm_90 GPU or Triton's Gluon Hopper API."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from mok_kernels._details import gl_dw  # noqa: E402
from mok_kernels._details.backward import group_starts  # noqa: E402

DEV = "cuda"
L, P, H, I, E, ALIGN = 2, 768, 512, 256, 3, 128
COUNTS = {0: [256, 0, 128, 384], 1: [128, 128, 0, 256]}  # rows a group, the shared one last


def _case(seed: int, shared: bool):
    """Inputs, poisoned outputs and the launch's keywords; rows past each rank's rows in
    use are NaN."""
    g = torch.Generator(DEV).manual_seed(seed)
    groups = E + int(shared)
    counts = torch.tensor([COUNTS[lr][:groups] for lr in range(L)], device=DEV)
    gst = group_starts(counts, ALIGN)
    total = gst[:, -1].contiguous()

    def rows(cols: int) -> torch.Tensor:
        t = torch.randn(L, P, cols, device=DEV, generator=g).bfloat16()
        for lr in range(L):
            t[lr, int(total[lr]):] = float("nan")
        return t

    hs, dy, x, pre = rows(I), rows(H), rows(H), rows(2 * I)
    slots = L * E + (L if shared else 0)
    dw2 = torch.full((slots, I, H), float("nan"), device=DEV).bfloat16()
    dw1 = torch.full((slots, H, 2 * I), float("nan"), device=DEV).bfloat16()
    return (hs, dy, x, pre, dw2, dw1, gst, total), groups


def _want(args, groups: int, shared: bool, interleaved: bool):
    """float32 dW_down and dW_gate_up of every slot (canonical gate, up columns)."""
    hs, dy, x, pre, dw2, dw1, gst, _ = args
    w2 = torch.zeros(dw2.shape, device=DEV)
    w1 = torch.zeros(dw1.shape, device=DEV)
    for lr in range(L):
        for gi in range(groups):
            s, e = int(gst[lr, gi]), int(gst[lr, gi + 1])
            slot = L * E + lr if shared and gi == E else lr * E + gi
            w2[slot] = hs[lr, s:e].float().t() @ dy[lr, s:e].float()
            m = x[lr, s:e].float().t() @ pre[lr, s:e].float()
            w1[slot] = torch.cat([m[:, 0::2], m[:, 1::2]], 1) if interleaved else m
    return w2, w1


@pytest.mark.parametrize("shared, interleaved, kinds",
                         [(False, True, "cd"), (True, True, "cd"), (True, False, "cd"),
                          (True, True, "c"), (True, True, "d")])
def test_gluon_dw_tiles_match_torch_and_rerun_bitwise(shared, interleaved, kinds):
    args, groups = _case(0, shared)
    w2, w1 = _want(args, groups, shared, interleaved)
    poisoned = (args[4].clone(), args[5].clone())
    kw = dict(E=E, shared=shared, interleaved=interleaved, row_align=ALIGN, programs=7,
              c="c" in kinds, d="d" in kinds)
    gl_dw.launch_dw(*args, **kw)
    torch.cuda.synchronize()
    for got, want, asked in ((args[4], w2, "c" in kinds), (args[5], w1, "d" in kinds)):
        if not asked:  # the other kind's buffer untouched
            assert torch.isnan(got.float()).all()
            continue
        got = got.float()
        assert not torch.isnan(got).any()  # every slot written, no NaN row read
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-2, err
    empty = 1  # rank 0's group 1 has no rows: zero gradients
    if "c" in kinds:
        assert not args[4][empty].any()
    if "d" in kinds:
        assert not args[5][empty].any()
    first = (args[4].clone(), args[5].clone())
    args[4].copy_(poisoned[0])
    args[5].copy_(poisoned[1])
    gl_dw.launch_dw(*args, **kw)
    torch.cuda.synchronize()
    for a, b in zip(first, (args[4], args[5])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_gluon_dw_rejects_shapes_it_does_not_tile():
    args, _ = _case(0, False)
    with pytest.raises(ValueError, match=r"^bwd_dw_gluon: row alignment \(bwd_block_m\)=32 "
                                         r"is not a multiple of 64$"):
        gl_dw.launch_dw(*args, E=E, shared=False, interleaved=True, row_align=32, programs=7)
