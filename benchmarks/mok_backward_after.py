"""Time mok's (BF16) backward after different untimed training forwards, on one GPU, in
alternating rounds, with the SM clock and power read after each timing: the check of why the
same backward kernel measured 37.186 ms after an FP8 forward at 128-row blocks and 41.736 ms
after the bf16 forward at Kimi 48 x 16384 (results/20261130-215158-h200-fp8,
results/20261130-213907-h200-bf16-train; notes/mok-kernel.md). Each backward is timed as the
harness times it (``mokbench.timing``: CUDA events around the backward alone, after an untimed
``prepare``); ``idle`` variants let the GPU sit idle for ``--idle-ms`` between the forward and
the backward (``torch.cuda._sleep``), which only a power or clock effect would reward.

    python benchmarks/mok_backward_after.py --experts 48 --tokens 16384 [--shared] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch
from bench_common import add_shape_args, cuda_ms

import mok_kernels as mk
from mokbench.mok_backend import config_from_env, default_config_fields, fp8_config_fields


def _clock_and_power(dev: torch.device) -> str:
    """SM clock (MHz) and board power (W) now, through NVML; '-' where NVML is missing."""
    try:
        return f"{torch.cuda.clock_rate(dev):5d} MHz {torch.cuda.power_draw(dev) / 1000:6.1f} W"
    except Exception:  # noqa: BLE001 - pynvml absent or unsupported: the timing still counts
        return "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--shared", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fp8-block-m", type=int, default=128,
                    help="row block of the FP8 forward (the backward's follows it)")
    ap.add_argument("--fp8-recipe", default="rowwise_all",
                    help="the FP8 forward's recipe (rowwise_all at 128 rows was the measured case)")
    ap.add_argument("--idle-ms", type=float, default=30.0)
    a = ap.parse_args()
    H, I, E, T, K = a.hidden, a.intermediate, a.experts, a.tokens, a.topk
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    base = default_config_fields(H, I, T, K, sms, 1, E)
    cfg16 = config_from_env(H, I, base)
    cfg8 = config_from_env(H, I, {**base, **fp8_config_fields(90, a.fp8_recipe)},
                           {"block_m": a.fp8_block_m, "bwd_block_m": 0})
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    p = torch.softmax(torch.randn(T, K, device=dev, generator=g), 1)
    dy = torch.randn(T, H, device=dev, generator=g).bfloat16()
    il = mk.interleave_gate_up
    w = (il((torch.randn(E, H, 2 * I, device=dev, generator=g) * H ** -0.5).bfloat16()),
         (torch.randn(E, I, H, device=dev, generator=g) * I ** -0.5).bfloat16(),
         il((torch.randn(H, 2 * I, device=dev) * H ** -0.5).bfloat16()) if a.shared else None,
         (torch.randn(I, H, device=dev) * I ** -0.5).bfloat16() if a.shared else None)
    w8 = mk.quantize_weights(cfg8, *w)
    sleep_cycles = int(a.idle_ms * 1e3 * torch.cuda.clock_rate(dev)) if a.idle_ms else 0

    def setup(cfg, fw):
        ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E,
                              topk=K, shared=a.shared, device=dev)
        held = {}

        def forward(idle: bool):
            held["ctx"] = mk.forward_train(cfg, ws, mk.build_schedule(ws, idx), x, p, *fw)[1]
            if idle:
                torch.cuda._sleep(sleep_cycles)

        def backward():
            mk.backward(cfg, ws, held.pop("ctx"), dy, *w)

        return ws, forward, backward

    cases = {}
    for name, cfg, fw in (("bf16", cfg16, w), (f"fp8 {a.fp8_recipe} {a.fp8_block_m}", cfg8, w8)):
        ws, fwd, bwd = setup(cfg, fw)
        cases[name] = (ws, fwd, bwd)
    print(f"shape H{H} I{I} E{E} T{T} k{K} shared={a.shared}; {torch.cuda.get_device_name()}")
    print(f"bf16 config {cfg16}\nfp8 config {cfg8}")
    for r in range(a.rounds):
        for name, (ws, fwd, bwd) in cases.items():
            for idle in (False, True):
                t = cuda_ms(bwd, lambda f=fwd, i=idle: f(i), warmup=a.warmup, iters=a.iters)
                mk.check_errors(ws)
                label = f"{name}{' + idle' if idle else ''}"
                print(f"round {r} backward after {label:26s} median {t.median_ms:8.3f} ms  "
                      f"p10 {t.p10_ms:8.3f}  p90 {t.p90_ms:8.3f}  {_clock_and_power(dev)}")


if __name__ == "__main__":
    main()
