"""Host side of the backward: buffers, one megakernel launch, the fixed-order sums. No host
sync from the forward's schedule to the gradients (forward + backward capture as one CUDA
graph); the device error words are read afterwards by ``errors.check_errors``.

Legend: L logical ranks in the launch, R EP ranks, T tokens per rank, H hidden, I
intermediate, E local experts, K top-k, S combine slots per token, G = E (+1 shared) groups,
P schedule rows, NJ = I / DAC I tiles of the dA items (router-gradient partials per slot).

Peer-visible per rank (one symmetric buffer in real EP, one [L, ...] byte buffer in loopback,
carved alike so one byte-offset table serves all three): dy [T, H] bf16 (pulled by the ranks
that ran the token's experts: reverse-combine), p [T, K] fp32 (the router weights, read by
the same ranks to pre-scale), drp [T, K, NJ] fp32 (router-gradient partials, pushed back),
and with ``bwd_fp8_da`` dyq [T, H] (dY as FP8 rows in bf16-row storage: H e4m3 values, then
the row's fp32 scale; read by the dA items of the ranks that ran the token's experts),
and with ``bwd_fp8_wgrad`` xam [H] and dyam [H] fp32 (the column max |v| of the rank's x
and dY, read by every rank to scale its FP8 copies alike).
dX rows are pushed into the forward's combine buffer [T, S, H] (reverse-dispatch) and summed
by the home rank in fixed slot order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mok_kernels._details.config import MoKConfig
from mok_kernels._details.ffn_fp8 import quantize_tokens_into
from mok_kernels._details.forward import (
    ForwardContext,
    _check_weights,
    _interpreting,
    _programs,
    _row_chunk,
    _token_source,
    readable_in_place,
    trace_args,
)
from mok_kernels._details.schedule import ScheduleTensors
from mok_kernels._details.workspace import Workspace, carve


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
class BackwardFp8Weights:
    """The weights as the FP8 dgrad items read them, quantised once
    (``quantize_backward_weights``): e4m3 rows, each with one fp32 scale, K-major for their
    GEMM. ``bwd_fp8_da``: W_down's I rows over H (dA = dY @ W_down^T); ``bwd_fp8_dx``:
    W_gate_up's H rows over 2I, in the kernel's column layout (dX = dGU @ W_gate_up^T).

    w2q_NH [L*E*I, H] e4m3, sw2_N [L*E*I] fp32, ws2q_IH [I, H], sws2_I [I] (shared expert);
    w1q_NF [L*E*H, 2I] e4m3, sw1_N [L*E*H] fp32, ws1q_HF [H, 2I], sws1_H [H]. None where the
    knob is off or there is no shared expert."""

    w2q_NH: torch.Tensor | None = None
    sw2_N: torch.Tensor | None = None
    ws2q_IH: torch.Tensor | None = None
    sws2_I: torch.Tensor | None = None
    w1q_NF: torch.Tensor | None = None
    sw1_N: torch.Tensor | None = None
    ws1q_HF: torch.Tensor | None = None
    sws1_H: torch.Tensor | None = None


def _rows_e4m3(w: torch.Tensor | None, pow2: bool) -> tuple:
    """(e4m3 rows [N, K], fp32 scales [N]) of w [..., K], one scale per row; (None, None)."""
    if w is None:
        return None, None
    from mok_kernels._details.tl_quant import quantize_rowwise

    q, s = quantize_rowwise(w.reshape(-1, w.shape[-1]), pow2_scales=pow2)
    return q, s.reshape(-1).contiguous()


def quantize_backward_weights(config: MoKConfig, w_down: torch.Tensor,
                              shared_down: torch.Tensor | None = None,
                              w_gate_up: torch.Tensor | None = None,
                              shared_gate_up: torch.Tensor | None = None
                              ) -> BackwardFp8Weights | None:
    """What ``backward`` needs besides the bf16 weights for this config: with ``bwd_fp8_da``
    the FP8 copies of W_down [L*E, I, H] (and the shared [I, H]), with ``bwd_fp8_dx`` those of
    W_gate_up [L*E, H, 2I] (and the shared [H, 2I]) in the layout the kernel reads (the
    config's gate/up layout: pass the weights as given to ``backward``); None with neither.
    Call once per weight update (not per backward), as the forward's ``quantize_weights``."""
    if not (config.bwd_fp8_da or config.bwd_fp8_dx):
        return None
    pow2 = config.fp8_pow2_scales
    out = BackwardFp8Weights()
    if config.bwd_fp8_da:
        out.w2q_NH, out.sw2_N = _rows_e4m3(w_down, pow2)
        out.ws2q_IH, out.sws2_I = _rows_e4m3(shared_down, pow2)
    if config.bwd_fp8_dx:
        if w_gate_up is None:
            raise ValueError("bwd_fp8_dx: quantize_backward_weights needs w_gate_up")
        out.w1q_NF, out.sw1_N = _rows_e4m3(w_gate_up, pow2)
        out.ws1q_HF, out.sws1_H = _rows_e4m3(shared_gate_up, pow2)
    return out


@dataclass
class BackwardBuffers:
    dy_LTH: torch.Tensor
    p_LTK: torch.Tensor
    drp_LTKJ: torch.Tensor
    dyq_LTH: torch.Tensor | None  # dY as FP8 rows (bwd_fp8_da), else None
    xam_LH: torch.Tensor | None  # bwd_fp8_wgrad: column max |x| of the rank's tokens
    dyam_LH: torch.Tensor | None  # bwd_fp8_wgrad: column max |dY| of the rank's tokens
    tab16_R: torch.Tensor  # int64 element offsets (bf16) of each rank's carve from this one
    tab32_R: torch.Tensor  # the same in fp32 elements
    counters_LC: torch.Tensor
    ones_NK: torch.Tensor  # unit weights: the dX slots are summed unweighted
    handle: object = None
    # bwd_fp8_prequant: the rank's own x and dY rows in e4m3 (global column scales), read by
    # the pull as bytes at tab8_R (the carve's byte offsets); else None
    xq8_LTH: torch.Tensor | None = None
    dyq8_LTH: torch.Tensor | None = None
    tab8_R: torch.Tensor | None = None


@dataclass
class BackwardScratch:
    """What one backward writes besides the workspace: the weight gradients (dws1 / dws2 a
    placeholder of one element without the shared expert) and the per-row scratch."""

    dw1_EHF: torch.Tensor  # [L*E, H, 2I] bf16
    dw2_EIH: torch.Tensor  # [L*E, I, H] bf16
    dws1_LHF: torch.Tensor  # [L, H, 2I] bf16: each logical rank's share
    dws2_LIH: torch.Tensor  # [L, I, H] bf16
    hs_LPI: torch.Tensor  # r * h of every schedule row
    xg_LPH: torch.Tensor | None  # pulled x rows (None when only FP8 copies are read)
    dyg_LPH: torch.Tensor | None  # pulled dY rows (likewise)
    gq_LPG: torch.Tensor | None = None  # bwd_fp8_dx: dG/dU as FP8 rows (2I e4m3, a scale)
    wgrad8: Fp8WgradScratch | None = None  # bwd_fp8_wgrad
    # bwd_dw_tma_store: the buffers the dW tensors above are views of, the shared expert's
    # L slots after the routed experts' L*E: [L*E (+ L), H, 2I] and [L*E (+ L), I, H]
    dw1_all: torch.Tensor | None = None
    dw2_all: torch.Tensor | None = None


@dataclass
class Fp8WgradScratch:
    """``bwd_fp8_wgrad``'s operands: e4m3 transposed copies (feature-major, the schedule's
    rows contiguous, so the weight-gradient tiles read both operands K-major) and the
    per-column scales; G groups (E, +1 shared)."""

    xqT_LHP: torch.Tensor  # x^T [L, H, P] e4m3, scaled by the global column max gxam_H
    dyqT_LHP: torch.Tensor  # dY^T [L, H, P] e4m3, by gdyam_H
    hqT_LIP: torch.Tensor  # (r h)^T [L, I, P] e4m3, by srh_LGI (per group and column)
    gqT_LFP: torch.Tensor  # [dG dU]^T [L, 2I, P] e4m3 (kernel column layout), by srg_LGF
    srh_LGI: torch.Tensor  # fp32 column scales of r h per group
    srg_LGF: torch.Tensor  # fp32 column scales of dG/dU per group
    gxam_H: torch.Tensor  # fp32 column max |x| over every rank's tokens
    gdyam_H: torch.Tensor  # fp32 column max |dY| over every rank's tokens
    bmax_LBF: torch.Tensor | None = None  # bwd_fp8_block_colmax: r h, dG/dU column max per block

    @staticmethod
    def empty(L: int, H: int, I: int, P: int, G: int, device: torch.device | str,
              blocks: int = 0) -> Fp8WgradScratch:
        f8, f32 = torch.float8_e4m3fn, torch.float32
        return Fp8WgradScratch(
            bmax_LBF=torch.empty(L, blocks, 3 * I, dtype=f32, device=device) if blocks else None,
            xqT_LHP=torch.empty(L, H, P, dtype=f8, device=device),
            dyqT_LHP=torch.empty(L, H, P, dtype=f8, device=device),
            hqT_LIP=torch.empty(L, I, P, dtype=f8, device=device),
            gqT_LFP=torch.empty(L, 2 * I, P, dtype=f8, device=device),
            srh_LGI=torch.empty(L, G, I, dtype=f32, device=device),
            srg_LGF=torch.empty(L, G, 2 * I, dtype=f32, device=device),
            gxam_H=torch.empty(H, dtype=f32, device=device),
            gdyam_H=torch.empty(H, dtype=f32, device=device))


def backward_scratch(ws: Workspace) -> BackwardScratch:
    """Fresh outputs and scratch for one backward on ``ws``. With ``bwd_fp8_wgrad`` no bf16
    x rows are pulled (the FP8 weight-gradient items read x's FP8 copy), nor bf16 dY rows
    when ``bwd_fp8_da`` also holds (the dA items then read dY's FP8 rows at home), unless
    ``bwd_pull_dedup`` needs them as its second pass's source."""
    cfg = ws.config
    L, H, I, P, dev = ws.L, ws.H, ws.I, ws.P, ws.device
    bf = torch.bfloat16
    w8, dedup = cfg.bwd_fp8_wgrad, cfg.bwd_pull_dedup
    combined = cfg.bwd_dw_tma_store or cfg.bwd_dw_gluon  # one buffer per weight: TMA stores
    dw1, dws1, dw1_all = _dw_buffers(L, ws.E, ws.shared, (H, 2 * I), combined, dev)
    dw2, dws2, dw2_all = _dw_buffers(L, ws.E, ws.shared, (I, H), combined, dev)
    return BackwardScratch(
        dw1_EHF=dw1, dw2_EIH=dw2, dws1_LHF=dws1, dws2_LIH=dws2, dw1_all=dw1_all,
        dw2_all=dw2_all,
        hs_LPI=torch.empty(L, P, I, dtype=bf, device=dev),
        xg_LPH=(torch.empty(L, P, H, dtype=bf, device=dev) if dedup or not w8 else None),
        dyg_LPH=(torch.empty(L, P, H, dtype=bf, device=dev)
                 if dedup or not (w8 and cfg.bwd_fp8_da) else None),
        gq_LPG=(torch.empty(L, P, dgu_row_elements(I), dtype=bf, device=dev)
                if cfg.bwd_fp8_dx else None),
        wgrad8=(Fp8WgradScratch.empty(L, H, I, P, ws.E + int(ws.shared), dev,
                                      P // cfg.bwd_bm if cfg.bwd_fp8_block_colmax else 0)
                if w8 else None))


def _dw_buffers(L: int, E: int, shared: bool, shape: tuple[int, int], combined: bool,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor,
                                                    torch.Tensor | None]:
    """bf16 weight-gradient buffers of one weight: (routed [L*E, *shape], shared [L,
    *shape] or a one-element placeholder without the shared expert, the buffer both are
    views of or None). ``combined`` (``bwd_dw_tma_store``): one buffer, the shared
    expert's L slots after the routed experts', so one TMA descriptor covers every slot."""
    bf = torch.bfloat16
    if not combined:
        return (torch.empty(L * E, *shape, dtype=bf, device=device),
                torch.empty((L, *shape) if shared else (1,), dtype=bf, device=device), None)
    every = torch.empty(L * E + (L if shared else 0), *shape, dtype=bf, device=device)
    routed = every[:L * E]
    return (routed, every[L * E:] if shared else torch.empty(1, dtype=bf, device=device),
            every)


def _dw_descriptors(cfg: MoKConfig, sc: BackwardScratch) -> dict:
    """``bwd_dw_tma_store``'s store descriptors over the combined dW buffers ([slots *
    rows, cols] views, [block_n / 2, block_n / 2] boxes: half a weight-gradient tile) and
    the shared expert's first slot; None and 0 without the knob."""
    if sc.dw1_all is None or sc.dw2_all is None:
        return dict(dw1_desc=None, dw2_desc=None, SH0=0)
    from triton.tools.tensor_descriptor import TensorDescriptor

    half = cfg.block_n // 2

    def desc(t: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), [half, half])

    return dict(dw1_desc=desc(sc.dw1_all), dw2_desc=desc(sc.dw2_all),
                SH0=sc.dw1_EHF.shape[0])


def dgu_row_elements(intermediate: int) -> int:
    """bf16 elements per FP8 dG/dU row of ``bwd_fp8_dx``: 2I e4m3 bytes and a 4-byte scale,
    rounded up to 16 bytes so every row starts 16-byte aligned (vector loads)."""
    return -(-(2 * intermediate + 4) // 16) * 8


def _carve(T: int, H: int, K: int, NJ: int, fp8_da: bool = False,
           fp8_wgrad: bool = False, prequant: bool = False) -> tuple[list[int], int]:
    """Byte offsets of dy, p, drp, dyq (its size 0 without ``fp8_da``), then xam and dyam
    (0 without ``fp8_wgrad``), then the e4m3 x and dY rows (0 without ``prequant``) inside
    one (symmetric) buffer, and its size."""
    return carve([T * H * 2, T * K * 4, T * K * NJ * 4, T * H * 2 * fp8_da,
                  H * 4 * fp8_wgrad, H * 4 * fp8_wgrad, T * H * prequant, T * H * prequant])


def _buffers(ws: Workspace) -> BackwardBuffers:
    """The workspace's backward buffers, made on the first backward (collective in EP)."""
    if "bwd" in ws.extra:
        return ws.extra["bwd"]
    cfg, L, T, H, K, dev = ws.config, ws.L, ws.T, ws.H, ws.K, ws.device
    NJ = ws.I // cfg.da_cols(ws.I)
    pre = cfg.bwd_fp8_prequant
    offs, nbytes = _carve(T, H, K, NJ, cfg.bwd_fp8_da, cfg.bwd_fp8_wgrad, pre)
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
        dyq_LTH=view(3, T * H * 2, torch.bfloat16, (T, H)) if cfg.bwd_fp8_da else None,
        xam_LH=view(4, H * 4, torch.float32, (H,)) if cfg.bwd_fp8_wgrad else None,
        dyam_LH=view(5, H * 4, torch.float32, (H,)) if cfg.bwd_fp8_wgrad else None,
        tab16_R=torch.tensor([b // 2 for b in tab], dtype=torch.int64, device=dev),
        tab32_R=torch.tensor([b // 4 for b in tab], dtype=torch.int64, device=dev),
        counters_LC=torch.zeros(L, counters_per_rank(cfg, ws.P, ws.E), dtype=torch.int32,
                                device=dev),
        ones_NK=torch.ones(L * T, K, dtype=torch.float32, device=dev),
        handle=handle,
        xq8_LTH=view(6, T * H, torch.uint8, (T, H)) if pre else None,
        dyq8_LTH=view(7, T * H, torch.uint8, (T, H)) if pre else None,
        tab8_R=torch.tensor(tab, dtype=torch.int64, device=dev) if pre else None)
    ws.extra["bwd"] = bb
    return bb


def pulls_per_group(cfg: MoKConfig) -> bool:
    """In-kernel pull items the dA items do not wait for (``bwd_fused_pull`` with dA items
    that read dY at home: ``bwd_fp8_da``): counted per expert group, and the weight-gradient
    items wait for their group's rows."""
    return cfg.bwd_fused_pull and cfg.bwd_fp8_da


def counters_per_rank(cfg: MoKConfig, P: int, E: int) -> int:
    """int32 counters of one logical rank (rounded up to 32): the ticket, one per row block,
    one per group (E + 1 with the shared expert slot); with ``bwd_fused_pull`` also one
    pulled flag per row block and the pull ticket, and with it and ``bwd_fp8_da`` then one
    pulled count per group; with ``bwd_fp8_wgrad`` one Q count per
    group; with ``bwd_split_launch`` the second launch's ticket, in the last slot."""
    n = 1 + P // cfg.bwd_bm + E + 1 + int(cfg.bwd_split_launch)
    if cfg.bwd_fused_pull:
        n += P // cfg.bwd_bm + 1
    if pulls_per_group(cfg):
        n += E + 1
    if cfg.bwd_fp8_wgrad:  # Q items done per group
        n += E + 1
    return -(-n // 32) * 32


def group_starts(counts_LG: torch.Tensor, block_m: int) -> torch.Tensor:
    """First schedule row of every group and the end of the last, int32 [L, G+1]: groups are
    consecutive and each padded to a multiple of ``block_m`` (pass the schedule's alignment,
    ``MoKConfig.row_align``, as the schedule lays them out)."""
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

    bk = backward_block_k(cfg)
    b1, b2 = [cfg.block_n, bk], [cfg.da_cols(ws.I), bk]
    return desc(w1, F, b1), desc(w2, ws.H, b2), desc(ws1, F, b1), desc(ws2, ws.H, b2)


def _need_fp8_weights(fp8_weights: BackwardFp8Weights | None, name: str,
                      knob: str) -> BackwardFp8Weights:
    if fp8_weights is None or getattr(fp8_weights, name) is None:
        raise ValueError(f"{knob} needs the FP8 weight copies: pass fp8_weights="
                         "quantize_backward_weights(config, w_down, shared_down, w_gate_up, "
                         "shared_gate_up)")
    return fp8_weights


def _fp8_dx_args(ws: Workspace, sc: BackwardScratch,
                 fp8_weights: BackwardFp8Weights | None) -> dict:
    """The FP8 dX items' arguments (``bwd_fp8_dx``): the FP8 dG/dU scratch rows and the e4m3
    W_gate_up rows through [BN, BK] TMA boxes, with their scales; all None without the
    knob."""
    names = ("gq_ptr", "w1q_desc", "ws1q_desc", "sw1q_ptr", "sws1q_ptr")
    if not ws.config.bwd_fp8_dx:
        return dict.fromkeys(names)
    fw = _need_fp8_weights(fp8_weights, "w1q_NF", "bwd_fp8_dx")
    from triton.tools.tensor_descriptor import TensorDescriptor

    F = 2 * ws.I
    if tuple(fw.w1q_NF.shape) != (ws.L * ws.E * ws.H, F) or (ws.shared and fw.ws1q_HF is None):
        raise ValueError(f"fp8_weights: w1q {tuple(fw.w1q_NF.shape)} does not fit this "
                         f"workspace (want {(ws.L * ws.E * ws.H, F)}, shared "
                         f"{'needed' if ws.shared else 'unused'})")
    box = [ws.config.block_n, fp8_backward_block_k(ws.config)]
    shared = ws.shared
    return dict(gq_ptr=sc.gq_LPG, w1q_desc=TensorDescriptor.from_tensor(fw.w1q_NF, box),
                ws1q_desc=TensorDescriptor.from_tensor(fw.ws1q_HF, box) if shared else None,
                sw1q_ptr=fw.sw1_N, sws1q_ptr=fw.sws1_H if shared else None)


def _fp8_da_args(ws: Workspace, bb: BackwardBuffers,
                 fp8_weights: BackwardFp8Weights | None) -> dict:
    """The FP8 dA items' arguments (``bwd_fp8_da``): the FP8 dY rows and the e4m3 W_down rows
    through [DAC, BK] TMA boxes, with their scales; all None without the knob."""
    names = ("dyq_base", "w2q_desc", "ws2q_desc", "sw2q_ptr", "sws2q_ptr")
    if not ws.config.bwd_fp8_da:
        return dict.fromkeys(names)
    fp8_weights = _need_fp8_weights(fp8_weights, "w2q_NH", "bwd_fp8_da")
    from triton.tools.tensor_descriptor import TensorDescriptor

    box = [ws.config.da_cols(ws.I), fp8_backward_block_k(ws.config)]
    fw = fp8_weights
    if tuple(fw.w2q_NH.shape) != (ws.L * ws.E * ws.I, ws.H) or (ws.shared and fw.ws2q_IH is None):
        raise ValueError(f"fp8_weights: w2q {tuple(fw.w2q_NH.shape)} does not fit this "
                         f"workspace (want {(ws.L * ws.E * ws.I, ws.H)}, shared "
                         f"{'needed' if ws.shared else 'unused'})")
    shared = ws.shared and fw.ws2q_IH is not None
    return dict(dyq_base=bb.dyq_LTH, w2q_desc=TensorDescriptor.from_tensor(fw.w2q_NH, box),
                ws2q_desc=TensorDescriptor.from_tensor(fw.ws2q_IH, box) if shared else None,
                sw2q_ptr=fw.sw2_N, sws2q_ptr=fw.sws2_I if shared else None)


def backward_block_k(cfg: MoKConfig) -> int:
    """Reduction step of the backward's dgrad items (BK): the forward's block_k, at most 64.
    The backward's GEMMs are bf16 whatever the forward's precision, and the FP8 forward's
    block_k 128 (one scale per step) would need 320 KB of shared memory for the dX tiles at
    four stages (sm_90 has 227 KB)."""
    return min(cfg.block_k, 64)


def fp8_backward_block_k(cfg: MoKConfig) -> int:
    """Reduction step of the FP8 dgrad items (BK8: ``bwd_fp8_da``, ``bwd_fp8_dx``):
    ``bwd_fp8_block_k``. Their tiles are half the bytes of bf16 ones, so 128 takes the shared
    memory of the bf16 items' 64."""
    return cfg.bwd_fp8_block_k


def fp8_wgrad_rows(cfg: MoKConfig) -> int:
    """Rows per reduction step of the FP8 weight-gradient items (BKW8: ``bwd_fp8_wgrad``):
    ``bwd_fp8_block_k``, or the backward's row block if smaller (groups are padded to whole
    row blocks)."""
    return min(cfg.bwd_fp8_block_k, cfg.bwd_bm)


PULL_ROWS = 16  # rows per step of an in-kernel pull item (x and dY chunks of CH columns)


def wgrad_rows(cfg: MoKConfig) -> int:
    """Rows per reduction step of the weight-gradient items (BKW): 64, or the backward's row
    block if smaller (every row operand comes through TMA from the pulled rows, so no pointer
    tensors)."""
    return min(64, cfg.bwd_bm)


def q_rows(cfg: MoKConfig) -> int:
    """Rows per step of the Q items' loops (QR): the weight-gradient items' (BKW), or with
    ``bwd_q_cols`` as many more as the columns are fewer, up to the backward's row block
    (groups are padded to whole row blocks, so a step never crosses into the next group):
    the same [rows, columns] register tile, and each step stores 128 bytes of every
    transposed e4m3 column at the Kimi shape (a whole L2 line) instead of 64."""
    rows = wgrad_rows(cfg)
    if cfg.bwd_q_cols:
        rows = min(cfg.bwd_bm, rows * (cfg.block_n // 2) // cfg.bwd_q_cols)
    return rows


def backward_groups(cfg: MoKConfig, group_LB: torch.Tensor) -> torch.Tensor:
    """Group of every backward row block, int32 [L, P / bwd_bm], from the schedule's group of
    every forward row block (block_m rows): with ``bwd_block_m`` a multiple of block_m, the
    first forward block of each backward block (groups are padded to whole backward blocks,
    so all of its forward blocks share the group). A device-side slice: no host sync."""
    step = cfg.bwd_bm // cfg.block_m
    return group_LB if step == 1 else group_LB[:, ::step].contiguous()


def _activation_descriptors(cfg: MoKConfig, pre_LPF: torch.Tensor, hs_LPI: torch.Tensor,
                            xg_LPH: torch.Tensor | None, dyg_LPH: torch.Tensor | None) -> tuple:
    """(pre for the dA epilogue, r*h for dW_down, dGU for dW_gate_up, dGU for dX: boxes
    [BM, BK], used with ``bwd_dx_tma``), then the pulled rows (dY for dA, dY for dW_down, x for
    dW_gate_up; None where those rows are not pulled), over [L*P, cols] views: the epilogue
    boxes cover a quarter tile of I columns (interleaved gate/up: both of its halves), the
    weight-gradient boxes BKW rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bkw = cfg.bwd_bm, cfg.block_n, wgrad_rows(cfg)
    q = bn // 4
    pre = pre_LPF.view(-1, pre_LPF.shape[-1])
    hs = hs_LPI.view(-1, hs_LPI.shape[-1])
    acts = (TensorDescriptor.from_tensor(pre, [bm, 2 * q if cfg.gate_up_interleaved else q]),
            # r h for dW_down (bf16), or for the Q items (FP8 weight gradients: their steps)
            TensorDescriptor.from_tensor(hs, [q_rows(cfg), cfg.q_cols] if cfg.bwd_fp8_wgrad
                                         else [bkw, bn // 2]),
            TensorDescriptor.from_tensor(pre, [bkw, bn]),
            TensorDescriptor.from_tensor(pre, [bm, backward_block_k(cfg)]))
    dyg_d = (None, None)
    if dyg_LPH is not None:
        dyg = dyg_LPH.view(-1, dyg_LPH.shape[-1])
        dyg_d = (TensorDescriptor.from_tensor(dyg, [bm, backward_block_k(cfg)]),
                 TensorDescriptor.from_tensor(dyg, [bkw, bn]))
    if xg_LPH is not None:
        xg_d = (TensorDescriptor.from_tensor(xg_LPH.view(-1, xg_LPH.shape[-1]), [bkw, bn // 2]),)
    else:
        xg_d = (None,)
    return acts + dyg_d + xg_d


def _fp8_wgrad_args(cfg: MoKConfig, sc: BackwardScratch, pre_LPF: torch.Tensor) -> dict:
    """The FP8 weight-gradient items' arguments (``bwd_fp8_wgrad``): the scratch of
    ``Fp8WgradScratch``, TMA descriptors over its transposed copies ([BN/2 or BN features,
    BKW8 rows] boxes) and the Q items' descriptor over dG/dU ([BKW rows, ``q_cols`` columns];
    r h's is ``hs_c_desc``); all None without the knob."""
    names = ("hqT_ptr", "gqT_ptr", "srh_ptr", "srg_ptr", "hqT_desc",
             "dyqT_desc", "xqT_desc", "gqT_desc", "gxam_ptr", "gdyam_ptr", "pre_q_desc",
             "xqT_ptr", "dyqT_ptr", "bmax_ptr")
    w8 = sc.wgrad8
    if w8 is None:
        return dict.fromkeys(names)
    from triton.tools.tensor_descriptor import TensorDescriptor

    bn, bkw = cfg.block_n, fp8_wgrad_rows(cfg)

    def desc_rows(t: torch.Tensor, feats: int, rows: int) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), [feats, rows])

    def desc(t: torch.Tensor, feats: int) -> TensorDescriptor:
        return desc_rows(t, feats, bkw)

    return dict(hqT_ptr=w8.hqT_LIP,
                gqT_ptr=w8.gqT_LFP, srh_ptr=w8.srh_LGI, srg_ptr=w8.srg_LGF,
                hqT_desc=desc(w8.hqT_LIP, bn // 2), dyqT_desc=desc(w8.dyqT_LHP, bn),
                xqT_desc=desc(w8.xqT_LHP, bn // 2), gqT_desc=desc(w8.gqT_LFP, bn),
                gxam_ptr=w8.gxam_H, gdyam_ptr=w8.gdyam_H,
                pre_q_desc=TensorDescriptor.from_tensor(pre_LPF.view(-1, pre_LPF.shape[-1]),
                                                        [q_rows(cfg), cfg.q_cols]),
                xqT_ptr=w8.xqT_LHP, dyqT_ptr=w8.dyqT_LHP,  # the in-kernel pull's stores
                bmax_ptr=w8.bmax_LBF)


def backward_stages(cfg: MoKConfig) -> int:
    """Pipeline stages of the backward kernel: ``bwd_stages``, or the forward's where it is 0;
    at most 2 with split gate/up columns, whose build otherwise needs more than 227 KB of
    shared memory (Triton 3.6, sm_90: 393 KB at 4 stages, 295 KB at 3, 197 KB at 2; the
    interleaved layout fits at 4)."""
    stages = cfg.bwd_stages or cfg.num_stages
    return stages if cfg.gate_up_interleaved else min(2, stages)


def backward_constants(cfg: MoKConfig, *, hidden: int, intermediate: int, slots: int,
                       shared: bool, programs: int, interpreting: bool = False,
                       phases: int = 15, split: int = 0) -> dict:
    """The backward kernel's compile-time arguments (part of :func:`backward_kernel_args`).
    ``split`` (``bwd_split_launch``): 0 one launch of every item kind, 1 the dgrad launch,
    2 the weight-gradient launch."""
    return dict(H=hidden, I=intermediate, S=slots, K=slots - int(shared), PROGS=programs,
                HAS_SHARED=shared, BM=cfg.bwd_bm, BN=cfg.block_n, BK=backward_block_k(cfg),
                BKW=wgrad_rows(cfg), DAC=cfg.da_cols(intermediate), F32_DOT=interpreting,
                INTERLEAVED=cfg.gate_up_interleaved, PHASES=phases, PULL=cfg.bwd_fused_pull,
                BR=PULL_ROWS, CH=_row_chunk(hidden),
                PULLERS=min(cfg.bwd_pull_programs or programs, programs),
                DXT=cfg.bwd_dx_tiles, DAT=cfg.bwd_da_tiles,
                DXTMA=cfg.bwd_dx_tma, FP8DA=cfg.bwd_fp8_da,
                FP8DX=cfg.bwd_fp8_dx, GQW=dgu_row_elements(intermediate),
                RQC=min(128, 2 * intermediate), POW2=cfg.fp8_pow2_scales,
                FP8W=cfg.bwd_fp8_wgrad, BK8=fp8_backward_block_k(cfg),
                BKW8=fp8_wgrad_rows(cfg),
                PULLG=pulls_per_group(cfg),
                PBR=min(wgrad_rows(cfg), cfg.bwd_bm), PCH=min(128, _row_chunk(hidden)),
                QBM=cfg.bwd_fp8_block_colmax,
                DXBAND=cfg.bwd_dx_band, DWT=cfg.bwd_dw_tiles,
                DWSC=3 if cfg.bwd_dw_stages == 4 else 2, DWSD=cfg.bwd_dw_stages,
                LEAN=cfg.bwd_lean_epilogue,
                QCNT=cfg.bwd_q_count_rows, SPLIT=split, QC=cfg.q_cols, QR=q_rows(cfg),
                DWTMA=cfg.bwd_dw_tma_store)


def backward_kernel_args(ws: Workspace, st: ScheduleTensors, pre_LPF: torch.Tensor,
                         weights: tuple, sc: BackwardScratch, *,
                         withhold: int, programs: int, phases: int,
                         interpreting: bool, split: int = 0,
                         x_src: torch.Tensor | None = None,
                         fp8_weights: BackwardFp8Weights | None = None,
                         dy_src: torch.Tensor | None = None) -> dict[str, object]:
    """Every argument of ``mok_backward_kernel`` by name: buffers, TMA descriptors, scalars
    and compile-time constants. The one list of them, for the launch and for
    ``lowering.compile_megakernel`` (which derives the types from it). ``pre_LPF``: the
    training forward's pre-activations; ``programs``: programs per logical rank;
    ``split``: which launch of ``bwd_split_launch`` (``backward_constants``);
    ``x_src``: where the x rows are pulled from (``bwd_fused_pull``;
    default the workspace's token buffer); ``fp8_weights``: ``bwd_fp8_da``'s W_down copies;
    ``dy_src``: where the dY rows are read from (``_dy_source``; default the carved buffer)."""
    cfg, bb = ws.config, _buffers(ws)
    dy_src = bb.dy_LTH if dy_src is None else dy_src
    if cfg.bwd_fused_pull:
        pull = dict(x_base=ws.x_LTH if x_src is None else x_src, x_tab=ws.x_tab_R,
                    dy_base=dy_src, tab16=bb.tab16_R, xg_ptr=sc.xg_LPH, dyg_ptr=sc.dyg_LPH)
    else:  # the pull kernel runs before the launch: constexpr None here
        pull = dict.fromkeys(("x_base", "x_tab", "dy_base", "tab16", "xg_ptr", "dyg_ptr"))
        if cfg.bwd_fp8_da:  # the dA items gather dY's FP8 rows at the home ranks
            pull["tab16"] = bb.tab16_R
    descs = _descriptors(ws, weights) + _activation_descriptors(cfg, pre_LPF, sc.hs_LPI,
                                                                sc.xg_LPH, sc.dyg_LPH)
    names = ("w1_desc", "w2_desc", "ws1_desc", "ws2_desc", "pre_a_desc", "hs_c_desc",
             "pre_d_desc", "pre_b_desc", "dyg_a_desc", "dyg_c_desc", "xg_d_desc")
    descs = dict(zip(names, descs, strict=True))
    args = dict(
        p_base=bb.p_LTK,
        drp_base=bb.drp_LTKJ, tab32=bb.tab32_R, comb_base=ws.comb_LTSH, comb_tab=ws.comb_tab_R,
        src_ptr=st.src_LP, group_ptr=backward_groups(cfg, st.group_LB), total_ptr=st.total_L,
        gstart_ptr=group_starts(st.counts_LG, cfg.row_align),
        gcount_ptr=st.counts_LG.contiguous() if cfg.bwd_q_count_rows else None,
        pre_ptr=pre_LPF, hs_ptr=sc.hs_LPI, ctr_ptr=bb.counters_LC, err_ptr=ws.errors_L4,
        dw1_ptr=sc.dw1_EHF, dw2_ptr=sc.dw2_EIH, dws1_ptr=sc.dws1_LHF, dws2_ptr=sc.dws2_LIH,
        **descs, **pull, **_fp8_da_args(ws, bb, fp8_weights),
        **_fp8_dx_args(ws, sc, fp8_weights), **_fp8_wgrad_args(cfg, sc, pre_LPF),
        **_dw_descriptors(cfg, sc),
        T=ws.T, E=ws.E, NG=ws.E + int(ws.shared), P=ws.P, NCTR=bb.counters_LC.shape[1],
        budget=cfg.spin_budget, withhold=withhold, trace_ptr=None, MAXT=0, TRACE=False,
        **backward_constants(cfg, hidden=ws.H, intermediate=ws.I, slots=ws.S,
                             shared=ws.shared, programs=programs, interpreting=interpreting,
                             phases=phases, split=split))
    from mok_kernels._details.tl_backward import mok_backward_kernel

    return {name: args[name] for name in mok_backward_kernel.arg_names}  # parameter order


def _dy_source(ws: Workspace, bb: BackwardBuffers, dy_TH: torch.Tensor) -> torch.Tensor:
    """The buffer the backward reads dY rows from (at ``bb.tab16_R``'s rank offsets). Real EP
    (peers read it) or several loopback ranks (laid out at the carve's offsets): the carved
    buffer, dY copied in. One rank in one process: its offset is 0, so dY is read where it is
    when ``readable_in_place``, as ``_token_source`` does for x: no copy (235 MB each way at
    Kimi K2 x 16384)."""
    if ws.L == 1 and readable_in_place(ws, dy_TH):
        return dy_TH
    bb.dy_LTH.copy_(dy_TH.view(bb.dy_LTH.shape))
    return bb.dy_LTH


def _col_amax(v_LTH: torch.Tensor) -> torch.Tensor:
    """Column max |v| over the tokens, fp32 [L, H], in one read (min and max at once, no
    |v| temporary); NaN where a column holds a NaN (torch's reductions propagate it), so the
    FP8 copies' scales, and the weight gradients, are NaN: a NaN input never passes."""
    lo, hi = torch.aminmax(v_LTH, dim=1)
    return torch.maximum(hi.float(), -lo.float())


def interleaved_block_order(counts_LG: torch.Tensor, total_L: torch.Tensor, row_align: int,
                            P: int, rows: int) -> torch.Tensor:
    """Row blocks of ``rows`` schedule rows in the order of their place inside their group,
    int32 [L, P / rows] (``bwd_pull_interleave``), from the schedule's real rows per group
    ``counts_LG`` [L, G] and rows in use ``total_L`` [L]: a stable sort of each block's first row's
    offset in its group over the group's padded size, so every group's first block comes
    first, then every group's second, and so on; blocks at or past the rank's total rows
    last. Device ops only (no host sync), deterministic."""
    L = counts_LG.shape[0]
    gst_LG1 = group_starts(counts_LG, row_align).to(torch.int64)  # [L, G + 1]
    G = gst_LG1.shape[1] - 1
    first_LB = (torch.arange(0, P, rows, device=gst_LG1.device, dtype=torch.int64)
                .view(1, -1).expand(L, -1).contiguous())
    g_LB = torch.searchsorted(gst_LG1[:, 1:].contiguous(), first_LB, right=True).clamp_(max=G - 1)
    g0_LB = torch.gather(gst_LG1, 1, g_LB)
    size_LB = torch.gather(gst_LG1, 1, g_LB + 1) - g0_LB
    place_LB = (first_LB - g0_LB).double() / size_LB.clamp(min=1).double()
    place_LB = torch.where(first_LB < total_L.view(L, 1).to(torch.int64), place_LB,
                           torch.full_like(place_LB, 2.0))
    return torch.argsort(place_LB, dim=1, stable=True).to(torch.int32)


def _pull_fp8_copies(ws: Workspace, bb: BackwardBuffers, st: ScheduleTensors,
                     sc: BackwardScratch, x_src: torch.Tensor, dy_src: torch.Tensor,
                     x_TH: torch.Tensor | None = None, dy_TH: torch.Tensor | None = None
                     ) -> None:
    """``bwd_fp8_wgrad``: the global column maxima of x and dY (after the barrier: every
    rank's own are in), then the pull of x and dY rows into their FP8 transposed copies
    (and the bf16 dY rows where the dA items read them); with ``bwd_pull_dedup`` in two
    passes, a token's first row on this rank from home, then its other rows from it. With
    ``bwd_fused_pull`` (and ``bwd_fp8_da``) the maxima only: the megakernel's pull items
    write the copies. With ``bwd_fp8_prequant`` each rank first quantises its own tokens'
    rows ``x_TH`` and ``dY_TH`` [L*T, H] with the global scales (``quantize_cols_kernel``),
    then, after a barrier (peers read them), the pull moves e4m3 bytes."""
    from mok_kernels._details.tl_backward_pull import (
        global_col_amax_kernel,
        pull_rows_fp8t_kernel,
        quantize_cols_kernel,
    )

    cfg, w8, H = ws.config, sc.wgrad8, ws.H
    ch = min(128, _row_chunk(H))
    global_col_amax_kernel[(-(-H // ch),)](bb.xam_LH, bb.dyam_LH, bb.tab32_R,
                                           bb.tab32_R.numel(), w8.gxam_H, w8.gdyam_H, H=H,
                                           CH=ch, num_warps=4)
    if cfg.bwd_fused_pull:
        return
    br = wgrad_rows(cfg)
    dy16 = sc.dyg_LPH is not None
    order = (interleaved_block_order(st.counts_LG, st.total_L, cfg.row_align, ws.P, br)
             if cfg.bwd_pull_interleave else None)
    pre = cfg.bwd_fp8_prequant
    src = (x_src, ws.x_tab_R, dy_src, bb.tab16_R, sc.dyg_LPH, sc.xg_LPH, w8.xqT_LHP,
           w8.dyqT_LHP)
    if pre:  # each rank's own rows in e4m3, then the pull of bytes (every tensor a byte view)
        if x_TH is None or dy_TH is None:
            raise ValueError("bwd_fp8_prequant: _pull_fp8_copies needs x_TH and dy_TH")
        qr = 32
        for lr in range(ws.L):
            for v_TH, q_TH, am in ((x_TH, bb.xq8_LTH, w8.gxam_H), (dy_TH, bb.dyq8_LTH,
                                                                   w8.gdyam_H)):
                quantize_cols_kernel[(-(-ws.T // qr), -(-H // ch))](
                    v_TH.view(ws.L, ws.T, H)[lr], am,
                    q_TH[lr].view(torch.float8_e4m3fn), ws.T, H=H, BR=qr, CH=ch,
                    POW2=cfg.fp8_pow2_scales, SOFT_CAST=_interpreting(), num_warps=4)
        ws.barrier()  # peers pull these rows

        def as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(torch.uint8)

        src = (bb.xq8_LTH, bb.tab8_R, bb.dyq8_LTH, bb.tab8_R, as_bytes(sc.dyg_LPH),
               as_bytes(sc.xg_LPH), as_bytes(w8.xqT_LHP), as_bytes(w8.dyqT_LHP))
    xs, xtab, dys, dytab, dyg, xg, xqT, dyqT = src
    for phase in (1, 2) if cfg.bwd_pull_dedup else (0,):
        pull_rows_fp8t_kernel[(ws.L, ws.P // br)](
            st.src_LP, st.total_L, xs, xtab, dys, dytab,
            dyg if dy16 else w8.gdyam_H, xqT, dyqT, w8.gxam_H,
            w8.gdyam_H, ws.T, ws.P, H=H, S=ws.S, BR=br, CH=ch, DY16=dy16,
            POW2=cfg.fp8_pow2_scales, SOFT_CAST=_interpreting(), first_ptr=st.first_LP,
            xg_ptr=xg, PHASE=phase, order_ptr=order, ORDER=order is not None, PRE=pre,
            AHEAD=cfg.bwd_pull_prefetch, num_warps=4)


PULL_TOKENS = 16  # tokens per program of the token-by-token pull (``bwd_pull_by_token``)


def _pull_by_token(ws: Workspace, bb: BackwardBuffers, st: ScheduleTensors,
                   sc: BackwardScratch, x_src: torch.Tensor, dy_src: torch.Tensor) -> None:
    """``bwd_pull_by_token``: the x and dY rows of every slot this launch serves, token by
    token over the group's N tokens (``pull_rows_by_token_kernel``), then zeros in the
    padding rows (``zero_padding_rows_kernel``)."""
    from mok_kernels._details.tl_backward_pull import (
        pull_rows_by_token_kernel,
        zero_padding_rows_kernel,
    )

    if st.slot_rows_LJ is None:
        raise ValueError("bwd_pull_by_token: the schedule has no slot rows (build it with "
                         "this config: build_schedule)")
    N = st.slot_rows_LJ.shape[1] // ws.S
    ch = bf16_pull_cols(ws.config, ws.H)
    pull_rows_by_token_kernel[(ws.L, -(-N // PULL_TOKENS))](
        st.slot_rows_LJ, st.total_L, x_src, ws.x_tab_R, dy_src, bb.tab16_R, sc.xg_LPH,
        sc.dyg_LPH, N, ws.T, ws.P, H=ws.H, S=ws.S, BT=PULL_TOKENS, CH=ch, num_warps=4)
    zero_padding_rows_kernel[(ws.L, ws.P // PULL_ROWS)](
        st.src_LP, st.total_L, sc.xg_LPH, sc.dyg_LPH, ws.P, H=ws.H, BR=PULL_ROWS, CH=ch,
        num_warps=4)


def bf16_pull_cols(cfg: MoKConfig, H: int) -> int:
    """Columns per step of the separate bf16 pulls (the row pull, the pull by token):
    ``bwd_pull_cols``, or H rounded up to a power of two, at most 1024 (``_row_chunk``)."""
    return cfg.bwd_pull_cols or _row_chunk(H)


def backward_trace_capacity(ws: Workspace) -> int:
    """Tickets of the backward megakernel's main order per logical rank, at most (every row
    block in use): the rows of a ``backward(_trace=...)`` buffer."""
    cfg = ws.config
    H, I, bn = ws.H, ws.I, cfg.block_n
    nb, ng, half = ws.P // cfg.bwd_bm, ws.E + int(ws.shared), bn // 2
    na = I // (cfg.da_cols(I) * cfg.bwd_da_tiles)
    nbx = H // (bn * cfg.bwd_dx_tiles)
    per_group = (3 * I // cfg.q_cols) + (I // half) * (H // bn) + (H // half) * (2 * I // bn)
    return nb * na + nb * nbx + ng * per_group


def _pull_rows(ws: Workspace, bb: BackwardBuffers, st: ScheduleTensors, x_src: torch.Tensor,
               dy_src: torch.Tensor, xg_LPH: torch.Tensor, dyg_LPH: torch.Tensor, *,
               phase: int = 0) -> None:
    """One launch of ``pull_rows_kernel`` over every logical rank's schedule rows (PULL_ROWS
    per program): the separate pull (``phase`` 0, or 1 then 2 with ``bwd_pull_dedup``)."""
    from mok_kernels._details.tl_backward_pull import pull_rows_kernel

    br = PULL_ROWS
    pull_rows_kernel[(ws.L, ws.P // br)](st.src_LP, st.total_L, x_src, ws.x_tab_R, dy_src,
                                         bb.tab16_R, xg_LPH, dyg_LPH, ws.T, ws.P, H=ws.H,
                                         S=ws.S, BR=br, CH=bf16_pull_cols(ws.config, ws.H),
                                         first_ptr=st.first_LP, PHASE=phase,
                                         num_warps=4)


def _dx_sum(ws: Workspace, bb: BackwardBuffers, stream) -> torch.Tensor:
    """dx [L*T, H] bf16: each token's dX slot rows summed in fixed k order
    (``weighted_sum_kernel`` with unit weights), on ``stream`` (None: the current one)."""
    from mok_kernels._details.tl_mega import weighted_sum_kernel

    dx = torch.empty(ws.L * ws.T, ws.H, dtype=torch.bfloat16, device=ws.device)
    bh = _row_chunk(ws.H)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        weighted_sum_kernel[(ws.L * ws.T, -(-ws.H // bh))](
            ws.comb_LTSH, bb.ones_NK, dx, H=ws.H, K=ws.K, S=ws.S, BH=bh, num_warps=4)
    return dx


def slot_rows(src_LP: torch.Tensor, slots: int) -> torch.Tensor:
    """The schedule row (over every logical rank's P rows) of each of the ``slots`` (token,
    slot) pairs, int32 [slots]: ``src_LP`` inverted on the device (no host sync); padding
    rows scatter to places past ``slots`` of their own, and a pair no row fills (none: no
    token is dropped) reads row 0."""
    rows = src_LP.numel()
    src = src_LP.reshape(-1).to(torch.int64)
    spare = slots + torch.arange(rows, device=src.device)
    inv = torch.zeros(slots + rows, dtype=torch.int32, device=src.device)
    inv.scatter_(0, torch.where(src >= 0, src, spare),
                 torch.arange(rows, dtype=torch.int32, device=src.device))
    return inv[:slots]


def _dx_rows_sum(ws: Workspace, rows_LPH: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """dx [L*T, H] bf16 from the dX rows in the schedule's order (``bwd_dx_rows``): each
    token's slot rows (``inv``: ``slot_rows``) summed in fixed slot order, bitwise what
    ``_dx_sum`` gives from the combine slots."""
    from mok_kernels._details.tl_mega import gather_sum_kernel

    dx = torch.empty(ws.L * ws.T, ws.H, dtype=torch.bfloat16, device=ws.device)
    bh = _row_chunk(ws.H)
    gather_sum_kernel[(ws.L * ws.T, -(-ws.H // bh))](rows_LPH, inv, dx, H=ws.H, S=ws.S, BH=bh,
                                                      num_warps=4)
    return dx


_SIDE_STREAMS: dict = {}  # device -> the stream of ``bwd_side_sms``' pull


def side_pull(ws: Workspace):
    """The stream the FP8 pull runs on beside the dgrad launch (``bwd_side_sms`` on a GPU,
    one per device, made once), or None: the pull runs first on the current stream (the
    knob off, or Triton's interpreter, where launches run one after another)."""
    if ws.config.bwd_side_sms == 0 or ws.device.type != "cuda" or _interpreting():
        return None
    key = (ws.device.index if ws.device.index is not None else torch.cuda.current_device())
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(ws.device)
    return _SIDE_STREAMS[key]


def launch_programs(ws: Workspace, progs: int, split: int) -> int:
    """Programs per logical rank of a backward megakernel launch: ``progs``, less
    ``bwd_side_sms // L`` (at least 1) for the dgrad launch (``split`` 1) when that knob
    leaves SMs to the pull beside it, and for the weight-gradient launch (``split`` 2) when
    ``bwd_side_sum`` leaves them to the dX sum."""
    side = ws.config.bwd_side_sms
    if side == 0 or not (split == 1 or (split == 2 and ws.config.bwd_side_sum)):
        return progs
    return max(1, progs - max(1, side // ws.L))


def runs_gluon_dx(cfg: MoKConfig, phases: int = 15) -> bool:
    """Whether a backward of this ``phases`` mask runs the B items' GEMM as the Gluon launch
    of ``bwd_dx_gluon`` (after the megakernel's launches, which then skip the B items); a
    clear error where Gluon cannot run (Triton's interpreter)."""
    on = cfg.bwd_dx_gluon and bool(phases & 2)
    if on and _interpreting():
        raise ValueError("bwd_dx_gluon=True is invalid here: allowed only on an sm_90 GPU "
                         "(Gluon kernels do not run in Triton's interpreter)")
    return on


def dx_rows_buffer(ws: Workspace, sc: BackwardScratch) -> torch.Tensor | None:
    """Where ``bwd_dx_rows`` puts the dX rows ([L, P, H]: the pulled dY rows' buffer, read by
    then), or None without the knob; a clear error in real EP, where a token's dX rows
    belong in its home rank's combine slots."""
    if not ws.config.bwd_dx_rows:
        return None
    if ws.group is not None:
        raise ValueError("bwd_dx_rows=True is invalid here: allowed only within one process "
                         "(one rank or loopback ranks): in real EP a token's dX rows go to "
                         "its home rank's combine slots")
    return sc.dyg_LPH


def gluon_dw_kinds(cfg: MoKConfig, phases: int = 15) -> int:
    """The C and D items' bits (4, 8) of this ``phases`` mask that ``bwd_dw_gluon``'s launch
    runs (after the megakernel's launches, which then skip them): 0 without the knob; a
    clear error where Gluon cannot run (Triton's interpreter)."""
    kinds = phases & (4 | 8) if cfg.bwd_dw_gluon else 0
    if kinds and _interpreting():
        raise ValueError("bwd_dw_gluon=True is invalid here: allowed only on an sm_90 GPU "
                         "(Gluon kernels do not run in Triton's interpreter)")
    return kinds


DGRAD_PHASES = 1 | 2 | 16  # the A and B items (16: the A items without their epilogue)
WGRAD_PHASES = 4 | 8 | 32  # the Q (either bit, or 32 alone), C and D items


def split_launches(cfg: MoKConfig, phases: int = 15) -> list[tuple[int, int]]:
    """(split, phases) of each backward megakernel launch: one launch of every item kind, or
    with ``bwd_split_launch`` the dgrad launch then the weight-gradient launch, each with its
    share of the ``phases`` mask (a launch left with no kind is not made)."""
    if not cfg.bwd_split_launch:
        return [(0, phases)]
    return [(n, phases & m) for n, m in ((1, DGRAD_PHASES), (2, WGRAD_PHASES)) if phases & m]


def backward(config: MoKConfig, ws: Workspace, context: ForwardContext, dy_TH: torch.Tensor,
             w_gate_up: torch.Tensor, w_down: torch.Tensor,
             shared_gate_up: torch.Tensor | None = None,
             shared_down: torch.Tensor | None = None, *,
             fp8_weights: BackwardFp8Weights | None = None, _withhold: int = 0,
             _phases: int = 15, _trace: torch.Tensor | None = None) -> Gradients:
    """Gradients of the layer for the training forward that made ``context`` (once per
    context: the saved pre-activations are overwritten by their gradients). ``fp8_weights``:
    with ``bwd_fp8_da``, ``quantize_backward_weights(config, w_down, shared_down)``.
    ``_trace`` (profiling only): an int64 [L, backward_trace_capacity(ws), 4] tensor that receives
    every megakernel item's (start ns, end ns, program, kind) at its ticket; rows of
    tickets not used keep what they held."""
    from mok_kernels._details.tl_backward import mok_backward_kernel

    if config != ws.config or context.schedule.workspace is not ws:
        raise ValueError("config / context do not belong to this workspace")
    L, T, H, K = ws.L, ws.T, ws.H, ws.K
    if tuple(dy_TH.shape) != (L * T, H):
        raise ValueError(f"dy shape {tuple(dy_TH.shape)} != {(L * T, H)}")
    weights = (w_gate_up, w_down, shared_gate_up, shared_down)
    _check_weights(ws, *weights, fp8=False)
    bb = _buffers(ws)
    st = context.schedule.tensors
    pre = config.bwd_fp8_prequant  # the pull reads e4m3 rows quantised at home instead
    dy_src = bb.dy_LTH if pre else _dy_source(ws, bb, dy_TH)
    w8 = config.bwd_fp8_wgrad  # each rank's column maxima of x and dY, read by every rank
    # after the barrier; with bwd_fused_colmax x's from the training forward's quantisation
    # of x where it took them, dY's from its row quantisation below (the same loads)
    fused = config.bwd_fused_colmax and config.bwd_fp8_da
    if config.bwd_fp8_da:  # dY quantised once, at its home rank (one scale per token row),
        dy_LTH = dy_TH.reshape(L, T, H)  # straight into each rank's (contiguous) rows
        for lr in range(L):
            quantize_tokens_into("rowwise", dy_LTH[lr], bb.dyq_LTH[lr],
                                 pow2_scales=config.fp8_pow2_scales,
                                 col_amax_H=bb.dyam_LH[lr] if fused else None)
    if w8 and not fused:
        bb.dyam_LH.copy_(_col_amax(dy_TH.view(L, T, H)))
    bb.p_LTK.copy_(context.p_NK.view(bb.p_LTK.shape))
    if w8:
        bb.xam_LH.copy_(_col_amax(context.x_TH.view(L, T, H)) if context.x_colmax_LH is None
                        else context.x_colmax_LH.view(bb.xam_LH.shape))
    # real EP: x back into the peer buffer (not read with prequant: the e4m3 rows are)
    x_src = ws.x_LTH if pre else _token_source(ws, context.x_TH, fp8=False)
    sc = backward_scratch(ws)
    bb.counters_LC.zero_()
    ws.barrier()
    gluon_dx = runs_gluon_dx(config, _phases)
    gluon_dw = gluon_dw_kinds(config, _phases)
    launches = split_launches(config, _phases & ~(2 if gluon_dx else 0) & ~gluon_dw)
    beside = side_pull(ws)  # bwd_side_sms on a GPU: the pull beside the dgrad launch
    if all(n != 1 for n, _ in launches):  # (a profiling mask without the dgrad launch)
        beside = None
    main = torch.cuda.current_stream(ws.device) if beside is not None else None
    if config.bwd_fp8_wgrad and beside is None:  # the pull writes FP8 transposed copies
        _pull_fp8_copies(ws, bb, st, sc, x_src, dy_src, context.x_TH, dy_TH)  # of x and dY
    elif beside is not None:
        beside.wait_stream(main)  # what the pull reads
    elif config.bwd_pull_by_token:  # each token's rows read once, written to its slots' rows
        _pull_by_token(ws, bb, st, sc, x_src, dy_src)
    elif not config.bwd_fused_pull:
        # else the megakernel pulls the rows itself
        for phase in (1, 2) if config.bwd_pull_dedup else (0,):  # dedup: first rows, then
            # the other rows from them (two launches: no wait inside the kernel)
            _pull_rows(ws, bb, st, x_src, dy_src, sc.xg_LPH, sc.dyg_LPH, phase=phase)
    progs, _ = _programs(ws)
    extra = {} if _interpreting() else {"launch_cooperative_grid": True}
    args = backward_kernel_args(ws, st, context.pre_LPF, weights, sc,
                                withhold=_withhold, programs=progs, phases=_phases,
                                interpreting=_interpreting(), x_src=x_src,
                                fp8_weights=fp8_weights, dy_src=dy_src)
    args.update(trace_args(_trace, L, backward_trace_capacity(ws)))
    dx = None
    for split, phases in launches:  # the launches differ in these only
        n = launch_programs(ws, progs, split)
        mok_backward_kernel[(L * n,)](**{**args, "SPLIT": split, "PHASES": phases,
                                         "PROGS": n},
                                      num_warps=config.num_warps,
                                      num_stages=backward_stages(config), **extra)
        if beside is not None and split == 1:  # submitted after the dgrad launch, so its
            with torch.cuda.stream(beside):  # programs take their SMs first
                _pull_fp8_copies(ws, bb, st, sc, x_src, dy_src, context.x_TH, dy_TH)
            main.wait_stream(beside)  # the weight-gradient launch reads the pull's copies
            if config.bwd_side_sum:  # peers' dX rows in (real EP), then the sum may start
                ws.barrier()
                beside.wait_stream(main)
        if config.bwd_side_sum and split == 2:
            dx = _dx_sum(ws, bb, beside)  # the stream it runs on: beside this launch
    if gluon_dw:  # r h, dG/dU and the pulled rows are whole once the A items have ended
        from mok_kernels._details.gl_dw import launch_dw

        launch_dw(sc.hs_LPI, sc.dyg_LPH, sc.xg_LPH, context.pre_LPF, sc.dw2_all, sc.dw1_all,
                  args["gstart_ptr"], st.total_L, E=ws.E,
                  shared=ws.shared, interleaved=config.gate_up_interleaved,
                  row_align=config.row_align, programs=L * progs, c=bool(gluon_dw & 4),
                  d=bool(gluon_dw & 8))
    if gluon_dx:  # dGU is whole once the A items' launch has ended
        from mok_kernels._details.gl_dx import launch_dx

        # bwd_dx_rows: the rows into the pulled dY rows' buffer, whose readers (the dA and
        # weight-gradient items, the launch above) are done
        rows = dx_rows_buffer(ws, sc)
        launch_dx(context.pre_LPF, w_gate_up, shared_gate_up, st.src_LP,
                  backward_groups(config, st.group_LB), st.total_L, ws.comb_LTSH,
                  ws.comb_tab_R, T=T, E=ws.E, H=H, I=ws.I, S=ws.S,
                  band=config.bwd_dx_band, programs=L * progs, rows_LPH=rows)
        if rows is not None:
            dx = _dx_rows_sum(ws, rows, slot_rows(st.src_LP, L * T * ws.S))
    if dx is None:  # the sum after every launch (or no weight-gradient launch was made)
        ws.barrier()
        dx = _dx_sum(ws, bb, None)
    else:  # the sum done (joined) before the barrier lets peers reuse the dX slots
        if beside is not None:
            main.wait_stream(beside)
        ws.barrier()
    dp = bb.drp_LTKJ.sum(-1).view(L * T, K)
    sg = sd = None
    if ws.shared:
        dws1, dws2 = sc.dws1_LHF, sc.dws2_LIH
        sg, sd = (dws1[0], dws2[0]) if L == 1 else (dws1.float().sum(0).bfloat16(),
                                                     dws2.float().sum(0).bfloat16())
    return Gradients(dx, dp, sc.dw1_EHF, sc.dw2_EIH, sg, sd)
