"""mok forward on one GPU: against the float32 reference layer, edge routings, loopback EP,
determinism, CUDA-graph replay, and the bounded-wait timeout. Sizes are small (the file runs
in well under two minutes, most of it Triton compilation)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")

import mok_kernels as mk  # noqa: E402
from mokbench.reference import reference_all_experts  # noqa: E402

DEV = "cuda"


def make_layer(L, T, H, I, E, K, shared=True, seed=0, idx=None):
    """Random bf16 inputs and weights for L loopback ranks (E experts each)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    NE = L * E
    x = torch.randn(L * T, H, generator=g, device=DEV).bfloat16()
    if idx is None:
        idx = torch.rand(L * T, NE, generator=g, device=DEV).topk(K, dim=1).indices
    p = torch.softmax(torch.randn(L * T, K, generator=g, device=DEV), 1)
    w1 = (torch.randn(NE, H, 2 * I, generator=g, device=DEV) * H ** -0.5).bfloat16()
    w2 = (torch.randn(NE, I, H, generator=g, device=DEV) * I ** -0.5).bfloat16()
    ws1 = (torch.randn(H, 2 * I, generator=g, device=DEV) * H ** -0.5).bfloat16() if shared \
        else None
    ws2 = (torch.randn(I, H, generator=g, device=DEV) * I ** -0.5).bfloat16() if shared \
        else None
    return x, idx, p, (w1, w2, ws1, ws2)


def run_mok(cfg, L, x, idx, p, w, E, withhold=0):
    T = x.shape[0] // L
    ws = mk.get_workspace(cfg, tokens=T, hidden=x.shape[1], intermediate=w[1].shape[1],
                          local_experts=E, topk=idx.shape[1], shared=w[2] is not None,
                          device=DEV, loopback_ranks=L)
    sched = mk.build_schedule(ws, idx)
    y = mk.forward(cfg, ws, sched, x, p, *w, _withhold=withhold)
    return y, ws


def rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def check(cfg, L, T, H, I, E, K, shared=True, idx=None, seed=0):
    x, idx, p, w = make_layer(L, T, H, I, E, K, shared, seed, idx)
    y, ws = run_mok(cfg, L, x, idx, p, w, E)
    mk.check_errors(ws)
    assert y.shape == (L * T, H) and y.dtype == torch.bfloat16
    err = rel_err(y, reference_all_experts(x, idx, p, *w).y_TH)
    assert err < 1e-2, err
    return y


CFG = mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=768)


@pytest.mark.parametrize("comm", [0, 8])
def test_matches_reference(comm):
    check(mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=768, fwd_comm_sms=comm),
          1, 512, 2048, 256, 8, 4)


@pytest.mark.parametrize("comm, shared, ranks", [(0, True, 1), (0, False, 2), (8, True, 2)])
def test_tma_weights_match_reference(comm, shared, ranks):
    cfg = mk.MoKConfig.for_shape(7168, 512, minibatch=256, macrobatch=768, fwd_comm_sms=comm,
                                 tma=True)
    check(cfg, ranks, 256, 7168, 512, 4, 4, shared=shared)


@pytest.mark.parametrize("tma, tiles, comm", [(True, 2, 0), (True, 4, 8), (False, 2, 0)])
def test_several_tiles_per_item_match_reference(tma, tiles, comm):
    """down_tiles / gate_up_tiles > 1: the flattened tile loops (I 1024 = 8 gate+up tiles,
    H 4096 = 16 down tiles per row block)."""
    cfg = mk.MoKConfig.for_shape(4096, 1024, minibatch=256, macrobatch=768, fwd_comm_sms=comm,
                                 tma=tma, down_tiles=tiles, gate_up_tiles=tiles)
    check(cfg, 2, 256, 4096, 1024, 4, 4)


@pytest.mark.parametrize("tma, tiles, comm, ranks, stages", [
    (True, 1, 0, 1, 4), (True, 2, 8, 2, 4), (True, 1, 8, 2, 3), (False, 1, 0, 2, 3)])
def test_interleaved_gate_up_matches_reference(tma, tiles, comm, ranks, stages):
    """gate_up_interleaved: the caller passes interleave_gate_up(w1) (routed and shared);
    one dot per gate+up tile, split in registers. Four stages: the backend's default."""
    cfg = mk.MoKConfig.for_shape(4096, 1024, minibatch=256, macrobatch=768, fwd_comm_sms=comm,
                                 tma=tma, down_tiles=tiles, gate_up_tiles=tiles,
                                 gate_up_interleaved=True, num_stages=stages)
    x, idx, p, w = make_layer(ranks, 256, 4096, 1024, 4, 4, seed=11)
    w_il = (mk.interleave_gate_up(w[0]), w[1], mk.interleave_gate_up(w[2]), w[3])
    y, ws = run_mok(cfg, ranks, x, idx, p, w_il, 4)
    mk.check_errors(ws)
    assert rel_err(y, reference_all_experts(x, idx, p, *w).y_TH) < 1e-2


def test_strided_x_is_copied_and_matches():
    """A non-contiguous x goes through the workspace buffer; a contiguous one is read where
    it is: both give the same output."""
    x, idx, p, w = make_layer(1, 256, 2048, 256, 4, 4, seed=5)
    y1, ws = run_mok(CFG, 1, x, idx, p, w, 4)
    x_strided = torch.cat([x, x], dim=1)[:, :2048]
    y2, _ = run_mok(CFG, 1, x_strided, idx, p, w, 4)
    mk.check_errors(ws)
    assert not x_strided.is_contiguous() and torch.equal(y1, y2)


@pytest.mark.parametrize("comm, ranks", [(0, 1), (8, 2)])
def test_prefetched_tickets_match_reference_and_rerun_bitwise(comm, ranks):
    """prefetch_ticket: each compute program claims its next item early (backend defaults
    otherwise); same output as the reference and bitwise equal on a rerun."""
    cfg = mk.MoKConfig.for_shape(4096, 1024, minibatch=256, macrobatch=768, fwd_comm_sms=comm,
                                 tma=True, gate_up_interleaved=True, num_stages=4,
                                 prefetch_ticket=True)
    x, idx, p, w = make_layer(ranks, 256, 4096, 1024, 4, 4, seed=13)
    w_il = (mk.interleave_gate_up(w[0]), w[1], mk.interleave_gate_up(w[2]), w[3])
    y1, ws = run_mok(cfg, ranks, x, idx, p, w_il, 4)
    y2, _ = run_mok(cfg, ranks, x, idx, p, w_il, 4)
    mk.check_errors(ws)
    assert rel_err(y1, reference_all_experts(x, idx, p, *w).y_TH) < 1e-2 and torch.equal(y1, y2)


@pytest.mark.parametrize("comm, ranks, recipe, slots", [(0, 1, "none", 2), (8, 2, "none", 3),
                                                        (0, 2, "rowwise_all", 3),
                                                        (8, 1, "rowwise", 2)])
def test_skewed_down_items_give_the_same_output_bitwise(comm, ranks, recipe, slots):
    """skew_down (each minibatch's down items after the next minibatch's gate+up items), with
    and without communication programs, bf16 and FP8, two and three ring slots: the output
    bitwise the plain order's (every item computes the same tiles), and a rerun's."""
    kw = dict(minibatch=256, macrobatch=256 * slots, fwd_comm_sms=comm, tma=True,
              gate_up_interleaved=True, fp8=recipe)
    if recipe == "none":
        kw.update(num_stages=4, down_tiles=2, gate_up_tiles=2)
    else:
        kw.update(block_k=128, block_m=64)
    x, idx, p, w = make_layer(ranks, 512, 2048, 512, 4, 4, seed=19)
    il = mk.interleave_gate_up
    plain = mk.MoKConfig.for_shape(2048, 512, **kw)
    skew = mk.MoKConfig.for_shape(2048, 512, skew_down=True, **kw)
    w_il = (il(w[0]), w[1], il(w[2]), w[3])
    if recipe != "none":
        w_il = mk.quantize_weights(plain, *w_il)
    y0, _ = run_mok(plain, ranks, x, idx, p, w_il, 4)
    y1, ws = run_mok(skew, ranks, x, idx, p, w_il, 4)
    y2, _ = run_mok(skew, ranks, x, idx, p, w_il, 4)
    mk.check_errors(ws)
    assert torch.isfinite(y1).all()
    assert torch.equal(y1.view(torch.int16), y0.view(torch.int16))
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))


@pytest.mark.parametrize("ranks, shared, tiles, topk", [(1, False, 2, 8), (2, True, 1, 4),
                                                       (4, True, 2, 10)])
def test_fused_sum_matches_reference_and_unfused(ranks, shared, tiles, topk):
    """fused_sum: the last down item of each (token, column tile) writes y; against the
    reference, against the separate weighted-sum pass, bitwise on a rerun, and every
    (token, column item) counted exactly S times."""
    kw = dict(minibatch=256, macrobatch=768, tma=True, gate_up_interleaved=True, num_stages=4,
              down_tiles=tiles, gate_up_tiles=tiles)
    fused = mk.MoKConfig.for_shape(4096, 1024, fused_sum=True, **kw)
    x, idx, p, w = make_layer(ranks, 256, 4096, 1024, 12, topk, shared=shared, seed=17)
    w_il = (mk.interleave_gate_up(w[0]), w[1],
            mk.interleave_gate_up(w[2]) if shared else None, w[3])
    y1, ws = run_mok(fused, ranks, x, idx, p, w_il, 12)
    y2, _ = run_mok(fused, ranks, x, idx, p, w_il, 12)
    y0, _ = run_mok(mk.MoKConfig.for_shape(4096, 1024, **kw), ranks, x, idx, p, w_il, 12)
    mk.check_errors(ws)
    assert rel_err(y1, reference_all_experts(x, idx, p, *w).y_TH) < 1e-2 and torch.equal(y1, y2)
    assert (y1.float() - y0.float()).abs().max().item() <= 2 ** -6 * y0.float().abs().max()
    used = 4096 // 256 // tiles
    assert (ws.sums_LTJ[:, :, :used] == topk + int(shared)).all()


def test_fused_sum_cuda_graph_replay_equals_eager():
    cfg = mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=768, fused_sum=True)
    L, T, E, K = 2, 256, 4, 4
    x, idx, p, w = make_layer(L, T, 2048, 256, E, K, seed=21)
    gf = mk.GraphedForward(cfg, mk.get_workspace(
        cfg, tokens=T, hidden=2048, intermediate=256, local_experts=E, topk=K, shared=True,
        device=DEV, loopback_ranks=L), w)
    gf(x, idx, p)
    x2, idx2, p2, _ = make_layer(L, T, 2048, 256, E, K, seed=22)
    replayed = gf(x2, idx2, p2)
    eager, ws = run_mok(cfg, L, x2, idx2, p2, w, E)
    mk.check_errors(ws)
    assert torch.equal(replayed, eager)


@pytest.mark.parametrize("hidden", [4096, 6144, 7168])
def test_hidden_sizes(hidden):
    check(mk.MoKConfig.for_shape(hidden, 256, minibatch=256, macrobatch=768), 1, 256, hidden,
          256, 4, 2)


@pytest.mark.parametrize("topk", [1, 10])
def test_topk(topk):
    check(CFG, 1, 256, 2048, 256, 16, topk, shared=(topk == 1))


def test_empty_experts_and_one_hot_expert():
    T, E, K = 384, 8, 4
    idx = torch.tensor([0, 5, 6, 7], device=DEV).repeat(T, 1)  # experts 1-4 get nothing
    check(CFG, 1, T, 2048, 256, E, K, idx=idx)


def test_tokens_not_a_multiple_of_minibatch():
    check(mk.MoKConfig.for_shape(2048, 256, minibatch=384, macrobatch=768), 1, 301, 2048,
          256, 8, 4)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_loopback_ranks(ranks):
    check(CFG, ranks, 128, 2048, 256, 2, 4)


def test_loopback_with_comm_programs():
    cfg = mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=512, fwd_comm_sms=8)
    check(cfg, 2, 256, 2048, 256, 4, 4)


@pytest.mark.parametrize("comm", [0, 8])
def test_two_runs_bitwise_equal(comm):
    cfg = mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=768, fwd_comm_sms=comm)
    x, idx, p, w = make_layer(1, 512, 2048, 256, 8, 4, seed=3)
    y1, ws = run_mok(cfg, 1, x, idx, p, w, 8)
    y2, _ = run_mok(cfg, 1, x, idx, p, w, 8)
    mk.check_errors(ws)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_replay_equals_eager(compiled):
    """Schedule + forward captured once and replayed on new inputs; also with the schedule
    built through torch.compile (compile_schedule)."""
    cfg = mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=768,
                                 compile_schedule=compiled)
    L, T, E, K = 2, 256, 4, 4
    x, idx, p, w = make_layer(L, T, 2048, 256, E, K, seed=4)
    eager, ws = run_mok(cfg, L, x, idx, p, w, E)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_mok(cfg, L, x, idx, p, w, E)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = run_mok(cfg, L, x, idx, p, w, E)
    x2, idx2, p2, _ = make_layer(L, T, 2048, 256, E, K, seed=5)
    x.copy_(x2), idx.copy_(idx2), p.copy_(p2)
    graph.replay()
    fresh, _ = run_mok(cfg, L, x, idx, p, w, E)
    torch.cuda.synchronize()
    mk.check_errors(ws)
    assert torch.equal(out, fresh) and not torch.equal(out, eager)


@pytest.mark.parametrize("comm, withhold", [(0, mk.WITHHOLD_ROWBLOCK),
                                            (8, mk.WITHHOLD_DISPATCH)])
def test_withheld_signal_times_out(comm, withhold):
    """The kernel returns and the error names a wait. Which wait expires first is a race:
    everything downstream of the withheld signal waits too."""
    cfg = mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=768, fwd_comm_sms=comm,
                                 spin_budget=20_000)
    x, idx, p, w = make_layer(1, 512, 2048, 256, 8, 4, seed=6)
    _, ws = run_mok(cfg, 1, x, idx, p, w, 8, withhold=withhold)
    torch.cuda.synchronize()  # returns: the kernel exits instead of hanging
    with pytest.raises(mk.MoKTimeoutError, match=r"wait '.+' timed out"):
        mk.check_errors(ws)
    y, _ = run_mok(cfg, 1, x, idx, p, w, 8)  # the workspace is usable again afterwards
    mk.check_errors(ws)
    ref = reference_all_experts(x, idx, p, *w).y_TH
    assert ((y.float() - ref).norm() / y.float().norm()).item() < 1e-2


@pytest.mark.parametrize("recipe, comm, ranks, tma", [
    ("blockwise", 0, 1, False), ("blockwise", 8, 2, False), ("blockwise", 0, 2, True),
    ("rowwise", 0, 2, False), ("rowwise", 8, 2, True), ("mx", 0, 1, False),
    ("rowwise_all", 0, 2, True), ("rowwise_all", 8, 2, True), ("rowwise_all", 0, 1, False)])
def test_fp8_forward_within_fp8_bound_and_reruns_bitwise(recipe, comm, ranks, tma):
    """The FP8 forward (tokens quantised at the source, FP8 GEMMs, h quantised in the
    epilogue) against the float32 layer within the FP8 bound 0.1 (about 0.065 on CPU), NaN
    free, bitwise equal on a rerun; with and without communication programs (which move the
    FP8 rows through the ring), with weight tiles by pointer loads and through TMA. MXFP8 is an
    emulation before Blackwell."""
    bm = 128 if recipe == "mx" and torch.cuda.get_device_capability()[0] >= 10 else 64
    cfg = mk.MoKConfig.for_shape(2048, 512, minibatch=256, macrobatch=768, fp8=recipe,
                                 gate_up_interleaved=True, block_k=128, block_m=bm,
                                 fwd_comm_sms=comm, tma=tma)
    x, idx, p, w = make_layer(ranks, 200, 2048, 512, 4, 4, True)
    il = mk.interleave_gate_up
    fw = mk.quantize_weights(cfg, il(w[0]), w[1], il(w[2]), w[3])
    y, ws = run_mok(cfg, ranks, x, idx, p, fw, 4)
    again, _ = run_mok(cfg, ranks, x, idx, p, fw, 4)
    mk.check_errors(ws)
    assert torch.isfinite(y).all()
    assert torch.equal(y.view(torch.int16), again.view(torch.int16))
    assert rel_err(y, reference_all_experts(x, idx, p, *w).y_TH) < 0.1


def test_fp8_graphed_forward_equals_eager_from_the_first_call():
    """GraphedForward with FP8 (x quantised into the token buffer inside the graph): the first
    call (which captures) and a replay on new inputs both equal the eager FP8 forward."""
    cfg = mk.MoKConfig.for_shape(2048, 512, minibatch=256, macrobatch=768, fp8="blockwise",
                                 gate_up_interleaved=True, block_k=128, block_m=64)
    L, T, E, K = 1, 256, 4, 4
    x, idx, p, w = make_layer(L, T, 2048, 512, E, K, seed=6)
    il = mk.interleave_gate_up
    fw = mk.quantize_weights(cfg, il(w[0]), w[1], il(w[2]), w[3])
    eager, ws = run_mok(cfg, L, x, idx, p, fw, E)
    gf = mk.GraphedForward(cfg, ws, fw)
    first = gf(x, idx, p)
    x2, idx2, p2, _ = make_layer(L, T, 2048, 512, E, K, seed=7)
    replayed = gf(x2, idx2, p2)
    fresh, _ = run_mok(cfg, L, x2, idx2, p2, fw, E)
    torch.cuda.synchronize()
    mk.check_errors(ws)
    assert torch.equal(first, eager)
    assert torch.equal(replayed, fresh)


@pytest.mark.parametrize("ranks, shared, fp8", [(2, True, False), (4, False, False),
                                                 (2, True, True)])
def test_remote_only_dispatch_and_direct_combine_equal_the_plain_path_bitwise(ranks, shared,
                                                                              fp8):
    """``dispatch_remote_only`` (the communication programs pull only other ranks' rows; a
    rank's own rows read from its token buffer) and ``combine_direct`` (the down tiles write
    the combine slots; the communication programs only dispatch, each ring slot reused once
    the down tiles of its previous minibatch are done), alone and together, with a ring of
    three minibatches (so the dispatch waits for free slots): the output equals the plain
    communication programs' bit for bit (bf16 and FP8 rows), on a rerun too."""
    H, I, E, K, T = 2048, 512, 4, 8 if ranks == 4 else 4, 256
    kw = dict(minibatch=256, macrobatch=768, fwd_comm_sms=8, tma=True, gate_up_interleaved=True)
    if fp8:
        kw.update(fp8="rowwise_all", block_k=128, block_m=128, block_n=256)
    x, idx, p, w = make_layer(ranks, T, H, I, E, K, shared, seed=23)
    il = mk.interleave_gate_up
    wk = (il(w[0]), w[1], il(w[2]) if shared else None, w[3])
    out = []
    for ronly, direct in ((False, False), (True, False), (False, True), (True, True),
                          (True, True)):
        cfg = mk.MoKConfig.for_shape(H, I, dispatch_remote_only=ronly, combine_direct=direct,
                                     **kw)
        wq = mk.quantize_weights(cfg, *wk) if fp8 else wk
        y, ws = run_mok(cfg, ranks, x, idx, p, wq, E)
        mk.check_errors(ws)
        out.append(y)
    for y in out[1:]:
        assert torch.equal(out[0].view(torch.int16), y.view(torch.int16))
    assert rel_err(out[0], reference_all_experts(x, idx, p, *w).y_TH) < (0.1 if fp8 else 1e-2)


@pytest.mark.parametrize("ranks, shared, fp8", [(2, True, False), (4, False, False),
                                                 (2, True, True)])
def test_dispatch_dedup_equals_the_plain_pull_bitwise(ranks, shared, fp8):
    """``dispatch_dedup``: a remote token's row pulled once per rank into the token cache, its
    other rows there copied from the cache: the ring holds the same rows, so the output equals
    the plain pull's bit for bit (bf16 and FP8 rows), on a rerun too; with many experts per
    token on one rank (topk 8 of 4 experts per rank) most rows are copies."""
    H, I, E, K, T = 2048, 512, 4, 8 if ranks == 4 else 4, 256
    kw = dict(minibatch=256, macrobatch=768, fwd_comm_sms=8, tma=True, gate_up_interleaved=True)
    if fp8:
        kw.update(fp8="rowwise_all", block_k=128, block_m=128, block_n=256)
    x, idx, p, w = make_layer(ranks, T, H, I, E, K, shared, seed=21)
    il = mk.interleave_gate_up
    wk = (il(w[0]), w[1], il(w[2]) if shared else None, w[3])
    out = []
    for dedup in (False, True, True):
        cfg = mk.MoKConfig.for_shape(H, I, dispatch_dedup=dedup, **kw)
        wq = mk.quantize_weights(cfg, *wk) if fp8 else wk
        y, ws = run_mok(cfg, ranks, x, idx, p, wq, E)
        mk.check_errors(ws)
        out.append(y)
    assert torch.equal(out[0].view(torch.int16), out[1].view(torch.int16))
    assert torch.equal(out[1].view(torch.int16), out[2].view(torch.int16))
    assert rel_err(out[1], reference_all_experts(x, idx, p, *w).y_TH) < (0.1 if fp8 else 1e-2)
