"""Per-rank entry point of one cell (one scenario x one backend), started by torchrun.

    python -m torch.distributed.run ... -m mokbench.worker --cell CELL.json

Every rank: builds the seeded weights and inputs, computes the float32 reference, sets the backend
up, checks each pass against the reference, then times it (mokbench.timing). Rank 0 writes one
result file per pass next to the cell file (``<stem>.<pass>.json``) as soon as that pass is done,
so a crash later in the cell keeps the earlier pass. The launcher turns those files into rows.
A Python exception in a pass becomes that pass's "failed" result; the next pass still runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mokbench.backend import RunContext, backend_options, get_backend
from mokbench.check import check_backward, check_forward
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.routing import expert_load_E, load_imbalance
from mokbench.scenario import Scenario
from mokbench.timing import time_pass


def init_context() -> RunContext:
    """Process group from torchrun's environment: NCCL on GPUs, gloo on CPU."""
    use_cuda = torch.cuda.is_available() and os.environ.get("MOKBENCH_DEVICE", "") != "cpu"
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=float(os.environ.get("MOKBENCH_PG_TIMEOUT_S", 600)))
    kwargs = {"device_id": device} if use_cuda else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return RunContext(rank, world, local, device, dist.group.WORLD, backend)


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in msg.lower():
        msg = "out of memory: " + msg
    return msg[:500]


def _write(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, default=str))
    os.replace(tmp, path)


def run_pass(pass_: str, backend, scenario: Scenario, ctx: RunContext, inputs, ref) -> dict:
    """Check, then time, one pass. Returns the pass's result fields."""
    T = scenario.timing
    x = inputs.x_TH.detach().clone().requires_grad_(True)
    p = inputs.topk_weights_TK.detach().clone().requires_grad_(True)
    idx = inputs.topk_idx_TK
    if hasattr(backend, "poison"):
        backend.poison()
    y = backend.forward(x, idx, p)
    if pass_ == "forward":
        chk = check_forward(y, ref, scenario.precision)
    else:
        backend.zero_grad()
        y.backward(inputs.dy_TH)
        chk = check_backward(x.grad, p.grad, backend.weight_grads(), ref, scenario.precision)
    del y
    out = {"max_abs_err": chk.max_abs_err, "max_rel_err": chk.max_rel_err,
           "worst_tensor": chk.worst}
    if hasattr(backend, "check"):
        backend.check()
    if not chk.ok:
        return {**out, "status": "failed", "reason": "correctness: " + chk.reason()}

    if pass_ == "forward":
        stats = time_pass(lambda: backend.forward(x, idx, p), None, warmup=T.warmup,
                          iters=T.iters, device=ctx.device, group=ctx.group)
    else:
        holder: dict = {}

        def prepare() -> None:
            backend.zero_grad()
            x.grad = p.grad = None
            holder["y"] = backend.forward(x, idx, p)

        def body() -> None:
            holder.pop("y").backward(inputs.dy_TH)

        stats = time_pass(body, prepare, warmup=T.warmup, iters=T.iters, device=ctx.device,
                          group=ctx.group)
    if hasattr(backend, "check"):
        backend.check()
    tflops = scenario.flops(pass_) / (stats.median_ms * 1e-3) / 1e12
    return {**out, **stats.to_dict(), "status": "ok", "reason": "", "tflops": tflops}


def run_cell(cell: dict, cell_path: Path) -> None:
    scenario = Scenario.from_dict(cell["scenario"])
    ctx = init_context()
    ctx.extra["options"] = backend_options(cell["backend"])
    stem = cell_path.with_suffix("")
    backend = get_backend(cell["backend"])
    extra = {"variant": getattr(backend, "variant", "")}  # completed after setup

    def emit(pass_: str, result: dict) -> None:
        if ctx.rank == 0:
            _write(Path(f"{stem}.{pass_}.json"), {**extra, **result})

    reason = backend.unavailable_reason(ctx, scenario)
    passes = [p for p in scenario.passes if p in backend.capabilities.passes]
    for p in scenario.passes:
        if reason or p not in passes:
            emit(p, {"status": "skipped",
                     "reason": reason or f"{backend.name} has no {p} pass yet"})
    if reason or not passes:
        return
    weights = make_weights(scenario, ctx.rank, ctx.device)
    inputs = make_inputs(scenario, ctx.rank, ctx.device)
    ref = reference_layer(inputs, weights, rank=ctx.rank, group=ctx.group,
                          backward="backward" in passes)
    load = load_imbalance(expert_load_E(inputs.topk_idx_TK, scenario.shape.num_experts))
    try:
        backend.setup(scenario, ctx, weights)
        extra.update(variant=getattr(backend, "variant", ""), load_imbalance=load)
    except Exception as exc:  # noqa: BLE001 - any setup error is this cell's failure
        traceback.print_exc()
        for p in passes:
            emit(p, {"status": "failed", "reason": "setup: " + _error_text(exc)})
        return
    del weights
    gc.collect()
    for p in passes:
        try:
            emit(p, run_pass(p, backend, scenario, ctx, inputs, ref))
        except Exception as exc:  # noqa: BLE001 - a failing pass is recorded, the cell goes on
            traceback.print_exc()
            emit(p, {"status": "failed", "reason": _error_text(exc)})
            if ctx.is_cuda:
                torch.cuda.empty_cache()
    backend.teardown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="mokbench worker (one cell, one rank)")
    ap.add_argument("--cell", required=True, type=Path, help="cell JSON written by the launcher")
    args = ap.parse_args(argv)
    cell = json.loads(args.cell.read_text())
    try:
        run_cell(cell, args.cell)
        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
