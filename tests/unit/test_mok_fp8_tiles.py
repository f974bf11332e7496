"""The FP8 expert-FFN tiles (``mok_kernels.ffn_fp8``) on CPU: the grouped gate+up (SwiGLU,
h quantised in the epilogue) and down kernels in Triton's interpreter against the torch
reference with the same quantisation, for each recipe (blockwise 1x128 / 128x128 as
TransformerEngine's Float8BlockScaling, rowwise, MXFP8, rowwise_all), bitwise reruns and NaN
propagation;
then their builds: Hopper e4m3 wgmma without spills, Blackwell block-scaled tcgen05 MMAs
(MXFP8) without spills. Tolerances: against the same-quantisation reference 1e-2 (norm
relative: the bf16 output and the odd h element rounded the other way); against the exact
fp32 layer 0.1, the FP8 bound the harness applies (measured here about 0.065)."""

from __future__ import annotations

import re
import textwrap

import pytest

pytest.importorskip("triton")

import mok_kernels as mk  # noqa: E402
from tests.unit.interpreted import run_interpreted  # noqa: E402

SCRIPT = textwrap.dedent("""
    import torch
    import mok_kernels as mk

    torch.manual_seed(0)
    BM, H, I, E = 16, 256, 256, 3
    grp = torch.tensor([0, 2, 2, 1], dtype=torch.int32)  # expert 1 one block, 0 one, 2 two
    T = grp.numel() * BM
    x = torch.randn(T, H).bfloat16()
    w1 = mk.interleave_gate_up((torch.randn(E, H, 2 * I) * H ** -0.5).bfloat16())
    w2 = (torch.randn(E, I, H) * I ** -0.5).bfloat16()
    tiles = {"gate_up": {"BM": BM, "BN": 256, "BK": 128},
             "down": {"BM": BM, "BN": 128, "BK": 128}}
    e_T = grp.long().repeat_interleave(BM)
    pre = torch.einsum("th,thf->tf", x.float(), w1.float()[e_T])
    g, u = pre[:, 0::2], pre[:, 1::2]
    exact = torch.einsum("ti,tih->th", g * torch.sigmoid(g) * u, w2.float()[e_T])
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    for recipe in mk.FP8_RECIPES:
        ops = mk.quantize_ffn(recipe, x, w1, w2)
        y = mk.ffn_fp8(ops, grp, tiles=tiles)
        ref = mk.ref_ffn_fp8(ops, grp, BM)
        again = mk.ffn_fp8(ops, grp, tiles=tiles)
        bitwise = torch.equal(y.view(torch.int16), again.view(torch.int16))
        xn = x.clone()
        xn[0, 5] = float("nan")
        yn = mk.ffn_fp8(mk.quantize_ffn(recipe, xn, w1, w2), grp, tiles=tiles)
        nan_ok = bool(yn[0].isnan().all()) and bool(yn[1:].isfinite().all())
        print("case", recipe, rel(y, ref), rel(y, exact), bitwise, nan_ok,
              bool(y.isfinite().all()))
""")


def test_fp8_ffn_in_interpreter_matches_reference():
    out = run_interpreted(SCRIPT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("case ")]
    assert [c[0] for c in cases] == list(mk.FP8_RECIPES), out.stdout
    for recipe, err_ref, err_exact, bitwise, nan_ok, finite in cases:
        assert float(err_ref) < 1e-2, (recipe, err_ref)
        assert float(err_exact) < 0.1, (recipe, err_exact)
        assert bitwise == "True", (recipe, "rerun differs")
        assert nan_ok == "True", (recipe, "a NaN input row must give NaN, only there")
        assert finite == "True", recipe


def test_bad_recipe_is_one_clear_error():
    import torch

    x = torch.zeros(128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"recipe='fp4' is invalid: allowed blockwise \| "
                                         r"rowwise \| mx"):
        mk.quantize_ffn("fp4", x, x[None], x[None])


@pytest.mark.parametrize("kernel", mk.FFN_KERNELS)
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "rowwise_all"])
def test_hopper_builds_use_fp8_wgmma_without_spills(recipe, kernel):
    """Kimi shape (H 7168, I 2048), the launch tiles: e4m3 x e4m3 wgmma, fp32 accumulation,
    both operands pipelined into shared memory by asynchronous copies (K-major weights: an
    N-major e4m3 tile went through registers every step, ten times slower on an H200)."""
    lw = mk.compile_fp8_ffn_kernel(kernel, recipe, arch=90)
    assert not lw.spills, lw.ptxas_log
    assert not re.search(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+xf8", lw.ttgir)
    assert lw.ttgir.count("ttg.async_copy_global_to_local") >= 2
    assert any(i.startswith("wgmma.mma_async") and i.endswith("f32.e4m3.e4m3")
               for i in lw.mma_instructions), lw.mma_instructions


@pytest.mark.parametrize("kernel", mk.FFN_KERNELS)
def test_blackwell_mx_builds_use_block_scaled_mma_without_spills(kernel):
    """MXFP8 on sm_100 at the launch tiles (BM 128): block-scaled tcgen05 MMAs with 1x32
    scales, not an emulation through bf16 MMAs (which Triton falls back to at BM 64)."""
    lw = mk.compile_fp8_ffn_kernel(kernel, "mx", arch=100)
    assert not lw.spills, lw.ptxas_log
    assert any("block_scale" in i and "mxf8f6f4" in i for i in lw.mma_instructions), \
        lw.mma_instructions
