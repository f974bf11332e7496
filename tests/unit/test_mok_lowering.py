"""The megakernel compiled for Hopper and Blackwell on a CPU host (Triton's compiler and
bundled ptxas), with the mok backend's defaults at the Kimi shape: it lowers, fits in shared
memory, does not spill, pipelines both K loops with the configured stages, and on Hopper uses
the full-width MMA (m64n256) without ptxas serialising it."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

import mok_kernels as mk  # noqa: E402
from mokbench.mok_backend import default_config_fields  # noqa: E402

H, I = 7168, 2048
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on H100/H200 (227 KB)


def _defaults(world_size: int = 1, experts: int = 48, tokens: int = 16384,
              arch: int = 90) -> mk.MoKConfig:
    """The backend's defaults for the shape, with the row pull: the pull by token is a kernel
    of its own, outside the megakernel these tests build, and the variants here that replace
    the separate pull would conflict with it."""
    return mk.MoKConfig.for_shape(H, I, **_row_pull(
        H, I, tokens, 8, 132, world_size, experts // world_size, arch))


def _row_pull(*shape) -> dict:
    """``default_config_fields(*shape)`` with the row pull (see ``_defaults``), and the dX
    items inside the megakernel (``bwd_dx_gluon`` off: its launch is built by
    ``compile_dx_gluon``; the FP8 dX items these tests also build exclude it)."""
    return {**default_config_fields(*shape), "bwd_pull_by_token": False, "bwd_dx_gluon": False,
            "bwd_dx_rows": False}


@pytest.mark.parametrize("world_size, shared, experts, tokens, tiles", [
    (1, False, 48, 16384, 4),   # well loaded: four tiles per work item, one flattened loop
    (2, True, 48, 16384, 4),
    (1, False, 384, 4096, 1),   # 85 rows per expert: one tile
])
def test_hopper_build_of_the_defaults(world_size, shared, experts, tokens, tiles):
    cfg = _defaults(world_size, experts, tokens)
    assert (cfg.gate_up_tiles, cfg.down_tiles) == (tiles, tiles)
    lw = mk.compile_megakernel(cfg, H, I, shared=shared, comm_programs=cfg.fwd_comm_sms)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills, lw.ptxas_log
    assert not lw.mma_serialized, lw.ptxas_log
    stages = cfg.num_stages
    # both K loops keep `stages` buffers of their A and B tiles in flight
    assert lw.ttgir.count(f"memdesc<{stages}x{cfg.block_m}x{cfg.block_k}xbf16") >= 2
    assert lw.ttgir.count(f"memdesc<{stages}x{cfg.block_k}x{cfg.block_n}xbf16") >= 2
    mmas = {ln.split()[0] for ln in lw.ptx.splitlines() if "wgmma.mma_async" in ln}
    assert mmas == {"wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"}, mmas


def test_hopper_build_with_the_sum_inside():
    """fused_sum at 48 x 16384 (four tiles per item): the summing code after the down tiles
    keeps the build free of spills and serialised MMAs."""
    cfg = mk.MoKConfig.for_shape(H, I, **{**_row_pull(H, I, 16384, 8, 132, 1, 48),
                                          "fused_sum": True})
    lw = mk.compile_megakernel(cfg, H, I)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills and not lw.mma_serialized, lw.ptxas_log


@pytest.mark.parametrize("experts, tokens", [(48, 16384), (384, 4096)])
def test_training_forward_stores_its_pre_activations_through_tma(experts, tokens):
    """``pre_tma_store`` at the backend's defaults (three stages and four tiles per item at
    48 x 16384, four stages and one tile at 384 x 4096): the training build's plain
    pre-activation store spills there (Triton 3.9); through TMA it does not, fits in
    shared memory, and stores each tile as two bulk tensor copies. In the flattened loop of
    four tiles their shared buffer is waited for only until it is read (before it is
    written again); with one tile per item Triton waits for each copy to complete."""
    fields = _row_pull(H, I, tokens, 8, 132, 1, experts)
    plain = mk.compile_megakernel(mk.MoKConfig.for_shape(H, I, **fields), H, I, training=True)
    lw = mk.compile_megakernel(mk.MoKConfig.for_shape(H, I, **fields, pre_tma_store=True),
                               H, I, training=True)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills and not lw.mma_serialized, lw.ptxas_log
    ops = lw.sass_opcodes()
    assert ops["UTMASTG"] == 2 and ops["UTMASTG"] > plain.sass_opcodes()["UTMASTG"]
    assert ops["STG"] < plain.sass_opcodes()["STG"]
    stores = [ln for ln in lw.ptx.splitlines() if "cp.async.bulk.tensor.2d.global.shared" in ln]
    assert len(stores) == 2
    reads = lw.ptx.count("cp.async.bulk.wait_group.read")
    assert reads >= 2 if experts == 48 else reads == 0, reads


@pytest.mark.parametrize("fp8", ["none", "rowwise_all"])
def test_hopper_build_with_skewed_down_items(fp8):
    """skew_down at the backend's defaults for 48 x 16384 (bf16: four tiles per item; FP8:
    rowwise_all, one tile per item, 128-row blocks): the ticket decoding keeps the build free
    of spills and serialised MMAs."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_row_pull(H, I, 16384, 8, 132, 1, 48),
              **(fp8_config_fields(90, fp8) if fp8 != "none" else {}), "skew_down": True}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    lw = mk.compile_megakernel(cfg, H, I)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills and not lw.mma_serialized, lw.ptxas_log


def test_blackwell_build_of_the_defaults():
    cfg = _defaults(2, arch=100)
    assert (cfg.gate_up_tiles, cfg.down_tiles) == (1, 1)  # the tile rule is Hopper's
    lw = mk.compile_megakernel(cfg, H, I, shared=True, comm_programs=cfg.fwd_comm_sms, arch=100)
    assert "tcgen05.mma" in lw.ptx and not lw.spills, lw.ptxas_log


def _spill_bytes(log: str) -> int:
    import re

    return max((int(n) for n in re.findall(r"(\d+) bytes spill stores", log)), default=0)


@pytest.mark.parametrize("world_size, shared, experts, tokens", [
    (1, False, 48, 16384),
    (1, True, 48, 16384),
    (2, True, 48, 16384),
])
def test_hopper_build_of_the_backward(world_size, shared, experts, tokens):
    """The backward kernel with the backend's defaults: fits in shared memory, full-width
    MMAs (m64n256) for every item kind, dA included (``bwd_wide_da``), none serialised, and
    at most a few dozen bytes of spill stores (48 with Triton 3.6; every item kind alone
    builds without spills)."""
    cfg = _defaults(world_size, experts, tokens)
    lw = mk.compile_megakernel(cfg, H, I, shared=shared, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.mma_serialized, lw.ptxas_log
    assert lw.mma_instructions == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"]
    assert _spill_bytes(lw.ptxas_log) <= 64, lw.ptxas_log


@pytest.mark.parametrize("phases, wide", [(1, False), (2, False), (4, False), (8, False),
                                          (1, True)])
def test_each_backward_item_kind_builds_without_spills(phases, wide):
    """Each item kind alone; ``bwd_wide_da``: the dA items at block_n columns (m64n256). The
    weight-gradient items (C: 4, D: 8) read through TMA what the A items wrote with plain
    stores, so they fence the async proxy after their group's acquire even with the pull
    outside the megakernel (the defaults)."""
    cfg = mk.MoKConfig.for_shape(H, I, **{**_defaults().__dict__, "bwd_wide_da": wide})
    assert not cfg.bwd_fused_pull
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", phases=phases)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills, lw.ptxas_log
    if phases in (4, 8):
        assert "fence.proxy.async.global" in lw.ptx
    if wide:
        assert lw.mma_instructions == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"]


def test_lean_da_epilogue_takes_half_the_instructions():
    """``bwd_lean_epilogue`` (on by default): the dA items' sigmoid by ``ex2.approx.ftz`` and
    ``rcp.approx.ftz``, no ``div.full`` left, each once per element (the r h store converts
    its value instead of recomputing the sigmoid in a second register layout); off, Triton's
    ``ex2.approx`` and ``div.full``, each twice per element. In the sm_90 SASS of the dA items
    alone (phase mask 1) that halves the MUFU instructions and cuts the whole build's by more
    than 40% (7000 to 3696 with Triton 3.9); both fit without spills."""
    assert _defaults().bwd_lean_epilogue
    builds = {}
    for lean in (True, False):
        cfg = mk.MoKConfig.for_shape(H, I, **{**_defaults().__dict__, "bwd_lean_epilogue": lean})
        lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", phases=1)
        assert not lw.spills, lw.ptxas_log
        ops = re.findall(r"\b(ex2\.approx[.a-z]*\.f32|rcp\.approx[.a-z]*\.f32|div\.[a-z]+\.f32)\b",
                         lw.ptx)
        # a [128, 256] tile over 256 threads: 128 elements a thread
        want = {"ex2.approx.ftz.f32": 128, "rcp.approx.ftz.f32": 128} if lean else {
            "ex2.approx.f32": 256, "div.full.f32": 256}
        assert {op: ops.count(op) for op in set(ops)} == want
        builds[lean] = lw.sass_opcodes()
    lean, plain = builds[True], builds[False]
    assert lean["MUFU"] <= plain["MUFU"] // 2 + 8, (lean["MUFU"], plain["MUFU"])
    assert lean.total() < 0.6 * plain.total(), (lean.total(), plain.total())


def test_da_items_without_epilogue_keep_their_k_loop_only():
    """Phase bit 16 (profiling: the dA items' K loop alone): the dA-only build keeps its
    m64n256 MMAs but loses the SwiGLU backward's exponentials and the epilogue's stores of
    r h and dG/dU; with bit 16 off the same build has them."""
    cfg = _defaults()
    full = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", phases=1)
    bare = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", phases=17)
    for lw in (full, bare):
        assert lw.mma_instructions == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"]
        assert not lw.spills, lw.ptxas_log
    assert full.ptx.count("ex2.approx") >= 4 and "ex2.approx" not in bare.ptx
    assert bare.ptx.count("st.global") < full.ptx.count("st.global") // 4


def test_dx_bands_build_as_the_default_order():
    """``bwd_dx_band`` changes only index arithmetic: against the row-block-major order, the
    whole backward with it (bf16 defaults, shared expert) fits,
    keeps the full-width MMAs and spills within the default build's bound
    (``test_hopper_build_of_the_backward``; a few bytes more than the plain order with
    Triton 3.9)."""
    base = mk.MoKConfig.for_shape(H, I, **{**_defaults().__dict__, "bwd_dx_band": 0})
    cfg = mk.MoKConfig.for_shape(H, I, **{**base.__dict__, "bwd_dx_band": 16})
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward")
    plain = mk.compile_megakernel(base, H, I, shared=True, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT
    assert lw.mma_instructions == plain.mma_instructions
    assert not lw.mma_serialized, lw.ptxas_log
    assert _spill_bytes(lw.ptxas_log) <= max(64, _spill_bytes(plain.ptxas_log)), lw.ptxas_log


@pytest.mark.parametrize("pullers", [0, 24])
def test_fused_pull_backward_builds_with_async_proxy_fences(pullers):
    """``bwd_fused_pull``: the pull items inside the backward kernel (by every program, or by
    ``bwd_pull_programs`` of them); it still fits, spills nothing, and fences the async proxy
    where plain-store rows meet TMA reads (after each pull item, before the dA, dW_down and
    dW_gate_up items read the rows)."""
    cfg = mk.MoKConfig.for_shape(H, I, **{**_defaults().__dict__, "bwd_fused_pull": True,
                                          "bwd_pull_programs": pullers})
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills, lw.ptxas_log
    assert lw.ptx.count("fence.proxy.async.global") >= 4


@pytest.mark.parametrize("knobs", [{"bwd_dx_tiles": 4},
                                   {"bwd_da_tiles": 4, "bwd_wide_da": False,
                                    "bwd_dx_tiles": 1, "bwd_stages": 4}])
def test_tiles_per_item_backward_fits(knobs):
    """``bwd_dx_tiles`` / ``bwd_da_tiles``: four dX or dA tiles per item in one flattened
    loop (dA with one dX tile: four of each spill); it fits in shared memory and
    spills nothing (no shared expert; with it the sm_90 build spills 96-180 bytes). Four dA
    tiles at the four-stage depth they were timed at (at three, the default's, Triton 3.9
    spills 4 bytes)."""
    cfg = mk.MoKConfig.for_shape(H, I, **{**_defaults().__dict__, **knobs})
    lw = mk.compile_megakernel(cfg, H, I, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT, lw.shared_bytes
    assert not lw.spills, lw.ptxas_log


@pytest.mark.parametrize("tiles, stages", [(1, 2), (4, 2), (4, 4)])
def test_weight_gradient_items_fit_at_their_depth(tiles, stages):
    """``bwd_dw_tiles``: one weight-gradient tile per item, or four in flattened loops of
    ``bwd_dw_stages`` (2: both loops two deep; 4: dW_gate_up four, dW_down three, the one
    pairing of deeper loops that fits beside each other); the whole backward fits in shared
    memory and spills nothing (no shared expert; the one-tile items once spilled 20 bytes
    when their output pointers were formed before the GEMM)."""
    cfg = mk.MoKConfig.for_shape(H, I, **{**_defaults().__dict__, "bwd_dw_tiles": tiles,
                                          "bwd_dw_stages": stages})
    lw = mk.compile_megakernel(cfg, H, I, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT, lw.shared_bytes
    assert not lw.spills, lw.ptxas_log
    if tiles > 1:
        c_depth, d_depth = (2, 2) if stages == 2 else (3, 4)
        for depth, operand in ((c_depth, "x128xbf16"), (c_depth, "x256xbf16"),
                               (d_depth, "x128xbf16"), (d_depth, "x256xbf16")):
            assert f"memdesc<{depth}x64{operand}" in lw.ttgir, (depth, operand)


def test_backward_stages_set_the_dgrad_loops_depth_alone():
    """``bwd_stages`` 3: the dA items' K loop (phase mask 17) builds with the ring of a
    three-stage build (the shared memory of ``num_stages`` 3, less than four's), while the
    forward, built from ``num_stages`` (4 here), is unchanged; 0 keeps the forward's. Three is
    the backend's one-Hopper-rank bf16 default for both at this well-loaded shape."""
    assert _defaults().bwd_stages == 3 and _defaults().num_stages == 3
    base = mk.MoKConfig.for_shape(H, I, **{**_defaults().__dict__, "bwd_stages": 0,
                                           "num_stages": 4})
    three = mk.MoKConfig.for_shape(H, I, **{**base.__dict__, "bwd_stages": 3})
    ns3 = mk.MoKConfig.for_shape(H, I, **{**base.__dict__, "num_stages": 3})
    da = {name: mk.compile_megakernel(cfg, H, I, kernel="backward", phases=17).shared_bytes
          for name, cfg in (("default", base), ("bwd_stages", three), ("num_stages", ns3))}
    assert da["bwd_stages"] == da["num_stages"] < da["default"], da
    fwd = [mk.compile_megakernel(cfg, H, I).shared_bytes for cfg in (base, three)]
    assert fwd[0] == fwd[1]


@pytest.mark.parametrize("dx_tiles", [1, 4])
def test_dx_items_through_tma_build_without_copies(dx_tiles):
    """``bwd_dx_tma``: the dX (B) items alone (phase mask 2) load both GEMM operands through
    TMA descriptors, with no per-thread asynchronous copy left (the default's B items copy
    their dGU rows), fenced once after the acquire, fitting with no spills and in fewer
    registers than the copies need."""
    knobs = {**_defaults().__dict__, "bwd_dx_tiles": dx_tiles}
    tma = mk.compile_megakernel(mk.MoKConfig.for_shape(H, I, **{**knobs, "bwd_dx_tma": True}),
                                H, I, kernel="backward", phases=2)
    copies = mk.compile_megakernel(mk.MoKConfig.for_shape(H, I, **{**knobs,
                                                                    "bwd_dx_tma": False}),
                                   H, I, kernel="backward", phases=2)
    assert copies.ttgir.count("ttg.async_copy_global_to_local") > 0
    assert tma.ttgir.count("ttg.async_copy_global_to_local") == 0
    assert tma.ttgir.count("async_tma_copy_global_to_local") >= 2
    assert tma.ptx.count("fence.proxy.async.global") >= 1
    assert tma.shared_bytes <= SMEM_LIMIT and not tma.spills, tma.ptxas_log
    assert tma.registers < copies.registers, (tma.registers, copies.registers)


def test_split_gate_up_backward_fits_with_two_stages():
    cfg = mk.MoKConfig.for_shape(2048, 256, minibatch=256, macrobatch=768, tma=True,
                                 num_stages=4)
    lw = mk.compile_megakernel(cfg, 2048, 256, shared=True, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT


@pytest.mark.parametrize("knobs", [{"bwd_fp8_da": True}, {"bwd_fp8_dx": True},
                                   {"bwd_fp8_da": True, "bwd_fp8_dx": True}])
@pytest.mark.parametrize("fp8_forward", [False, True])
def test_fp8_dgrad_items_build_with_e4m3_mmas(knobs, fp8_forward):
    """``bwd_fp8_da`` / ``bwd_fp8_dx`` with the backend's defaults (bf16, or the FP8
    forward's): the FP8 items run full-width e4m3 MMAs (m64n256k32), the others stay bf16,
    the kernel fits in shared memory; the dX items alone build without spills. The whole
    kernel spills a little (108-184 bytes with Triton 3.9: the dA items' pointer gathers of
    the FP8 dY rows, the dG/dU requantisation in the dA item that completes a row block):
    bounded here until a GPU run times the knobs."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_defaults().__dict__, **(fp8_config_fields(90) if fp8_forward else {}),
              **knobs}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.mma_serialized, lw.ptxas_log
    assert sorted(lw.mma_instructions) == [
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3"]
    assert _spill_bytes(lw.ptxas_log) <= 192, lw.ptxas_log
    if knobs.get("bwd_fp8_dx") and not fp8_forward:
        dx_only = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", phases=2)
        assert not dx_only.spills, dx_only.ptxas_log
        assert dx_only.mma_instructions == [
            "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3"]


@pytest.mark.parametrize("tiles", [4, 1])
@pytest.mark.parametrize("dgrad8", [False, True])
def test_fp8_weight_gradients_build_with_e4m3_mmas(dgrad8, tiles):
    """``bwd_fp8_wgrad`` (alone, and with both FP8 dgrad knobs) at the backend's defaults
    (four weight-gradient and dX tiles per item, as ``fp8_backward_fields`` leaves them) and
    with one of each: the weight-gradient items run full-width e4m3 MMAs on their TMA tiles
    and fit in shared memory; the whole kernel spills a little (172-364 bytes with Triton
    3.9; ptxas's allocation over the whole kernel moves with any item's code): bounded here.
    The weight-gradient items built on their own (the Q and C items, the Q and D items) do
    not spill with one tile and spill under 128 bytes with four (88 and 24, Triton 3.9). The
    Q items read r h and dG/dU through pipelined TMA copies and store their transposed copies
    as 16-byte vectors."""

    fields = {**_row_pull(H, I, 16384, 8, 132, 1, 48, 90), "bwd_fp8_wgrad": True,
              "bwd_fp8_da": dgrad8, "bwd_fp8_dx": dgrad8,
              "bwd_dw_tiles": tiles, "bwd_dx_tiles": tiles}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.mma_serialized, lw.ptxas_log
    e4m3 = "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3"
    bf16 = "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"
    assert sorted(set(lw.mma_instructions)) == ([e4m3] if dgrad8 else [bf16, e4m3])
    assert _spill_bytes(lw.ptxas_log) <= 384, lw.ptxas_log
    for phases in (4, 8):  # the C items (with the Q items), the D items (with the Q items)
        part = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", phases=phases)
        assert _spill_bytes(part.ptxas_log) <= (0 if tiles == 1 else 128), part.ptxas_log
        assert part.mma_instructions and set(part.mma_instructions) == {e4m3}
        # the Q items read r h and dG/dU through TMA, pipelined: copies ahead of the loops
        for desc in ("hs_c_desc", "pre_q_desc"):
            copies = re.findall(rf"async_tma_copy_global_to_local %{desc}\[", part.ttgir)
            assert len(copies) >= 2, (desc, len(copies))
        assert "st.global.b8" not in part.ptx  # 16-byte vectors, not one byte per thread


@pytest.mark.parametrize("fp8_forward", [False, True])
def test_whole_fp8_backward_builds_with_128_deep_steps(fp8_forward):
    """``bwd_fp8_block_k=128`` with the three FP8 backward knobs (bf16 or FP8 forward
    defaults): every GEMM an e4m3 MMA, 128-byte e4m3 TMA boxes for the weights and the
    transposed copies, the kernel within sm_90's shared memory (196.6 KB with Triton 3.9,
    twice the 64-deep build's), small spills (320 bytes with Triton 3.9, 400 with 3.6;
    ptxas's allocation over the whole kernel moves with any item's code)."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_row_pull(H, I, 16384, 8, 132, 1, 48, 90),
              **(fp8_config_fields(90) if fp8_forward else {}), "bwd_fp8_da": True,
              "bwd_fp8_dx": True, "bwd_fp8_wgrad": True, "bwd_fp8_block_k": 128}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.mma_serialized, lw.ptxas_log
    assert sorted(set(lw.mma_instructions)) == [
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3"]
    assert _spill_bytes(lw.ptxas_log) <= 416, lw.ptxas_log
    boxes = set(re.findall(r"tensordesc<(\d+)x(\d+)xf8E4M3FN", lw.ttgir))
    assert boxes and all(k == "128" for _, k in boxes), boxes


def _whole_fp8_backward(knobs: dict):
    """(config, build) of the whole FP8 backward (the backend's FP8 fields, the three FP8
    knobs, 128-deep steps) at the Kimi shape with ``knobs``; the build fits sm_90's shared
    memory and runs e4m3 MMAs only."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_row_pull(H, I, 16384, 8, 132, 1, 48, 90), **fp8_config_fields(90),
              "bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True,
              "bwd_fp8_block_k": 128, **knobs}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward")
    assert lw.shared_bytes <= SMEM_LIMIT
    assert sorted(set(lw.mma_instructions)) == [
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3"]
    return cfg, lw


@pytest.mark.parametrize("knobs", [{"bwd_fused_pull": True, "bwd_pull_programs": 0},
                                   {"bwd_fused_pull": True, "bwd_pull_programs": 32},
                                   {"bwd_fp8_block_colmax": True}])
def test_whole_fp8_backward_builds_with_pull_items_or_block_maxima(knobs):
    """The whole FP8 backward with ``bwd_fused_pull`` (the pull items write the FP8
    transposed copies of x and dY; every program pulls first, or 32 of them while the rest
    start on the dA items), or with ``bwd_fp8_block_colmax``: e4m3 MMAs only, within sm_90's
    shared memory, small spills (Triton 3.9: 324 bytes with the pull items, 340 with the
    block maxima, 320 with none; Triton 3.6: 92, 468, 400 with none), and the async proxy
    fenced after each pull item and before the weight-gradient items read TMA copies."""
    lw = _whole_fp8_backward(knobs)[1]
    assert _spill_bytes(lw.ptxas_log) <= 544, lw.ptxas_log
    assert lw.ptx.count("fence.proxy.async.global") >= 4


def test_whole_fp8_backward_builds_for_blackwell():
    """The three FP8 backward knobs together at the backend's Blackwell defaults (sm_100, the
    MXFP8 forward's config): every backward GEMM is a tcgen05 e4m3 MMA (kind::f8f6f4), the
    kernel fits in shared memory, its spills stay small (76 bytes with Triton 3.9). Built
    only: unverified on Blackwell hardware."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_row_pull(H, I, 16384, 8, 148, 1, 48, 100), **fp8_config_fields(100),
              "bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", arch=100)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert sorted(set(lw.mma_instructions)) == ["tcgen05.mma.cta_group::1.kind::f8f6f4"]
    assert _spill_bytes(lw.ptxas_log) <= 96, lw.ptxas_log


@pytest.mark.parametrize("fp8_forward", [False, True])
def test_dispatch_dedup_builds_without_spills(fp8_forward):
    """``dispatch_dedup`` at the EP-2 defaults (16 communication programs): the forward with
    the token cache and its flags builds like the plain pull, in the same shared memory and
    without spills."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_row_pull(H, I, 8192, 8, 132, 2, 6, 90),
              **(fp8_config_fields(90) if fp8_forward else {})}
    plain = mk.compile_megakernel(mk.MoKConfig.for_shape(H, I, **fields), H, I, shared=True,
                                  comm_programs=16)
    lw = mk.compile_megakernel(mk.MoKConfig.for_shape(H, I, **fields, dispatch_dedup=True), H,
                               I, shared=True, comm_programs=16)
    assert lw.shared_bytes == plain.shared_bytes <= SMEM_LIMIT
    assert not lw.spills, lw.ptxas_log


@pytest.mark.parametrize("fp8_forward", [False, True])
def test_direct_communication_builds_like_the_plain_pull(fp8_forward):
    """``dispatch_remote_only`` and ``combine_direct`` together at the EP-2 defaults (16
    communication programs): the same shared memory as the plain pull, and spills within
    64 bytes of its build (bf16 at H 7168: 60 bytes under Triton 3.9 against none for the
    plain pull; none under 3.6, the GPU machine's; FP8: 28 bytes under 3.6)."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_row_pull(H, I, 8192, 8, 132, 2, 6, 90),
              **(fp8_config_fields(90) if fp8_forward else {})}
    plain = mk.compile_megakernel(mk.MoKConfig.for_shape(H, I, **fields), H, I, shared=True,
                                  comm_programs=16)
    cfg = mk.MoKConfig.for_shape(H, I, **fields, dispatch_remote_only=True, combine_direct=True)
    lw = mk.compile_megakernel(cfg, H, I, shared=True, comm_programs=16)
    assert lw.shared_bytes == plain.shared_bytes <= SMEM_LIMIT
    assert _spill_bytes(lw.ptxas_log) <= _spill_bytes(plain.ptxas_log) + 64, lw.ptxas_log


def _global_ops(ptx: str) -> list[str]:
    """Every plain global load and store of a build's PTX, with its width
    (``ld.global.v4.b32``, ``st.global.b8``, ...), in order."""
    return re.findall(r"\b((?:ld|st)\.global(?:\.[a-z0-9]+)+)", ptx)


def _narrow(ops: list[str]) -> list[str]:
    """The byte- and halfword-wide ones among ``ops``."""
    return [op for op in ops if op.endswith((".b8", ".u8", ".b16", ".u16"))]


@pytest.mark.parametrize("kind, phase, interleave", [
    ("bf16", 0, False), ("bf16", 1, False), ("bf16", 2, False), ("fp8t", 0, False),
    ("fp8t", 1, False), ("fp8t", 2, False), ("bf16_by_token", 0, False), ("fp8t", 0, True)])
def test_separate_pulls_move_rows_in_16_byte_vectors(kind, phase, interleave):
    """The backward's separate pulls (the bf16 one, ``bwd_pull_by_token``'s token by token,
    and ``bwd_fp8_wgrad``'s transposing one; one pass, or the two of ``bwd_pull_dedup``)
    build for sm_90 and load the gathered bf16 rows and store their copies as 16-byte
    vectors. Without the rows' alignment said (their
    offsets are loaded values) every bf16 was loaded alone; with a row mask on the
    transposed stores every byte was stored alone, and the transposing pull took most of the
    FP8 backward's time on an H200. With ``bwd_pull_interleave`` (a program's row block from
    the block order) the same."""
    from mok_kernels._details.quant_lowering import compile_pull_kernel

    lw = compile_pull_kernel(kind, phase, hidden=4096, interleave=interleave)
    ops = _global_ops(lw.ptx)
    assert not _narrow(ops), sorted(set(ops))
    assert ops.count("ld.global.v4.b32") >= 16, sorted(set(ops))
    assert ops.count("st.global.v4.b32") >= 8, sorted(set(ops))


@pytest.mark.parametrize("kind", ["bf16", "bf16_by_token"])
def test_bf16_pulls_in_256_column_steps_hold_fewer_registers(kind):
    """``bwd_pull_cols`` 256 at the Kimi hidden size: either bf16 pull builds for sm_90 with
    16-byte vectors, no spills and under half the registers of its 1024-column steps (the
    pull by token spills there: 255 registers, 152 bytes of spill stores, Triton 3.9)."""
    from mok_kernels._details.quant_lowering import compile_pull_kernel

    wide = compile_pull_kernel(kind, 0, hidden=7168)
    narrow = compile_pull_kernel(kind, 0, hidden=7168, cols=256)
    assert not narrow.spills, narrow.ptxas_log
    assert 2 * narrow.registers < wide.registers, (narrow.registers, wide.registers)
    ops = _global_ops(narrow.ptx)
    assert not _narrow(ops)
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops


def test_prefetching_pull_loads_the_next_chunk_before_it_stores():
    """``bwd_pull_prefetch``: the FP8 pull's sm_90 build loads the next chunk's x and dY
    rows (16-byte vectors) ahead of the current chunk's stores: twice the plain loop's row
    loads (the first chunk's before the loop, the next chunk's in it), no byte-wide access,
    no spills."""
    from mok_kernels._details.quant_lowering import compile_pull_kernel

    plain = compile_pull_kernel("fp8t", 0, hidden=7168, interleave=True)
    ahead = compile_pull_kernel("fp8t", 0, hidden=7168, interleave=True, prefetch=True)
    ops = _global_ops(ahead.ptx)
    assert ops.count("ld.global.v4.b32") == 2 * _global_ops(plain.ptx).count(
        "ld.global.v4.b32") > 0
    assert not _narrow(ops)
    assert not ahead.spills, ahead.ptxas_log


@pytest.mark.parametrize("phase", [0, 1, 2])
def test_prequantised_pull_moves_e4m3_rows_in_wide_words(phase):
    """``bwd_fp8_prequant``'s pull (the rows e4m3 at home, moved as bytes into the
    transposed copies; one pass, or the two of ``bwd_pull_dedup``) builds for sm_90 with no
    byte-wide global load or store, no fp32 arithmetic of its own (nothing is scaled or
    converted), and its loads as wide vectors."""
    from mok_kernels._details.quant_lowering import compile_pull_kernel

    lw = compile_pull_kernel("fp8t", phase, hidden=4096, prequant=True)
    ops = _global_ops(lw.ptx)
    assert not _narrow(ops), sorted(set(ops))
    assert any(op.startswith("ld.global.v") for op in ops), sorted(set(ops))
    assert "cvt.rn.satfinite.e4m3x2.f32" not in lw.ptx and "mul.f32" not in lw.ptx


@pytest.mark.parametrize("kernel, knobs", [
    ("forward", {}), ("backward", {}),
    ("backward", {"bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True})])
def test_megakernels_access_global_memory_in_wide_words(kernel, knobs):
    """Every plain global load and store of the megakernels (forward, bf16 backward, whole
    FP8 backward) moves at least 4 bytes per thread: a 1- or 2-byte access means Triton
    could not prove a row's alignment. The FP8 backward's quantisation items, which stored
    their transposed e4m3 bytes one per thread until their column max became a running max,
    now store 16-byte vectors too."""

    fields = {**_row_pull(H, I, 16384, 8, 132, 1, 48, 90), **knobs}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    lw = mk.compile_megakernel(cfg, H, I, shared=True, kernel=kernel)
    ops = re.findall(r"\b((?:ld|st)\.global(?:\.[a-z0-9:]+)+)", lw.ptx)
    assert ops
    narrow = sorted({op for op in ops if op.endswith((".b8", ".u8", ".s8", ".b16", ".u16",
                                                       ".s16"))})
    assert narrow == [], narrow


def _q_and_c_items(phases=4, **knobs):
    """sm_90 build of the FP8 backward's Q and C items alone (phase mask 4; 32: the Q items
    alone; Kimi shape, FP8 weight gradients, one tile per item) with ``knobs``."""
    fields = {**_row_pull(H, I, 16384, 8, 132, 1, 48, 90), "bwd_fp8_wgrad": True,
              "bwd_dw_tiles": 1, "bwd_dx_tiles": 1, **knobs}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    return mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", phases=phases)


def test_profiling_bit_32_builds_the_q_items_without_any_gemm():
    """Phase bit 32 (profiling: the Q items apart from the GEMMs, for a profiler's view of
    their stalls): the build has the Q items' pipelined TMA reads of r h and dG/dU and
    their transposed stores, and no MMA at all (no C or D item); mask 4 has the C items'."""
    q = _q_and_c_items(phases=32)
    assert not q.mma_instructions
    for desc in ("hs_c_desc", "pre_q_desc"):
        assert len(re.findall(rf"async_tma_copy_global_to_local %{desc}\[", q.ttgir)) >= 2
    assert "st.global.v4.b32" in q.ptx
    assert _q_and_c_items(phases=4).mma_instructions


def test_quantisation_items_store_16_byte_vectors():
    """The Q items with the C items (Kimi shape): the transposed e4m3 copies go out as
    16-byte vectors along a column's rows (the group's first row said to be a multiple of
    16), no byte-wide store left; no spills, within shared memory. (TMA stores of the same
    tiles, each waited for in full before the item's release, were timed slower in
    results/20261203-061457-h200-fp8-backward and removed.)"""
    plain = _q_and_c_items()
    assert "st.global.b8" not in plain.ptx
    assert "st.global.v4.b32" in plain.ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta" not in plain.ptx
    assert not plain.spills, plain.ptxas_log
    assert plain.shared_bytes <= SMEM_LIMIT


def test_item_trace_builds_and_reads_the_global_timer():
    """The backward with its item trace (profiling only) at the Kimi shape, whole FP8
    backward: it builds for sm_90 within shared memory and reads ``%globaltimer`` around the
    items; the build without it has no such read (the trace costs nothing when off)."""
    from mokbench.mok_backend import fp8_config_fields

    fields = {**_row_pull(H, I, 16384, 8, 132, 1, 48, 90), **fp8_config_fields(90),
              "bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True,
              "bwd_fp8_block_k": 128}
    cfg = mk.MoKConfig.for_shape(H, I, **fields)
    on = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward", trace=True)
    off = mk.compile_megakernel(cfg, H, I, shared=True, kernel="backward")
    assert on.shared_bytes <= SMEM_LIMIT
    assert on.ptx.count("%globaltimer") >= 2
    assert "%globaltimer" not in off.ptx


def test_forward_item_trace_builds_and_reads_the_global_timer():
    """The forward megakernel with its compute items' trace at the Kimi defaults (sm_90):
    it builds, reads ``%globaltimer`` around the items, and without the trace has no such
    read."""

    cfg = mk.MoKConfig.for_shape(H, I, **_row_pull(H, I, 16384, 8, 132, 1, 48, 90))
    on = mk.compile_megakernel(cfg, H, I, shared=True, trace=True)
    off = mk.compile_megakernel(cfg, H, I, shared=True)
    assert on.shared_bytes <= SMEM_LIMIT
    assert on.ptx.count("%globaltimer") >= 2
    assert "%globaltimer" not in off.ptx


def test_quantisation_items_counting_rows_load_no_slot_ids():
    """``bwd_q_count_rows`` with the Q and C items alone (Kimi shape): the Q loops load no
    slot ids (no pipelined int32 copies, half the async-copy waits), and the whole FP8
    backward with it still fits shared memory, spilling about as little as without it
    (Triton 3.9: 360 bytes against 336)."""
    plain, counted = _q_and_c_items(), _q_and_c_items(bwd_q_count_rows=True)
    assert re.search(r"memdesc<\d+x64xi32", plain.ttgir)
    assert not re.search(r"memdesc<\d+x64xi32", counted.ttgir)
    assert counted.ptx.count("cp.async.wait_group") < plain.ptx.count("cp.async.wait_group")
    _, whole = _whole_fp8_backward({"bwd_q_count_rows": True, "bwd_dw_tiles": 4,
                                    "bwd_dx_tiles": 4, "bwd_dw_stages": 4})
    assert _spill_bytes(whole.ptxas_log) <= 416, whole.ptxas_log


def test_split_launches_each_spill_less_than_the_one_launch():
    """``bwd_split_launch`` at the Kimi shape with mok's FP8 backward on Hopper: the dgrad
    launch (A, B items) and the weight-gradient launch (Q, C, D) are each built with only
    their item kinds, and each spills less than the one launch of all five (Triton 3.9: 12
    and 96 bytes of spill stores against 324), within sm_90's shared memory."""
    from mok_kernels._details.backward import split_launches
    from mokbench.mok_backend import fp8_backward_fields, fp8_config_fields

    fields = {**default_config_fields(H, I, 16384, 8, 132, 1, 48), **fp8_config_fields(90),
              **fp8_backward_fields(90)}
    one = mk.MoKConfig.for_shape(H, I, **{**fields, "bwd_split_launch": False})
    split = mk.MoKConfig.for_shape(H, I, **{**fields, "bwd_split_launch": True})
    assert split_launches(one) == [(0, 15)] and split_launches(split) == [(1, 3), (2, 12)]
    whole = _spill_bytes(mk.compile_megakernel(one, H, I, kernel="backward").ptxas_log)
    for n, phases in split_launches(split):
        lw = mk.compile_megakernel(split, H, I, kernel="backward", phases=phases, split=n)
        assert lw.shared_bytes <= SMEM_LIMIT
        assert _spill_bytes(lw.ptxas_log) < whole, (n, lw.ptxas_log)


def test_narrow_q_items_hold_fewer_registers():
    """``bwd_q_cols`` 64 at the Kimi shape with mok's FP8 backward on Hopper and the split
    launch: Q items of 64 columns in 128-row steps keep a running column max of the same
    [rows, columns] size as the default's 128 columns in 64-row steps, and the
    weight-gradient launch spills less (Triton 3.9: 76 bytes of spill stores against 96;
    the Q and C items alone none), within sm_90's shared memory."""
    from mok_kernels._details.backward import q_rows
    from mokbench.mok_backend import fp8_backward_fields, fp8_config_fields

    fields = {**default_config_fields(H, I, 16384, 8, 132, 1, 48), **fp8_config_fields(90),
              **fp8_backward_fields(90)}
    assert fields["bwd_split_launch"]  # the one-rank FP8 default
    spills = {}
    for q_cols, rows in ((0, 64), (64, 128)):
        cfg = mk.MoKConfig.for_shape(H, I, **fields, bwd_q_cols=q_cols)
        assert q_rows(cfg) == rows
        for phases in (4, 12):
            lw = mk.compile_megakernel(cfg, H, I, kernel="backward", phases=phases, split=2)
            assert lw.shared_bytes <= SMEM_LIMIT
            spills[q_cols, phases] = _spill_bytes(lw.ptxas_log)
    assert spills[64, 4] == 0, spills
    assert spills[64, 12] < spills[0, 12], spills


@pytest.mark.parametrize("fp8", [False, True])
def test_weight_gradient_tiles_stored_through_tma_do_not_wait_for_their_writes(fp8):
    """``bwd_dw_tma_store`` at the Kimi shape (mok's bf16 defaults, one launch; its FP8
    backward, the weight-gradient launch): the C items and the D items alone (phase masks 4
    and 8) store their tiles as bulk tensor copies instead of 16-byte vectors (32 of those
    without the knob), and every wait on those copies is for their shared buffer to be read
    (``.read``: the writes overlap the next tile's K loop; Triton 3.9 adds one full wait
    where an item's tile loop ends, Triton 3.6 none); within sm_90's shared memory, no
    spills; the whole launch fits too."""
    from mok_kernels._details.backward import split_launches
    from mokbench.mok_backend import fp8_backward_fields, fp8_config_fields

    fields = default_config_fields(H, I, 16384, 8, 132, 1, 48)
    if fp8:
        fields = {**fields, **fp8_config_fields(90), **fp8_backward_fields(90)}
    assert fields["bwd_dw_tiles"] > 1
    split, whole = split_launches(mk.MoKConfig.for_shape(H, I, **fields))[-1]
    for knob in (False, True):
        cfg = mk.MoKConfig.for_shape(H, I, **{**fields, "bwd_dw_tma_store": knob})
        for phases in (4, 8):
            lw = mk.compile_megakernel(cfg, H, I, kernel="backward", phases=phases,
                                       split=split)
            vectors = lw.ptx.count("st.global.v4")
            stores = lw.ptx.count("cp.async.bulk.tensor.2d.global.shared")
            waits = re.findall(r"cp\.async\.bulk\.wait_group(\.read)?\s", lw.ptx)
            if not knob:
                assert vectors >= 32 and stores == 0, (phases, vectors, stores)
                continue
            assert vectors <= 4 and stores >= 2, (phases, vectors, stores)
            assert waits.count(".read") >= stores and waits.count("") <= 2, waits
            assert lw.shared_bytes <= SMEM_LIMIT and not lw.spills, lw.ptxas_log
    lw = mk.compile_megakernel(cfg, H, I, kernel="backward", phases=whole, split=split)
    assert lw.shared_bytes <= SMEM_LIMIT


@pytest.mark.parametrize("shared", [False, True])
def test_hopper_build_of_the_gluon_dx_launch(shared):
    """``bwd_dx_gluon``'s launch at Kimi K2 48 x 16384 (P rows a rank): it fits in shared
    memory (the four-stage ring and two store buffers), does not spill, gives the producer
    warp and the consumer warpgroups their register budgets (setmaxnreg), runs the
    full-width MMA unserialised, loads through TMA, and stores only 16-byte pieces of rows
    (the accumulator staged through shared memory: no 2- or 4-byte stores)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from mok_kernels._details.lowering import compile_dx_gluon, sass_instructions

    lw = compile_dx_gluon(H, I, rows=16384 * 8 + 48 * 128, slots=8 + shared, shared=shared)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills and not lw.mma_serialized, lw.ptxas_log
    assert lw.mma_instructions == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"]
    assert "setmaxnreg.dec" in lw.ptx and "setmaxnreg.inc" in lw.ptx
    ops = {m for _, m in sass_instructions(lw.sass())}
    assert any(m.startswith("UTMALDG") for m in ops)
    assert {m for m in ops if m.startswith("STG")} == {"STG.E.128"}


@pytest.mark.parametrize("shared, interleaved", [(False, True), (True, True), (True, False)])
def test_hopper_build_of_the_gluon_dw_launch(shared, interleaved):
    """``bwd_dw_gluon``'s launch at Kimi K2 48 x 16384 (P rows a rank): it fits in shared
    memory (the three-stage ring and four store buffers), does not spill, gives the producer
    warp and the consumer warpgroups their register budgets (setmaxnreg), runs the
    full-width MMA unserialised, loads through TMA and stores only through TMA (no global
    store from registers)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from mok_kernels._details.lowering import compile_dw_gluon, sass_instructions

    lw = compile_dw_gluon(H, I, rows=16384 * 8 + 48 * 128, groups=48 + shared, shared=shared,
                          interleaved=interleaved)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills and not lw.mma_serialized, lw.ptxas_log
    assert lw.mma_instructions == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"]
    assert "setmaxnreg.dec" in lw.ptx and "setmaxnreg.inc" in lw.ptx
    ops = {m for _, m in sass_instructions(lw.sass())}
    assert any(m.startswith("UTMALDG") for m in ops) and any(m.startswith("UTMASTG") for m in ops)
    assert not {m for m in ops if m.startswith("STG")}


def test_gluon_dw_launch_replaces_the_c_and_d_items_only_where_gluon_runs(monkeypatch):
    """With ``bwd_dw_gluon`` the C and D items (bits 4 and 8) of a backward's mask run as the
    Gluon launch (only those the mask holds), and the megakernel's launches skip them (the
    split leaves only the dgrad launch); in Triton's interpreter, a one-line error naming the
    knob."""
    from mok_kernels._details.backward import gluon_dw_kinds, split_launches

    on = mk.MoKConfig.for_shape(H, I, bwd_dw_gluon=True)
    split = mk.MoKConfig.for_shape(H, I, bwd_dw_gluon=True, bwd_split_launch=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert gluon_dw_kinds(on) == 12 and gluon_dw_kinds(on, 1 | 4) == 4
    assert gluon_dw_kinds(on, 1 | 2) == 0
    assert gluon_dw_kinds(mk.MoKConfig.for_shape(H, I)) == 0
    assert split_launches(split, 15 & ~12) == [(1, 1 | 2)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"^bwd_dw_gluon=True is invalid here: allowed only "
                                         r"on an sm_90 GPU"):
        gluon_dw_kinds(on)
    assert gluon_dw_kinds(on, 1 | 2) == 0


def test_hopper_build_of_the_gluon_dx_launch_storing_rows():
    """``bwd_dx_rows``: the Gluon dX launch with its tiles stored through TMA (a three-stage
    ring and four store buffers): it fits, does not spill, and stores only through TMA."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from mok_kernels._details.lowering import compile_dx_gluon, sass_instructions

    lw = compile_dx_gluon(H, I, rows=16384 * 8 + 48 * 128, slots=9, shared=True,
                          store_rows=True)
    assert lw.shared_bytes <= SMEM_LIMIT
    assert not lw.spills and not lw.mma_serialized, lw.ptxas_log
    ops = {m for _, m in sass_instructions(lw.sass())}
    assert any(m.startswith("UTMASTG") for m in ops)
    assert not {m for m in ops if m.startswith("STG")}


def test_gluon_dx_launch_replaces_the_b_items_only_where_gluon_runs(monkeypatch):
    """With ``bwd_dx_gluon`` a backward whose mask holds the B items (bit 2) runs them as the
    Gluon launch, and its megakernel launches skip them (the dgrad launch of the split keeps
    only the A items); in Triton's interpreter, a one-line error naming the knob."""
    from mok_kernels._details.backward import runs_gluon_dx, split_launches

    on = mk.MoKConfig.for_shape(H, I, bwd_dx_gluon=True)
    split = mk.MoKConfig.for_shape(H, I, bwd_dx_gluon=True, bwd_split_launch=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert runs_gluon_dx(on) and not runs_gluon_dx(on, 1 | 4 | 8)
    assert not runs_gluon_dx(mk.MoKConfig.for_shape(H, I))
    assert split_launches(split, 15 & ~2) == [(1, 1), (2, 4 | 8)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"^bwd_dx_gluon=True is invalid here: allowed only "
                                         r"on an sm_90 GPU"):
        runs_gluon_dx(on)
    assert not runs_gluon_dx(on, 1 | 4 | 8)
