"""The passes on one rank without a process group: the forward is a training forward
(autograd on, inputs require grad, y keeps its graph), inference runs under torch.no_grad() on
inputs that do not require grad, a step times the training forward and its backward together,
and each is checked before it is timed."""

from __future__ import annotations

import pytest
import torch

from mokbench.backend import Capabilities, RunContext
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.scenario import (
    DEFAULT_PASSES,
    PASSES,
    Scenario,
    ScenarioError,
    TimingConfig,
    pass_label,
    preset,
)
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
    assert DEFAULT_PASSES == ("forward", "backward", "inference")
    assert PASSES == DEFAULT_PASSES + ("step",)  # step only where a sweep asks for it
    assert Scenario(preset("tiny"), 32, 1).passes == DEFAULT_PASSES
    assert Scenario.from_dict(Scenario(preset("tiny"), 32, 1).to_dict()).passes == DEFAULT_PASSES
    assert [pass_label(p) for p in PASSES] == ["forward (training)", "backward",
                                               "inference (no_grad)", "step (forward + backward)"]
    assert Scenario(preset("tiny"), 32, 1, passes=("step",)).passes == ("step",)
    with pytest.raises(ScenarioError, match="^passes=.*inference, step"):
        Scenario(preset("tiny"), 32, 1, passes=("predict",))


def test_inference_counts_the_forward_flops():
    s = Scenario(preset("tiny"), 32, 1)
    assert s.flops("inference") == s.flops("forward") == s.flops("backward") / 2
    assert s.flops("step") == s.flops("forward") + s.flops("backward")


def test_inference_follows_forward_unless_opted_out():
    assert Capabilities().runs("inference")
    assert Capabilities(passes=("forward",)).runs("inference")
    assert not Capabilities(passes=("backward",)).runs("inference")
    assert not Capabilities(inference=False).runs("inference")
    assert Capabilities(inference=False).runs("forward")


def test_step_runs_where_forward_and_backward_run():
    assert Capabilities().runs("step")
    assert not Capabilities(passes=("forward",)).runs("step")
    assert not Capabilities(passes=("backward",)).runs("step")


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


def test_step_pass_times_forward_and_backward_together(setup):
    """Each timed step is one training forward and its backward (the probe logs one call per
    forward: check, warm-up and three timed steps); the gradients are cleared before each, so
    they are one step's, checked with y against the reference; TFLOP/s counts both passes."""
    scn, backend, ctx, inputs, ref = setup
    out = run_pass("step", backend, scn, ctx, inputs, ref)
    assert out["status"] == "ok", out["reason"]
    assert out["max_rel_err"] < 1e-2 and len(out["samples_ms"]) == 3
    assert len(backend.calls) == 1 + 1 + 3
    assert all(c == {"grad": True, "x": True, "p": True} for c in backend.calls)
    assert out["tflops"] == pytest.approx(3 * scn.flops("forward") / (out["median_ms"] * 1e-3)
                                          / 1e12)


@pytest.mark.parametrize("wrong", ["y", "grad"])
def test_step_pass_checks_y_and_the_gradients(setup, wrong):
    scn, backend, ctx, inputs, ref = setup
    forward = GradProbeBackend.forward

    def off(self, x, idx, p):
        y = forward(self, x, idx, p)
        if wrong == "y":
            return y + 1.0  # y off, gradients right
        return y + (y - y.detach()) * 0.5  # y right, every gradient 1.5 times

    backend.forward = off.__get__(backend)
    out = run_pass("step", backend, scn, ctx, inputs, ref)
    assert out["status"] == "failed" and out["reason"].startswith("correctness"), out
    assert ("y:" in out["reason"]) == (wrong == "y")
    assert ("dx:" in out["reason"]) == (wrong == "grad")
    assert "median_ms" not in out


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
