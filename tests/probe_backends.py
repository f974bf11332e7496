"""Backends that watch how the harness calls them, for the pass tests (loaded through
MOKBENCH_EXTRA_BACKENDS in the distributed tier, directly in the unit tier)."""

from __future__ import annotations

import json
import os

import torch

from baselines.nccl_torch import NcclTorchBackend
from mokbench.backend import Capabilities

PROBE_LOG_ENV = "MOKBENCH_PROBE_LOG"  # a folder: each rank appends one JSON line per forward


class GradProbeBackend(NcclTorchBackend):
    """nccl_torch that records, per forward call, whether autograd was on and whether x and
    the router weights required grad. A call that mixes the two (autograd on with inputs that
    do not require grad, or off with inputs that do) raises, so its row fails."""

    name = "grad_probe"

    def setup(self, scenario, ctx, weights) -> None:
        super().setup(scenario, ctx, weights)
        self.calls: list[dict] = []

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        call = {"grad": torch.is_grad_enabled(), "x": x_TH.requires_grad,
                "p": topk_weights_TK.requires_grad}
        self.calls.append(call)
        log = os.environ.get(PROBE_LOG_ENV)
        if log:
            with open(os.path.join(log, f"rank{self.ctx.rank}.jsonl"), "a") as f:
                f.write(json.dumps(call) + "\n")
        if len(set(call.values())) != 1:
            raise RuntimeError(f"grad mode and inputs disagree: {call}")
        return super().forward(x_TH, topk_idx_TK, topk_weights_TK)


class NoInferenceBackend(NcclTorchBackend):
    """nccl_torch that opts out of the inference pass."""

    name = "no_inference"
    capabilities = Capabilities(inference=False, notes="opts out of inference")
