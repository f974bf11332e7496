"""``bwd_dx_rows``' host side on CPU: the schedule inverted on the device (``slot_rows``), and
the dX sum gathering each token's rows from the schedule's order (``gather_sum_kernel``, in
Triton's interpreter) bitwise equal to the sum over the combine slots that the default path
runs (``weighted_sum_kernel`` with unit weights)."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from mok_kernels._details.backward import slot_rows  # noqa: E402
from tests.unit.interpreted import run_interpreted  # noqa: E402


def _schedule(L: int, T: int, S: int, P: int, seed: int) -> torch.Tensor:
    """src [L, P] int32: every global slot id (rank*T*S + t*S + s) once, at a random row of
    a random logical rank, the other rows padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((L * P,), -1, dtype=torch.int32)
    rows = torch.randperm(L * P, generator=g)[:L * T * S]
    src[rows] = torch.randperm(L * T * S, generator=g).int()
    return src.view(L, P)


def test_slot_rows_inverts_the_schedule():
    L, T, S, P = 2, 5, 3, 24
    src = _schedule(L, T, S, P, 0)
    inv = slot_rows(src, L * T * S)
    assert inv.dtype == torch.int32 and inv.shape == (L * T * S,)
    flat = src.view(-1)
    assert torch.equal(flat[inv.long()], torch.arange(L * T * S, dtype=torch.int32))


def test_gather_sum_is_bitwise_the_slot_sum_in_the_interpreter():
    script = textwrap.dedent("""
        import torch
        from mok_kernels._details.backward import slot_rows
        from mok_kernels._details.tl_mega import gather_sum_kernel, weighted_sum_kernel
        from tests.unit.test_mok_dx_rows import _schedule

        L, T, K, S, P, H, BH = 2, 5, 2, 3, 24, 96, 64  # S = K + 1: the shared expert's slot
        src = _schedule(L, T, S, P, 1)
        g = torch.Generator().manual_seed(2)
        rows = torch.randn(L * P, H, generator=g).bfloat16()
        comb = torch.empty(L * T * S, H, dtype=torch.bfloat16)
        flat = src.view(-1)
        live = flat >= 0
        comb[flat[live].long()] = rows[live]  # each row in its (token, slot) place
        want = torch.empty(L * T, H, dtype=torch.bfloat16)
        weighted_sum_kernel[(L * T, 2)](comb, torch.ones(L * T, K), want, H=H, K=K, S=S,
                                        BH=BH)
        got = torch.empty(L * T, H, dtype=torch.bfloat16)
        gather_sum_kernel[(L * T, 2)](rows, slot_rows(src, L * T * S), got, H=H, S=S, BH=BH)
        ref = comb.float().view(L * T, S, H).sum(1)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "not bitwise"
        assert ((got.float() - ref).abs().max() / ref.abs().max()) < 1e-2
        print("OK")
    """)
    out = run_interpreted(script)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
