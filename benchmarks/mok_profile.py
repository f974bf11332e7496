"""One profiled forward of the mok megakernel (and, for comparison, torch._grouped_mm on the
same rows) for Nsight Compute: where the GEMM time goes (tensor-pipe, L2 and DRAM throughput,
warp stalls). Warm-up calls run first; only the calls between cudaProfilerStart/Stop are seen.

    ncu --clock-control none --profile-from-start off \\
        --kernel-name regex:'mok_forward|device_kernel|gemm|Gemm' \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        --section WarpStateStats --csv --page raw \\
        python benchmarks/mok_profile.py --config '{"gate_up_interleaved": true}' > prof.csv

torch's grouped GEMM on Hopper is a CUTLASS 3 kernel (ATen's GroupMM.cu), named
``cutlass::device_kernel<...>``; ``gemm|Gemm`` alone catches only its ``prepare_grouped_gemm``
helpers.

Legend: T tokens, E experts, H hidden, I intermediate, K top-k (no shared expert: the
48 x 16384 point of the one-GPU sweeps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from mok_device_check import make_layer  # noqa: E402

import mok_kernels as mk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--config", default="{}", help="MoKConfig overrides as JSON")
    ap.add_argument("--no-grouped-mm", action="store_true")
    args = ap.parse_args()
    T, E, H, I, K = args.tokens, args.experts, 7168, 2048, 8
    x, idx, p, (w1, w2, _, _) = make_layer(T, H, I, E, K)
    over = {"minibatch": 4096, "macrobatch": 3 * 4096, "tma": True, **json.loads(args.config)}
    cfg = mk.MoKConfig.for_shape(H, I, **over)
    w1k = mk.interleave_gate_up(w1) if cfg.gate_up_interleaved else w1
    ws = mk.get_workspace(cfg, tokens=T, hidden=H, intermediate=I, local_experts=E, topk=K,
                          shared=False, device="cuda")

    def mok():
        return mk.forward(cfg, ws, mk.build_schedule(ws, idx), x, p, w1k, w2)

    flat = idx.reshape(-1)
    xs = x[torch.argsort(flat, stable=True) // K]
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).int()
    w1c, w2c = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))

    def grouped_mm():
        h = torch._grouped_mm(xs, w1c, offs=offs)
        return torch._grouped_mm(torch.nn.functional.silu(h[:, :I]) * h[:, I:], w2c, offs=offs)

    for _ in range(2):
        mok()
        grouped_mm()
    torch.cuda.synchronize()
    mk.check_errors(ws)
    torch.cuda.cudart().cudaProfilerStart()
    mok()
    if not args.no_grouped_mm:
        grouped_mm()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", cfg)


if __name__ == "__main__":
    main()
