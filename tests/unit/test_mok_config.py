"""MoK knobs: one-line validation errors, shape defaults, and the two-waves planner."""

from __future__ import annotations

import pytest

from mok_kernels import MoKConfig, MoKConfigError, plan


@pytest.mark.parametrize("fields, name", [
    ({"minibatch": 100}, "minibatch"),
    ({"macrobatch": 3000}, "macrobatch"),
    ({"block_m": 96}, "block_m"),
    ({"block_n": 384}, "block_n"),
    ({"block_k": 8}, "block_k"),
    ({"capacity_mult": 0.0}, "capacity_mult"),
    ({"capacity_mult": 1.5}, "capacity_mult"),
    ({"fwd_comm_sms": -1}, "fwd_comm_sms"),
    ({"num_warps": 2}, "num_warps"),
    ({"num_stages": 0}, "num_stages"),
    ({"spin_budget": 0}, "spin_budget"),
    ({"fused_sum": 1}, "fused_sum"),
    ({"fused_sum": True, "fwd_comm_sms": 8}, "fused_sum"),
    ({"bwd_pull_programs": -1, "bwd_fused_pull": True}, "bwd_pull_programs"),
    ({"bwd_pull_programs": 16}, "bwd_pull_programs"),
    ({"bwd_dx_tiles": 0}, "bwd_dx_tiles"),
    ({"bwd_dw_tiles": 0}, "bwd_dw_tiles"),
    ({"bwd_dw_tiles": True}, "bwd_dw_tiles"),
    ({"bwd_da_tiles": 65}, "bwd_da_tiles"),
    ({"bwd_dx_tma": 1}, "bwd_dx_tma"),
    ({"bwd_lean_epilogue": "yes"}, "bwd_lean_epilogue"),
    ({"bwd_fp8_da": "yes"}, "bwd_fp8_da"),
    ({"bwd_fp8_dx": 1}, "bwd_fp8_dx"),
    ({"bwd_fp8_wgrad": 1}, "bwd_fp8_wgrad"),
    ({"bwd_pull_dedup": "yes"}, "bwd_pull_dedup"),
    ({"bwd_pull_dedup": True, "bwd_fused_pull": True}, "bwd_pull_dedup"),
    ({"bwd_fp8_wgrad": True, "bwd_fused_pull": True}, "bwd_fp8_wgrad"),
    ({"bwd_fp8_block_colmax": 1}, "bwd_fp8_block_colmax"),
    ({"bwd_fp8_block_colmax": True, "bwd_fp8_wgrad": True}, "bwd_fp8_block_colmax"),
    ({"skew_down": 1}, "skew_down"),
    ({"skew_down": True, "minibatch": 256, "macrobatch": 256}, "skew_down"),
    ({"dispatch_dedup": True}, "dispatch_dedup"),
    ({"dispatch_dedup": 1, "fwd_comm_sms": 8}, "dispatch_dedup"),
    ({"dispatch_remote_only": True}, "dispatch_remote_only"),
    ({"dispatch_remote_only": 1, "fwd_comm_sms": 8}, "dispatch_remote_only"),
    ({"dispatch_remote_only": True, "dispatch_dedup": True, "fwd_comm_sms": 8},
     "dispatch_remote_only"),
    ({"combine_direct": True}, "combine_direct"),
    ({"combine_direct": "yes", "fwd_comm_sms": 8}, "combine_direct"),
    ({"bwd_dx_band": -1}, "bwd_dx_band"),
    ({"bwd_q_count_rows": 1}, "bwd_q_count_rows"),
    ({"bwd_fused_colmax": 1}, "bwd_fused_colmax"),
    ({"bwd_fused_colmax": True}, "bwd_fused_colmax"),
    ({"bwd_q_count_rows": True}, "bwd_q_count_rows"),
    ({"bwd_split_launch": 1}, "bwd_split_launch"),
    ({"bwd_side_sms": -1}, "bwd_side_sms"),
    ({"bwd_side_sum": 1}, "bwd_side_sum"),
    ({"bwd_side_sum": True}, "bwd_side_sum"),
    ({"bwd_side_sms": True}, "bwd_side_sms"),
    ({"bwd_side_sms": 4, "bwd_fp8_wgrad": True}, "bwd_side_sms"),
    ({"bwd_side_sms": 4, "bwd_split_launch": True}, "bwd_side_sms"),
    ({"bwd_side_sms": 4, "bwd_split_launch": True, "bwd_fp8_wgrad": True,
      "bwd_fp8_da": True, "bwd_fused_pull": True}, "bwd_side_sms"),
    ({"bwd_fp8_prequant": 1}, "bwd_fp8_prequant"),
    ({"bwd_fp8_prequant": True, "bwd_fp8_wgrad": True}, "bwd_fp8_prequant"),
    ({"bwd_fp8_prequant": True, "bwd_fp8_wgrad": True, "bwd_fp8_da": True,
      "bwd_fused_pull": True}, "bwd_fp8_prequant"),
    ({"bwd_q_cols": 32}, "bwd_q_cols"),
    ({"bwd_q_cols": 48, "bwd_fp8_wgrad": True}, "bwd_q_cols"),
    ({"bwd_q_cols": 4, "bwd_fp8_wgrad": True}, "bwd_q_cols"),
    ({"bwd_q_cols": 256, "bwd_fp8_wgrad": True}, "bwd_q_cols"),
    ({"bwd_q_cols": True, "bwd_fp8_wgrad": True}, "bwd_q_cols"),
    ({"bwd_pull_interleave": 1}, "bwd_pull_interleave"),
    ({"bwd_pull_prefetch": 1}, "bwd_pull_prefetch"),
    ({"bwd_pull_cols": 32}, "bwd_pull_cols"),
    ({"bwd_pull_cols": 96}, "bwd_pull_cols"),
    ({"bwd_pull_cols": True}, "bwd_pull_cols"),
    ({"bwd_dw_tma_store": 1, "bwd_dw_tiles": 4}, "bwd_dw_tma_store"),
    ({"bwd_dw_tma_store": True}, "bwd_dw_tma_store"),
    ({"bwd_pull_prefetch": True}, "bwd_pull_prefetch"),
    ({"bwd_pull_prefetch": True, "bwd_fp8_wgrad": True, "bwd_pull_dedup": True},
     "bwd_pull_prefetch"),
    ({"bwd_pull_interleave": True}, "bwd_pull_interleave"),
    ({"bwd_pull_interleave": True, "bwd_fp8_wgrad": True, "bwd_fp8_da": True,
      "bwd_fused_pull": True}, "bwd_pull_interleave"),
    ({"bwd_dx_band": True}, "bwd_dx_band"),
    ({"bwd_stages": 1}, "bwd_stages"),
    ({"bwd_dx_gluon": 1}, "bwd_dx_gluon"),
    ({"bwd_dx_gluon": True, "block_m": 64, "minibatch": 192, "macrobatch": 384},
     "bwd_dx_gluon"),
    ({"bwd_dx_gluon": True, "bwd_fp8_dx": True}, "bwd_dx_gluon"),
    ({"bwd_dx_gluon": True, "bwd_side_sum": True, "bwd_side_sms": 8, "bwd_split_launch": True,
      "bwd_fp8_wgrad": True}, "bwd_dx_gluon"),
    ({"bwd_dw_gluon": 1}, "bwd_dw_gluon"),
    ({"bwd_dx_rows": 1, "bwd_dx_gluon": True}, "bwd_dx_rows"),
    ({"bwd_dx_rows": True}, "bwd_dx_rows"),
    ({"bwd_dw_gluon": True, "bwd_fp8_wgrad": True}, "bwd_dw_gluon"),
    ({"bwd_dw_gluon": True, "block_m": 32, "minibatch": 192, "macrobatch": 384},
     "bwd_dw_gluon"),
    ({"bwd_dw_gluon": True, "bwd_side_sum": True, "bwd_side_sms": 8, "bwd_split_launch": True,
      "bwd_fp8_wgrad": True}, "bwd_dw_gluon"),
    ({"bwd_stages": True}, "bwd_stages"),
    ({"bwd_block_m": 96}, "bwd_block_m"),
    ({"bwd_block_m": True}, "bwd_block_m"),
    ({"block_m": 128, "bwd_block_m": 64}, "bwd_block_m"),
    ({"block_m": 64, "minibatch": 192, "macrobatch": 384, "bwd_block_m": 128}, "bwd_block_m"),
])
def test_bad_field_names_field_and_allowed(fields, name):
    with pytest.raises(MoKConfigError) as info:
        MoKConfig(**fields)
    msg = str(info.value)
    assert msg.startswith(f"{name}=") and "allowed" in msg and "\n" not in msg


def test_minibatch_must_align_to_block_m():
    MoKConfig(minibatch=512, macrobatch=1024, block_m=64)
    with pytest.raises(MoKConfigError, match="multiple of block_m"):
        MoKConfig(minibatch=96, macrobatch=192, block_m=64)


def test_shape_check_and_defaults():
    cfg = MoKConfig.for_shape(7168, 2048)
    assert (cfg.block_n, cfg.block_k) == (256, 64)
    tiny = MoKConfig.for_shape(128, 64, minibatch=256, macrobatch=512)
    assert tiny.block_n == 128 and 128 % tiny.block_n == 0 and 64 % (tiny.block_n // 2) == 0
    with pytest.raises(MoKConfigError, match="block_n"):
        MoKConfig(block_n=256).check_shape(7168, 96)
    MoKConfig(block_n=256, bwd_dx_tiles=4).check_shape(7168, 2048)  # 28 H tiles
    with pytest.raises(MoKConfigError, match=r"^bwd_dx_tiles=3 is invalid: allowed a divisor "
                                             r"of hidden / block_n \(28\)"):
        MoKConfig(block_n=256, bwd_dx_tiles=3).check_shape(7168, 2048)
    MoKConfig(block_n=256, bwd_dw_tiles=4).check_shape(7168, 2048)  # 28 H and 16 2I tiles
    with pytest.raises(MoKConfigError, match=r"^bwd_dw_tiles=8 is invalid: allowed a divisor "
                                             r"of hidden / block_n \(28\) and 2 \* "
                                             r"intermediate / block_n \(16\)"):
        MoKConfig(block_n=256, bwd_dw_tiles=8).check_shape(7168, 2048)
    MoKConfig(block_n=256, bwd_da_tiles=4).check_shape(7168, 2048)  # 16 dA tiles of 128
    with pytest.raises(MoKConfigError, match=r"^bwd_da_tiles=3 is invalid: allowed a divisor "
                                             r"of the dA tiles of the intermediate size \(8\)"):
        MoKConfig(block_n=256, bwd_wide_da=True, bwd_da_tiles=3).check_shape(7168, 2048)


def test_plan_reproduces_published_minibatch():
    p = plan(7168, 2048, num_sms=148, comm_sms=0, block_m=128, block_n=256)
    assert p.min_tokens == 2368
    assert p.minibatch % 128 == 0 and p.minibatch >= 2368
    text = str(p)
    assert "2368" in text and "148" in text


def test_plan_ring_memory_and_comm_split():
    p = plan(7168, 2048, num_sms=132, comm_sms=8, ring_slots=3)
    assert p.min_tokens == 1984  # 2 * 124 * 128 * 256 / 4096
    assert p.ring_bytes == p.macrobatch * (2 * 7168 + 2048) * 2
    with pytest.raises(MoKConfigError, match="comm_sms"):
        plan(7168, 2048, num_sms=132, comm_sms=132)
