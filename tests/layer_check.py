"""One rank, no process group: run a backend on seeded inputs and check it against the
reference (forward and backward). Shared by the CPU and GPU test tiers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mokbench.backend import RunContext, get_backend
from mokbench.check import CheckResult, check_backward, check_forward
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import ReferenceResult, reference_layer
from mokbench.scenario import Scenario


@dataclass
class SingleRankCheck:
    y_TH: torch.Tensor
    ref: ReferenceResult
    forward: CheckResult
    backward: CheckResult


def check_single_rank(backend_name: str, scenario: Scenario,
                      device: torch.device) -> SingleRankCheck:
    w, inp = make_weights(scenario, 0, device), make_inputs(scenario, 0, device)
    ref = reference_layer(inp, w)
    b = get_backend(backend_name)
    b.setup(scenario, RunContext(device=device), w)
    x = inp.x_TH.clone().requires_grad_()
    p = inp.topk_weights_TK.clone().requires_grad_()
    y = b.forward(x, inp.topk_idx_TK, p)
    fwd = check_forward(y, ref, scenario.precision)
    y.backward(inp.dy_TH)
    bwd = check_backward(x.grad, p.grad, b.weight_grads(), ref, scenario.precision)
    return SingleRankCheck(y.detach(), ref, fwd, bwd)
