"""The three passes on one rank without a process group: the forward is a training forward
(autograd on, inputs require grad, y keeps its graph), inference runs under torch.no_grad() on
inputs that do not require grad, and each is checked before it is timed."""

from __future__ import annotations

import pytest
import torch

from mokbench.backend import Capabilities, RunContext
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.scenario import PASSES, Scenario, ScenarioError, TimingConfig, pass_label, preset
from mokbench.worker import run_pass
from tests.probe_backends import GradProbeBackend

CPU = torch.device("cpu")


@pytest.fixture
def setup():
    scn = Scenario(preset("tiny"), 32, 1, timing=TimingConfig(warmup=1, iters=3))
    weights, inputs = make_weights(scn, 0, CPU), make_inputs(scn, 0, CPU)
    ref = reference_layer(inputs, weights, backward=True)
    backend = GradProbeBackend()
    ctx = RunContext(device=CPU)
    backend.setup(scn, ctx, weights)
    return scn, backend, ctx, inputs, ref


def test_default_passes_and_labels():
    assert PASSES == ("forward", "backward", "inference")
    assert Scenario(preset("tiny"), 32, 1).passes == PASSES
    assert [pass_label(p) for p in PASSES] == ["forward (training)", "backward",
                                               "inference (no_grad)"]
    with pytest.raises(ScenarioError, match="^passes=.*inference"):
        Scenario(preset("tiny"), 32, 1, passes=("predict",))


def test_inference_counts_the_forward_flops():
    s = Scenario(preset("tiny"), 32, 1)
    assert s.flops("inference") == s.flops("forward") == s.flops("backward") / 2


def test_inference_follows_forward_unless_opted_out():
    assert Capabilities().runs("inference")
    assert Capabilities(passes=("forward",)).runs("inference")
    assert not Capabilities(passes=("backward",)).runs("inference")
    assert not Capabilities(inference=False).runs("inference")
    assert Capabilities(inference=False).runs("forward")


def test_forward_pass_is_a_training_forward(setup):
    scn, backend, ctx, inputs, ref = setup
    out = run_pass("forward", backend, scn, ctx, inputs, ref)
    assert out["status"] == "ok", out["reason"]
    assert out["keeps_graph"] is True
    assert len(backend.calls) == 1 + 1 + 3  # check, warm-up, timed
    assert all(c == {"grad": True, "x": True, "p": True} for c in backend.calls)


def test_inference_pass_runs_without_grad(setup):
    scn, backend, ctx, inputs, ref = setup
    torch.set_grad_enabled(True)
    out = run_pass("inference", backend, scn, ctx, inputs, ref)
    assert out["status"] == "ok", out["reason"]
    assert out["max_rel_err"] < 1e-2 and "keeps_graph" not in out
    assert len(backend.calls) == 5
    assert all(c == {"grad": False, "x": False, "p": False} for c in backend.calls)
    assert torch.is_grad_enabled()  # the pass does not leave autograd off
    assert out["tflops"] == pytest.approx(scn.flops("forward") / (out["median_ms"] * 1e-3)
                                          / 1e12)


def test_backward_pass_forward_records_the_graph(setup):
    scn, backend, ctx, inputs, ref = setup
    out = run_pass("backward", backend, scn, ctx, inputs, ref)
    assert out["status"] == "ok", out["reason"]
    assert all(c == {"grad": True, "x": True, "p": True} for c in backend.calls)


def test_rows_keep_samples_and_memory(setup):
    scn, backend, ctx, inputs, ref = setup
    out = run_pass("inference", backend, scn, ctx, inputs, ref)
    assert len(out["samples_ms"]) == out["iters"] == 3
    assert min(out["samples_ms"]) == pytest.approx(out["min_ms"])
    assert out["peak_mem_bytes"] is None  # CPU: no GPU memory to count


def test_inference_is_checked_before_timing(setup):
    scn, backend, ctx, inputs, ref = setup
    wrong = GradProbeBackend.forward

    def off_by_one(self, x, idx, p):
        return wrong(self, x, idx, p) + 1.0

    backend.forward = off_by_one.__get__(backend)
    out = run_pass("inference", backend, scn, ctx, inputs, ref)
    assert out["status"] == "failed" and out["reason"].startswith("correctness")
    assert len(backend.calls) == 1 and "median_ms" not in out
