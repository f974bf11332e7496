"""The whole forward (schedule included) captured once in a CUDA graph and replayed.

Possible because nothing from the schedule to the output synchronises with the host. Inputs
are copied into the workspace's own buffers (x and the routing go there anyway), the router
weights into one static buffer; one graph launch replaces about forty kernel launches, so
the host no longer paces the GPU.

Legend: L logical ranks, T tokens per rank, H hidden, K top-k.
"""

from __future__ import annotations

import torch

from mok_kernels._details.config import MoKConfig
from mok_kernels._details.forward import build_schedule, forward
from mok_kernels._details.workspace import Workspace


class GraphedForward:
    """``y_TH = gf(x_TH, topk_idx_TK, topk_weights_TK)``; captures on the first call."""

    def __init__(self, config: MoKConfig, ws: Workspace, weights: tuple) -> None:
        self.config, self.ws, self.weights = config, ws, weights
        self.graph: torch.cuda.CUDAGraph | None = None
        self.p_TK: torch.Tensor | None = None
        self.y_TH: torch.Tensor | None = None
        # With FP8 the forward quantises x into the token buffer, so x needs a static buffer
        # of its own (quantising the token buffer in place would read its own FP8 rows).
        self.x_TH = (torch.empty(ws.L * ws.T, ws.H, dtype=torch.bfloat16, device=ws.device)
                     if config.fp8 != "none" else ws.x_LTH.view(ws.L * ws.T, ws.H))

    def _body(self) -> torch.Tensor:
        ws = self.ws
        idx_TK = ws.idx_LTK.view(ws.L * ws.T, ws.K)  # copy onto itself: a no-op
        sched = build_schedule(ws, idx_TK)
        return forward(self.config, ws, sched, self.x_TH, self.p_TK, *self.weights)

    def _capture(self, topk_weights_TK: torch.Tensor) -> None:
        self.p_TK = torch.empty_like(topk_weights_TK, dtype=torch.float32)
        self.p_TK.copy_(topk_weights_TK)
        side = torch.cuda.Stream(device=self.ws.device)
        side.wait_stream(torch.cuda.current_stream(self.ws.device))
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            self._body()
        torch.cuda.current_stream(self.ws.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y_TH = self._body()

    def __call__(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor) -> torch.Tensor:
        ws = self.ws
        self.x_TH.copy_(x_TH)
        ws.idx_LTK.view(ws.L * ws.T, ws.K).copy_(topk_idx_TK)
        if self.graph is None:
            self._capture(topk_weights_TK)
        else:
            self.p_TK.copy_(topk_weights_TK)
        self.graph.replay()
        return self.y_TH.clone()  # the static output is overwritten by the next replay
