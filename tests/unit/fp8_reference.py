"""Torch references of the FP8 backward's operands, shared by the interpreter tests (CPU) and
the GPU tier: the weight gradients from the operands quantised as ``bwd_fp8_wgrad`` does."""

from __future__ import annotations

from collections.abc import Callable

import torch


def trunc_bf16(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 as Triton's interpreter casts (truncating)."""
    return (v.float().view(torch.int32) & -65536).view(torch.float32)


def round_bf16(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 as a GPU casts (nearest even)."""
    return v.bfloat16().float()


def colq(v: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """v [N, F] fp32 as e4m3 with one scale per column (448 / amax, 1 where amax is 0), and
    back: the values the FP8 weight-gradient tiles multiply."""
    inv = torch.where(amax == 0, torch.ones_like(amax), 448.0 / amax)
    return (v * inv).to(torch.float8_e4m3fn).float() / inv


def wgrad_of_fp8_columns(saved, pre_LPF: torch.Tensor, x: torch.Tensor, dy: torch.Tensor,
                         p: torch.Tensor, L: int, E: int, K: int, S: int, BM: int, I: int,
                         cast: Callable[[torch.Tensor], torch.Tensor] = round_bf16) -> tuple:
    """(dW_gate_up [L*E, H, 2I] canonical, dW_down [L*E, I, H], shared dW_gate_up [H, 2I],
    shared dW_down [I, H]) from the FP8 operands the kernel builds: x and dY scaled per
    column over every token; r h (from the forward's bf16 pre-activations ``pre_LPF``, the
    interleaved layout, cast to bf16 by ``cast``) and the backward's bf16 dG/dU rows (left in
    ``saved.pre_LPF``) per column over the expert's rows. BM: the forward's row blocks (the
    schedule's ``group_LB`` names their groups); the shared expert summed over the loopback
    ranks; products in fp32."""
    st = saved.schedule.tensors
    H, dev = x.shape[1], x.device
    gx, gdy = x.float().abs().amax(0), dy.float().abs().amax(0)
    dw1 = torch.zeros(L * E, H, 2 * I, device=dev)
    dw2 = torch.zeros(L * E, I, H, device=dev)
    dws1, dws2 = torch.zeros(H, 2 * I, device=dev), torch.zeros(I, H, device=dev)
    for lr in range(L):
        total = int(st.total_L[lr])
        rows = torch.arange(total, device=dev)
        slot_P = st.src_LP[lr, :total].long()
        group_P = st.group_LB[lr, rows // BM].long()
        for g in range(E + 1):
            mine = rows[(slot_P >= 0) & (group_P == g)]
            if mine.numel() == 0:
                continue
            slot = slot_P[mine]
            tok, k = slot // S, slot % S
            r = torch.where(k < K, p[tok, k.clamp_max(K - 1)].float(),
                            torch.ones(len(mine), device=dev))
            pre = pre_LPF[lr, mine].float()  # interleaved: gate c, up c
            gate, up = pre[:, 0::2], pre[:, 1::2]
            rh = cast(gate * (1.0 / (1.0 + torch.exp(-gate))) * up * r[:, None])
            dgu = saved.pre_LPF[lr, mine].float()
            rhq, dguq = colq(rh, rh.abs().amax(0)), colq(dgu, dgu.abs().amax(0))
            d2 = rhq.T @ colq(dy[tok].float(), gdy)
            d1 = colq(x[tok].float(), gx).T @ dguq
            d1 = torch.cat([d1[:, 0::2], d1[:, 1::2]], 1)
            if g == E:
                dws1 += d1
                dws2 += d2
            else:
                dw1[lr * E + g], dw2[lr * E + g] = d1, d2
    return dw1, dw2, dws1, dws2
