"""Scenarios, presets, validation errors and the FLOP formula."""

import pytest

from mokbench.scenario import PRESETS, ModelShape, Scenario, ScenarioError, preset


def test_presets_match_published_shapes():
    k = preset("kimi-k2.7-code")
    assert (k.num_experts, k.hidden, k.intermediate, k.topk) == (384, 7168, 2048, 8)
    q = preset("qwen3.5-397b")
    assert (q.num_experts, q.hidden, q.intermediate, q.topk) == (512, 4096, 1024, 10)
    assert preset("mixtral-8x7b").intermediate == 14336
    assert {"glm-5.2", "deepseek-v4-pro", "deepseek-v3", "kimi-k2", "qwen3-30b-a3b"} <= set(PRESETS)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_experts=0, hidden=128, intermediate=64, topk=1), "num_experts"),
    (dict(num_experts=8, hidden=100, intermediate=64, topk=1), "hidden"),
    (dict(num_experts=8, hidden=128, intermediate=-64, topk=1), "intermediate"),
    (dict(num_experts=8, hidden=128, intermediate=64, topk=9), "topk"),
])
def test_shape_errors_name_the_field(kwargs, field):
    with pytest.raises(ScenarioError) as e:
        ModelShape("x", **kwargs)
    msg = str(e.value)
    assert msg.startswith(f"{field}=") and "allowed" in msg and "\n" not in msg


def test_experts_must_divide_by_world_size():
    with pytest.raises(ScenarioError, match=r"num_experts=8 is invalid: allowed a multiple of "
                                            r"world_size \(3\)"):
        Scenario(preset("tiny"), 64, 3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(precision="fp4"), "precision"), (dict(routing="zipf"), "routing"),
    (dict(tokens_per_rank=0), "tokens_per_rank"), (dict(passes=("sideways",)), "passes"),
])
def test_scenario_errors(kwargs, field):
    base = dict(shape=preset("tiny"), tokens_per_rank=64, world_size=2)
    with pytest.raises(ScenarioError, match=f"^{field}="):
        Scenario(**{**base, **kwargs})


def test_unknown_preset_lists_known():
    with pytest.raises(ScenarioError, match="preset='gpt5' is unknown: allowed .*kimi-k2"):
        preset("gpt5")


def test_flops_formula_as_published():
    s = Scenario(preset("kimi-k2.7-code"), 2048, 64)
    fwd = 6 * (2048 + 2048 * 8) * 7168 * 2048
    assert s.flops("forward") == fwd and s.flops("backward") == 2 * fwd
    no_se = s.with_(shared_expert=False)
    assert no_se.flops("forward") == 6 * 2048 * 8 * 7168 * 2048


def test_scenario_roundtrip_and_ids():
    s = Scenario(preset("tiny"), 64, 2, routing="imbalanced", zipf_s=1.5)
    assert Scenario.from_dict(s.to_dict()) == s
    assert s.scenario_id != s.with_(routing="uniform").scenario_id
    assert s.digest() == Scenario.from_dict(s.to_dict()).digest()
    assert s.local_experts == 4
