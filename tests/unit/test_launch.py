"""The launcher without launching: where a cell runs in a multi-node launch, the torchrun
command, which nodes take no part, and the crash reason read from a cell's log."""

from __future__ import annotations

import pytest

from mokbench.errors import InputError
from mokbench.launch import (
    CellRunner,
    LaunchOptions,
    _tail,
    placement_reason,
    takes_part,
    torchrun_command,
)
from mokbench.scenario import Scenario, preset
from mokbench.sweep import Cell


def _cell(world_size: int) -> Cell:
    shape = preset("kimi-k2")  # 384 experts: divisible by every world size used here
    return Cell(Scenario(shape, 64, world_size), "nccl_torch")


def _opts(node_rank: int = 0, nnodes: int = 18, nproc: int = 4) -> LaunchOptions:
    return LaunchOptions(nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank,
                         rdzv_endpoint="node-a:29500")


def test_ep64_on_18_nodes_of_4_runs_on_the_first_16():
    cell = _cell(64)
    assert placement_reason(cell, _opts()) is None
    cmd = torchrun_command(cell, "c.json", _opts(node_rank=3), index=33)
    assert "--nnodes=16" in cmd and "--node-rank=3" in cmd and "--nproc-per-node=4" in cmd
    assert "--master-addr=node-a" in cmd and "--master-port=29501" in cmd
    assert [takes_part(cell, _opts(node_rank=i)) for i in (0, 15, 16, 17)] == [
        True, True, False, False]


def test_small_cells_run_on_node_0_alone():
    cell = _cell(2)
    assert placement_reason(cell, _opts()) is None
    assert "--standalone" in torchrun_command(cell, "c.json", _opts())
    assert takes_part(cell, _opts(node_rank=0)) and not takes_part(cell, _opts(node_rank=1))


@pytest.mark.parametrize("ws, needle", [(6, "neither <= nor a multiple of nproc-per-node 4"),
                                        (96, "world size 96 > nnodes x nproc-per-node (18 x 4)")])
def test_cells_that_do_not_fit(ws, needle):
    assert needle in placement_reason(_cell(ws), _opts())


def test_a_node_without_a_part_writes_and_launches_nothing(tmp_path):
    runner = CellRunner(tmp_path, "run", _opts(node_rank=17))
    assert runner.run(_cell(64), 0) == []
    assert not (tmp_path / "rows.jsonl").exists() and not list(tmp_path.glob("cells/*"))


@pytest.mark.parametrize("kwargs, needle", [
    ({"nproc_per_node": True}, "nproc_per_node=True"),
    ({"nnodes": 2, "node_rank": 2}, "node_rank=2 is invalid: allowed 0..nnodes-1 (0..1)"),
    ({"timeout_s": float("nan")}, "timeout_s=nan"),
    ({"rdzv_endpoint": "h:65535"}, "rdzv_endpoint='h:65535'"),
    ({"rdzv_endpoint": ":29500"}, "rdzv_endpoint=':29500'"),
    ({"parallel": 0}, "parallel=0 is invalid: allowed a positive integer"),
    ({"parallel": 3, "gpus_on_node": 2}, "parallel=3 is invalid: allowed 1..2 (the GPUs of "
                                         "this node)"),
    ({"parallel": 2, "nnodes": 2}, "parallel=2 is invalid with nnodes 2: allowed 1"),
])
def test_launch_options_check_themselves(kwargs, needle):
    with pytest.raises(InputError) as e:
        LaunchOptions(**kwargs)
    assert needle in str(e.value)


# The end of a real cell log (torch 2.x, gloo): the workers' traceback, then torchrun's.
CRASH_LOG = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "mokbench/worker.py", line 123, in run_cell
[rank1]:     reason = backend.unavailable_reason(ctx, scenario)
[rank1]: RuntimeError: Connection closed by peer
[rank0]: Traceback (most recent call last):
[rank0]:   File "mokbench/worker.py", line 123, in run_cell
[rank0]: ValueError: weights of expert 3 are {odd}
E1130 13:14:28.212000 3810 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 3841)
Traceback (most recent call last):
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
mokbench.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 3842)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_13:14:28
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : {code} (pid: 3841)
  error_file: <N/A>
============================================================
"""


def test_crash_reason_is_the_root_cause_ranks_own_exception():
    assert _tail(CRASH_LOG.replace("{code}", "1")) == "ValueError: weights of expert 3 are {odd}"


def test_crash_reason_of_a_killed_rank():
    log = "\n".join(ln for ln in CRASH_LOG.splitlines() if not ln.startswith("[rank"))
    assert _tail(log.replace("{code}", "-9")) == "rank 0 was killed by SIGKILL"


def test_run_folder_records_the_backends_filter(tmp_path):
    """env.json keeps the run's --backends list (the report's "Not run" section tells the cells
    it left out from the cells the sweep stopped before); without the flag there is none."""
    from mokbench import runner
    from mokbench.results import read_env

    data = {"name": "t", "backends": ["nccl_torch", "mok"], "world_sizes": [1],
            "scenarios": [{"preset": "kimi-k2", "num_experts": 8, "tokens_per_rank": [64]}]}
    opts = runner._options(1, 1, 0, "localhost:29500", 60.0, "cpu")
    sw = runner._load(None, data, opts, ["nccl_torch"])
    assert [c.backend for c in sw.cells] == ["nccl_torch"]
    run = runner._prepare_run_dir(sw, tmp_path / "a", None, opts, ["nccl_torch"])
    assert read_env(run)["backends"] == ["nccl_torch"]
    run = runner._prepare_run_dir(sw, tmp_path / "b", None, opts)
    assert "backends" not in read_env(run)


def test_exit_text_names_a_signal_from_outside():
    """A launcher killed by a signal (negative return code) is named as such in a row's
    reason, so a cell stopped by hand does not read as the backend's own failure."""
    from mokbench.launch import exit_text

    assert exit_text(1) == "exit code 1"
    assert exit_text(0) == "exit code 0"
    assert exit_text(-15) == "killed by SIGTERM from outside the harness (exit code -15)"
    assert exit_text(-9) == "killed by SIGKILL from outside the harness (exit code -9)"
    assert exit_text(-200) == "killed by signal 200 from outside the harness (exit code -200)"


def test_parallel_cells_get_the_gpus_cuda_visible_devices_names(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert LaunchOptions(gpus_on_node=3, parallel=3).gpu_ids() == ["4", "5", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert LaunchOptions(gpus_on_node=2, parallel=2).gpu_ids() == ["0", "1"]
    assert LaunchOptions(gpus_on_node=2, device="cpu", parallel=8).gpu_ids() == []
