"""The megakernel's FP8 forward (``MoKConfig(fp8=...)``) on CPU, in Triton's interpreter (no
communication programs; one and two loopback ranks, shared expert on and off, inference and
training forward), against (a) a torch reference with the same quantisation (tokens at the
source, weights 128x128 / per column / MX, h 1x128, per row or MX) within 2e-2 norm relative (the
interpreter truncates the bf16 combine slots; the bf16 test uses the same bound) and (b) the
exact fp32 layer within the FP8 bound 0.1 (measured about 0.065). After the training forward,
the bf16 backward on its context gives every gradient within 0.1 of the fp32 reference.
Inputs and weights carry block magnitudes from 2^-3 to 2^3, so that a scale read from the
wrong block shows. Then the builds: sm_90 e4m3 wgmma without spills at block_m 64, sm_100
MXFP8 block-scaled tcgen05 MMAs without spills at block_m 128. Not yet run on a GPU
(tests/gpu/test_mok_forward.py's FP8 cases check it there)."""

from __future__ import annotations

import re
import textwrap

import pytest

pytest.importorskip("triton")

import mok_kernels as mk  # noqa: E402
from tests.unit.interpreted import run_interpreted  # noqa: E402

SCRIPT = textwrap.dedent('''
import torch
import mok_kernels as mk
from mok_kernels._details import quant_ref as qr
from mok_kernels._details.ffn_fp8 import dequantize_weight
from mokbench.reference import reference_all_experts

def blocks(shape, b0, b1, lo, hi):
    """2^k factors, constant over b0 x b1 blocks of the last two dims."""
    *lead, R, C = shape
    f = 2.0 ** torch.randint(lo, hi + 1, (*lead, R // b0, C // b1)).float()
    return f.repeat_interleave(b0, -2).repeat_interleave(b1, -1)

def deq_w(recipe, fw, gate_up):
    q, s = fw.q, fw.scale
    three = q.dim() == 3
    q3, s3 = (q, s) if three else (q[None], s[None])
    keep = gate_up or recipe in ("mx", "rowwise_all")  # else w2 in 128x128 blocks
    w = dequantize_weight(recipe if keep else "blockwise", q3, s3)
    return w if three else w[0]

def deq_x(recipe, x):
    if recipe == "mx":
        return qr.dequantize_mx(*qr.ref_quantize_mx(x))
    if recipe in ("rowwise", "rowwise_all"):
        return qr.dequantize_rowwise(*qr.ref_quantize_rowwise(x))
    return qr.dequantize_blockwise(*qr.ref_quantize_blockwise(x, 128))

def ffn(recipe, xd, w1d, w2d):
    pre = xd @ w1d
    g, u = pre[:, 0::2], pre[:, 1::2]
    h = g * torch.sigmoid(g) * u
    if recipe == "mx":
        h = qr.dequantize_mx(*qr.ref_quantize_mx(h))
    elif recipe == "rowwise_all":  # one scale per row of h, kept in bf16 until it is whole
        h = qr.dequantize_rowwise(*qr.ref_quantize_rowwise(h.bfloat16()))
    else:
        h = qr.dequantize_blockwise(*qr.ref_quantize_blockwise(h, 128))
    return h @ w2d

# rowwise_all at I 512 too: four gate+up tiles per row block, one per item, so the item that
# completes a row block requantises rows that other items wrote
for recipe, I in (("blockwise", 128), ("rowwise", 128), ("mx", 128), ("rowwise_all", 128),
                  ("rowwise_all", 512)):
    for (L, T, E, K, shared, train, tma) in [(1, 24, 3, 2, True, False, True),
                                             (2, 13, 2, 2, False, True, False)]:
        torch.manual_seed(L)
        H = 256
        cfg = mk.MoKConfig(minibatch=32, macrobatch=64, block_m=16, block_n=256, block_k=128,
                           num_warps=4, num_stages=1, spin_budget=1000,
                           gate_up_interleaved=True, fp8=recipe, tma=tma)
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=shared, device="cpu", loopback_ranks=L)
        x = (torch.randn(L * T, H) * blocks((L * T, H), 1, 128, -3, 3)).bfloat16()
        idx = torch.stack([torch.randperm(L * E)[:K] for _ in range(L * T)])
        p = torch.softmax(torch.randn(L * T, K), 1)
        w1 = (torch.randn(L * E, H, 2 * I) * H ** -0.5
              * blocks((L * E, H, 2 * I), 128, 128, -2, 2)).bfloat16()
        w2 = (torch.randn(L * E, I, H) * I ** -0.5
              * blocks((L * E, I, H), 128, 128, -2, 2)).bfloat16()
        ws1 = (torch.randn(H, 2 * I) * H ** -0.5).bfloat16() if shared else None
        ws2 = (torch.randn(I, H) * I ** -0.5).bfloat16() if shared else None
        il = mk.interleave_gate_up
        fw = mk.quantize_weights(cfg, il(w1), w2, il(ws1) if shared else None, ws2)
        sched = mk.build_schedule(ws, idx)
        if train:
            y, ctx = mk.forward_train(cfg, ws, sched, x, p, *fw)
            # the bf16 backward on the FP8 forward's context (what the backend runs at EP 2
            # and on Blackwell)
            dy = torch.randn(L * T, H).bfloat16()
            g = mk.backward(cfg, ws, ctx, dy, il(w1), w2, il(ws1) if shared else None, ws2)
            gr = reference_all_experts(x, idx, p, w1, w2, ws1, ws2, dy_NH=dy)
            got = {"dx_TH": g.dx_TH, "dprobs_TK": g.d_router_weights_TK,
                   "w1_EHF": g.w_gate_up, "w2_EIH": g.w_down}
            want = {"dx_TH": gr.dx_TH, "dprobs_TK": gr.dprobs_TK,
                    "w1_EHF": gr.dweights["w1_EHF"], "w2_EIH": gr.dweights["w2_EIH"]}
            worst = max(((got[k].float() - v).norm() / v.norm()).item()
                        for k, v in want.items())
            print("bwd", recipe, worst)
        else:
            y = mk.forward(cfg, ws, sched, x, p, *fw)
        mk.check_errors(ws)
        exact = reference_all_experts(x, idx, p, w1, w2, ws1, ws2).y_TH
        xd = deq_x(recipe, x)
        w1d, w2d = deq_w(recipe, fw[0], True), deq_w(recipe, fw[1], False)
        ref = torch.zeros(L * T, H)
        for t in range(L * T):
            for k in range(K):
                e = int(idx[t, k])
                ref[t] += p[t, k] * ffn(recipe, xd[t:t + 1], w1d[e], w2d[e])[0]
            if shared:
                ref[t] += ffn(recipe, xd[t:t + 1], deq_w(recipe, fw[2], True),
                              deq_w(recipe, fw[3], False))[0]
        e_ref = ((y.float() - ref).norm() / ref.norm()).item()
        e_exact = ((y.float() - exact).norm() / exact.norm()).item()
        print("case", recipe, L, train, e_ref, e_exact, bool(y.isfinite().all()))
''')


def test_fp8_forward_in_interpreter_matches_references():
    out = run_interpreted(SCRIPT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("case ")]
    assert len(cases) == 10, out.stdout
    bwd = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("bwd ")]
    assert len(bwd) == 5, out.stdout
    for recipe, worst in bwd:  # every gradient within the FP8 bound of the fp32 reference
        assert float(worst) < 0.1, (recipe, worst)
    for recipe, L, train, e_ref, e_exact, finite in cases:
        assert float(e_ref) < 2e-2, (recipe, L, train, e_ref)
        assert float(e_exact) < 0.1, (recipe, L, train, e_exact)
        assert finite == "True", (recipe, L, train)


@pytest.mark.parametrize("recipe, arch, block_m, comm, tma", [
    ("blockwise", 90, 64, 0, True), ("rowwise", 90, 64, 0, True), ("blockwise", 90, 64, 16, True),
    ("blockwise", 90, 64, 16, False), ("mx", 100, 128, 0, False), ("mx", 100, 128, 0, True),
    ("rowwise_all", 90, 64, 0, True), ("rowwise_all", 90, 64, 16, True),
    ("rowwise_all", 90, 128, 0, True), ("rowwise_all", 90, 128, 16, True)])
def test_fp8_megakernel_builds_without_spills(recipe, arch, block_m, comm, tma):
    """Kimi shape; comm: with communication programs (dispatch moves the FP8 rows); tma: the
    FP8 weight tiles through TMA descriptors (the backend's default). The K-major weight tiles
    are pipelined into shared memory (asynchronous copies), never staged through registers:
    an N-major e4m3 tile was, and ran an FFN about ten times slower on an H200."""
    cfg = mk.MoKConfig.for_shape(7168, 2048, fp8=recipe, gate_up_interleaved=True,
                                 block_k=128, block_m=block_m, minibatch=4096,
                                 macrobatch=12288, fwd_comm_sms=comm, tma=tma)
    lw = mk.compile_megakernel(cfg, 7168, 2048, arch=arch, comm_programs=comm)
    assert not lw.spills, lw.ptxas_log
    assert not re.search(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+xf8", lw.ttgir)
    if arch == 90:  # 128-row blocks: each warpgroup's MMA covers all 256 columns
        n = 256 if block_m == 128 else 128
        assert lw.mma_instructions == [f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3"]
    else:
        assert any("mxf8f6f4.block_scale" in i for i in lw.mma_instructions), \
            lw.mma_instructions


def test_rowwise_all_megakernel_builds_pure_k_loops():
    """fp8="rowwise_all": both GEMMs rowwise (scales after the K loops), so its sm_90 build
    needs fewer registers than "rowwise", whose down GEMM rescales every 128-deep step (Kimi
    shape, block_m 64, TMA weight tiles); at block_m 128 (m64n256 MMAs) it spills at most a
    few bytes where "rowwise" spills hundreds."""
    def build(recipe, block_m):
        cfg = mk.MoKConfig.for_shape(7168, 2048, fp8=recipe, gate_up_interleaved=True,
                                     block_k=128, block_m=block_m, minibatch=4096,
                                     macrobatch=12288, tma=True)
        return mk.compile_megakernel(cfg, 7168, 2048)

    def spilled(lw):
        return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", lw.ptxas_log))

    assert build("rowwise_all", 64).registers < build("rowwise", 64).registers
    wide, wide_rowwise = build("rowwise_all", 128), build("rowwise", 128)
    assert "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3" in wide.mma_instructions
    assert spilled(wide) <= 16 < 256 <= spilled(wide_rowwise), (spilled(wide),
                                                              spilled(wide_rowwise))


def test_fp8_config_errors_name_the_field():
    with pytest.raises(mk.MoKConfigError, match=r"^fp8='e5m2' is invalid: allowed none \| "
                                                r"blockwise \| rowwise \| mx \| rowwise_all$"):
        mk.MoKConfig(fp8="e5m2")
    with pytest.raises(mk.MoKConfigError, match=r"^block_k=64 is invalid: allowed 128 with"):
        mk.MoKConfig(fp8="blockwise", gate_up_interleaved=True, block_k=64)
    with pytest.raises(mk.MoKConfigError, match=r"^block_n=128 is invalid: allowed 256 with"):
        mk.MoKConfig(fp8="mx", gate_up_interleaved=True, block_k=128, block_n=128)


def test_dispatch_moves_half_the_bytes_of_bf16_rows():
    """An FP8 row's values and scales fill just over half of its bf16 row's bytes; dispatch
    copies only those (bf16 elements per row, Kimi H 7168)."""
    from mok_kernels._details.tl_gemm_fp8 import BLOCKWISE, MX, ROWWISE, fp8_row_elements

    assert fp8_row_elements(7168, 0) == 7168
    assert fp8_row_elements(7168, BLOCKWISE) == (7168 + 7168 // 32) // 2 == 3696
    assert fp8_row_elements(7168, MX) == 3696
    assert fp8_row_elements(7168, ROWWISE) == 3586


@pytest.mark.parametrize("recipe, block_m", [("blockwise", 64), ("rowwise", 64),
                                             ("rowwise_all", 128)])
def test_fp8_training_backward_fits_in_shared_memory(recipe, block_m):
    """The backward of an FP8 training forward is the bf16 megakernel at the FP8 config's
    block_n 256, 128-row blocks (``bwd_block_m`` where the forward's are 64) and a bf16
    reduction step of 64: at the forward's block_k 128 its dX tiles needed 320 KB of shared
    memory at four stages (327712 bytes reported by Triton 3.6 on an H200, more than the
    227 KB of sm_90)."""
    from mokbench.mok_backend import default_config_fields, fp8_config_fields

    fields = {**default_config_fields(7168, 2048, 16384, 8, 132, 1, 48),
              **fp8_config_fields(90, recipe)}
    cfg = mk.MoKConfig.for_shape(7168, 2048, **fields)
    assert (cfg.block_m, cfg.bwd_bm) == (block_m, 128)
    lw = mk.compile_megakernel(cfg, 7168, 2048, shared=True, kernel="backward")
    assert lw.shared_bytes <= 232448, lw.shared_bytes
    # the BF16 backward's own build with the shared expert: a few dozen bytes of spill
    # stores at 128-row blocks, as test_mok_lowering's bound for it
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", lw.ptxas_log)]
    assert max(spills, default=0) <= 64, lw.ptxas_log
