"""Backend variants (``name@key=value``): parsing, sweep validation, scratch-file names, and
the knob chart."""

import pandas as pd
import pytest

from mokbench.backend import split_label
from mokbench.plots import make_plots
from mokbench.report import summarize
from mokbench.results import new_row
from mokbench.scenario import ScenarioError
from mokbench.sweep import expand


def test_split_label_reads_json_values():
    assert split_label("mok") == ("mok", {})
    assert split_label("mok@minibatch=2048,cuda_graph=true,tag=a b") == (
        "mok", {"minibatch": 2048, "cuda_graph": True, "tag": "a b"})
    for bad in ("mok@minibatch", "mok@", "mok@ , "):
        with pytest.raises(ScenarioError, match="allowed name.*@key=value"):
            split_label(bad)


def test_backends_option_keeps_a_labels_own_commas():
    from mokbench.cli import _split

    assert _split(["nccl_torch,mok@tma=true,num_stages=4,te", "mok@minibatch=512"]) == [
        "nccl_torch", "mok@tma=true,num_stages=4", "te", "mok@minibatch=512"]
    assert _split(None) is None


def _sweep(backends):
    return {"name": "v", "backends": backends, "world_sizes": [1],
            "scenarios": [{"preset": "kimi-k2", "num_experts": 8, "tokens_per_rank": 4096}]}


def test_variants_expand_as_separate_cells_with_distinct_stems():
    sw = expand(_sweep(["nccl_torch", "mok@minibatch=512", "mok@minibatch=4096"]), 1)
    assert [c.backend for c in sw.cells] == ["nccl_torch", "mok@minibatch=512",
                                             "mok@minibatch=4096"]
    assert len({c.stem for c in sw.cells}) == 3
    assert all("@" not in c.stem and "=" not in c.stem for c in sw.cells)


@pytest.mark.parametrize("label, needle", [
    ("mok@colour=1", "colour=1 is unknown: allowed block_k"),
    ("mok@minibatch=100", "minibatch=100 is invalid"),
    ("nope@minibatch=512", "backend='nope' is unknown"),
])
def test_bad_variants_fail_before_launch(label, needle):
    with pytest.raises(ScenarioError) as e:
        expand(_sweep([label]), 1)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fused_sum_refused_across_processes():
    sw = _sweep(["mok@fused_sum=true"])
    assert [c.backend for c in expand(sw, 1).cells] == ["mok@fused_sum=true"]
    sw["world_sizes"] = [2]
    with pytest.raises(ScenarioError) as e:  # 16 communication programs by default there
        expand(sw, 2)
    assert "fused_sum=True is invalid: allowed false when fwd_comm_sms > 0" in str(e.value)
    sw["backends"] = ["mok@fused_sum=true,fwd_comm_sms=0"]
    with pytest.raises(ScenarioError) as e:
        expand(sw, 2)
    assert "fused_sum=True is invalid at world_size 2: allowed only at world_size 1" \
        in str(e.value)


def test_knob_chart_drawn_for_a_minibatch_sweep(tmp_path):
    rows = [new_row(status="ok", backend="nccl_torch", is_baseline=True, median_ms=10.0,
                    scenario_id="s", hidden=7168, intermediate=2048, tflops=1.0,
                    tokens_per_rank=4096, precision="bf16", **{"pass": "forward"})]
    for mb, ms in ((512, 12.0), (2048, 8.0), (8192, 7.5)):
        rows.append(new_row(status="ok", backend=f"mok@minibatch={mb}", is_baseline=False,
                            median_ms=ms, scenario_id="s", hidden=7168, intermediate=2048,
                            tflops=1.0, tokens_per_rank=4096, precision="bf16",
                            **{"pass": "forward"}))
    summary = summarize(pd.DataFrame(rows), {})
    paths = make_plots(summary, tmp_path, {"sm_count": 132})
    assert (tmp_path / "knobs.png").exists() and (tmp_path / "knobs.svg").exists()
    assert len(paths) >= 2
