"""The upstream MoK package (``mok``, mixture-of-kittens) behind the backend protocol.

Legend: T tokens on this rank, K top-k, H hidden, I intermediate, E local experts.

MoK fuses dispatch, the routed and shared SwiGLU experts and combine into one persistent kernel
over symmetric memory. Its functional API (``mok.functional``; the quantiser in ``mok.ops``):

    cfg = MoKConfig()
    ws = get_workspace(cfg, group, device=, num_local_tokens=T, hidden_size=H, topk=K)
    sched = build_schedule(ws, cfg, topk_idx_TK (int64), num_local_experts=E)
    y, fctx = forward(cfg, ws, sched, x, router_weights, shared_gate [I, H], shared_up [I, H],
                      shared_down [H, I], routed_gate [E, I, H], routed_up [E, I, H],
                      routed_down [E, H, I])
    dx, dw, d_gate, d_up, d_down, d_sgate, d_sup, d_sdown = backward(cfg, ws, sched, fctx, dy,
                      x, router_weights, <the same six weights>)

MXFP8: routed weights go in as ``mxfp8_quantize(w, True, True)`` = (fp8, scales, fp8_T,
scales_T): forward takes (fp8, scales) of gate, up and down; backward takes all four of gate and
up, and (fp8_T, scales_T) of down. The shared expert stays bf16. Quantisation runs in every
forward (weights change every training step). The schedule is built in every forward, as MoK's
published forward time includes it.

Its limits (from its own argument checks): SM100/SM103, EP 4 to 64, tokens per rank a multiple of
256 and at least 512, H and I multiples of 256, a shared expert always present, top-k <= 255.
It is our reference point, not a baseline (``is_baseline=False``).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace
from typing import Any

import torch

from mokbench.backend import BackendBase, Capabilities, RunContext

INSTALL_HINT = ("pip install 'mokbench[mok]', i.e. "
                "git+https://github.com/cursor/mixture-of-kittens")
EP_SIZES = (4, 8, 16, 32, 64)
CCS = ((10, 0), (10, 3))
API_NAMES = ("MoKConfig", "get_workspace", "build_schedule", "forward", "backward",
             "mxfp8_quantize")
_MOK = ("w_gate_EIH", "w_up_EIH", "w_down_EHI", "ws_gate_IH", "ws_up_IH", "ws_down_HI")


def mok_reason(world_size: int, precision: str, tokens: int, hidden: int, inter: int,
               topk: int, shared_expert: bool, cc: tuple[int, int] | None, *,
               installed: bool, upstream: bool = True) -> str | None:
    """Why upstream MoK cannot run this cell (None when it can). Pure: facts passed in.
    ``upstream``: the importable ``mok`` has ``mok.functional`` (PyPI's "mok" is unrelated)."""
    if not installed:
        return f"package 'mok' is not installed ({INSTALL_HINT})"
    if not upstream:
        return f"the installed 'mok' is not upstream MoK (no mok.functional; {INSTALL_HINT})"
    if cc not in CCS:
        have = "no GPU is visible" if cc is None else f"GPU has {cc[0]}.{cc[1]}"
        return f"needs compute capability 10.0/10.3 (Blackwell); {have}"
    if world_size not in EP_SIZES:
        return f"needs EP 4, 8, 16, 32 or 64 (world size {world_size})"
    if tokens < 512 or tokens % 256:
        return f"needs tokens per rank a multiple of 256 and at least 512 (got {tokens})"
    if hidden % 256 or inter % 256:
        return f"needs hidden and intermediate multiples of 256 (got {hidden}, {inter})"
    if not shared_expert:
        return "always computes a shared expert; the scenario has none"
    if topk > 255:
        return f"needs top-k <= 255 (got {topk})"
    if precision not in ("bf16", "fp8"):
        return f"precision {precision} not supported: allowed bf16, fp8 (MXFP8)"
    return None


def resolve_api(mok: Any) -> SimpleNamespace:
    """MoK's entry points, looked up in ``mok`` then ``mok.functional`` then ``mok.ops``
    (where the published package keeps them)."""
    places = [mok]
    for sub in ("functional", "ops"):
        try:
            places.append(importlib.import_module(f"{mok.__name__}.{sub}"))
        except ImportError:
            pass
    found = {}
    for name in API_NAMES:
        hit = next((getattr(p, name) for p in places if hasattr(p, name)), None)
        if hit is None:
            raise ImportError(f"mok has no {name} (looked in mok, mok.functional, mok.ops)")
        found[name] = hit
    return SimpleNamespace(**found)


def mok_weights(w1_EHF: torch.Tensor, w2_EIH: torch.Tensor, ws1_HF: torch.Tensor,
                ws2_IH: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical weights -> MoK's K-major split layout (gate/up [.., I, H], down [.., H, I])."""
    I = w2_EIH.shape[1]
    return {
        "w_gate_EIH": w1_EHF[..., :I].transpose(1, 2).contiguous(),
        "w_up_EIH": w1_EHF[..., I:].transpose(1, 2).contiguous(),
        "w_down_EHI": w2_EIH.transpose(1, 2).contiguous(),
        "ws_gate_IH": ws1_HF[:, :I].t().contiguous(),
        "ws_up_IH": ws1_HF[:, I:].t().contiguous(),
        "ws_down_HI": ws2_IH.t().contiguous(),
    }


def canonical_from_mok(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`mok_weights` (also for their gradients)."""
    return {
        "w1_EHF": torch.cat([t["w_gate_EIH"], t["w_up_EIH"]], dim=1).transpose(1, 2),
        "w2_EIH": t["w_down_EHI"].transpose(1, 2),
        "ws1_HF": torch.cat([t["ws_gate_IH"], t["ws_up_IH"]], dim=0).t(),
        "ws2_IH": t["ws_down_HI"].t(),
    }


def routed_args(api: Any, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                mxfp8: bool) -> tuple[tuple, tuple]:
    """(forward's, backward's) routed weight arguments: the bf16 tensors, or MXFP8 tuples."""
    if not mxfp8:
        return (gate, up, down), (gate, up, down)
    g, u, d = (api.mxfp8_quantize(w.detach(), True, True) for w in (gate, up, down))
    return ((g[0], g[1]), (u[0], u[1]), (d[0], d[1])), (tuple(g), tuple(u), (d[2], d[3]))


class _MoKLayer(torch.autograd.Function):
    """MoK forward; backward through MoK's own backward (all grads at once)."""

    @staticmethod
    def forward(ctx, run: MoKUpstreamBackend, topk_idx_TK, x_TH, w_TK, *weights):
        api, cfg, ws = run.api, run.cfg, run.workspace
        sched = api.build_schedule(ws, cfg, topk_idx_TK.contiguous(), num_local_experts=run.E)
        gate, up, down, sg, su, sd = weights
        fwd_routed, bwd_routed = routed_args(api, gate, up, down, run.mxfp8)
        x, w = x_TH.detach().contiguous(), w_TK.detach().float().contiguous()
        y_TH, fctx = api.forward(cfg, ws, sched, x, w, sg, su, sd, *fwd_routed)
        ctx.run, ctx.sched, ctx.fctx, ctx.bwd_routed = run, sched, fctx, bwd_routed
        ctx.save_for_backward(x, w, sg, su, sd)
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        run = ctx.run
        x, w, sg, su, sd = ctx.saved_tensors
        (dx, dw, d_gate, d_up, d_down, d_sg, d_su, d_sd) = run.api.backward(
            run.cfg, run.workspace, ctx.sched, ctx.fctx, dy_TH.contiguous(), x, w, sg, su, sd,
            *ctx.bwd_routed)
        return None, None, dx, dw, d_gate, d_up, d_down, d_sg, d_su, d_sd


class MoKUpstreamBackend(BackendBase):
    """Upstream MoK, run through its functional API."""

    name = "mok_upstream"
    capabilities = Capabilities(
        precisions=("bf16", "fp8"), world_sizes=EP_SIZES, min_cc=(10, 0), max_cc=(10, 3),
        needs_gpu=True, packages=("mok",), is_baseline=False,
        notes="upstream MoK: SM100/SM103, EP 4-64, tokens a multiple of 256 and >= 512, "
              "H and I multiples of 256, shared expert required; fp8 = MXFP8")

    def unavailable_reason(self, ctx: RunContext | None, scenario=None) -> str | None:
        cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        installed = importlib.util.find_spec("mok") is not None
        facts = {"installed": installed,
                 "upstream": installed and importlib.util.find_spec("mok.functional") is not None}
        if scenario is None:
            ws = ctx.world_size if ctx else 1
            return mok_reason(ws, "bf16", 512, 256, 256, 1, True, cc, **facts)
        s = scenario.shape
        return mok_reason(scenario.world_size, scenario.precision, scenario.tokens_per_rank,
                          s.hidden, s.intermediate, s.topk, scenario.shared_expert, cc, **facts)

    def setup(self, scenario, ctx, weights) -> None:
        self.api = resolve_api(importlib.import_module("mok"))
        self.cfg = self.api.MoKConfig()
        s = scenario.shape
        device = torch.device(ctx.device)
        self.workspace = self.api.get_workspace(
            self.cfg, ctx.group, device=device, num_local_tokens=scenario.tokens_per_rank,
            hidden_size=s.hidden, topk=s.topk)
        self.E, self.mxfp8 = scenario.local_experts, scenario.precision == "fp8"
        t = mok_weights(weights.w1_EHF, weights.w2_EIH, weights.ws1_HF, weights.ws2_IH)
        self.params = {k: torch.nn.Parameter(v) for k, v in t.items()}
        self.variant = "mxfp8" if self.mxfp8 else "bf16"

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        return _MoKLayer.apply(self, topk_idx_TK, x_TH, topk_weights_TK,
                               *(self.params[k] for k in _MOK))

    def weight_grads(self) -> dict[str, torch.Tensor]:
        if any(self.params[k].grad is None for k in _MOK):
            return {}
        return canonical_from_mok({k: self.params[k].grad for k in _MOK})
