"""mok backend knobs on CPU: shape defaults and the $MOKBENCH_MOK_CONFIG override."""

from __future__ import annotations

import pytest

from mok_kernels import MoKConfig, MoKConfigError
from mokbench.backend import get_backend
from mokbench.mok_backend import (
    CONFIG_ENV,
    config_from_env,
    default_config_fields,
    graph_option,
)


def test_defaults_follow_two_waves_and_cap_at_rows():
    big = default_config_fields(7168, 2048, 16384, 8, 132)
    assert big["minibatch"] >= 2176 and big["minibatch"] % 128 == 0
    assert big["macrobatch"] == 3 * big["minibatch"] and big["fwd_comm_sms"] == 0
    small = default_config_fields(2048, 256, 100, 2, 132)
    assert small["minibatch"] == 384  # 100 tokens x (2 + 1) rows, rounded to 128
    assert default_config_fields(7168, 2048, 4096, 8, 132, world_size=4)["fwd_comm_sms"] == 16
    # TMA weight tiles, interleaved gate/up columns, four stages (measured faster on H200)
    assert big["tma"] is True and big["gate_up_interleaved"] is True
    assert big["num_stages"] == 4 and big["compile_schedule"] is True
    # four tiles per work item only where experts average >= 2048 rows (tokens x topk / local)
    assert (big["gate_up_tiles"], big["down_tiles"]) == (1, 1)  # experts unknown: rule off
    e48 = default_config_fields(7168, 2048, 16384, 8, 132, local_experts=48)
    assert (e48["gate_up_tiles"], e48["down_tiles"]) == (4, 4)  # 2731 rows per expert
    e384 = default_config_fields(7168, 2048, 4096, 8, 132, local_experts=384)
    assert (e384["gate_up_tiles"], e384["down_tiles"]) == (1, 1)  # 85 rows per expert
    edge = default_config_fields(7168, 2048, 2048, 8, 132, local_experts=8)
    assert edge["gate_up_tiles"] == 4  # exactly 2048 rows per expert
    assert default_config_fields(7168, 2048, 2047, 8, 132, local_experts=8)["down_tiles"] == 1
    # the backward's dX items read dG/dU through TMA on Hopper,
    # and their dA items span block_n columns (both measured faster on H200), neither on
    # Blackwell (unmeasured there)
    assert big["bwd_dx_tma"] is True and big["bwd_wide_da"] is True
    bw = default_config_fields(7168, 2048, 16384, 8, 148, arch=100)
    assert bw["bwd_dx_tma"] is False and bw["bwd_wide_da"] is False
    # the backward's pull fetches a token's rows once per rank on several ranks only
    assert big["bwd_pull_dedup"] is False
    assert default_config_fields(7168, 2048, 8192, 8, 132, world_size=2)["bwd_pull_dedup"]
    # the down items after the next minibatch's gate+up items on one Hopper rank only
    assert big["skew_down"] is True and bw["skew_down"] is False
    assert default_config_fields(7168, 2048, 8192, 8, 132, world_size=2)["skew_down"] is False
    # the backward's dX items in bands of 16 row blocks on one Hopper rank only
    assert big["bwd_dx_band"] == 16 and bw["bwd_dx_band"] == 0
    assert default_config_fields(7168, 2048, 8192, 8, 132, world_size=2)["bwd_dx_band"] == 0
    # four weight-gradient tiles per item, four and three stages deep, on one Hopper rank
    assert (big["bwd_dw_tiles"], big["bwd_dw_stages"]) == (4, 4)
    assert (bw["bwd_dw_tiles"], bw["bwd_dw_stages"]) == (1, 2)
    ep2 = default_config_fields(7168, 2048, 4096, 8, 132, world_size=2, local_experts=192)
    assert (ep2["bwd_dw_tiles"], ep2["bwd_dw_stages"]) == (1, 2)
    # H 7168 = 28 tiles of 256, 2I 1536 = 6: two tiles divide both, four do not
    assert default_config_fields(7168, 768, 4096, 8, 132, local_experts=384)["bwd_dw_tiles"] == 2
    # four dX tiles per item on one Hopper rank (two where four do not divide the H tiles)
    assert big["bwd_dx_tiles"] == 4 and bw["bwd_dx_tiles"] == 1 and ep2["bwd_dx_tiles"] == 1
    assert default_config_fields(1536, 1024, 4096, 8, 132, local_experts=8)["bwd_dx_tiles"] == 2
    # the backward's bf16 pull token by token on one Hopper rank only
    assert big["bwd_pull_by_token"] is True and bw["bwd_pull_by_token"] is False
    assert ep2["bwd_pull_by_token"] is False


def test_one_ring_slot_turns_off_the_default_skew_unless_asked_for():
    """``skew_down`` needs two ring slots: a variant asking for one (macrobatch = minibatch)
    turns the default off; asking for both is the one-line error naming the knob."""
    d = default_config_fields(2048, 512, 8192, 8, 132, local_experts=8)
    cfg = config_from_env(2048, 512, d, {"minibatch": 1024, "macrobatch": 1024})
    assert cfg.skew_down is False and cfg.ring_slots == 1
    assert config_from_env(2048, 512, d, {"minibatch": 1024}).skew_down is True
    with pytest.raises(MoKConfigError, match="skew_down"):
        config_from_env(2048, 512, d, {"minibatch": 1024, "macrobatch": 1024,
                                       "skew_down": True})


def test_a_pull_knob_turns_off_the_defaults_that_need_the_separate_pull(monkeypatch):
    """``bwd_fused_pull`` asked for at EP 2 or in an FP8 cell turns off the default
    ``bwd_pull_dedup`` (and ``bwd_fp8_wgrad`` where the dA items are bf16) instead of failing
    (it keeps ``bwd_fp8_wgrad`` where the dA items are FP8: its pull items write the FP8
    copies); asked for together, the conflict is the one-line error."""
    from mokbench.mok_backend import scenario_config
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    ep2 = Scenario(ModelShape("kimi", 48, 7168, 2048, 8), tokens_per_rank=8192, world_size=2,
                   precision="fp8")
    assert scenario_config(ep2).bwd_pull_dedup and scenario_config(ep2).bwd_fp8_wgrad
    items = scenario_config(ep2, {"bwd_fused_pull": True, "bwd_pull_programs": 32})
    assert items.bwd_fused_pull and items.bwd_fp8_wgrad and not items.bwd_pull_dedup
    bf16_dx = scenario_config(ep2, {"bwd_fused_pull": True, "bwd_fp8_da": False})
    assert not bf16_dx.bwd_fp8_wgrad  # bf16 dA items wait for the pull: no FP8 copies
    with pytest.raises(MoKConfigError, match=r"^bwd_pull_dedup=True is invalid: allowed false "
                                             r"when bwd_fused_pull"):
        scenario_config(ep2, {"bwd_fused_pull": True, "bwd_pull_dedup": True})


def test_env_override(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, '{"minibatch": 1024, "fwd_comm_sms": 4, "cuda_graph": false}')
    cfg = config_from_env(7168, 2048, default_config_fields(7168, 2048, 16384, 8, 132))
    assert (cfg.minibatch, cfg.macrobatch, cfg.fwd_comm_sms) == (1024, 3072, 4)
    assert graph_option() is False
    monkeypatch.setenv(CONFIG_ENV, '{"cuda_graph": true}')
    assert graph_option() is True and graph_option({"cuda_graph": False}) is False


def test_env_override_errors(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, "{minibatch: 3}")
    with pytest.raises(MoKConfigError, match=CONFIG_ENV):
        config_from_env(7168, 2048, {})
    monkeypatch.setenv(CONFIG_ENV, '{"minibatch": 100}')
    with pytest.raises(MoKConfigError, match="minibatch=100"):
        config_from_env(7168, 2048, {})


def test_capabilities():
    b = get_backend("mok")
    caps = b.capabilities
    assert b.name == "mok" and caps.passes == ("forward", "backward") and caps.min_cc == (9, 0)
    assert caps.needs_gpu and not caps.is_baseline and caps.packages == ("triton",)


def _scenario(precision: str):
    from mokbench.scenario import ModelShape, Scenario

    return Scenario(ModelShape("kimi", 48, 7168, 2048, 8), tokens_per_rank=16384, world_size=1,
                    precision=precision)


def test_fp8_cells_get_the_fp8_path(monkeypatch):
    """precision fp8: the FP8 forward with the rowwise_all recipe at 128-row blocks by default
    on Hopper (MXFP8 at 128 on Blackwell), rowwise and TE's blockwise as knobs at 64-row blocks
    with the backward at 128, the FP8 tile constraints and TMA weight tiles, the bf16 cells'
    weight-gradient and dX tiles; a bf16 cell stays bf16."""
    from mokbench.mok_backend import scenario_config

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    cfg = scenario_config(_scenario("fp8"))
    assert (cfg.fp8, cfg.block_k, cfg.block_n, cfg.block_m, cfg.tma,
            cfg.gate_up_interleaved) == ("rowwise_all", 128, 256, 128, True, True)
    assert cfg.bwd_bm == 128 and cfg.row_align == 128
    for recipe in ("rowwise", "blockwise"):
        c = scenario_config(_scenario("fp8"), {"fp8": recipe})
        assert (c.fp8, c.block_m, c.bwd_bm, c.row_align) == (recipe, 64, 128, 128)
    mx = scenario_config(_scenario("fp8"), {"fp8": "mx"}, arch=100)
    assert (mx.fp8, mx.block_m, mx.bwd_bm) == ("mx", 128, 128)
    assert scenario_config(_scenario("fp8"), arch=100).fp8 == "mx"
    assert scenario_config(_scenario("bf16")).fp8 == "none"
    # the bf16 pull by token in bf16 cells; the FP8 weight gradients' row pull in FP8 cells
    assert scenario_config(_scenario("bf16")).bwd_pull_by_token is True
    assert cfg.bwd_pull_by_token is False and cfg.bwd_fp8_wgrad is True
    # four weight-gradient and dX tiles per item, as in bf16 cells (the faster FP8 backward
    # in the profiling script at this shape)
    assert (cfg.bwd_dw_tiles, cfg.bwd_dw_stages, cfg.bwd_dx_tiles) == (4, 4, 4)
    assert "fp8" in get_backend("mok").capabilities.precisions


def test_fp8_knob_must_match_the_precision(monkeypatch):
    from mokbench.mok_backend import scenario_config

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(MoKConfigError, match=r"^fp8='blockwise' is invalid for precision "
                                             r"'bf16': allowed none for bf16"):
        scenario_config(_scenario("bf16"), {"fp8": "blockwise", "gate_up_interleaved": True,
                                            "block_k": 128, "tma": False})
    with pytest.raises(MoKConfigError, match=r"^fp8='e5m2' is invalid: allowed none \| "):
        scenario_config(_scenario("fp8"), {"fp8": "e5m2"})


def test_fp8_backward_knobs_name_the_row_variant(monkeypatch):
    """An FP8 cell on Hopper runs the whole FP8 backward by default, at EP 1 and EP 2; on
    Blackwell and in bf16 cells the bf16 one. The FP8 backward knobs come through the variant
    syntax (``mok@bwd_fp8_wgrad=false``) and name the backward's precision in the row's
    variant (``bwd=fp8_da_dx_wgrad``); a combination the kernel cannot run is a one-line error
    naming the field."""
    from mokbench.mok_backend import backward_kind, scenario_config
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert backward_kind(scenario_config(_scenario("fp8"))) == "fp8_da_dx_wgrad"
    assert backward_kind(scenario_config(_scenario("bf16"))) == "bf16"
    assert backward_kind(scenario_config(_scenario("fp8"), num_sms=148, arch=100)) == "bf16"
    ep2 = Scenario(ModelShape("kimi", 48, 7168, 2048, 8), tokens_per_rank=8192, world_size=2,
                   precision="fp8")
    assert backward_kind(scenario_config(ep2)) == "fp8_da_dx_wgrad"
    off = {"bwd_fp8_da": False, "bwd_fp8_dx": False, "bwd_fp8_wgrad": False}
    assert backward_kind(scenario_config(_scenario("fp8"), off)) == "bf16"
    for knobs, kind in (({**off, "bwd_fp8_wgrad": True}, "fp8_wgrad"),
                        ({"bwd_fp8_wgrad": False}, "fp8_da_dx"),
                        ({"bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True},
                         "fp8_da_dx_wgrad")):
        assert backward_kind(scenario_config(_scenario("fp8"), knobs)) == kind
    with pytest.raises(MoKConfigError, match=r"^bwd_fp8_wgrad=True is invalid: allowed false "
                                             r"with bwd_fused_pull but without bwd_fp8_da"):
        scenario_config(_scenario("bf16"), {"bwd_fp8_wgrad": True, "bwd_fused_pull": True,
                                            "bwd_fp8_da": False})


def test_fp8_backward_block_k_comes_through_the_variant_syntax(monkeypatch):
    """``mok@bwd_fp8_block_k=128`` reaches the config; a value the kernel has no build for,
    or one that does not divide the layer, is a one-line error naming the field."""
    from mokbench.mok_backend import scenario_config

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    knobs = {"bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True}
    assert scenario_config(_scenario("fp8"), knobs).bwd_fp8_block_k == 128  # the FP8 default
    cfg = scenario_config(_scenario("fp8"), {**knobs, "bwd_fp8_block_k": 64})
    assert cfg.bwd_fp8_block_k == 64
    with pytest.raises(MoKConfigError, match=r"^bwd_fp8_block_k=96 is invalid: allowed 64 \| 128$"):
        scenario_config(_scenario("fp8"), {**knobs, "bwd_fp8_block_k": 96})
    with pytest.raises(MoKConfigError, match=r"^bwd_fp8_block_k=128 is invalid: allowed a "
                                             r"divisor of hidden \(64\)"):
        MoKConfig(block_n=32, block_k=16, bwd_fp8_da=True,
                  bwd_fp8_block_k=128).check_shape(64, 32)


def test_pull_by_token_turns_off_the_default_pull_dedup_unless_asked_for():
    """At EP > 1 the backend's default ``bwd_pull_dedup`` (two passes) yields to a variant
    asking for ``bwd_pull_by_token`` (one pass, a token read once per rank too); asking for
    both is the one-line error naming the knob."""
    d = default_config_fields(7168, 2048, 8192, 8, 132, world_size=2, local_experts=24)
    assert d["bwd_pull_dedup"] is True
    cfg = config_from_env(7168, 2048, d, {"bwd_pull_by_token": True})
    assert cfg.bwd_pull_by_token and not cfg.bwd_pull_dedup
    with pytest.raises(MoKConfigError, match="bwd_pull_by_token"):
        config_from_env(7168, 2048, d, {"bwd_pull_by_token": True, "bwd_pull_dedup": True})


@pytest.mark.parametrize("asked", [{"bwd_fused_pull": True}, {"bwd_pull_dedup": True}])
def test_other_pulls_turn_off_the_default_pull_by_token_unless_asked_for(asked):
    """The pull by token replaces only the bf16 separate row pull: a variant asking for
    another pull gets a valid config without it; asking for both is the one-line error."""
    d = default_config_fields(7168, 2048, 16384, 8, 132, local_experts=48)
    assert config_from_env(7168, 2048, d).bwd_pull_by_token is True
    assert config_from_env(7168, 2048, d, asked).bwd_pull_by_token is False
    with pytest.raises(MoKConfigError, match=r"^bwd_pull_by_token=True is invalid"):
        config_from_env(7168, 2048, d, {**asked, "bwd_pull_by_token": True})


def test_the_row_variant_is_what_the_gpu_runs_recorded(monkeypatch):
    """``variant_text`` at Kimi K2 48 x 16384 on one H200 (132 SMs, sm_90) gives the variant
    that the GPU run of results/20261202-051552-h200-bf16-train recorded for plain ``mok``, and
    names the dA tiles when a variant asks for them; the defaults since that run (the Gluon
    dX launch, the K loops three stages deep) set back."""
    import json
    from pathlib import Path

    from mokbench.mok_backend import gluon_dx_available, scenario_config, variant_text

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    run = Path(__file__).resolve().parents[2] / "results" / "20261202-051552-h200-bf16-train"
    recorded = {json.loads(ln)["variant"] for ln in (run / "rows.jsonl").read_text().splitlines()
                if '"backend": "mok"' in ln and "kimi-k2-e48-" in ln}
    assert len(recorded) == 1
    cell = _scenario("bf16")
    gluon = ",dx_gluon=1"  # the default since that run, where Triton has the Gluon API
    assert (gluon in variant_text(scenario_config(cell), 7168, 2048, fp8=False,
                                  graphed=False)) == gluon_dx_available()
    then = {"bwd_dx_gluon": False, "bwd_stages": 0, "num_stages": 4}
    text = variant_text(scenario_config(cell, then), 7168, 2048, fp8=False, graphed=False)
    assert {text} == recorded
    text = variant_text(scenario_config(cell, {**then, "bwd_da_tiles": 2}), 7168, 2048,
                        fp8=False, graphed=False)
    assert ",da_tiles=2," in text and {text.replace(",da_tiles=2", "")} == recorded, text


def test_fp8_cells_count_the_q_rows_unless_the_weight_gradients_are_bf16(monkeypatch):
    """FP8 cells on Hopper default to ``bwd_q_count_rows``; a variant without FP8 weight
    gradients (which have no Q items) turns that default off instead of failing, while asking
    for both is the one-line error; bf16 cells leave it off."""
    from mokbench.mok_backend import scenario_config
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    shape = ModelShape("kimi", 48, 7168, 2048, 8)
    fp8 = Scenario(shape, tokens_per_rank=16384, world_size=1, precision="fp8")
    assert scenario_config(fp8).bwd_q_count_rows
    assert not scenario_config(fp8, {"bwd_fp8_wgrad": False}).bwd_q_count_rows
    assert not scenario_config(fp8, {"bwd_q_count_rows": False}).bwd_q_count_rows
    bf16 = Scenario(shape, tokens_per_rank=16384, world_size=1)
    assert not scenario_config(bf16).bwd_q_count_rows
    with pytest.raises(MoKConfigError, match=r"^bwd_q_count_rows=True is invalid"):
        scenario_config(fp8, {"bwd_fp8_wgrad": False, "bwd_q_count_rows": True})


def test_fp8_cells_on_one_rank_split_the_launch_and_interleave_the_pull(monkeypatch):
    """FP8 cells on one Hopper rank default to ``bwd_split_launch`` and ``bwd_pull_interleave``
    (results/20261204-183317-h200-fp8-backward); at EP 2 both stay off (unmeasured there); a
    variant that removes the FP8 pull (bf16 weight gradients, or the pull as items) turns the
    interleave off instead of failing, and the row's variant names both."""
    from mokbench.mok_backend import scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    shape = ModelShape("kimi", 48, 7168, 2048, 8)
    fp8 = Scenario(shape, tokens_per_rank=16384, world_size=1, precision="fp8")
    cfg = scenario_config(fp8)
    assert cfg.bwd_split_launch and cfg.bwd_pull_interleave
    text = variant_text(cfg, 7168, 2048, fp8=True, graphed=False)
    assert ",pull_interleave=1" in text and ",split_launch=1" in text, text
    ep2 = Scenario(shape, tokens_per_rank=8192, world_size=2, precision="fp8")
    assert not scenario_config(ep2).bwd_split_launch
    assert not scenario_config(ep2).bwd_pull_interleave
    assert not scenario_config(fp8, {"bwd_fp8_wgrad": False}).bwd_pull_interleave
    fused = scenario_config(fp8, {"bwd_fused_pull": True})
    assert fused.bwd_fused_pull and not fused.bwd_pull_interleave and fused.bwd_split_launch
    bf16 = Scenario(shape, tokens_per_rank=16384, world_size=1)
    assert not scenario_config(bf16).bwd_split_launch
    assert not scenario_config(bf16).bwd_pull_interleave
    with pytest.raises(MoKConfigError, match=r"^bwd_pull_interleave=True is invalid"):
        scenario_config(fp8, {"bwd_fused_pull": True, "bwd_pull_interleave": True})
    side = scenario_config(fp8, {"bwd_side_sms": 4})
    assert ",side_sms=4" in variant_text(side, 7168, 2048, fp8=True, graphed=False)
    both = scenario_config(fp8, {"bwd_side_sms": 4, "bwd_side_sum": True})
    assert ",side_sms=4,side_sum=1" in variant_text(both, 7168, 2048, fp8=True, graphed=False)


def test_weight_gradient_tma_stores_are_the_fp8_one_rank_default(monkeypatch):
    """``bwd_dw_tma_store``: on by default in FP8 cells on one Hopper rank
    (results/20261205-015933-h200-fp8-backward), off in bf16 cells and at EP 2; asked for
    in a bf16 cell (four weight-gradient tiles an item by default) it resolves and the
    row's variant names it; a variant of one tile per item turns the FP8 default off
    instead of failing, and asking for both, or for the knob at EP 2 (one tile there), is a
    one-line error naming the knob and what it needs."""
    from mokbench.mok_backend import scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    shape = ModelShape("kimi", 48, 7168, 2048, 8)
    one = Scenario(shape, tokens_per_rank=16384, world_size=1)
    cfg = scenario_config(one, {"bwd_dw_tma_store": True})
    assert cfg.bwd_dw_tma_store and cfg.bwd_dw_tiles == 4
    assert ",dw_tma_store=1" in variant_text(cfg, 7168, 2048, fp8=False, graphed=False)
    assert ",dw_tma_store" not in variant_text(scenario_config(one), 7168, 2048, fp8=False,
                                               graphed=False)
    ep2 = Scenario(shape, tokens_per_rank=8192, world_size=2)
    with pytest.raises(MoKConfigError, match=r"^bwd_dw_tma_store=True is invalid: allowed "
                                             r"false unless bwd_dw_tiles > 1"):
        scenario_config(ep2, {"bwd_dw_tma_store": True})
    fp8 = Scenario(shape, tokens_per_rank=16384, world_size=1, precision="fp8")
    assert scenario_config(fp8).bwd_dw_tma_store
    assert not scenario_config(fp8, {"bwd_dw_tiles": 1}).bwd_dw_tma_store
    assert not scenario_config(Scenario(shape, tokens_per_rank=8192, world_size=2,
                                        precision="fp8")).bwd_dw_tma_store
    with pytest.raises(MoKConfigError, match=r"^bwd_dw_tma_store=True is invalid"):
        scenario_config(fp8, {"bwd_dw_tiles": 1, "bwd_dw_tma_store": True})


def test_direct_communication_knobs_at_ep2_name_the_row_variant(monkeypatch):
    """At EP 2 (16 communication programs by default) ``dispatch_remote_only`` and
    ``combine_direct`` come through the variant syntax and name the row's variant; at one
    rank (no communication programs) asking for either is the one-line error."""
    from mokbench.mok_backend import scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    ep2 = Scenario(ModelShape("kimi", 24, 7168, 2048, 8), tokens_per_rank=8192, world_size=2)
    plain = variant_text(scenario_config(ep2), 7168, 2048, fp8=False, graphed=False)
    asked = scenario_config(ep2, {"dispatch_remote_only": True, "combine_direct": True})
    assert asked.fwd_comm_sms == 16 and asked.dispatch_remote_only and asked.combine_direct
    text = variant_text(asked, 7168, 2048, fp8=False, graphed=False)
    assert ",remote_only=1,combine_direct=1" in text
    assert text.replace(",remote_only=1,combine_direct=1", "") == plain
    with pytest.raises(MoKConfigError, match="combine_direct"):
        scenario_config(_scenario("bf16"), {"combine_direct": True})


def test_gluon_dx_launch_is_the_one_hopper_rank_bf16_default_and_named_in_the_variant(
        monkeypatch):
    """``bwd_dx_gluon`` (the dX GEMM as a Gluon launch): the bf16 default on one Hopper rank
    where Triton has the Gluon API, off at EP 2, in FP8 cells and on Blackwell; a variant
    asking for the FP8 dX items turns the default off, and asking for both is a one-line
    error naming the knob and what it excludes; the row's variant names it."""
    from mokbench.mok_backend import gluon_dx_available, scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    shape = ModelShape("kimi", 48, 7168, 2048, 8)
    one = Scenario(shape, tokens_per_rank=16384, world_size=1)
    assert scenario_config(one).bwd_dx_gluon == gluon_dx_available()
    assert not scenario_config(Scenario(shape, tokens_per_rank=16384, world_size=2)).bwd_dx_gluon
    assert not scenario_config(Scenario(shape, tokens_per_rank=16384, world_size=1,
                                        precision="fp8")).bwd_dx_gluon
    assert not scenario_config(one, arch=100).bwd_dx_gluon
    assert not scenario_config(one, {"bwd_fp8_dx": True, "bwd_fp8_da": True}).bwd_dx_gluon
    cfg = scenario_config(one, {"bwd_dx_gluon": True})
    assert cfg.bwd_dx_gluon
    assert ",dx_gluon=1" in variant_text(cfg, 7168, 2048, fp8=False, graphed=False)
    assert ",dx_gluon" not in variant_text(scenario_config(one, {"bwd_dx_gluon": False}), 7168,
                                           2048, fp8=False, graphed=False)
    with pytest.raises(MoKConfigError, match=r"^bwd_dx_gluon=True is invalid: allowed false "
                                             r"unless .* bwd_fp8_dx"):
        scenario_config(one, {"bwd_dx_gluon": True, "bwd_fp8_dx": True, "bwd_fp8_da": True})


def test_gluon_dw_launch_is_asked_for_only_and_named_in_the_variant(monkeypatch):
    """``bwd_dw_gluon`` (the weight gradients as a Gluon launch) is off by default, on where
    a variant asks for it, named in the row's variant; a one-line error in an FP8 cell (whose
    defaults set the FP8 weight gradients it excludes)."""
    from mokbench.mok_backend import scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    shape = ModelShape("kimi", 48, 7168, 2048, 8)
    one = Scenario(shape, tokens_per_rank=16384, world_size=1)
    assert not scenario_config(one).bwd_dw_gluon
    cfg = scenario_config(one, {"bwd_dw_gluon": True})
    assert cfg.bwd_dw_gluon
    assert ",dw_gluon=1" in variant_text(cfg, 7168, 2048, fp8=False, graphed=False)
    assert ",dw_gluon" not in variant_text(scenario_config(one), 7168, 2048, fp8=False,
                                           graphed=False)
    fp8 = Scenario(shape, tokens_per_rank=16384, world_size=1, precision="fp8")
    with pytest.raises(MoKConfigError, match=r"^bwd_dw_gluon=True is invalid: allowed false "
                                             r"unless .* bwd_fp8_wgrad"):
        scenario_config(fp8, {"bwd_dw_gluon": True})


def test_dx_rows_follow_the_gluon_dx_launch_by_default_and_are_named_in_the_variant(
        monkeypatch):
    """``bwd_dx_rows`` (the Gluon dX launch's tiles through TMA stores in row order): on by
    default wherever ``bwd_dx_gluon`` is (one Hopper rank, bf16, Gluon API), off where that
    launch is off (EP 2, FP8 cells, Blackwell, a variant turning it off, the FP8 dX items);
    asked for without the launch it is a one-line error; the row's variant names it."""
    from mokbench.mok_backend import gluon_dx_available, scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    shape = ModelShape("kimi", 48, 7168, 2048, 8)
    one = Scenario(shape, tokens_per_rank=16384, world_size=1)
    assert scenario_config(one).bwd_dx_rows == gluon_dx_available()
    for off in (scenario_config(Scenario(shape, tokens_per_rank=16384, world_size=2)),
                scenario_config(Scenario(shape, tokens_per_rank=16384, world_size=1,
                                         precision="fp8")),
                scenario_config(one, arch=100),
                scenario_config(one, {"bwd_dx_gluon": False}),
                scenario_config(one, {"bwd_fp8_dx": True, "bwd_fp8_da": True})):
        assert not off.bwd_dx_rows and not off.bwd_dx_gluon
    rows = scenario_config(one, {"bwd_dx_gluon": True, "bwd_dx_rows": True})
    assert ",dx_rows=1" in variant_text(rows, 7168, 2048, fp8=False, graphed=False)
    plain = scenario_config(one, {"bwd_dx_gluon": True, "bwd_dx_rows": False})
    assert plain.bwd_dx_gluon and not plain.bwd_dx_rows
    assert ",dx_rows" not in variant_text(plain, 7168, 2048, fp8=False, graphed=False)
    with pytest.raises(MoKConfigError, match=r"^bwd_dx_rows=True is invalid: allowed true "
                                             r"\| false; true needs bwd_dx_gluon"):
        scenario_config(one, {"bwd_dx_gluon": False, "bwd_dx_rows": True})


def test_backward_k_loops_run_three_stages_deep_on_one_hopper_rank_in_bf16(monkeypatch):
    """``bwd_stages`` (the backward's dA/dX K-loop depth apart from the forward's): 3 by
    default in bf16 cells on one Hopper rank, whatever the forward's ``num_stages``; 0 (the
    forward's depth) in FP8 cells, at EP 2 and on Blackwell; a variant sets it back, and the
    row's variant names it."""
    from mokbench.mok_backend import scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    shape = ModelShape("kimi", 48, 7168, 2048, 8)
    one = Scenario(shape, tokens_per_rank=16384, world_size=1)
    cfg = scenario_config(one)
    assert cfg.bwd_stages == 3
    assert ",stages=3" in variant_text(cfg, 7168, 2048, fp8=False, graphed=False)
    assert scenario_config(one, {"num_stages": 4}).bwd_stages == 3
    for off in (scenario_config(Scenario(shape, tokens_per_rank=16384, world_size=2)),
                scenario_config(Scenario(shape, tokens_per_rank=16384, world_size=1,
                                         precision="fp8")),
                scenario_config(one, arch=100)):
        assert off.bwd_stages == 0
    four = scenario_config(one, {"bwd_stages": 4})
    assert four.bwd_stages == 4
    assert ",stages=4" in variant_text(four, 7168, 2048, fp8=False, graphed=False)
    with pytest.raises(MoKConfigError, match=r"^bwd_stages=1 is invalid: allowed 0 "):
        scenario_config(one, {"bwd_stages": 1})


def test_forward_k_loops_run_three_stages_deep_where_one_hopper_rank_is_well_loaded(
        monkeypatch):
    """``num_stages`` (the forward's K-loop depth): 3 in bf16 cells on one Hopper rank where
    the experts average at least 2048 rows (four tiles per item: Kimi K2 48 x 16384, Qwen3.5
    64 x 16384), 4 where they do not (Kimi K2 384 x 4096, 85 rows per expert), in FP8 cells,
    at EP 2 and on Blackwell; a variant sets it back without moving the backward's depth,
    and the row's variant names it."""
    from mokbench.mok_backend import scenario_config, variant_text
    from mokbench.scenario import ModelShape, Scenario

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    kimi48, kimi384 = ModelShape("kimi", 48, 7168, 2048, 8), ModelShape("kimi", 384, 7168,
                                                                         2048, 8)
    qwen = ModelShape("qwen", 64, 4096, 1024, 10)
    one = Scenario(kimi48, tokens_per_rank=16384, world_size=1)
    for loaded in (one, Scenario(qwen, tokens_per_rank=16384, world_size=1)):
        cfg = scenario_config(loaded)
        assert (cfg.num_stages, cfg.gate_up_tiles, cfg.bwd_stages) == (3, 4, 3)
    assert ",num_stages=3," in variant_text(scenario_config(one), 7168, 2048, fp8=False,
                                            graphed=False)
    for four in (scenario_config(Scenario(kimi384, tokens_per_rank=4096, world_size=1)),
                 scenario_config(Scenario(kimi48, tokens_per_rank=16384, world_size=2)),
                 scenario_config(Scenario(kimi48, tokens_per_rank=16384, world_size=1,
                                          precision="fp8")),
                 scenario_config(one, arch=100)):
        assert four.num_stages == 4
    back = scenario_config(one, {"num_stages": 4})
    assert (back.num_stages, back.bwd_stages) == (4, 3)
    assert ",num_stages=4," in variant_text(back, 7168, 2048, fp8=False, graphed=False)
