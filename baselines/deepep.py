"""DeepEP (V1 ``deep_ep.Buffer`` API) dispatch and combine + torch grouped GEMM experts.

Legend: T tokens on this rank, K top-k, H hidden, W ranks, E local experts, R tokens received
by this rank (each once, however many of its experts it routes to), M expert rows (received
token-slots, grouped by local expert).

The layer, as DeepEP's README and Megatron-Core's ``fused_a2a`` use the library:

1. ``get_dispatch_layout`` then ``dispatch`` (host sync for the per-expert counts, as Megatron
   does; ``num_worst_tokens`` is left at 0 because the grouped GEMM needs the host counts);
2. received slots grouped by local expert; fused gate+up ``torch._grouped_mm``, SwiGLU, down;
3. router weights applied to each slot, slots summed per received token (``combine`` sums
   WITHOUT weights);
4. ``combine`` back, plus the shared expert.

Backward: dispatch's backward is a combine and combine's backward is a cached dispatch, both
wrapped in ``torch.autograd.Function``. FP8 (``precision="fp8"``) sends e4m3 tokens with one fp32
scale per 128 channels (needs a DeepEP build with SM90 kernels); experts stay bf16.

Knobs: ``MOKBENCH_DEEPEP_SMS`` communication SMs (even, default 24: ``Buffer.set_num_sms(24)`` in
DeepEP's README; the library's own default is 20). Buffers are sized as the README does, from
``Buffer.get_dispatch_config(W)`` / ``get_combine_config(W)`` (which read the SM count when
called, so it is set first); the row's variant records the SMs and the NVLink buffer size.
DeepEP is not on PyPI; benchmarks/build_deepep.sh builds a checkout of it. The V1 API ships in
tag v1.2.1 and the hybrid-ep branch (same intranode ``Buffer`` calls; its ``Buffer()`` also
checks NVLink through ``pynvml`` on every GPU, v1.2.1 only on PCIe GPUs); current main is the V2
API (ElasticBuffer).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Any

import torch

from baselines.common import canonical_grads, expert_params, grouped_swiglu_ffn, shared_expert
from mokbench.backend import BackendBase, Capabilities, RunContext

BUILD_SCRIPT = "benchmarks/build_deepep.sh"
DEEPEP_URL = "https://github.com/deepseek-ai/DeepEP"
INSTALL_HINT = f"not on PyPI: build tag v1.2.1 with {BUILD_SCRIPT}"
WORLD_SIZES = (2, 4, 8)  # intranode kernels only
SMS_ENV = "MOKBENCH_DEEPEP_SMS"
DEFAULT_SMS = 24
FP8_BLOCK = 128  # channels per fp32 scale in DeepEP's FP8 dispatch
FP8_MAX = 448.0  # largest finite e4m3 value


def comm_sms(env: dict[str, str] | None = None) -> int:
    """SMs DeepEP's dispatch/combine kernels use: $MOKBENCH_DEEPEP_SMS, default 24. DeepEP
    splits them into send/receive pairs, so the count must be even."""
    raw = (os.environ if env is None else env).get(SMS_ENV, "")
    try:
        n = int(raw) if raw.strip() else DEFAULT_SMS
    except ValueError:
        n = -1
    if n <= 0 or n % 2:
        raise ValueError(f"{SMS_ENV}={raw!r} is invalid: allowed a positive even integer")
    return n


def hidden_bytes(hidden: int, element_size: int) -> int:
    """Bytes per token row for buffer sizing, as DeepEP's README computes it (at least 2 bytes
    per element, so one buffer serves the bf16 combine after an FP8 dispatch)."""
    return hidden * max(element_size, 2)


def buffer_bytes(configs: list[Any], hidden_bytes_: int, num_ranks: int) -> tuple[int, int]:
    """(NVLink bytes, RDMA bytes) for a Buffer: the largest size hint over the dispatch and
    combine configs (``Buffer.get_dispatch_config(W)``, ``Buffer.get_combine_config(W)``)."""
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes_, num_ranks) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes_, num_ranks) for c in configs)
    return nvl, rdma


def build_recipe(ref: str, what: str) -> str:
    """How to install DeepEP at ``ref`` (tag or branch; ``what`` it brings) with our build
    script, as one line for ``mokbench backends``."""
    return (f"git clone -b {ref} {DEEPEP_URL} /path/to/DeepEP ({what}); then "
            f"{BUILD_SCRIPT} /path/to/DeepEP --check (--help: options)")


def deep_ep_installed() -> bool:
    """Whether a ``deep_ep`` package can be imported, without importing it."""
    return importlib.util.find_spec("deep_ep") is not None


def buffer_needs_pynvml(buffer_cls: Any) -> bool:
    """Whether this ``Buffer`` imports ``pynvml`` on every construction: the hybrid-ep branch's
    ``Buffer(..., allow_nvlink_for_normal_mode=True)`` checks NVLink between every pair of GPUs
    through it (v1.2.1 only on PCIe GPUs), and ``pynvml`` is not a dependency of torch."""
    try:
        params = inspect.signature(buffer_cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "allow_nvlink_for_normal_mode" in params


def visible_devices_reason(value: str | None) -> str | None:
    """The NVLink check of hybrid-ep's ``Buffer()`` maps the current device to a physical GPU
    with ``int()`` of its $CUDA_VISIBLE_DEVICES entry: UUIDs or MIG names there fail. Pure."""
    entries = [v.strip() for v in (value or "").strip(",").split(",") if v.strip()]
    if all(v.isdigit() for v in entries):
        return None
    return (f"deep_ep's Buffer reads CUDA_VISIBLE_DEVICES as GPU indices; it is {value!r} "
            "(use indices, e.g. 0,1)")


def deepep_reason(world_size: int, precision: str, hidden: int, *, installed: bool,
                  has_v1_buffer: bool = True, sm90_compiled: bool = True,
                  import_error: str | None = None, pynvml_missing: bool = False,
                  visible_devices: str | None = None) -> str | None:
    """Why DeepEP cannot run this cell (None when it can). Pure: facts are passed in;
    ``visible_devices``: $CUDA_VISIBLE_DEVICES where the Buffer checks NVLink through pynvml."""
    if not installed:
        return f"package 'deep_ep' is not installed ({INSTALL_HINT})"
    if import_error:
        return f"package 'deep_ep' does not import: {import_error}"
    if not has_v1_buffer:
        return "deep_ep has no V1 Buffer (V2 API installed); install v1.2.1 or the hybrid-ep branch"
    if pynvml_missing:
        return ("deep_ep's Buffer checks NVLink through pynvml, which is not installed "
                "(pip install nvidia-ml-py)")
    if visible_devices_reason(visible_devices):
        return visible_devices_reason(visible_devices)
    if world_size not in WORLD_SIZES:
        return f"needs 2, 4 or 8 GPUs (world size {world_size})"
    if precision == "fp8":
        if not sm90_compiled:
            return "FP8 dispatch needs DeepEP built with SM90 kernels (Buffer.is_sm90_compiled())"
        if hidden % FP8_BLOCK:
            return f"FP8 dispatch needs hidden a multiple of {FP8_BLOCK}; hidden is {hidden}"
    return None


def per_token_cast_to_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 tokens and fp32 scales [T, H/128] (one per 128 channels), DeepEP's FP8 input."""
    T, H = x_TH.shape
    x_TBC = x_TH.float().view(T, H // FP8_BLOCK, FP8_BLOCK)
    amax_TB = x_TBC.abs().amax(dim=2).clamp(min=1e-4)
    x_fp8 = (x_TBC * (FP8_MAX / amax_TB).unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
    return x_fp8, amax_TB / FP8_MAX


def fp8_to_bf16(x_fp8_TH: torch.Tensor, scales_TB: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp8` (up to e4m3 rounding)."""
    T, H = x_fp8_TH.shape
    x_TBC = x_fp8_TH.float().view(T, H // FP8_BLOCK, FP8_BLOCK) * scales_TB.unsqueeze(2)
    return x_TBC.view(T, H).to(torch.bfloat16)


def group_received(recv_idx_RK: torch.Tensor, counts: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Received slots grouped by local expert: (token row of each slot, its k), both [M].

    ``recv_idx_RK`` holds local expert ids, -1 where the slot belongs to another rank;
    ``counts`` are DeepEP's received rows per local expert (host list; M = sum(counts))."""
    E, K = len(counts), recv_idx_RK.shape[1]
    flat = recv_idx_RK.reshape(-1)
    key = torch.where(flat < 0, torch.full_like(flat, E), flat)
    order_M = torch.argsort(key, stable=True)[:sum(counts)]
    return order_M // K, order_M % K


class DeepEPComm:
    """One DeepEP V1 Buffer for this process group; dispatch/combine as autograd functions."""

    def __init__(self, group: Any, num_experts: int, hidden: int, fp8: bool) -> None:
        from deep_ep import Buffer

        self.num_sms = comm_sms()
        Buffer.set_num_sms(self.num_sms)  # before the configs: they read Buffer.num_sms
        W = group.size()
        configs = [Buffer.get_dispatch_config(W), Buffer.get_combine_config(W)]
        self.nvl_bytes, self.rdma_bytes = buffer_bytes(configs, hidden_bytes(hidden, 2), W)
        self.buffer = Buffer(group, self.nvl_bytes, self.rdma_bytes, explicitly_destroy=True)
        self.num_experts, self.fp8 = num_experts, fp8
        self.counts: list[int] = []

    def describe(self) -> str:
        """The row's variant: communication SMs, NVLink buffer (MiB), FP8 dispatch."""
        mib = self.nvl_bytes / 2**20
        return (f"sms={self.num_sms},nvl_buffer_mib={mib:.0f}"
                + (f",rdma_buffer_mib={self.rdma_bytes / 2**20:.0f}" if self.rdma_bytes else "")
                + (",fp8_dispatch" if self.fp8 else ""))

    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         Any]:
        """(recv_x_RH bf16, recv_weights_RK fp32, recv_idx_RK local ids, handle);
        received rows per local expert land in ``self.counts``."""
        return _Dispatch.apply(x_TH, topk_weights_TK.float(), topk_idx_TK, self)

    def combine(self, y_RH: torch.Tensor, handle: Any) -> torch.Tensor:
        return _Combine.apply(y_RH, handle, self)

    def raw_dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor,
                     topk_weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor, Any]:
        """``get_dispatch_layout`` then a non-cached ``dispatch`` (synchronous: no previous
        event, no async finish). DeepEP checks: x bf16 [T, H] contiguous, or (e4m3 [T, H], fp32
        [T, H/128]) in FP8; topk_idx int64 [T, K]; topk_weights fp32 [T, K] contiguous. It
        returns (recv_x, recv_topk_idx, recv_topk_weights, per-expert counts (host list),
        handle, event); recv_x is a tuple again in FP8, converted back to bf16 here."""
        buf = self.buffer
        topk_idx_TK = topk_idx_TK.to(torch.int64).contiguous()
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx_TK,
                                                                      self.num_experts)
        x_in = per_token_cast_to_fp8(x_TH) if self.fp8 else x_TH
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x_in, topk_idx=topk_idx_TK, topk_weights=topk_weights_TK,
            num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
        if isinstance(recv_x, tuple):
            recv_x = fp8_to_bf16(*recv_x)
        self.counts = list(counts)
        return recv_x, recv_idx, recv_w, handle

    def teardown(self) -> None:
        self.buffer.destroy()


class _Dispatch(torch.autograd.Function):
    """Forward: DeepEP dispatch. Backward: a combine of the received-token gradients."""

    @staticmethod
    def forward(ctx, x_TH, topk_weights_TK, topk_idx_TK, comm: DeepEPComm):
        recv_x, recv_idx, recv_w, handle = comm.raw_dispatch(x_TH.contiguous(), topk_idx_TK,
                                                             topk_weights_TK.contiguous())
        ctx.comm, ctx.handle = comm, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle

    @staticmethod
    def backward(ctx, g_recv_x, g_recv_w, _g_idx, _g_handle):
        g_w = None if g_recv_w is None else g_recv_w.float().contiguous()
        g_x, g_topk_w, _ = ctx.comm.buffer.combine(g_recv_x.contiguous(), ctx.handle,
                                                   topk_weights=g_w)
        return g_x, g_topk_w, None, None


class _Combine(torch.autograd.Function):
    """Forward: DeepEP combine (unweighted sum). Backward: a cached dispatch of the gradient."""

    @staticmethod
    def forward(ctx, y_RH, handle, comm: DeepEPComm):
        ctx.comm, ctx.handle = comm, handle
        y_TH, _, _ = comm.buffer.combine(y_RH.contiguous(), handle)
        return y_TH

    @staticmethod
    def backward(ctx, g_TH):
        g_RH, *_ = ctx.comm.buffer.dispatch(g_TH.contiguous(), handle=ctx.handle)
        return g_RH, None, None


def deepep_status(world_size: int, precision: str, hidden: int) -> str | None:
    """:func:`deepep_reason` with the facts read from the installed package."""
    if not deep_ep_installed():
        return deepep_reason(world_size, precision, hidden, installed=False)
    try:
        import deep_ep
    except Exception as exc:  # noqa: BLE001 - a broken build (missing .so, symbols) is a reason
        first = (str(exc).strip().splitlines() or [""])[0]
        return deepep_reason(world_size, precision, hidden, installed=True,
                             import_error=f"{type(exc).__name__}: {first}")
    buffer = getattr(deep_ep, "Buffer", None)
    v1 = buffer is not None and hasattr(buffer, "get_dispatch_layout")
    sm90 = buffer.is_sm90_compiled() if v1 and precision == "fp8" else True
    nvml = v1 and buffer_needs_pynvml(buffer)
    return deepep_reason(world_size, precision, hidden, installed=True, has_v1_buffer=v1,
                         sm90_compiled=bool(sm90),
                         pynvml_missing=nvml and importlib.util.find_spec("pynvml") is None,
                         visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES") if nvml else None)


class DeepEPBackend(BackendBase):
    """DeepEP V1 dispatch/combine around torch grouped-GEMM SwiGLU experts."""

    name = "deepep"
    capabilities = Capabilities(
        precisions=("bf16", "fp8"), world_sizes=WORLD_SIZES, min_cc=(8, 0), needs_gpu=True,
        notes="DeepEP V1 Buffer dispatch/combine (host-synced counts) + torch._grouped_mm; "
              "fp8 = FP8 dispatch, bf16 experts")

    def unavailable_reason(self, ctx: RunContext | None, scenario=None) -> str | None:
        ws = scenario.world_size if scenario is not None else (ctx.world_size if ctx else 1)
        prec = scenario.precision if scenario is not None else "bf16"
        hidden = scenario.shape.hidden if scenario is not None else FP8_BLOCK
        return deepep_status(ws, prec, hidden) or super().unavailable_reason(ctx, scenario)

    def install_hint(self) -> str | None:
        """The build recipe while no deep_ep with the V1 Buffer is installed, else None."""
        if deepep_status(WORLD_SIZES[0], "bf16", FP8_BLOCK) is None:
            return None
        return build_recipe("v1.2.1", "the V1 Buffer; branch hybrid-ep has it too")

    def setup(self, scenario, ctx, weights) -> None:
        self.ctx = ctx
        self.params = expert_params(weights)
        self.comm = DeepEPComm(ctx.group, scenario.shape.num_experts, scenario.shape.hidden,
                               fp8=scenario.precision == "fp8")
        self.variant = self.comm.describe()

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        recv_x_RH, recv_w_RK, recv_idx_RK, handle = self.comm.dispatch(x_TH, topk_idx_TK,
                                                                       topk_weights_TK)
        counts = self.comm.counts
        rows_M, k_M = group_received(recv_idx_RK, counts)
        counts_E = torch.tensor(counts, dtype=torch.int64, device=x_TH.device)
        out_MH = grouped_swiglu_ffn(recv_x_RH[rows_M], counts_E, self.params["w1_EFH"],
                                    self.params["w2_EHI"], None if x_TH.is_cuda else counts)
        out_MH = out_MH * recv_w_RK[rows_M, k_M].unsqueeze(1).to(out_MH.dtype)
        y_RH = torch.zeros_like(recv_x_RH).index_add(0, rows_M, out_MH)
        y_TH = self.comm.combine(y_RH, handle)
        if "ws1_FH" in self.params:
            y_TH = y_TH + shared_expert(x_TH, self.params["ws1_FH"], self.params["ws2_HI"])
        return y_TH

    def weight_grads(self):
        return canonical_grads(self.params)

    def teardown(self) -> None:
        comm = getattr(self, "comm", None)
        if comm is not None:
            if self.ctx.is_cuda:
                torch.cuda.synchronize()  # no kernel may still use the buffer
            comm.teardown()
            self.comm = None
        super().teardown()
