"""GPU tier of the harness: the embedded default sweep over NCCL with nccl_torch, and the
reference check of nccl_torch on the GPU (run on the GPU machine; skipped elsewhere)."""

import pytest
import torch

from mokbench.results import read_rows
from mokbench.scenario import Scenario, preset
from tests.distributed.helpers import mokbench, only_run_dir
from tests.layer_check import check_single_rank

pytestmark = pytest.mark.gpu


def test_default_sweep_nccl_torch_on_all_gpus(tmp_path):
    r = mokbench("sweep", "--backends", "nccl_torch", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")
    assert rows and all(x["status"] == "ok" for x in rows), [x["reason"] for x in rows]
    assert {x["world_size"] for x in rows} == {torch.cuda.device_count()}
    assert all(x["gpu_name"] != "cpu" and x["device"] == "cuda" for x in rows)
    assert {x["pass"] for x in rows} == {"forward", "backward", "inference"}
    # Peak GPU memory per pass: at least what was resident at its start, and something.
    assert all(x["peak_mem_bytes"] >= x["start_mem_bytes"] > 0 for x in rows)


def test_nccl_torch_grouped_mm_matches_reference_on_gpu():
    s = Scenario(preset("qwen3-30b-a3b"), 512, 1, routing="imbalanced")
    res = check_single_rank("nccl_torch", s, torch.device("cuda"))
    assert res.forward.ok, res.forward.reason()
    assert res.backward.ok, res.backward.reason()


PARALLEL_SWEEP = """
name = "parallel-gpus"
backends = ["nccl_torch"]
world_sizes = [1]
[timing]
warmup = 1
iters = 3
[[scenarios]]
preset = "tiny"
tokens_per_rank = [64, 128, 256, 512]
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (--parallel 2)")
def test_parallel_cells_each_get_a_gpu_of_their_own(tmp_path):
    """--parallel 2 on a node of two or more GPUs: four one-GPU cells in one run folder, every
    row ok, each cell on one GPU named in cell_gpus, both GPUs used."""
    f = tmp_path / "s.toml"
    f.write_text(PARALLEL_SWEEP)
    r = mokbench("sweep", str(f), "--parallel", "2", "--out", str(tmp_path / "out"),
                 env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")
    assert len(rows) == 12 and all(x["status"] == "ok" for x in rows), rows
    assert all(x["parallel_cells"] == 2 and x["cell_gpus"] in ("0", "1") for x in rows)
    assert {x["cell_gpus"] for x in rows} == {"0", "1"}
