"""MoK-style MoE megakernels, forward and backward, in Triton (BF16; an FP8 forward): one GPU,
loopback or EP.

Legend: L logical ranks of one launch (1 in real EP, R in loopback), T tokens per rank,
H hidden, I expert intermediate, E local experts, K top-k.

Use::

    cfg = MoKConfig.for_shape(H, I, minibatch=2048, macrobatch=6144)
    ws = get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E, topk=K,
                       shared=True, device="cuda", group=ep_group)   # or loopback_ranks=R
    sched = build_schedule(ws, topk_idx_TK)                          # no host sync
    y_TH = forward(cfg, ws, sched, x_TH, topk_weights_TK, w1_EHF, w2_EIH, ws1_HF, ws2_IH)
    check_errors(ws)                                                 # the one host sync

Training: ``y_TH, ctx = forward_train(...)`` (same arguments) keeps what the backward needs
(``ctx.nbytes``); ``g = backward(cfg, ws, ctx, dy_TH, w1_EHF, w2_EIH, ws1_HF, ws2_IH)``
returns dx, the router-weight gradient and every weight gradient (:class:`Gradients`), in one
persistent launch plus two fixed-order sums, with no host sync.

FP8 expert FFN (the tiles of the FP8 path, runnable alone): ``ops = quantize_ffn(recipe,
x_TH, w1_EHF, w2_EIH)`` (recipe ``FP8_RECIPES``: blockwise, rowwise, mx), ``y_TH = ffn_fp8(ops,
grp_B)`` for rows grouped by expert in row blocks, ``ref_ffn_fp8`` the torch reference,
``compile_fp8_ffn_kernel`` their builds. The megakernel's forward runs them with
``MoKConfig(fp8="rowwise", gate_up_interleaved=True, block_n=256, block_k=128)`` and the
(K-major) weights of ``quantize_weights(cfg, ...)``; MXFP8 is unverified on Blackwell
hardware.

``GraphedForward(cfg, ws, weights)`` captures schedule + forward in one CUDA graph.
``compile_megakernel(cfg, H, I, arch=90)`` builds the kernel for Hopper (or 100: Blackwell) on
any host, GPU or not, and reports shared memory, spills and ptxas's warnings.

Weights are in the canonical math layout: w1_EHF [E, H, 2I] (gate columns then up columns),
w2_EIH [E, I, H]; in loopback they hold all L*E experts, rank-major. With
``MoKConfig(gate_up_interleaved=True)`` the gate+up weights (routed and shared) are passed as
``interleave_gate_up(w1_EHF)`` instead. This package never
imports mokbench.
"""

from mok_kernels._details.backward import (
    BackwardFp8Weights,
    Gradients,
    backward,
    backward_trace_capacity,
    quantize_backward_weights,
)
from mok_kernels._details.config import MoKConfig, MoKConfigError, Plan, plan
from mok_kernels._details.errors import (
    MoKCapacityError,
    MoKError,
    MoKTimeoutError,
    check_errors,
)
from mok_kernels._details.ffn_fp8 import (
    Fp8Ffn,
    Fp8Weight,
    ffn_fp8,
    quantize_ffn,
    quantize_weights,
    ref_ffn_fp8,
    tiles_for,
)
from mok_kernels._details.forward import (
    WITHHOLD_DGRAD,
    WITHHOLD_DISPATCH,
    WITHHOLD_NONE,
    WITHHOLD_PULLED,
    WITHHOLD_ROWBLOCK,
    WITHHOLD_WGRAD_QUANT,
    ForwardContext,
    Schedule,
    build_schedule,
    down_tiles,
    forward,
    forward_trace_capacity,
    forward_train,
    gate_up_tiles,
    interleave_gate_up,
)
from mok_kernels._details.graph import GraphedForward
from mok_kernels._details.lowering import Lowered, compile_megakernel
from mok_kernels._details.quant_lowering import (
    FFN_KERNELS,
    QUANT_KERNELS,
    compile_fp8_ffn_kernel,
    compile_quant_kernel,
)
from mok_kernels._details.tl_gemm_fp8 import RECIPES as FP8_RECIPES
from mok_kernels._details.tl_quant import (
    dequantize_blockwise,
    dequantize_colwise,
    dequantize_mx,
    dequantize_rowwise,
    dequantize_weight_128x128,
    quantize_blockwise,
    quantize_mx,
    quantize_rowwise,
    quantize_weight_128x128,
    quantize_weight_colwise,
    ref_quantize_blockwise,
    ref_quantize_colwise,
    ref_quantize_mx,
    ref_quantize_rowwise,
    ref_quantize_weight_128x128,
)
from mok_kernels._details.workspace import Workspace, clear_workspace_cache, get_workspace

__all__ = [
    "BackwardFp8Weights",
    "FFN_KERNELS",
    "FP8_RECIPES",
    "ForwardContext",
    "Fp8Ffn",
    "Fp8Weight",
    "Gradients",
    "GraphedForward",
    "Lowered",
    "MoKCapacityError",
    "MoKConfig",
    "MoKConfigError",
    "MoKError",
    "MoKTimeoutError",
    "Plan",
    "QUANT_KERNELS",
    "Schedule",
    "WITHHOLD_DISPATCH",
    "WITHHOLD_NONE",
    "WITHHOLD_ROWBLOCK",
    "WITHHOLD_DGRAD",
    "WITHHOLD_WGRAD_QUANT",
    "WITHHOLD_PULLED",
    "Workspace",
    "backward",
    "backward_trace_capacity",
    "build_schedule",
    "check_errors",
    "clear_workspace_cache",
    "compile_fp8_ffn_kernel",
    "compile_megakernel",
    "compile_quant_kernel",
    "dequantize_blockwise",
    "dequantize_colwise",
    "dequantize_mx",
    "dequantize_rowwise",
    "dequantize_weight_128x128",
    "down_tiles",
    "ffn_fp8",
    "forward",
    "forward_trace_capacity",
    "forward_train",
    "get_workspace",
    "gate_up_tiles",
    "interleave_gate_up",
    "plan",
    "quantize_backward_weights",
    "quantize_blockwise",
    "quantize_ffn",
    "quantize_weights",
    "quantize_mx",
    "quantize_rowwise",
    "quantize_weight_128x128",
    "quantize_weight_colwise",
    "ref_ffn_fp8",
    "ref_quantize_blockwise",
    "ref_quantize_colwise",
    "ref_quantize_mx",
    "ref_quantize_rowwise",
    "ref_quantize_weight_128x128",
    "tiles_for",
]
