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
