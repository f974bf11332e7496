"""``mokbench sweep --parallel N`` without launching: which GPUs each cell gets, that cells
running at the same time never share one, that sweep order is kept, and that two sweeps of
the same name started in the same second get run folders of their own."""

from __future__ import annotations

import threading
import time

from mokbench.cellpool import run_parallel
from mokbench.launch import LaunchOptions
from mokbench.runner import _new_folder
from mokbench.scenario import Scenario, preset
from mokbench.sweep import Cell


class _FakeRunner:
    """Records (start, end, gpus) of each cell instead of launching it."""

    def __init__(self) -> None:
        self.spans: dict[int, tuple[float, float, tuple[str, ...]]] = {}
        self.lock = threading.Lock()

    def run(self, cell, index, gpus=None):
        t0 = time.monotonic()
        time.sleep(0.2 + 0.1 * (index % 2))
        with self.lock:
            self.spans[index] = (t0, time.monotonic(), gpus or ())
        return [{"index": index}]

    def stop_all(self) -> None:
        pass


def _cells(world_sizes):
    shape = preset("kimi-k2")
    return [(i, Cell(Scenario(shape, 64, w), "nccl_torch")) for i, w in enumerate(world_sizes)]


def test_parallel_cells_never_share_a_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    opts = LaunchOptions(nproc_per_node=4, gpus_on_node=4, parallel=4)
    runner, order = _FakeRunner(), []
    sizes = [1, 1, 2, 4, 1, 2, 1, 1, 8]  # 8 > 4 GPUs: placed as a skip (runner.run decides)
    run_parallel(runner, _cells(sizes), opts, lambda c: order.append(id(c)),
                  lambda c, rows: None)
    assert sorted(runner.spans) == list(range(len(sizes)))
    for i, w in enumerate(sizes):
        gpus = runner.spans[i][2]
        assert len(gpus) == (w if w <= 4 else 0) and set(gpus) <= {"0", "1", "2", "3"}
    for i in runner.spans:  # overlapping in time => disjoint GPUs
        for j in runner.spans:
            (a0, a1, ga), (b0, b1, gb) = runner.spans[i], runner.spans[j]
            if i < j and a0 < b1 and b0 < a1:
                assert not set(ga) & set(gb), (i, j, ga, gb)
    starts = [runner.spans[i][0] for i in range(len(sizes))]
    assert starts == sorted(starts), "cells start in sweep order"
    assert runner.spans[3][0] >= max(runner.spans[i][1] for i in (0, 1, 2)) - 1e-3, \
        "the 4-GPU cell waits for every GPU"


def test_parallel_on_cpu_runs_n_cells_at_once():
    opts = LaunchOptions(nproc_per_node=2, device="cpu", parallel=3)
    runner, rows = _FakeRunner(), []
    run_parallel(runner, _cells([2] * 7), opts, lambda c: None,
                  lambda c, r: rows.extend(r))
    assert sorted(r["index"] for r in rows) == list(range(7))
    spans = runner.spans.values()
    most = max(sum(1 for b0, b1, _ in spans if b0 <= a0 < b1) for a0, _, _ in spans)
    assert most == 3 and all(g == () for _, _, g in spans)


def test_same_second_sweeps_get_their_own_folders(tmp_path):
    first = _new_folder(tmp_path / "20261130-234427-h200-fp8")
    second = _new_folder(tmp_path / "20261130-234427-h200-fp8")
    assert (first.name, second.name) == ("20261130-234427-h200-fp8",
                                         "20261130-234427-h200-fp8-2")
    assert first.is_dir() and second.is_dir()
