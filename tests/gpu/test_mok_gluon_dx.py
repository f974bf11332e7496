"""The Gluon dX launch of ``bwd_dx_gluon`` (mok_kernels/_details/gl_dx.py) alone, on synthetic
buffers of the backward's layout, against torch: two logical ranks, ragged groups, the shared
expert's group, padding rows, row blocks past a rank's rows in use, slots on either rank;
bitwise equal on a rerun. Skipped without an sm_90 GPU or Triton's Gluon Hopper API."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from mok_kernels._details import gl_dx  # noqa: E402

DEV = "cuda"


def _case(seed: int, shared: bool, band: int):
    """L=2 ranks, P=768 rows (6 blocks) a rank, T=256 tokens, S slots a token, E=3 experts a
    rank; rank 0 uses 5 blocks (its last two rows of each group padding), rank 1 uses 3.
    Returns the launch's arguments and the expected combine buffer (NaN where unwritten)."""
    g = torch.Generator(DEV).manual_seed(seed)
    L, P, H, I, T, E = 2, 768, 512, 128, 256, 3
    S = 3 if shared else 2
    BM = gl_dx.BM
    pre = torch.randn(L, P, 2 * I, device=DEV, generator=g).bfloat16()
    w = (torch.randn(L * E, H, 2 * I, device=DEV, generator=g) * (2 * I) ** -0.5).bfloat16()
    ws = ((torch.randn(H, 2 * I, device=DEV, generator=g) * (2 * I) ** -0.5).bfloat16()
          if shared else None)
    groups = {0: [0, 0, 1, 2, 3 if shared else 2], 1: [1, 3 if shared else 2, 3 if shared else 2]}
    total = torch.tensor([BM * len(groups[0]), BM * len(groups[1])], dtype=torch.int32,
                         device=DEV)
    grp = torch.full((L, P // BM), 0, dtype=torch.int32, device=DEV)
    src = torch.full((L, P), -1, dtype=torch.int32, device=DEV)
    slots = torch.randperm(L * T * S, device=DEV, generator=g)  # each slot written once
    n = 0
    for lr, gs in groups.items():
        grp[lr, :len(gs)] = torch.tensor(gs, dtype=torch.int32)
        for b in range(len(gs)):
            rows = BM - 2  # two padding rows a block
            src[lr, b * BM:b * BM + rows] = slots[n:n + rows].int()
            n += rows
    comb = torch.full((L, T, S, H), float("nan"), device=DEV).bfloat16()
    comb_tab = torch.arange(L, device=DEV, dtype=torch.int64) * (T * S * H)
    want = comb.float().clone().view(L * T * S, H)
    for lr, gs in groups.items():
        for b, gi in enumerate(gs):
            rows = slice(b * BM, (b + 1) * BM)
            wt = ws if gi == E else w[lr * E + gi]
            out = pre[lr, rows].float() @ wt.float().t()
            ok = src[lr, rows] >= 0
            want[src[lr, rows][ok].long()] = out[ok]
    kw = dict(T=T, E=E, H=H, I=I, S=S, band=band, programs=7)
    return (pre, w, ws, src, grp, total, comb, comb_tab), kw, want


@pytest.mark.parametrize("shared, band", [(False, 16), (True, 1), (True, 4)])
def test_gluon_dx_rows_land_in_their_slots_and_nowhere_else(shared, band):
    args, kw, want = _case(0, shared, band)
    poisoned = args[6].clone()
    gl_dx.launch_dx(*args, **kw)
    torch.cuda.synchronize()
    got = args[6].float().view_as(want)
    written = ~torch.isnan(want[:, 0])
    assert torch.equal(torch.isnan(got[:, 0]), ~written)  # no slot missed, none extra
    err = ((got[written] - want[written]).norm() / want[written].norm()).item()
    assert err < 1e-2, err
    first = args[6].clone()
    args[6].copy_(poisoned)  # the same NaN bits in the unwritten slots
    gl_dx.launch_dx(*args, **kw)
    torch.cuda.synchronize()
    assert torch.equal(args[6].view(-1).view(torch.int16), first.view(-1).view(torch.int16))


@pytest.mark.parametrize("shared", [False, True])
def test_gluon_dx_rows_mode_stores_every_live_row_in_place(shared):
    """``bwd_dx_rows``: the same rows, stored whole in the schedule's order (TMA stores);
    live rows equal the slot launch's rows bitwise, row blocks past a rank's rows in use
    stay untouched; bitwise on a rerun."""
    from mok_kernels._details.backward import slot_rows

    args, kw, want = _case(0, shared, 16)
    pre, w, ws, src, grp, total, comb, comb_tab = args
    gl_dx.launch_dx(*args, **kw)  # the slot path: comb holds every live row
    L, P = src.shape
    H = comb.shape[-1]
    rows = torch.full((L, P, H), float("nan"), device=DEV).bfloat16()
    poisoned = rows.clone()
    gl_dx.launch_dx(*args, **kw, rows_LPH=rows)
    torch.cuda.synchronize()
    flat = rows.view(L * P, H)
    inv = slot_rows(src, comb.numel() // H).long()
    written = ~torch.isnan(want[:, 0])
    slots_flat = comb.view(-1, H)
    assert torch.equal(flat[inv[written]].view(torch.int16),
                       slots_flat[written].view(torch.int16))
    for lr in range(L):  # whole blocks past the rows in use: never stored
        assert torch.isnan(rows[lr, int(total[lr]):].float()).all()
    first = rows.clone()
    rows.copy_(poisoned)
    gl_dx.launch_dx(*args, **kw, rows_LPH=rows)
    torch.cuda.synchronize()
    assert torch.equal(rows.view(torch.int16), first.view(torch.int16))
