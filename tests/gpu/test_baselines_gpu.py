"""GPU tier for the library baselines: TransformerEngine (``te``) and Megatron-Core
(``megatron_alltoall``) each run a small sweep through the real torchrun path, bf16 and fp8,
and must pass the reference check forward and backward. Skipped where the library is missing.
TE runs 1000 tokens (its shared expert pads them to 1008 for the block-scaled fp8 GEMMs);
Megatron, which does not pad the shared expert, 1008 (1000 is skipped there with the reason,
tests/unit/test_baselines_megatron.py)."""

import pytest
import torch

from mokbench.results import read_rows
from tests.distributed.helpers import mokbench, only_run_dir

pytestmark = pytest.mark.gpu

SWEEP = """
name = "library-baselines"
backends = ["te", "megatron_alltoall"]
world_sizes = [1]

[timing]
warmup = 1
iters = 3

[[scenarios]]
preset = "qwen3-30b-a3b"
num_experts = 16
tokens_per_rank = [{tokens}]
precision = ["bf16", "fp8"]
routing = ["imbalanced"]
"""


@pytest.mark.parametrize("backend, module, tokens", [("te", "transformer_engine", 1000),
                                                     ("megatron_alltoall", "megatron.core", 1008)])
def test_library_baseline_passes_check(tmp_path, backend, module, tokens):
    pytest.importorskip("transformer_engine")
    pytest.importorskip(module)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP.replace("{tokens}", str(tokens)))
    r = mokbench("sweep", str(sweep), "--backends", backend, "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")
    by = {(x["precision"], x["pass"]): x for x in rows}
    fp8_runs = torch.cuda.get_device_capability()[0] in (9, 10)
    for precision in ("bf16", "fp8") if fp8_runs else ("bf16",):
        for p in ("forward", "backward"):
            row = by[(precision, p)]
            assert row["status"] == "ok", (precision, p, row["reason"])
            assert row["max_rel_err"] < (1e-2 if precision == "bf16" else 1e-1), row
