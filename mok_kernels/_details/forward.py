"""Host side of the forward: schedule, launches, barriers, error check. No host sync from the
schedule to the output (graph capturable); the device error words are read afterwards by
``errors.check_errors``, the one sync, which the user calls outside the forward.

Legend: L logical ranks in the launch, T tokens per rank, H hidden, I intermediate, E local
experts, K top-k, S combine slots per token, F = 2*I.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mok_kernels._details.config import MoKConfig
from mok_kernels._details.ffn_fp8 import Fp8Weight, quantize_tokens_into
from mok_kernels._details.schedule import (
    ScheduleTensors,
    build_schedule_tensors,
    compiled_schedule_builder,
    flag_capacity_errors,
)
from mok_kernels._details.tl_gemm_fp8 import fp8_row_elements, fp8_scale_sizes
from mok_kernels._details.workspace import Workspace

# Test-only switch: withhold one signal so a bounded wait must expire (0 = off;
# WITHHOLD_WGRAD_QUANT: the first Q item of the backward with ``bwd_fp8_wgrad``;
# WITHHOLD_PULLED: the pull item of row block 0 with ``bwd_fused_pull`` and dA items that do not
# wait for the pull, ``bwd_fp8_da``).
WITHHOLD_NONE, WITHHOLD_DISPATCH, WITHHOLD_ROWBLOCK, WITHHOLD_DGRAD = 0, 1, 2, 3
WITHHOLD_WGRAD_QUANT, WITHHOLD_PULLED = 4, 5


@dataclass
class Schedule:
    """A built schedule (device tensors, no host values) bound to its workspace."""

    workspace: Workspace
    tensors: ScheduleTensors


def build_schedule(ws: Workspace, topk_idx_TK: torch.Tensor) -> Schedule:
    """Publish this rank's routing, barrier, and build the schedule of its local experts from
    the whole group's routing. ``topk_idx_TK``: global expert ids [L*T, K] (rank-major in
    loopback). On the GPU, no host synchronisation."""
    L, T, K = ws.L, ws.T, ws.K
    if tuple(topk_idx_TK.shape) != (L * T, K):
        raise ValueError(f"topk_idx shape {tuple(topk_idx_TK.shape)} != {(L * T, K)} "
                         "(workspace tokens x topk)")
    ws.idx_LTK.view(L * T, K).copy_(topk_idx_TK)
    ws.barrier()
    build = compiled_schedule_builder() if ws.config.compile_schedule else build_schedule_tensors
    st = build(ws.gather_idx(), ws.ranks_L, tokens=T, local_experts=ws.E, shared=ws.shared,
               block_m=ws.config.block_m, capacity=ws.P, align=ws.config.row_align,
               first_rows=ws.config.dispatch_dedup or ws.config.bwd_pull_dedup,
               slot_rows=ws.config.bwd_pull_by_token)
    flag_capacity_errors(ws.errors_L4, st, ws.P)
    ws.sched = st
    return Schedule(ws, st)


def _programs(ws: Workspace) -> tuple[int, int]:
    """(programs per logical rank, communication programs per logical rank)."""
    if ws.device.type == "cuda":
        sms = torch.cuda.get_device_properties(ws.device).multi_processor_count
    else:  # TRITON_INTERPRET on CPU: programs run one after another
        sms = 4 * ws.L
    progs = sms // ws.L
    comm = 0 if ws.config.fwd_comm_sms == 0 else max(1, ws.config.fwd_comm_sms // ws.L)
    if progs - comm < 1:
        raise ValueError(f"fwd_comm_sms={ws.config.fwd_comm_sms} leaves no compute SM for "
                         f"{ws.L} loopback ranks on {sms} SMs")
    return progs, comm


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _descriptors(ws: Workspace, w1: torch.Tensor, w2: torch.Tensor, ws1: torch.Tensor | None,
                 ws2: torch.Tensor | None, h: torch.Tensor) -> tuple:
    """Host TMA descriptors (w1, w2, shared w1, shared w2, h ring) over 2-D views: bf16
    weights [experts*H, F] / [experts*I, H] with [BK, BN/2] / [BK, BN] boxes, FP8 weights
    (K-major, :class:`Fp8Weight`) [experts*F, H] / [experts*H, I] with [BN, BK] boxes, h
    [L*Q, I] with [BM, BK] boxes. Built per launch (host only, no GPU work); a CUDA graph
    keeps them as parameters."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    boxes = descriptor_boxes(ws.config)

    def desc(t: torch.Tensor, cols: int, box: list[int]) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t.view(-1, cols), box)

    if isinstance(w1, Fp8Weight):  # K-major: rows of K = H (gate+up) and I (down) values
        cols1, cols2 = ws.H, ws.I
    else:
        cols1, cols2 = 2 * ws.I, ws.H
    w1, w2, ws1, ws2 = (w.q if isinstance(w, Fp8Weight) else w for w in (w1, w2, ws1, ws2))
    return (desc(w1, cols1, boxes["w1_desc"]), desc(w2, cols2, boxes["w2_desc"]),
            desc(ws1, cols1, boxes["ws1_desc"]) if ws1 is not None else None,
            desc(ws2, cols2, boxes["ws2_desc"]) if ws2 is not None else None,
            desc(h, ws.I, boxes["h_desc"]))


def _pre_descriptor(cfg: MoKConfig, pre_LPF: torch.Tensor):
    """``pre_tma_store``'s store descriptor: the pre-activations [L, P, 2I] as [L*P, 2I]
    with [BM, BN/2] boxes (a gate+up tile's two column halves; 32 KB of shared memory a
    box at 128 x 128)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(pre_LPF.view(-1, pre_LPF.shape[-1]),
                                        [cfg.block_m, cfg.block_n // 2])


def descriptor_boxes(cfg: MoKConfig) -> dict[str, list[int]]:
    """TMA box (rows, columns) of each descriptor argument of the kernel: bf16 weight tiles
    [BK, BN] ([BK, BN/2] per half when gate/up are split), FP8 (K-major) weight tiles
    [BN, BK], SwiGLU rows [BM, BK]."""
    if cfg.fp8 != "none":
        w1 = w2 = [cfg.block_n, cfg.block_k]
    else:
        w1 = [cfg.block_k, cfg.block_n if cfg.gate_up_interleaved else cfg.block_n // 2]
        w2 = [cfg.block_k, cfg.block_n]
    return {"w1_desc": w1, "w2_desc": w2, "ws1_desc": w1, "ws2_desc": w2,
            "h_desc": [cfg.block_m, cfg.block_k]}


def _row_chunk(H: int) -> int:
    """Columns a program handles at once when it streams whole H-wide rows (row copies, the
    weighted sum): H rounded up to a power of two, at most 1024 (masked past H)."""
    return min(1024, 1 << (H - 1).bit_length())


def gate_up_tiles(cfg: MoKConfig, intermediate: int) -> int:
    """Gate+up column tiles per work item: ``gate_up_tiles`` where it divides the row
    block's 2I / block_n tiles (else 1)."""
    tiles = 2 * intermediate // cfg.block_n
    return cfg.gate_up_tiles if tiles % cfg.gate_up_tiles == 0 else 1


def down_tiles(cfg: MoKConfig, hidden: int) -> int:
    """Down column tiles per work item: ``down_tiles`` where it divides the row block's
    H / block_n tiles (else 1)."""
    return cfg.down_tiles if (hidden // cfg.block_n) % cfg.down_tiles == 0 else 1


def kernel_constants(cfg: MoKConfig, *, hidden: int, intermediate: int, slots: int,
                     shared: bool, programs: int, comm: int, interpreting: bool = False,
                     save_pre: bool = False) -> dict:
    """The megakernel's compile-time arguments for a config and shape (part of
    :func:`forward_kernel_args`). Tiles per item fall back to 1 where they
    do not divide the row block's column tiles."""
    H, I = hidden, intermediate
    ch = _row_chunk(H)
    sw1, sw2 = fp8_scale_sizes(H, I, cfg.quant)
    return dict(
        H=H, I=I, XW=fp8_row_elements(H, cfg.quant), S=slots, PROGS=programs, COMM=comm,
        HAS_SHARED=shared,
        MB=cfg.minibatch, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        DT=down_tiles(cfg, H),
        GJ=gate_up_tiles(cfg, I),
        CR=max(1, 4096 // ch), CH=ch, QUANT=cfg.quant, POW2=cfg.fp8_pow2_scales,
        SW1=sw1, SW2=sw2,
        F32_DOT=interpreting, TMA=cfg.tma,
        INTERLEAVED=cfg.gate_up_interleaved, PREFETCH=cfg.prefetch_ticket,
        K=slots - int(shared), FUSED_SUM=cfg.fused_sum, SAVE_PRE=save_pre,
        SKEW=cfg.skew_down, RONLY=cfg.dispatch_remote_only, CDIRECT=cfg.combine_direct)


def forward_kernel_args(ws: Workspace, st: ScheduleTensors, w1: torch.Tensor,
                        w2: torch.Tensor, ws1: torch.Tensor | None, ws2: torch.Tensor | None, *,
                        y_NH: torch.Tensor, p_NK: torch.Tensor, x_LTH: torch.Tensor,
                        pre_LPF: torch.Tensor | None, withhold: int, programs: int, comm: int,
                        interpreting: bool) -> dict[str, object]:
    """Every argument of ``mok_forward_kernel`` by name: buffers, TMA descriptors (None
    without ``tma``), scalars and compile-time constants. The one list of them, for the
    launch and for ``lowering.compile_megakernel`` (which derives the types from it).
    ``programs`` / ``comm``: programs and communication programs per logical rank."""
    cfg = ws.config
    h = ws.h_LQI  # SwiGLU rows: the ring of Q rows, indexed row % Q
    descs = _descriptors(ws, w1, w2, ws1, ws2, h) if cfg.tma else (None,) * 5
    dedup = dict(DEDUP=False, first_ptr=None, tcache_ptr=None, tflag_ptr=None, rank0=0,
                 NTOK=0)
    if cfg.dispatch_dedup:
        tcache_LNX, tflag_LN = dedup_buffers(ws)
        dedup = dict(DEDUP=True, first_ptr=st.first_LP, tcache_ptr=tcache_LNX,
                     tflag_ptr=tflag_LN, rank0=ws.rank_base, NTOK=ws.R * ws.T)
    if cfg.dispatch_remote_only:  # which rows are this rank's own
        dedup["rank0"] = ws.rank_base
    pre_tma = dict(pre_desc=None, PRE_TMA=False)
    if pre_LPF is not None and cfg.pre_tma_store:
        pre_tma = dict(pre_desc=_pre_descriptor(cfg, pre_LPF), PRE_TMA=True)
    args = dict(
        **dedup, **pre_tma,
        x_base=x_LTH, x_tab=ws.x_tab_R, comb_base=ws.comb_LTSH, comb_tab=ws.comb_tab_R,
        src_ptr=st.src_LP, group_ptr=st.group_LB, total_ptr=st.total_L,
        ring_ptr=ws.ring_LQH, h_ptr=h, out_ptr=ws.out_LQH,
        pre_ptr=pre_LPF if pre_LPF is not None else h,
        ctr_ptr=ws.counters_LC, err_ptr=ws.errors_L4,
        y_ptr=y_NH, p_ptr=p_NK, sum_ptr=ws.sums_LTJ,
        **_weight_args(w1, w2, ws1, ws2),
        **dict(zip(("w1_desc", "w2_desc", "ws1_desc", "ws2_desc", "h_desc"), descs)),
        T=ws.T, E=ws.E, P=ws.P, Q=ws.Q, NCTR=ws.counters_LC.shape[1], MMAX=ws.mmax,
        budget=cfg.spin_budget, withhold=withhold, trace_ptr=None, MAXT=0, TRACE=False,
        **kernel_constants(cfg, hidden=ws.H, intermediate=ws.I, slots=ws.S, shared=ws.shared,
                           programs=programs, comm=comm, interpreting=interpreting,
                           save_pre=pre_LPF is not None))
    from mok_kernels._details.tl_mega import mok_forward_kernel

    return {name: args[name] for name in mok_forward_kernel.arg_names}  # parameter order


def dedup_buffers(ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """``dispatch_dedup``'s token cache [L, R*T, XW] bf16 (a remote token's row, pulled once
    per rank) and its per-token flags [L, R*T] int32 (zeroed before every launch), made on
    first use."""
    if "dedup" not in ws.extra:
        xw = fp8_row_elements(ws.H, ws.config.quant)
        n = ws.R * ws.T
        ws.extra["dedup"] = (torch.empty(ws.L, n, xw, dtype=torch.bfloat16, device=ws.device),
                             torch.zeros(ws.L, n, dtype=torch.int32, device=ws.device))
    return ws.extra["dedup"]


def _weight_args(w1, w2, ws1, ws2) -> dict[str, object]:
    """The weight pointers (bf16 tensors; with FP8, the e4m3 ``q`` of each
    :class:`Fp8Weight`) and, with FP8, their scales (None for bf16: never read). A missing
    shared expert's pointers are the routed ones (never read either)."""
    ws1 = w1 if ws1 is None else ws1
    ws2 = w2 if ws2 is None else ws2
    if isinstance(w1, Fp8Weight):
        return dict(w1_ptr=w1.q, w2_ptr=w2.q, ws1_ptr=ws1.q, ws2_ptr=ws2.q,
                    sw1_ptr=w1.scale, sw2_ptr=w2.scale, sws1_ptr=ws1.scale,
                    sws2_ptr=ws2.scale)
    return dict(w1_ptr=w1, w2_ptr=w2, ws1_ptr=ws1, ws2_ptr=ws2, sw1_ptr=None, sw2_ptr=None,
                sws1_ptr=None, sws2_ptr=None)


def trace_args(trace: torch.Tensor | None, logical_ranks: int, rows: int) -> dict:
    """Either megakernel's trace arguments (profiling only): none without a trace (the
    kernel then has no timer read), else ``trace`` checked to be int64
    [logical_ranks, rows, 4]."""
    if trace is None:
        return {}
    want = (logical_ranks, rows, 4)
    if tuple(trace.shape) != want or trace.dtype != torch.int64:
        raise ValueError(f"_trace: want an int64 tensor of shape {want}")
    return dict(trace_ptr=trace, MAXT=rows, TRACE=True)


def forward_trace_capacity(ws: Workspace) -> int:
    """Tickets of the forward megakernel's compute items per logical rank, at most (every
    minibatch full; ``skew_down``: one more minibatch's gate+up tickets; tiles per item as
    the kernel runs them, after their fallback to 1): the rows of a ``forward(_trace=...)``
    buffer."""
    cfg = ws.config
    blocks = cfg.minibatch // cfg.block_m
    gate_up = blocks * (ws.I // (cfg.block_n // 2) // gate_up_tiles(cfg, ws.I))
    per_mb = gate_up + blocks * (ws.H // cfg.block_n // down_tiles(cfg, ws.H))
    return -(-ws.P // cfg.minibatch) * per_mb + (gate_up if cfg.skew_down else 0)


def launch_megakernel(ws: Workspace, st: ScheduleTensors, w1: torch.Tensor, w2: torch.Tensor,
                      ws1: torch.Tensor | None, ws2: torch.Tensor | None, *, y_NH: torch.Tensor,
                      p_NK: torch.Tensor, withhold: int = 0,
                      programs: tuple[int, int] | None = None,
                      x_LTH: torch.Tensor | None = None,
                      pre_LPF: torch.Tensor | None = None,
                      trace: torch.Tensor | None = None) -> None:
    """One persistent launch for all L logical ranks (grid = SMs, split among them).
    ``x_LTH``: where the token rows are read (default: the workspace's token buffer).
    ``pre_LPF``: the training forward's buffer for the gate/up pre-activations of every
    schedule row, kept for the backward (default: nothing is kept).
    ``y_NH`` / ``p_NK`` (N = L*T): the output and the fp32 router weights, which the kernel
    reads and writes only with ``fused_sum``. ``trace``: the compute items' trace
    (profiling only; int64 [L, forward_trace_capacity(ws), 4])."""
    from mok_kernels._details.tl_mega import mok_forward_kernel

    cfg = ws.config
    progs, comm = programs or _programs(ws)
    extra = {} if _interpreting() else {"launch_cooperative_grid": True}
    args = forward_kernel_args(ws, st, w1, w2, ws1, ws2, y_NH=y_NH, p_NK=p_NK,
                               x_LTH=ws.x_LTH if x_LTH is None else x_LTH, pre_LPF=pre_LPF,
                               withhold=withhold, programs=progs, comm=comm,
                               interpreting=_interpreting())
    args.update(trace_args(trace, ws.L, forward_trace_capacity(ws)))
    mok_forward_kernel[(ws.L * progs,)](**args, num_warps=cfg.num_warps,
                                        num_stages=cfg.num_stages, **extra)


def weighted_sum(ws: Workspace, p_NK: torch.Tensor, y_NH: torch.Tensor) -> None:
    """y = sum_k p_k * comb[:, k] (+ shared slot), fixed order, into y_NH [L*T, H] bf16;
    p_NK [L*T, K] fp32 contiguous."""
    from mok_kernels._details.tl_mega import weighted_sum_kernel

    n = ws.L * ws.T
    bh = _row_chunk(ws.H)
    weighted_sum_kernel[(n, -(-ws.H // bh))](ws.comb_LTSH, p_NK, y_NH, H=ws.H, K=ws.K, S=ws.S,
                                             BH=bh, num_warps=4)


def interleave_gate_up(w_gate_up: torch.Tensor) -> torch.Tensor:
    """[..., H, 2I] gate columns then up columns -> [..., H, 2I] with column 2c = gate c and
    2c + 1 = up c: the layout ``MoKConfig(gate_up_interleaved=True)`` reads. A new tensor
    (done once, where the weights are set up)."""
    *lead, H, F = w_gate_up.shape
    if F % 2:
        raise ValueError(f"w_gate_up: last dimension {F} is not 2 * intermediate")
    return w_gate_up.reshape(*lead, H, 2, F // 2).transpose(-1, -2).reshape(*lead, H, F) \
        .contiguous()


def _check_weights(ws: Workspace, w1, w2, ws1, ws2, fp8: bool | None = None) -> None:
    """bf16 weights, or with ``fp8`` (default: the config's forward is FP8) the
    :class:`Fp8Weight` of ``quantize_weights``. The backward always takes bf16 weights."""
    n_exp, H, I = ws.L * ws.E, ws.H, ws.I
    want = {"w_gate_up": (w1, (n_exp, H, 2 * I)), "w_down": (w2, (n_exp, I, H))}
    if ws.shared:
        if ws1 is None or ws2 is None:
            raise ValueError("workspace has the shared expert on: pass shared_gate_up/down")
        want["shared_gate_up"] = (ws1, (H, 2 * I))
        want["shared_down"] = (ws2, (I, H))
    fp8 = ws.config.fp8 != "none" if fp8 is None else fp8
    for name, (t, shape) in want.items():
        if fp8:
            if not isinstance(t, Fp8Weight) or t.shape != shape \
                    or t.q.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name}: want an Fp8Weight {shape} (quantize_weights) with "
                                 f"fp8={ws.config.fp8!r}, got {type(t).__name__}")
        elif (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape
              or t.dtype != torch.bfloat16 or not t.is_contiguous()):
            raise ValueError(f"{name}: want contiguous bf16 {shape}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")


def _token_source(ws: Workspace, x_TH: torch.Tensor, fp8: bool | None = None,
                  x_colmax_LH: torch.Tensor | None = None) -> torch.Tensor:
    """The buffer the kernel reads token rows from. Real EP: the symmetric buffer (peers read
    it), so x is copied in. One process (one rank or loopback): every reader is in this
    launch, so a contiguous bf16 x on the device is read where it is ([L*T, H] is laid out
    like the loopback [L, T, H] buffer, whose rank offsets x_tab_R holds): no copy.
    FP8 (``fp8``, default: the config's forward is FP8): x is quantised once, here at its
    source, into FP8 rows of the token buffer (the backward passes ``fp8=False``);
    ``x_colmax_LH`` (fp32 [L, H], a row-wise recipe): each logical rank's column max |x| too,
    from the same loads (``quantize_tokens_into``)."""
    if fp8 is None:
        fp8 = ws.config.fp8 != "none"
    if fp8 and x_colmax_LH is not None:  # per logical rank: the maxima are each rank's own
        x_LTH = x_TH.reshape(ws.L, ws.T, ws.H)
        for lr in range(ws.L):
            quantize_tokens_into(ws.config.fp8, x_LTH[lr], ws.x_LTH[lr],
                                 pow2_scales=ws.config.fp8_pow2_scales,
                                 col_amax_H=x_colmax_LH[lr])
        return ws.x_LTH
    if fp8:
        quantize_tokens_into(ws.config.fp8, x_TH, ws.x_LTH.view(ws.L * ws.T, ws.H),
                             pow2_scales=ws.config.fp8_pow2_scales)
        return ws.x_LTH
    if readable_in_place(ws, x_TH):
        return x_TH
    ws.x_LTH.view(ws.L * ws.T, ws.H).copy_(x_TH)
    return ws.x_LTH


def readable_in_place(ws: Workspace, rows_NH: torch.Tensor) -> bool:
    """Whether the kernels may read token rows from ``rows_NH`` itself instead of a copy in
    a workspace buffer: one process (no peers read it), a contiguous bf16 tensor on the
    workspace's device, 16-byte aligned (the pulls' row loads are 16-byte vectors)."""
    return (ws.handle is None and rows_NH.dtype == torch.bfloat16 and rows_NH.is_contiguous()
            and rows_NH.data_ptr() % 16 == 0 and rows_NH.device.type == ws.device.type
            and ws.device.index in (None, rows_NH.device.index))


def _check_call(config: MoKConfig, ws: Workspace, schedule: Schedule, x_TH: torch.Tensor,
                topk_weights_TK: torch.Tensor) -> None:
    if config != ws.config:
        raise ValueError("config differs from the one the workspace was built for")
    if schedule.workspace is not ws:
        raise ValueError("schedule was built on another workspace")
    L, T, H = ws.L, ws.T, ws.H
    if tuple(x_TH.shape) != (L * T, H) or tuple(topk_weights_TK.shape) != (L * T, ws.K):
        raise ValueError(f"x {tuple(x_TH.shape)} / router weights "
                         f"{tuple(topk_weights_TK.shape)}: want {(L * T, H)} / {(L * T, ws.K)}")


def _run(config: MoKConfig, ws: Workspace, schedule: Schedule, x_TH: torch.Tensor,
         p_NK: torch.Tensor, weights: tuple, withhold: int,
         pre_LPF: torch.Tensor | None, trace: torch.Tensor | None = None,
         x_colmax_LH: torch.Tensor | None = None) -> torch.Tensor:
    """Barrier, one megakernel launch, barrier, weighted sum: y [L*T, H] bf16
    (``x_colmax_LH``: see ``_token_source``)."""
    _check_weights(ws, *weights)
    x_src = _token_source(ws, x_TH, x_colmax_LH=x_colmax_LH)
    y_NH = torch.empty(ws.L * ws.T, ws.H, dtype=torch.bfloat16, device=ws.device)
    ws.counters_LC.zero_()
    if config.dispatch_dedup:
        dedup_buffers(ws)[1].zero_()
    if config.fused_sum:  # the megakernel writes y itself (every slot is in this process)
        ws.sums_LTJ.zero_()
    ws.barrier()
    launch_megakernel(ws, schedule.tensors, *weights, y_NH=y_NH, p_NK=p_NK, withhold=withhold,
                      x_LTH=x_src, pre_LPF=pre_LPF, trace=trace)
    ws.barrier()
    if not config.fused_sum:
        weighted_sum(ws, p_NK, y_NH)
    return y_NH


def forward(config: MoKConfig, ws: Workspace, schedule: Schedule, x_TH: torch.Tensor,
            topk_weights_TK: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
            shared_gate_up: torch.Tensor | None = None,
            shared_down: torch.Tensor | None = None, *, _withhold: int = 0,
            _trace: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer forward for this rank (or all loopback ranks): y [L*T, H] bf16. Keeps
    nothing for a backward (inference); see :func:`forward_train`. ``_trace`` (profiling
    only): an int64 [L, forward_trace_capacity(ws), 4] tensor that receives every compute
    item's (start ns, end ns, program, kind 0 gate+up / 1 down) at its ticket."""
    _check_call(config, ws, schedule, x_TH, topk_weights_TK)
    p_NK = topk_weights_TK.to(torch.float32).contiguous()
    return _run(config, ws, schedule, x_TH, p_NK,
                (w_gate_up, w_down, shared_gate_up, shared_down), _withhold, None, _trace)


@dataclass
class ForwardContext:
    """What the training forward keeps for :func:`mok_kernels.backward`.

    x_TH: the layer input as given (its rows are read again for the gate+up weight
    gradient); p_NK: the router weights, fp32 [L*T, K]; schedule: the forward's schedule
    (row -> (rank, token, k), groups), reused by the backward in reverse; pre_LPF: gate and
    up pre-activations of every schedule row, bf16 [L, P, 2I] in the gate+up weights' column
    layout (the backward overwrites them with their gradients). The SwiGLU output is
    recomputed from them in the backward's dA epilogue (elementwise, no GEMM replayed).
    x_colmax_LH: with ``bwd_fused_colmax`` after a row-wise FP8 forward, each logical
    rank's column max |x|, fp32 [L, H], taken by the forward's quantisation of x from its
    own loads (the scales of x's FP8 transposed copy; without it the backward reads x once
    more for them); else None.
    """

    schedule: Schedule
    x_TH: torch.Tensor
    p_NK: torch.Tensor
    pre_LPF: torch.Tensor
    x_colmax_LH: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the context holds beyond the layer's inputs: the saved activations and the
        schedule (P rows x 2I bf16, plus 4 bytes per row and per row block), and with
        ``x_colmax_LH`` 4 bytes per hidden column and logical rank."""
        st = self.schedule.tensors
        sched = sum(t.numel() * t.element_size() for t in (st.src_LP, st.group_LB))
        cm = 0 if self.x_colmax_LH is None else self.x_colmax_LH.numel() * 4
        return self.pre_LPF.numel() * 2 + sched + cm


def forward_train(config: MoKConfig, ws: Workspace, schedule: Schedule, x_TH: torch.Tensor,
                  topk_weights_TK: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, shared_gate_up: torch.Tensor | None = None,
                  shared_down: torch.Tensor | None = None, *,
                  _trace: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, ForwardContext]:
    """The training forward: y as :func:`forward`, and the context its backward needs: the
    gate+up tiles also store their pre-activations (one more bf16 store per tile), and
    with ``bwd_fused_colmax`` and a row-wise FP8 forward the quantisation of x keeps x's
    column maxima (``ForwardContext.x_colmax_LH``). ``_trace``: as :func:`forward`'s."""
    _check_call(config, ws, schedule, x_TH, topk_weights_TK)
    p_NK = topk_weights_TK.to(torch.float32).contiguous()
    pre = torch.empty(ws.L, ws.P, 2 * ws.I, dtype=torch.bfloat16, device=ws.device)
    colmax = (torch.empty(ws.L, ws.H, dtype=torch.float32, device=ws.device)
              if config.bwd_fused_colmax and config.fp8 in ("rowwise", "rowwise_all")
              else None)
    y = _run(config, ws, schedule, x_TH, p_NK, (w_gate_up, w_down, shared_gate_up,
                                                  shared_down), 0, pre, _trace, colmax)
    return y, ForwardContext(schedule, x_TH, p_NK, pre, colmax)
