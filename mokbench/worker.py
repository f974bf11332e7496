"""Per-rank entry point of one cell (one scenario x one backend), started by torchrun.

    python -m torch.distributed.run ... -m mokbench.worker --cell CELL.json

Every rank: builds the seeded weights and inputs, computes the float32 reference, sets the backend
up, checks each pass against the reference, then times it (mokbench.timing). Passes: forward (a
training forward: autograd on, inputs require grad), backward, inference (the forward under
``torch.no_grad()``); see :func:`run_pass`. Rank 0 writes one
result file per pass next to the cell file (``<stem>.<pass>.json``) as soon as that pass is done,
so a crash later in the cell keeps the earlier pass. The launcher turns those files into rows.
A Python exception in a pass becomes that pass's "failed" result; the next pass still runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
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


def _pass_inputs(pass_: str, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """x and the router weights as a pass takes them: fresh leaves that require grad for the
    training passes (forward, backward), so each backend keeps what its backward needs; plain
    tensors that do not for inference."""
    train = pass_ != "inference"
    x = inputs.x_TH.detach().clone().requires_grad_(train)
    p = inputs.topk_weights_TK.detach().clone().requires_grad_(train)
    return x, p


def _grad_mode(pass_: str):
    """Autograd on for the training passes, ``torch.no_grad()`` for inference."""
    return torch.no_grad() if pass_ == "inference" else torch.enable_grad()


def _check_pass(pass_: str, backend, x, idx, p, inputs, ref, precision: str) -> dict:
    """One untimed run of the pass against the reference. Forward and inference check y;
    backward checks dx, the router-weight gradient and the weight gradients; step checks y,
    then the gradients (its errors: the larger of the two). The forward row also says whether
    y kept an autograd graph (``keeps_graph``)."""
    if hasattr(backend, "poison"):
        backend.poison()
    with _grad_mode(pass_):
        y = backend.forward(x, idx, p)
    extra = {"keeps_graph": bool(y.requires_grad)} if pass_ == "forward" else {}
    if pass_ in ("backward", "step"):
        fwd = check_forward(y, ref, precision) if pass_ == "step" else None
        backend.zero_grad()
        y.backward(inputs.dy_TH)
        chk = check_backward(x.grad, p.grad, backend.weight_grads(), ref, precision, fwd)
    else:
        chk = check_forward(y, ref, precision)
    del y
    out = {"max_abs_err": chk.max_abs_err, "max_rel_err": chk.max_rel_err,
           "worst_tensor": chk.worst, **extra}
    if not chk.ok:
        out.update(status="failed", reason="correctness: " + chk.reason())
    return out


def _time_body(pass_: str, backend, x, idx, p, dy) -> tuple[Callable, Callable | None]:
    """(timed body, untimed prepare) of a pass. Forward: the training forward with autograd
    on (the graph it builds is dropped after each iteration). Inference: the same call under
    ``torch.no_grad()``. Backward: ``y.backward(dy)`` after an untimed training forward.
    Step: the training forward and ``y.backward(dy)`` in one timed body, gradients cleared
    before each (untimed), as before each backward."""
    def clear() -> None:  # gradients of the iteration before
        backend.zero_grad()
        x.grad = p.grad = None

    if pass_ == "step":
        def step() -> None:
            with _grad_mode(pass_):
                backend.forward(x, idx, p).backward(dy)

        return step, clear
    if pass_ != "backward":
        def forward() -> None:
            with _grad_mode(pass_):
                backend.forward(x, idx, p)

        return forward, None
    holder: dict = {}

    def prepare() -> None:
        clear()
        holder["y"] = backend.forward(x, idx, p)

    def body() -> None:
        holder.pop("y").backward(dy)

    return body, prepare


def _memory_start(ctx: RunContext) -> int | None:
    """Reset the peak counter; bytes allocated now on this GPU (None on CPU)."""
    if not ctx.is_cuda:
        return None
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def _memory_peak(ctx: RunContext, start: int | None) -> dict:
    """Peak bytes allocated during the pass (torch.cuda.max_memory_allocated since the reset;
    it includes what was resident at the start: weights, inputs, the reference) and the bytes
    at its start, each the maximum over ranks; None on CPU."""
    if start is None:
        return {"peak_mem_bytes": None, "start_mem_bytes": None}
    t = torch.tensor([torch.cuda.max_memory_allocated(ctx.device), start], device=ctx.device,
                     dtype=torch.int64)
    if ctx.group is not None and ctx.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return {"peak_mem_bytes": int(t[0]), "start_mem_bytes": int(t[1])}


def run_pass(pass_: str, backend, scenario: Scenario, ctx: RunContext, inputs, ref) -> dict:
    """Check, then time, one pass. Returns the pass's result fields.

    forward (training): inputs require grad, autograd on, the backend keeps what its backward
    needs. inference: the forward under ``torch.no_grad()`` on inputs without grad; checked
    against the reference y like the forward. backward: timed after an untimed forward.
    step: the training forward and its backward timed together (y and the gradients checked).
    """
    T = scenario.timing
    x, p = _pass_inputs(pass_, inputs)
    idx = inputs.topk_idx_TK
    mem0 = _memory_start(ctx)
    out = _check_pass(pass_, backend, x, idx, p, inputs, ref, scenario.precision)
    if hasattr(backend, "check"):
        backend.check()
    if out.get("status") == "failed":
        return out
    body, prepare = _time_body(pass_, backend, x, idx, p, inputs.dy_TH)
    stats = time_pass(body, prepare, warmup=T.warmup, iters=T.iters, device=ctx.device,
                      group=ctx.group)
    if hasattr(backend, "check"):
        backend.check()
    tflops = scenario.flops(pass_) / (stats.median_ms * 1e-3) / 1e12
    return {**out, **stats.to_dict(), **_memory_peak(ctx, mem0), "status": "ok", "reason": "",
            "tflops": tflops}


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
    passes = [p for p in scenario.passes if backend.capabilities.runs(p)]
    for p in scenario.passes:
        if reason or p not in passes:
            emit(p, {"status": "skipped",
                     "reason": reason or f"{backend.name} has no {p} pass yet"})
    if reason or not passes:
        return
    weights = make_weights(scenario, ctx.rank, ctx.device)
    inputs = make_inputs(scenario, ctx.rank, ctx.device)
    ref = reference_layer(inputs, weights, rank=ctx.rank, group=ctx.group,
                          backward="backward" in passes or "step" in passes)
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


def _leave() -> None:
    """End the worker process after a finished cell without running C++ static destructors:
    at interpreter exit a process-group thread can abort the process ("terminate called
    without an active exception", SIGABRT) after every result is written and the group is
    destroyed, which torchrun then reports as this rank's failure and which leaves the other
    nodes' agents waiting at their exit barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _leave()
