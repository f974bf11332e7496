"""Host side of the backward: buffers, one megakernel launch, the fixed-order sums. No host
sync from the forward's schedule to the gradients (forward + backward capture as one CUDA
graph); the device error words are read afterwards by ``errors.check_errors``.

Legend: L logical ranks in the launch, R EP ranks, T tokens per rank, H hidden, I
intermediate, E local experts, K top-k, S combine slots per token, G = E (+1 shared) groups,
P schedule rows, NJ = I / DAC I tiles of the dA items (router-gradient partials per slot).

Peer-visible per rank (one symmetric buffer in real EP, one [L, ...] byte buffer in loopback,
carved alike so one byte-offset table serves all three): dy [T, H] bf16 (pulled by the ranks
that ran the token's experts: reverse-combine), p [T, K] fp32 (the router weights, read by
the same ranks to pre-scale), drp [T, K, NJ] fp32 (router-gradient partials, pushed back).
dX rows are pushed into the forward's combine buffer [T, S, H] (reverse-dispatch) and summed
by the home rank in fixed slot order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_kernels._details.config import MoKConfig
from mok_kernels._details.forward import (
    ForwardContext,
    _check_weights,
    _interpreting,
    _programs,
    _row_chunk,
    _token_source,
)
from mok_kernels._details.workspace import Workspace

_ALIGN = 1024


@dataclass
class Gradients:
    """Gradients of one backward, canonical layouts (w_gate_up: gate columns, then up).

    dx_TH [L*T, H] bf16; d_router_weights_TK [L*T, K] fp32; w_gate_up [L*E, H, 2I] and
    w_down [L*E, I, H] bf16 (this launch's experts); shared_gate_up [H, 2I], shared_down
    [I, H] bf16 (this rank's contribution; summed over loopback ranks) or None.
    """

    dx_TH: torch.Tensor
    d_router_weights_TK: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    shared_gate_up: torch.Tensor | None
    shared_down: torch.Tensor | None


@dataclass
class BackwardBuffers:
    dy_LTH: torch.Tensor
    p_LTK: torch.Tensor
    drp_LTKJ: torch.Tensor
    tab16_R: torch.Tensor  # int64 element offsets (bf16) of each rank's carve from this one
    tab32_R: torch.Tensor  # the same in fp32 elements
    counters_LC: torch.Tensor
    ones_NK: torch.Tensor  # unit weights: the dX slots are summed unweighted
    handle: object = None


def da_cols(cfg: MoKConfig, intermediate: int) -> int:
    """Intermediate columns per dA item (DAC): block_n with ``bwd_wide_da`` where it divides
    the intermediate size, else block_n / 2."""
    wide = cfg.bwd_wide_da and intermediate % cfg.block_n == 0
    return cfg.block_n if wide else cfg.block_n // 2


def _carve(T: int, H: int, K: int, NJ: int) -> tuple[list[int], int]:
    sizes = [T * H * 2, T * K * 4, T * K * NJ * 4]
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += -(-n // _ALIGN) * _ALIGN
    return offs, pos


def _buffers(ws: Workspace) -> BackwardBuffers:
    """The workspace's backward buffers, made on the first backward (collective in EP)."""
    if "bwd" in ws.extra:
        return ws.extra["bwd"]
    cfg, L, T, H, K, dev = ws.config, ws.L, ws.T, ws.H, ws.K, ws.device
    NJ = ws.I // da_cols(cfg, ws.I)
    offs, nbytes = _carve(T, H, K, NJ)
    handle = None
    if ws.handle is not None:  # real EP: one symmetric buffer, offsets from the peers' bases
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
        handle = symm_mem.rendezvous(buf, ws.group)
        ptrs = list(handle.buffer_ptrs)
        tab = [p - ptrs[ws.rank_base] for p in ptrs]
        buf_L = buf.view(1, nbytes)
    else:
        buf_L = torch.zeros(L, nbytes, dtype=torch.uint8, device=dev)
        tab = [r * nbytes for r in range(L)]

    def view(i: int, n: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        return buf_L[:, offs[i]:offs[i] + n].view(dtype).view(buf_L.shape[0], *shape)

    bb = BackwardBuffers(
        dy_LTH=view(0, T * H * 2, torch.bfloat16, (T, H)),
        p_LTK=view(1, T * K * 4, torch.float32, (T, K)),
        drp_LTKJ=view(2, T * K * NJ * 4, torch.float32, (T, K, NJ)),
        tab16_R=torch.tensor([b // 2 for b in tab], dtype=torch.int64, device=dev),
        tab32_R=torch.tensor([b // 4 for b in tab], dtype=torch.int64, device=dev),
        counters_LC=torch.zeros(L, -(-(1 + ws.P // cfg.block_m + ws.E + 1) // 32) * 32,
                                dtype=torch.int32, device=dev),
        ones_NK=torch.ones(L * T, K, dtype=torch.float32, device=dev),
        handle=handle)
    ws.extra["bwd"] = bb
    return bb


def group_starts(counts_LG: torch.Tensor, block_m: int) -> torch.Tensor:
    """First schedule row of every group and the end of the last, int32 [L, G+1]: groups are
    consecutive and each padded to a multiple of block_m (as the schedule lays them out)."""
    padded = (counts_LG.to(torch.int64) + block_m - 1) // block_m * block_m
    zero = padded.new_zeros(padded.shape[0], 1)
    return torch.cat([zero, torch.cumsum(padded, 1)], 1).to(torch.int32)


def _descriptors(ws: Workspace, weights: tuple) -> tuple:
    """Weight descriptors: gate+up [experts*H, 2I] with [BN, BK] boxes (dX reads W^T tiles),
    down [experts*I, H] with [DAC, BK] boxes (dA reads W_down^T tiles)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = ws.config
    w1, w2, ws1, ws2 = weights
    F = 2 * ws.I

    def desc(t: torch.Tensor | None, cols: int, box: list[int]):
        return None if t is None else TensorDescriptor.from_tensor(t.view(-1, cols), box)

    b1, b2 = [cfg.block_n, cfg.block_k], [da_cols(cfg, ws.I), cfg.block_k]
    return desc(w1, F, b1), desc(w2, ws.H, b2), desc(ws1, F, b1), desc(ws2, ws.H, b2)


def wgrad_rows(cfg: MoKConfig) -> int:
    """Rows per reduction step of the weight-gradient items (BKW): 64, or block_m if smaller
    (every row operand comes through TMA from the pulled rows, so no pointer tensors)."""
    return min(64, cfg.block_m)


def _activation_descriptors(cfg: MoKConfig, pre_LPF: torch.Tensor, hs_LPI: torch.Tensor,
                            xg_LPH: torch.Tensor, dyg_LPH: torch.Tensor) -> tuple:
    """(pre for the dA epilogue, r*h for the dA epilogue, r*h for dW_down, dGU for
    dW_gate_up), then the pulled rows (dY for dA, dY for dW_down, x for dW_gate_up), over
    [L*P, cols] views: epilogue boxes cover a quarter tile of I columns (half of an I tile;
    interleaved gate/up: both of its halves), weight-gradient boxes BKW rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bkw = cfg.block_m, cfg.block_n, wgrad_rows(cfg)
    q = bn // 4
    pre = pre_LPF.view(-1, pre_LPF.shape[-1])
    hs = hs_LPI.view(-1, hs_LPI.shape[-1])
    xg, dyg = xg_LPH.view(-1, xg_LPH.shape[-1]), dyg_LPH.view(-1, dyg_LPH.shape[-1])
    return (TensorDescriptor.from_tensor(pre, [bm, 2 * q if cfg.gate_up_interleaved else q]),
            TensorDescriptor.from_tensor(hs, [bm, q]),
            TensorDescriptor.from_tensor(hs, [bkw, bn // 2]),
            TensorDescriptor.from_tensor(pre, [bkw, bn]),
            TensorDescriptor.from_tensor(dyg, [bm, cfg.block_k]),
            TensorDescriptor.from_tensor(dyg, [bkw, bn]),
            TensorDescriptor.from_tensor(xg, [bkw, bn // 2]))


def backward_stages(cfg: MoKConfig) -> int:
    """Pipeline stages of the backward kernel: the forward's, or at most 2 with split gate/up
    columns, whose build otherwise needs more than 227 KB of shared memory (Triton 3.6, sm_90:
    393 KB at 4 stages, 295 KB at 3, 197 KB at 2; the interleaved layout fits at 4)."""
    return cfg.num_stages if cfg.gate_up_interleaved else min(2, cfg.num_stages)


def backward_constants(cfg: MoKConfig, *, hidden: int, intermediate: int, slots: int,
                       shared: bool, programs: int, interpreting: bool = False,
                       phases: int = 15) -> dict:
    """The backward kernel's compile-time arguments (the launch and the lowering check)."""
    return dict(H=hidden, I=intermediate, S=slots, K=slots - int(shared), PROGS=programs,
                HAS_SHARED=shared, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                BKW=wgrad_rows(cfg), DAC=da_cols(cfg, intermediate), F32_DOT=interpreting,
                INTERLEAVED=cfg.gate_up_interleaved, PHASES=phases)


def backward(config: MoKConfig, ws: Workspace, context: ForwardContext, dy_TH: torch.Tensor,
             w_gate_up: torch.Tensor, w_down: torch.Tensor,
             shared_gate_up: torch.Tensor | None = None,
             shared_down: torch.Tensor | None = None, *, _withhold: int = 0,
             _phases: int = 15) -> Gradients:
    """Gradients of the layer for the training forward that made ``context`` (once per
    context: the saved pre-activations are overwritten by their gradients)."""
    from mok_kernels._details.tl_backward import mok_backward_kernel, pull_rows_kernel
    from mok_kernels._details.tl_mega import weighted_sum_kernel

    if config != ws.config or context.schedule.workspace is not ws:
        raise ValueError("config / context do not belong to this workspace")
    L, T, H, I, K = ws.L, ws.T, ws.H, ws.I, ws.K
    if tuple(dy_TH.shape) != (L * T, H):
        raise ValueError(f"dy shape {tuple(dy_TH.shape)} != {(L * T, H)}")
    weights = (w_gate_up, w_down, shared_gate_up, shared_down)
    _check_weights(ws, *weights)
    bb = _buffers(ws)
    st = context.schedule.tensors
    bb.dy_LTH.copy_(dy_TH.view(bb.dy_LTH.shape))
    bb.p_LTK.copy_(context.p_NK.view(bb.p_LTK.shape))
    x_src = _token_source(ws, context.x_TH)  # real EP: x back into the peer-visible buffer
    gst = group_starts(st.counts_LG, config.block_m)
    E = ws.E
    dw1 = torch.empty(L * E, H, 2 * I, dtype=torch.bfloat16, device=ws.device)
    dw2 = torch.empty(L * E, I, H, dtype=torch.bfloat16, device=ws.device)
    dws1 = torch.empty((L, H, 2 * I) if ws.shared else (1,), dtype=torch.bfloat16,
                       device=ws.device)
    dws2 = torch.empty((L, I, H) if ws.shared else (1,), dtype=torch.bfloat16,
                       device=ws.device)
    hs = torch.empty(L, ws.P, I, dtype=torch.bfloat16, device=ws.device)  # r * h, per row
    xg = torch.empty(L, ws.P, H, dtype=torch.bfloat16, device=ws.device)  # pulled x rows
    dyg = torch.empty(L, ws.P, H, dtype=torch.bfloat16, device=ws.device)  # pulled dY rows
    bb.counters_LC.zero_()
    ws.barrier()
    br = 16
    pull_rows_kernel[(L, ws.P // br)](st.src_LP, st.total_L, x_src, ws.x_tab_R, bb.dy_LTH,
                                      bb.tab16_R, xg, dyg, T, ws.P, H=H, S=ws.S, BR=br,
                                      CH=_row_chunk(H), num_warps=4)
    progs, _ = _programs(ws)
    extra = {} if _interpreting() else {"launch_cooperative_grid": True}
    descs = _descriptors(ws, weights)
    mok_backward_kernel[(L * progs,)](
        x_src, ws.x_tab_R, bb.dy_LTH, bb.tab16_R, bb.p_LTK, bb.drp_LTKJ, bb.tab32_R,
        ws.comb_LTSH, ws.comb_tab_R, st.src_LP, st.group_LB, st.total_L, gst,
        context.pre_LPF, hs, bb.counters_LC, ws.errors_L4,
        dw1, dw2, dws1, dws2, *descs,
        *_activation_descriptors(config, context.pre_LPF, hs, xg, dyg),
        T, E, E + int(ws.shared), ws.P, bb.counters_LC.shape[1], config.spin_budget,
        _withhold,
        **backward_constants(config, hidden=H, intermediate=I, slots=ws.S, shared=ws.shared,
                             programs=progs, interpreting=_interpreting(), phases=_phases),
        num_warps=config.num_warps, num_stages=backward_stages(config), **extra)
    ws.barrier()
    dx = torch.empty(L * T, H, dtype=torch.bfloat16, device=ws.device)
    bh = _row_chunk(H)
    weighted_sum_kernel[(L * T, -(-H // bh))](ws.comb_LTSH, bb.ones_NK, dx, H=H, K=K, S=ws.S,
                                              BH=bh, num_warps=4)
    dp = bb.drp_LTKJ.sum(-1).view(L * T, K)
    sg = sd = None
    if ws.shared:
        sg, sd = (dws1[0], dws2[0]) if L == 1 else (dws1.float().sum(0).bfloat16(),
                                                     dws2.float().sum(0).bfloat16())
    return Gradients(dx, dp, dw1, dw2, sg, sd)
