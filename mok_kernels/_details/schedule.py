"""The expert schedule: which (source rank, token, k) rows each local expert pulls, in order.

Pure PyTorch, the same ops on CPU and GPU, with no host synchronisation (no host reads, no
boolean-mask indexing, no ``bincount``), so it is CUDA-graph capturable and its logic is tested
on CPU.

Legend: L logical ranks built at once (1 in real EP, R in loopback), R EP ranks, T tokens per
rank, N = R*T tokens of the group, K top-k, S combine slots per token (K, plus 1 for the shared
expert), G GEMM groups per rank (E local experts, plus 1 for the shared expert), P schedule
capacity in rows, NB = P / BM row blocks.

A slot id encodes (source rank r, token t, k) as j = (r*T + t)*S + k; slot k = K (when the
shared expert is on) is the token's shared-expert slot, served by the token's own rank.
Rows of one group are consecutive in ascending slot id (= source rank, token, k order), and
each group's rows are padded to a multiple of ``align`` (BM, or a multiple of it: the
backward's row blocks, ``MoKConfig.row_align``), so a BM-row block belongs to one group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mok_kernels._details.errors import ERR_CAPACITY


@dataclass
class ScheduleTensors:
    """Device-side schedule for L logical ranks (see module legend).

    src_LP: int32 slot id of each row, -1 for padding rows.
    group_LB: int32 group (local expert; E = shared) of each BM-row block (undefined past total).
    total_L: int32 rows used (a multiple of the alignment); 0 when the capacity was exceeded.
    counts_LG: int32 real (unpadded) rows per group.
    needed_L: int32 rows the routing needed (for the capacity error message).
    first_LP: int32 row of the first schedule row of each row's token on that rank (the row
        itself where it is the first; -1 for padding rows), with ``first_rows``
        (``dispatch_dedup``), else None.
    slot_rows_LJ: int32 row of every slot (j = token * S + s over the group's N tokens; P
        where this rank does not serve it), with ``slot_rows`` (``bwd_pull_by_token``),
        else None.
    """

    src_LP: torch.Tensor
    group_LB: torch.Tensor
    total_L: torch.Tensor
    counts_LG: torch.Tensor
    needed_L: torch.Tensor
    first_LP: torch.Tensor | None = None
    slot_rows_LJ: torch.Tensor | None = None


def schedule_capacity(tokens: int, ranks: int, topk: int, shared: bool, local_experts: int,
                      block_m: int, minibatch: int, capacity_mult: float) -> int:
    """Rows P of the schedule: the worst-case routed slots (capacity_mult of all N*K), the
    shared-expert rows of this rank, per-group padding, rounded up to whole minibatches."""
    routed = -(-int(round(capacity_mult * ranks * tokens * topk * 1_000_000)) // 1_000_000)
    groups = local_experts + (1 if shared else 0)
    rows = routed + (tokens if shared else 0) + groups * (block_m - 1)
    return -(-rows // minibatch) * minibatch


def group_keys(idx_NK: torch.Tensor, ranks_L: torch.Tensor, tokens: int, local_experts: int,
               shared: bool) -> torch.Tensor:
    """Group of every slot for each logical rank: int64 [L, N*S]; G (= sentinel) where the slot
    is not served by that rank."""
    N, K = idx_NK.shape
    E = local_experts
    G = E + (1 if shared else 0)
    rank_L11 = ranks_L.view(-1, 1, 1).to(torch.int64)
    local_LNK = idx_NK.to(torch.int64).unsqueeze(0) - rank_L11 * E
    ok = (local_LNK >= 0) & (local_LNK < E)
    key = torch.where(ok, local_LNK, torch.full_like(local_LNK, G))
    if shared:
        owner_N = torch.arange(N, device=idx_NK.device) // tokens
        mine_LN1 = (owner_N.view(1, N) == ranks_L.view(-1, 1).to(torch.int64)).unsqueeze(2)
        shared_key = torch.where(mine_LN1, torch.full_like(mine_LN1, E, dtype=torch.int64),
                                 torch.full_like(mine_LN1, G, dtype=torch.int64))
        key = torch.cat([key, shared_key], dim=2)
    return key.reshape(key.shape[0], -1)


def build_schedule_tensors(idx_NK: torch.Tensor, ranks_L: torch.Tensor, *, tokens: int,
                           local_experts: int, shared: bool, block_m: int, capacity: int,
                           align: int | None = None, first_rows: bool = False,
                           slot_rows: bool = False) -> ScheduleTensors:
    """Schedule of every logical rank in ``ranks_L`` from the group's routing ``idx_NK``
    (global expert ids of all N = R*T tokens, rank-major); groups padded to ``align`` rows
    (default block_m; a multiple of it), ``group_LB`` per block_m rows; with ``first_rows``
    also ``first_LP`` (each row's token's first row on the rank: a min over its slots), with
    ``slot_rows`` ``slot_rows_LJ`` (the row of every slot)."""
    key_LJ = group_keys(idx_NK, ranks_L, tokens, local_experts, shared)
    L, J = key_LJ.shape
    G = local_experts + (1 if shared else 0)
    P, BM, dev = capacity, block_m, idx_NK.device
    # One flat stable sort (a segmented sort over dim 1 is much slower on CUDA): rank l's
    # keys are offset by l*(G+1), so each rank's J slots stay together, and within a group
    # slots keep ascending slot-id order (deterministic).
    shift_L1 = torch.arange(L, device=dev).view(L, 1) * (G + 1)
    skey, perm = torch.sort((key_LJ + shift_L1).view(-1), stable=True)
    skey_LJ = skey.view(L, J) - shift_L1
    perm_LJ = perm.view(L, J) - torch.arange(L, device=dev).view(L, 1) * J
    counts_LG1 = torch.zeros(L, G + 1, dtype=torch.int64, device=dev)
    counts_LG1.scatter_add_(1, key_LJ, torch.ones_like(key_LJ))
    counts_LG = counts_LG1[:, :G]
    A = align or BM
    padded_LG = (counts_LG + A - 1) // A * A
    pend_LG = torch.cumsum(padded_LG, 1)
    pstart_LG1 = torch.cat([pend_LG.new_zeros(L, 1), pend_LG], 1)  # start of group g; g=G unused
    start_LG1 = torch.cumsum(counts_LG1, 1) - counts_LG1
    pos_LJ = torch.arange(J, device=dev).view(1, J)
    row_LJ = torch.gather(pstart_LG1, 1, skey_LJ) + pos_LJ - torch.gather(start_LG1, 1, skey_LJ)
    needed_L = pend_LG[:, -1]
    overflow_L = needed_L > P
    dump = torch.full_like(row_LJ, P)
    row_LJ = torch.where((skey_LJ < G) & (row_LJ < P), row_LJ, dump)
    src_LP1 = torch.full((L, P + 1), -1, dtype=torch.int64, device=dev)
    src_LP1.scatter_(1, row_LJ, perm_LJ)
    block_start_LB = torch.arange(0, P, BM, device=dev).view(1, -1).expand(L, -1).contiguous()
    group_LB = torch.searchsorted(pend_LG.contiguous(), block_start_LB, right=True)
    total_L = torch.where(overflow_L, torch.zeros_like(needed_L), needed_L)
    first_LP = row_by_slot_LJ = None
    if first_rows or slot_rows:  # sorted position j's row is row_LJ[:, j] (P: not served)
        row_by_slot_LJ = torch.full_like(row_LJ, P)
        row_by_slot_LJ.scatter_(1, perm_LJ, row_LJ)  # row of slot j (sorted order undone)
    if first_rows:  # min over a token's S slots
        N = idx_NK.shape[0]
        S = J // N
        first_LN = row_by_slot_LJ.view(L, N, S).amin(2)
        src_LP = src_LP1[:, :P]
        tok_LP = torch.where(src_LP >= 0, src_LP, torch.zeros_like(src_LP)) // S
        first_LP = torch.where(src_LP >= 0, torch.gather(first_LN, 1, tok_LP),
                               torch.full_like(src_LP, -1)).to(torch.int32)
    return ScheduleTensors(
        src_LP=src_LP1[:, :P].to(torch.int32),
        group_LB=group_LB.clamp_(max=G - 1).to(torch.int32),
        total_L=total_L.to(torch.int32),
        counts_LG=counts_LG.to(torch.int32),
        needed_L=needed_L.to(torch.int32),
        first_LP=first_LP,
        slot_rows_LJ=row_by_slot_LJ.to(torch.int32) if slot_rows else None,
    )


@functools.cache
def compiled_schedule_builder():
    """``build_schedule_tensors`` through ``torch.compile`` (static shapes: compiled once per
    shape and keyword values). The same ops, so the same result bit for bit; on CUDA the ~50
    small launches become a few fused kernels plus the sort."""
    return torch.compile(build_schedule_tensors, dynamic=False)


def flag_capacity_errors(errors_L4: torch.Tensor, sched: ScheduleTensors, capacity: int
                         ) -> None:
    """Record a capacity overflow in the device error word (first error wins), no host sync."""
    over_L = (sched.needed_L > capacity) & (errors_L4[:, 0] == 0)
    errors_L4[:, 1] = torch.where(over_L, sched.needed_L, errors_L4[:, 1])
    errors_L4[:, 2] = torch.where(over_L, torch.full_like(sched.needed_L, capacity),
                                  errors_L4[:, 2])
    errors_L4[:, 0] = torch.where(over_L, torch.full_like(errors_L4[:, 0], ERR_CAPACITY),
                                  errors_L4[:, 0])
