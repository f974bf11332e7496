"""The mok backend through the harness protocol on one GPU, against the reference layer."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from mokbench.backend import RunContext, get_backend  # noqa: E402
from mokbench.inputs import make_inputs, make_weights  # noqa: E402
from mokbench.reference import reference_layer  # noqa: E402
from mokbench.scenario import ModelShape, Scenario  # noqa: E402
from tests.layer_check import check_single_rank  # noqa: E402


@pytest.mark.parametrize("graph, interleaved", [("true", "false"), ("false", "false"),
                                               ("false", "true")])
def test_backend_forward_matches_reference(monkeypatch, graph, interleaved):
    """Eager and graphed; the interleaved gate/up layout is set up by the backend itself."""
    monkeypatch.setenv("MOKBENCH_MOK_CONFIG", f'{{"minibatch": 256, "cuda_graph": {graph}, '
                                              f'"gate_up_interleaved": {interleaved}}}')
    sc = Scenario(ModelShape("t", 16, 2048, 256, 4), tokens_per_rank=500, world_size=1,
                  passes=("forward",))
    dev = torch.device("cuda")
    ctx = RunContext(device=dev)
    backend = get_backend("mok")
    assert backend.unavailable_reason(ctx, sc) is None
    weights = make_weights(sc, 0, dev)
    backend.setup(sc, ctx, weights)
    inputs = make_inputs(sc, 0, dev)
    ref = reference_layer(inputs, weights, backward=False).y_TH
    for _ in range(2):
        y = backend.forward(inputs.x_TH, inputs.topk_idx_TK, inputs.topk_weights_TK)
        assert y.shape == ref.shape and y.dtype == torch.bfloat16 and not y.requires_grad
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    backend.check()
    backend.teardown()


def test_backend_fp8_cell_runs_the_fp8_backward_within_the_fp8_bound(monkeypatch):
    """An FP8 cell on one Hopper GPU: the backend's default config runs the whole FP8 backward
    (the row's variant says so), and forward and backward pass the harness's FP8 check against
    the reference layer, as in a sweep cell."""
    monkeypatch.delenv("MOKBENCH_MOK_CONFIG", raising=False)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FP8 backward is the FP8 cells' default on Hopper only")
    sc = Scenario(ModelShape("t", 16, 2048, 512, 4), tokens_per_rank=1024, world_size=1,
                  precision="fp8")
    res = check_single_rank("mok", sc, torch.device("cuda"))
    assert res.forward.ok, res.forward.reason()
    assert res.backward.ok, res.backward.reason()
    backend = get_backend("mok")
    dev = torch.device("cuda")
    backend.setup(sc, RunContext(device=dev), make_weights(sc, 0, dev))
    assert "bwd=fp8_da_dx_wgrad" in backend.variant, backend.variant
    backend.teardown()


def test_backend_step_pass_is_checked_and_timed(monkeypatch):
    """The step pass (training forward and backward in one timed body) through the worker's
    own pass code, as a sweep cell runs it: y and every gradient pass the bf16 check, then
    three steps are timed; one Hopper rank's defaults (four dX and dW tiles per item)."""
    from mokbench.scenario import TimingConfig
    from mokbench.worker import run_pass

    monkeypatch.delenv("MOKBENCH_MOK_CONFIG", raising=False)
    sc = Scenario(ModelShape("t", 16, 2048, 512, 4), tokens_per_rank=1024, world_size=1,
                  passes=("step",), timing=TimingConfig(warmup=1, iters=3))
    dev = torch.device("cuda")
    ctx = RunContext(device=dev)
    backend = get_backend("mok")
    weights = make_weights(sc, 0, dev)
    inputs = make_inputs(sc, 0, dev)
    ref = reference_layer(inputs, weights, backward=True)
    backend.setup(sc, ctx, weights)
    out = run_pass("step", backend, sc, ctx, inputs, ref)
    assert out["status"] == "ok", out.get("reason")
    assert out["max_rel_err"] < 1e-2 and len(out["samples_ms"]) == 3
    backend.teardown()
