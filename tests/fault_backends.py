"""Backends that misbehave on purpose, for the fault tests (loaded via MOKBENCH_EXTRA_BACKENDS)."""

import os
import signal
import time

from baselines.nccl_torch import NcclTorchBackend


class RaiseBackend(NcclTorchBackend):
    name = "fault_raise"

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        raise RuntimeError("deliberate failure in forward")


class HangBackend(NcclTorchBackend):
    name = "fault_hang"

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        while True:
            time.sleep(1)


class KillBackend(NcclTorchBackend):
    name = "fault_kill"

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        os.kill(os.getpid(), signal.SIGKILL)


class BackwardOnlyFailsBackend(NcclTorchBackend):
    """Forward is right; the backward pass raises, so the forward row must survive."""

    name = "fault_backward"

    def weight_grads(self):
        raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


class CrashBackend(NcclTorchBackend):
    """Raises outside any pass (in the worker's availability check), so the worker process
    dies and torchrun reports only ChildFailedError; the row must carry this line."""

    name = "fault_crash"

    def unavailable_reason(self, ctx, scenario=None):
        if ctx is not None:  # in the worker, not in the launcher's host check
            raise RuntimeError("deliberate crash outside a pass")
        return super().unavailable_reason(ctx, scenario)
