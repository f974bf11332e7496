"""Workspaces: the symmetric buffers of an EP group (or their loopback stand-ins), the ring,
the counters and error words, allocated once per (group, shapes, config) and reused.

Legend: L logical ranks in one launch (1 in real EP, R in loopback), R EP ranks, T tokens per
rank, H hidden, I intermediate, K top-k, S = K (+1 with the shared expert) combine slots per
token, E local experts, P schedule rows, Q ring rows (macrobatch), MB minibatch.

Symmetric (peer-visible) per rank: x [T, H] bf16 (its tokens, read by dispatch), idx [T, K]
int32 (its routing, read by every rank's schedule) and comb [T, S, H] bf16 (written by the
ranks that ran its tokens' experts). In real EP they are carved out of one
``torch.distributed._symmetric_memory`` buffer (empty + rendezvous once). In loopback they are
one local [R, ...] allocation each, and the peer tables point into it; the kernel is the same.

Kept for a later backward: the schedule (row -> source rank, token, k and the group of every
row block) stays in the workspace and serves both directions: pull reverse-combine reads dy
rows in the same order dispatch pulled x rows, and push reverse-dispatch writes dx rows to
the same (rank, token) slots; counters and error words are reused with the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mok_kernels._details.config import MoKConfig
from mok_kernels._details.schedule import ScheduleTensors, schedule_capacity

_ALIGN = 1024  # bytes between carved symmetric buffers


@dataclass(eq=False)
class Workspace:
    """Buffers of one EP rank (or of R loopback ranks). Create with :func:`get_workspace`."""

    config: MoKConfig
    L: int
    R: int
    rank_base: int
    T: int
    H: int
    I: int
    E: int
    K: int
    shared: bool
    P: int
    Q: int
    device: torch.device
    x_LTH: torch.Tensor
    idx_LTK: torch.Tensor
    comb_LTSH: torch.Tensor
    x_tab_R: torch.Tensor  # int64 element offsets of each rank's x from x_LTH
    comb_tab_R: torch.Tensor  # int64 element offsets of each rank's comb from comb_LTSH
    idx_views_R: list[torch.Tensor]  # each rank's idx [T, K] (peer views in real EP)
    ring_LQH: torch.Tensor
    h_LQI: torch.Tensor
    out_LQH: torch.Tensor
    counters_LC: torch.Tensor
    errors_L4: torch.Tensor
    sums_LTJ: torch.Tensor  # fused_sum: arrivals per (token, down column tile), int32
    handle: Any = None  # symmetric-memory handle (real EP) or None
    group: Any = None  # the EP process group (real EP) or None
    sched: ScheduleTensors | None = None
    extra: dict = field(default_factory=dict)

    @property
    def S(self) -> int:
        return self.K + (1 if self.shared else 0)

    @property
    def ranks_L(self) -> torch.Tensor:
        return torch.arange(self.rank_base, self.rank_base + self.L, device=self.device)

    @property
    def mmax(self) -> int:
        return self.P // self.config.minibatch

    def barrier(self) -> None:
        """Device-side barrier of the EP group (system scope); a no-op within one launch."""
        if self.handle is not None:
            self.handle.barrier(channel=0)

    def gather_idx(self) -> torch.Tensor:
        """The group's routing [N = R*T, K] int32, rank-major (peer reads in real EP)."""
        if self.handle is None:
            return self.idx_LTK.reshape(self.R * self.T, self.K)
        return torch.cat(self.idx_views_R)


_CACHE: dict[tuple, Workspace] = {}


def counters_per_rank(P: int, config: MoKConfig) -> int:
    """Ticket + 3 per-minibatch arrays + one per row block, padded to 32 words."""
    n = 1 + 3 * (P // config.minibatch) + P // config.block_m
    return -(-n // 32) * 32


def _local_buffers(config: MoKConfig, L: int, T: int, H: int, I: int, P: int, Q: int,
                   dev: torch.device) -> dict[str, torch.Tensor]:
    comm = config.fwd_comm_sms > 0
    bf = torch.bfloat16
    return {
        "ring_LQH": torch.empty((L, Q, H) if comm else (1,), dtype=bf, device=dev),
        "h_LQI": torch.empty(L, Q, I, dtype=bf, device=dev),
        "out_LQH": torch.empty((L, Q, H) if comm else (1,), dtype=bf, device=dev),
        "counters_LC": torch.zeros(L, counters_per_rank(P, config), dtype=torch.int32,
                                   device=dev),
        "errors_L4": torch.zeros(L, 4, dtype=torch.int32, device=dev),
        "sums_LTJ": torch.zeros((L, T, H // config.block_n) if config.fused_sum else (1,),
                                dtype=torch.int32, device=dev),
    }


def carve(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of buffers of ``sizes`` bytes laid one after another in one allocation,
    each aligned to 1 KiB, and the allocation's size. Every rank carves alike, so one byte
    offset between two ranks' bases serves every buffer."""
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += -(-n // _ALIGN) * _ALIGN
    return offs, pos


def _carve(T: int, H: int, K: int, S: int) -> tuple[list[int], int]:
    """Byte offsets of x, idx, comb inside one symmetric buffer, and its size."""
    return carve([T * H * 2, T * K * 4, T * S * H * 2])


def _symmetric(T: int, H: int, K: int, S: int, group: Any, dev: torch.device) -> dict:
    """Real EP: one symmetric buffer, one rendezvous; peer tables from the handle."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    offs, nbytes = _carve(T, H, K, S)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
    handle = symm_mem.rendezvous(buf, group)
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    ptrs = list(handle.buffer_ptrs)
    x = buf[offs[0]:offs[0] + T * H * 2].view(torch.bfloat16).view(1, T, H)
    idx = buf[offs[1]:offs[1] + T * K * 4].view(torch.int32).view(1, T, K)
    comb = buf[offs[2]:offs[2] + T * S * H * 2].view(torch.bfloat16).view(1, T, S, H)
    x_tab = [(p - ptrs[rank]) // 2 for p in ptrs]  # same offset inside every buffer
    views = [handle.get_buffer(r, (T, K), torch.int32, offs[1] // 4) for r in range(R)]
    return {"x_LTH": x, "idx_LTK": idx, "comb_LTSH": comb, "handle": handle, "R": R,
            "rank_base": rank, "idx_views_R": views,
            "x_tab_R": torch.tensor(x_tab, dtype=torch.int64, device=dev),
            "comb_tab_R": torch.tensor(x_tab, dtype=torch.int64, device=dev)}


def _loopback(L: int, T: int, H: int, K: int, S: int, dev: torch.device) -> dict:
    """R = L logical ranks on one GPU: their 'symmetric' buffers are slices of one tensor."""
    x = torch.empty(L, T, H, dtype=torch.bfloat16, device=dev)
    idx = torch.empty(L, T, K, dtype=torch.int32, device=dev)
    comb = torch.empty(L, T, S, H, dtype=torch.bfloat16, device=dev)
    return {"x_LTH": x, "idx_LTK": idx, "comb_LTSH": comb, "handle": None, "R": L,
            "rank_base": 0, "idx_views_R": list(idx.unbind(0)),
            "x_tab_R": torch.arange(L, device=dev, dtype=torch.int64) * (T * H),
            "comb_tab_R": torch.arange(L, device=dev, dtype=torch.int64) * (T * S * H)}


def get_workspace(config: MoKConfig, *, tokens: int, hidden: int, intermediate: int,
                  local_experts: int, topk: int, shared: bool, device: torch.device | str,
                  group: Any = None, loopback_ranks: int | None = None) -> Workspace:
    """The cached workspace for this group (or loopback size), shapes and config.

    ``group`` with more than one rank: real EP over symmetric memory (collective: every rank
    must call it). ``loopback_ranks=R``: R logical ranks on this GPU. Neither: one rank.
    """
    config.check_shape(hidden, intermediate)
    dev = torch.device(device)
    world = 1
    if group is not None:
        import torch.distributed as dist

        world = dist.get_world_size(group)
    if config.fused_sum and world > 1:
        raise ValueError(f"fused_sum=True is invalid for an EP group of {world} ranks: allowed "
                         "one process (one rank or loopback ranks)")
    if loopback_ranks is not None and world > 1:
        raise ValueError("loopback_ranks is for one process; got a group of "
                         f"{world} ranks too")
    L = loopback_ranks or 1
    key = (id(group) if world > 1 else None, L, tokens, hidden, intermediate, local_experts,
           topk, shared, str(dev), config)
    if key in _CACHE:
        return _CACHE[key]
    R = world * L
    S = topk + (1 if shared else 0)
    P = schedule_capacity(tokens, R, topk, shared, local_experts, config.row_align,
                          config.minibatch, config.capacity_mult)
    Q = config.macrobatch
    sym = (_symmetric(tokens, hidden, topk, S, group, dev) if world > 1
           else _loopback(L, tokens, hidden, topk, S, dev))
    ws = Workspace(config=config, L=L, T=tokens, H=hidden, I=intermediate, E=local_experts,
                   K=topk, shared=shared, P=P, Q=Q, device=dev, group=group if world > 1
                   else None, **sym,
                   **_local_buffers(config, L, tokens, hidden, intermediate, P, Q, dev))
    _CACHE[key] = ws
    return ws


def clear_workspace_cache() -> None:
    """Drop cached workspaces (their memory is freed when no caller holds them)."""
    _CACHE.clear()
