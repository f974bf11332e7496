"""An sbatch script that runs one sweep across several nodes: one srun task per node, each
running ``mokbench sweep`` with torchrun's multi-node arguments, all meeting at a rendezvous on
the first node of the allocation.

The sweep is read and checked first (:func:`job_nodes`): every cell's world size must fit the
allocation (W <= GPUs per node: node 0 alone; else W a multiple of GPUs per node on the first
W / G nodes), and without ``nodes`` the allocation is sized to the largest world size. The
sweep and the results folder must be on a file system every node sees; rank 0 (on the first
node) writes the rows.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

from mokbench.errors import InputError, is_int

DEFAULT_PORT = 29500
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")  # MM, HH:MM:SS, D-HH:MM:SS, ...
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_counts(**counts: int | None) -> None:
    """Node and GPU counts (None: not given) are positive integers."""
    for name, v in counts.items():
        if v is not None and (not is_int(v) or v < 1):
            raise InputError(f"{name}={v!r} is invalid: allowed a positive integer")


def _check(nodes: int, gpus_per_node: int, time: str, extra_env: dict[str, str]) -> None:
    """One-line errors naming the field and what is allowed."""
    _check_counts(nodes=nodes, gpus_per_node=gpus_per_node)
    if not isinstance(time, str) or not _TIME.match(time):
        raise InputError(f"time={time!r} is invalid: allowed HH:MM:SS, MM or D-HH:MM:SS")
    for key in extra_env:
        if not _ENV_NAME.match(key):
            raise InputError(f"extra_env key {key!r} is invalid: allowed a shell variable name")


def _check_names(**names: str | None) -> None:
    """Partition and account go into #SBATCH lines: one word each."""
    for name, v in names.items():
        if v is not None and not re.match(r"^[A-Za-z0-9_.,+-]+$", v):
            raise InputError(f"{name}={v!r} is invalid: allowed one word (letters, digits, "
                             "and . _ , + -)")


def job_nodes(sweep_file: str | Path, gpus_per_node: int, nodes: int | None = None
              ) -> tuple[int, str]:
    """Read and check the sweep; return the nodes the job takes and a note for the script.

    Without ``nodes``: the fewest nodes that hold the sweep's largest world size ("auto" world
    sizes then mean every rank of that allocation). With ``nodes``: each cell must fit it, and
    the note says which nodes idle when the largest world size needs fewer.
    """
    from mokbench.launch import multinode_reason
    from mokbench.sweep import load_sweep

    _check_counts(nodes=nodes, gpus_per_node=gpus_per_node)
    if nodes is None:
        probe = load_sweep(Path(sweep_file), auto_world=gpus_per_node)
        nodes = max(math.ceil(c.scenario.world_size / gpus_per_node) for c in probe.cells)
    cells = load_sweep(Path(sweep_file), auto_world=nodes * gpus_per_node).cells
    for cell in cells:
        reason = multinode_reason(cell.scenario.world_size, nodes, gpus_per_node)
        if reason:
            raise InputError(f"world_size={cell.scenario.world_size} of "
                             f"{cell.scenario.scenario_id} is invalid on {nodes} node(s) x "
                             f"{gpus_per_node} GPU(s): {reason}; allowed W <= GPUs per node, "
                             f"or a multiple of it up to {nodes * gpus_per_node}")
    used = max(math.ceil(c.scenario.world_size / gpus_per_node) for c in cells)
    sizes = sorted({c.scenario.world_size for c in cells})
    note = f"world sizes {', '.join(map(str, sizes))}: {len(cells)} cells"
    if used < nodes:
        note += (f"; the largest uses {used} of the {nodes} nodes, nodes {used}..{nodes - 1} "
                 "take no part")
    return nodes, note


def _sbatch_lines(nodes: int, gpus_per_node: int, partition: str | None, time: str,
                  account: str | None) -> list[str]:
    """#SBATCH directives (Slurm's log stays in the submit folder: an --output folder must
    exist before the job starts)."""
    lines = [
        "#SBATCH --job-name=mokbench",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --time={time}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    return lines


def render_sbatch(sweep_file: str | Path, nodes: int, gpus_per_node: int,
                  partition: str | None = None, time: str = "02:00:00",
                  account: str | None = None, out_dir: str | Path = "results",
                  extra_env: dict[str, str] | None = None, note: str = "") -> str:
    """The text of an sbatch script running ``sweep_file`` on ``nodes`` x ``gpus_per_node`` GPUs.

    Each node runs one task (``--ntasks-per-node=1``):
    ``mokbench sweep SWEEP --nnodes $SLURM_NNODES --node-rank $SLURM_NODEID
    --nproc-per-node G --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --out DIR``, where
    MASTER_ADDR is the first host of the allocation. The world size is nodes * gpus_per_node.
    Only the variables in ``extra_env`` are exported (no NCCL tuning is added by default).
    ``note`` (from :func:`job_nodes`) becomes a comment line.
    """
    extra_env = dict(extra_env or {})
    _check(nodes, gpus_per_node, time, extra_env)
    _check_names(partition=partition, account=account)
    sweep, out = shlex.quote(str(sweep_file)), shlex.quote(str(out_dir))
    world = nodes * gpus_per_node
    lines = [
        "#!/bin/bash",
        f"# mokbench: sweep {sweep_file} on {nodes} node(s) x {gpus_per_node} GPU(s) "
        f"= {world} ranks.",
        "# One srun task per node; each starts torchrun with --nproc-per-node GPUs.",
        *([f"# {' '.join(note.split())}"] if note else []),
        "# A GB300 NVL72 rack is 18 nodes x 4 GPUs: --nodes 18 --gpus-per-node 4 (72 ranks).",
        *_sbatch_lines(nodes, gpus_per_node, partition, time, account),
        "",
        "set -euo pipefail",
        f"mkdir -p {out}",
        # sed reads the whole list: `head -n1` may close the pipe early, and under pipefail
        # scontrol's SIGPIPE would end the job.
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"MASTER_PORT=${{MASTER_PORT:-{DEFAULT_PORT}}}",
        "export MASTER_ADDR MASTER_PORT",
    ]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(extra_env.items())]
    # Single quotes: $SLURM_NODEID must expand inside each task, not once in the batch step.
    task = (f"exec mokbench sweep {sweep} --nnodes $SLURM_NNODES --node-rank $SLURM_NODEID "
            f"--nproc-per-node {gpus_per_node} --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT "
            f"--out {out}")
    lines += [
        "",
        f"srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"    bash -c {shlex.quote(task)}",
        "",
    ]
    return "\n".join(lines)
