"""FP8 quantisation kernels on a GPU: the hardware conversions (cvt.rn.satfinite, cvt from
bf16) against the CPU torch references bit for bit, and against the integer conversions the
interpreter tests run (``soft_cast``), which pins that the CPU tier checks the same bits."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")

import mok_kernels as mk  # noqa: E402
from tests.unit.test_mok_quant import cast_matrix, magnitudes, same_bits  # noqa: E402

DEV = "cuda"


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    x = magnitudes(300, 1024)
    x[10, 3], x[20, 300], x[30, 0] = float("nan"), float("inf"), -float("inf")
    return [x.to(dtype), cast_matrix().to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_activation_quantisers_match_reference_bitwise(dtype, pow2):
    for x in _inputs(dtype):
        xd = x.to(DEV)
        for soft in (False, True):
            got = [t.cpu() for t in mk.quantize_blockwise(xd, pow2_scales=pow2, soft_cast=soft)]
            assert all(map(same_bits, got, mk.ref_quantize_blockwise(x, pow2_scales=pow2)))
            got = [t.cpu() for t in mk.quantize_rowwise(xd, pow2_scales=pow2, soft_cast=soft)]
            assert all(map(same_bits, got, mk.ref_quantize_rowwise(x, pow2_scales=pow2)))
            got = [t.cpu() for t in mk.quantize_mx(xd, soft_cast=soft)]
            assert all(map(same_bits, got, mk.ref_quantize_mx(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_weight_quantisers_match_reference_bitwise(dtype, pow2):
    w = magnitudes(3 * 512, 768, seed=1).view(3, 512, 768).to(dtype)
    wd = w.to(DEV)
    for soft in (False, True):
        got = [t.cpu() for t in mk.quantize_weight_128x128(wd, pow2_scales=pow2,
                                                           soft_cast=soft)]
        assert all(map(same_bits, got, mk.ref_quantize_weight_128x128(w, pow2_scales=pow2)))
        got = [t.cpu() for t in mk.quantize_weight_colwise(wd, pow2_scales=pow2,
                                                           soft_cast=soft)]
        assert all(map(same_bits, got, mk.ref_quantize_colwise(w, pow2_scales=pow2)))


def test_quantisation_is_deterministic_at_the_kimi_shape():
    x = torch.randn(4096, 7168, device=DEV).bfloat16()
    a, b = mk.quantize_blockwise(x), mk.quantize_blockwise(x)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
