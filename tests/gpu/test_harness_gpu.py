"""GPU tier of the harness: the embedded default sweep over NCCL with nccl_torch, and the
reference check of nccl_torch on the GPU (run on the GPU machine; skipped elsewhere)."""

import pytest
import torch

from mokbench.backend import RunContext, get_backend
from mokbench.check import check_backward, check_forward
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.results import read_rows
from mokbench.scenario import Scenario, preset
from tests.distributed.helpers import mokbench, only_run_dir

pytestmark = pytest.mark.gpu


def test_default_sweep_nccl_torch_on_all_gpus(tmp_path):
    r = mokbench("sweep", "--backends", "nccl_torch", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")
    assert rows and all(x["status"] == "ok" for x in rows), [x["reason"] for x in rows]
    assert {x["world_size"] for x in rows} == {torch.cuda.device_count()}
    assert all(x["gpu_name"] != "cpu" and x["device"] == "cuda" for x in rows)


def test_nccl_torch_grouped_mm_matches_reference_on_gpu():
    dev = torch.device("cuda")
    s = Scenario(preset("qwen3-30b-a3b"), 512, 1, routing="imbalanced")
    w, inp = make_weights(s, 0, dev), make_inputs(s, 0, dev)
    ref = reference_layer(inp, w)
    b = get_backend("nccl_torch")
    b.setup(s, RunContext(device=dev), w)
    x = inp.x_TH.clone().requires_grad_()
    p = inp.topk_weights_TK.clone().requires_grad_()
    y = b.forward(x, inp.topk_idx_TK, p)
    assert check_forward(y, ref, "bf16").ok
    y.backward(inp.dy_TH)
    res = check_backward(x.grad, p.grad, b.weight_grads(), ref, "bf16")
    assert res.ok, res.reason()
