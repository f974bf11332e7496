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


EP2_SWEEP = """
name = "dispatch-baselines-ep2"
backends = ["{backend}"]
world_sizes = [2]

[timing]
warmup = 1
iters = 3

[[scenarios]]
preset = "kimi-k2.7-code"
num_experts = 16
tokens_per_rank = [1024]
precision = {precisions}
routing = ["uniform", "imbalanced"]
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (EP 2)")
@pytest.mark.parametrize("backend, needs", [("deepep", ("deep_ep",)),
                                            ("hybridep_megatron",
                                             ("deep_ep", "transformer_engine", "megatron.core"))])
def test_dispatch_baseline_at_ep2_passes_check(tmp_path, backend, needs):
    """DeepEP's V1 Buffer and Megatron's flex dispatcher on HybridEP, two ranks on two GPUs,
    through the real torchrun path: every row ok and within the precision's tolerance, forward
    and backward, balanced and imbalanced routing (bf16; fp8 too on Hopper/Blackwell)."""
    for module in needs:
        pytest.importorskip(module)
    if backend == "hybridep_megatron":
        import deep_ep

        if not hasattr(deep_ep, "HybridEPBuffer"):
            pytest.skip("deep_ep has no HybridEPBuffer (build DeepEP's branch hybrid-ep)")
        from baselines.hybridep_megatron import hybridep_runtime_reason

        why = hybridep_runtime_reason()  # a static C++ runtime: run the tier with LD_PRELOAD
        if why:
            pytest.skip(why)
    fp8_runs = torch.cuda.get_device_capability()[0] in (9, 10)
    precisions = ("bf16", "fp8") if fp8_runs else ("bf16",)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(EP2_SWEEP.replace("{backend}", backend)
                     .replace("{precisions}", str(list(precisions)).replace("'", '"')))
    r = mokbench("sweep", str(sweep), "--out", str(tmp_path / "out"), "--nproc-per-node", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_rows(only_run_dir(tmp_path / "out") / "rows.jsonl")
    by = {(x["precision"], x["routing"], x["pass"]): x for x in rows}
    for precision in precisions:
        for routing in ("uniform", "imbalanced"):
            for p in ("forward", "backward"):
                row = by[(precision, routing, p)]
                assert row["status"] == "ok", (precision, routing, p, row["reason"])
                assert row["max_rel_err"] < (1e-2 if precision == "bf16" else 1e-1), row
