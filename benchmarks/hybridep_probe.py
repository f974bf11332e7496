"""Does DeepEP's ``HybridEPBuffer`` construct on this machine? Two ranks, one per GPU:

    torchrun --standalone --nproc-per-node 2 benchmarks/hybridep_probe.py \
        ['{"use_shared_buffer": false}']

The optional argument is a JSON dict of constructor overrides (defaults: hidden 7168, 1024
tokens per rank, 8 local experts, bf16). Each rank prints the stage it reached; a crash in
native code is shown by faulthandler (for a native backtrace, run each rank under
``cuda-gdb -batch -ex run -ex bt --args python3 ...`` through ``torchrun --no-python``).
Rank 0 first prints the C++ runtime the process has mapped (libstdc++ and libgcc_s paths,
LD_PRELOAD, LD_LIBRARY_PATH) and the compiler that built hybrid_ep_cpp (its GCC comment):
two C++ runtimes in one process, or an extension built by a newer GCC than the loaded
libstdc++, is a known cause of crashes inside iostream code such as HybridEPBuffer's
``get_comm_id``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import sys

import torch
import torch.distributed as dist


def runtime_report(extension_path: str) -> list[str]:
    """Lines naming the C++ runtime libraries mapped into this process and the GCC versions
    recorded in ``extension_path`` (its .comment section strings)."""
    with open("/proc/self/maps") as f:
        libs = sorted({ln.split()[-1] for ln in f if re.search(r"lib(stdc\+\+|gcc_s)", ln)})
    with open(extension_path, "rb") as f:
        gcc = sorted({m.decode() for m in re.findall(rb"GCC: \([^)]*\) [0-9.]+", f.read())})
    return ([f"mapped: {lib}" for lib in libs]
            + [f"{os.path.basename(extension_path)} built by: {g}" for g in gcc]
            + [f"{v}={os.environ.get(v, '')}" for v in ("LD_PRELOAD", "LD_LIBRARY_PATH")])


def main() -> None:
    faulthandler.enable()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    kw = dict(hidden_dim=7168, max_num_of_tokens_per_rank=1024, num_local_experts=8,
              use_fp8=False)
    kw.update(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    import hybrid_ep_cpp
    from deep_ep import HybridEPBuffer

    if rank == 0:
        for line in runtime_report(hybrid_ep_cpp.__file__):
            print(0, line, flush=True)
        from baselines.hybridep_megatron import hybridep_runtime_reason

        print(0, "runtime check:", hybridep_runtime_reason() or "ok", flush=True)

    ranks = hybrid_ep_cpp.ExtendedMemoryAllocator().detect_accessible_ranks(dist.group.WORLD)
    print(rank, "ranks reachable over NVLink:", ranks, flush=True)
    print(rank, "constructing HybridEPBuffer", kw, flush=True)
    HybridEPBuffer(group=dist.group.WORLD, **kw)
    print(rank, "constructed", flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
