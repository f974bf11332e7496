"""Sweep files: grid expansion, world sizes, YAML, shipped sweeps, one-line errors."""

from pathlib import Path

import pytest

from mokbench.scenario import ScenarioError
from mokbench.sweep import expand, load_sweep, parse_text

REPO = Path(__file__).resolve().parents[2]


def _data(**over):
    d = {"name": "t", "backends": ["nccl_torch", "mok"], "world_sizes": [1, 2],
         "scenarios": [{"preset": "tiny", "tokens_per_rank": [64, 128],
                        "routing": ["uniform", "imbalanced"]}]}
    d.update(over)
    return d


def test_grid_expansion_backends_side_by_side():
    sw = expand(_data(), auto_world=2)
    assert len(sw.cells) == 2 * 2 * 2 * 2
    assert [c.backend for c in sw.cells[:2]] == ["nccl_torch", "mok"]
    assert sw.cells[0].scenario == sw.cells[1].scenario
    assert len({c.key for c in sw.cells}) == len(sw.cells)


def test_auto_world_and_overrides():
    sw = expand(_data(world_sizes=["auto"]), auto_world=4, backends_override=["nccl_torch"])
    assert {c.scenario.world_size for c in sw.cells} == {4}
    assert {c.backend for c in sw.cells} == {"nccl_torch"}


@pytest.mark.parametrize("data, needle", [
    (_data(colour="red"), "sweep key 'colour' is unknown"),
    (_data(backends=["nope"]), "backend='nope' is unknown"),
    (_data(scenarios=[{"preset": "gpt9", "tokens_per_rank": 8}]), "preset='gpt9' is unknown"),
    (_data(scenarios=[{"preset": "tiny", "tokens_per_rank": 8, "topk": 99}]), "topk=99"),
    (_data(world_sizes=[3]), "num_experts=8 is invalid: allowed a multiple of world_size (3)"),
    (_data(scenarios=[{"preset": "tiny"}]), "'tokens_per_rank' is missing"),
    (_data(scenarios=[{"preset": "tiny", "tokens_per_rank": 8, "hidden": 100}]), "hidden=100"),
    (_data(timing={"iters": 0}), "iters=0"),
])
def test_bad_sweeps_one_line_errors(data, needle):
    with pytest.raises(ScenarioError) as e:
        expand(data, auto_world=2)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_yaml_sweep():
    text = "name: y\nbackends: [nccl_torch]\nworld_sizes: [2]\nscenarios:\n" \
           "  - {preset: tiny, tokens_per_rank: 32}\n"
    sw = expand(parse_text(text, ".yaml"), auto_world=1)
    assert sw.name == "y" and len(sw.cells) == 1


@pytest.mark.parametrize("path", sorted((REPO / "sweeps").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_sweeps_validate(path):
    sw = load_sweep(path, auto_world=8)
    assert sw.cells


def test_embedded_defaults_validate():
    assert load_sweep(None, 2, default_name="default_cpu").cells
    assert load_sweep(None, 8, default_name="default_gpu").cells


def test_a_seed_list_expands_to_one_cell_per_seed():
    sw = expand(_data(backends=["nccl_torch"], world_sizes=[2],
                      scenarios=[{"preset": "tiny", "tokens_per_rank": 64,
                                  "seed": [1, 2, 3]}]), auto_world=2)
    assert [c.scenario.seed for c in sw.cells] == [1, 2, 3]
    ids = [c.scenario.scenario_id for c in sw.cells]
    assert len(set(ids)) == 3 and all(i.endswith(f"-seed{s}") for i, s in zip(ids, (1, 2, 3)))


def test_the_default_seed_keeps_the_ids_of_earlier_runs():
    sw = expand(_data(world_sizes=[2]), auto_world=2)
    assert sw.cells[0].scenario.scenario_id == "tiny-E8H128I64k2+se-T64-ep2-bf16-uniform"


def test_a_file_name_becomes_a_safe_run_name(tmp_path):
    path = tmp_path / "my sweep.toml"
    path.write_text('backends = ["nccl_torch"]\nworld_sizes = [2]\n'
                    '[[scenarios]]\npreset = "tiny"\ntokens_per_rank = 8\n')
    assert load_sweep(path, auto_world=2).name == "my-sweep"
