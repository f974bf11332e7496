"""The rendered sbatch script: directives, the per-node command, and what each node runs when
the script is executed with stand-ins for srun, scontrol and mokbench."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from mokbench.slurm import render_sbatch


def test_directives_and_command():
    text = render_sbatch("sweeps/gb300.toml", nodes=18, gpus_per_node=4, partition="gb300",
                         account="moe", time="04:00:00", out_dir="/shared/results")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for d in ("--nodes=18", "--ntasks-per-node=1", "--gpus-per-node=4", "--exclusive",
              "--time=04:00:00", "--partition=gb300", "--account=moe"):
        assert f"#SBATCH {d}" in lines
    assert "18 nodes x 4 GPUs" in text  # the NVL72 note
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in text
    assert ("mokbench sweep sweeps/gb300.toml --nnodes $SLURM_NNODES --node-rank $SLURM_NODEID "
            "--nproc-per-node 4 --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT "
            "--out /shared/results") in text
    assert "srun --nodes=18 --ntasks-per-node=1" in text
    assert "NCCL" not in text


def test_optional_directives_and_extra_env():
    text = render_sbatch("s.toml", nodes=2, gpus_per_node=8,
                         extra_env={"NCCL_NVLS_ENABLE": "0", "NOTE": "a b"})
    assert "--partition" not in text and "--account" not in text
    assert "#SBATCH --time=02:00:00" in text
    assert "export NCCL_NVLS_ENABLE=0" in text and "export NOTE='a b'" in text


@pytest.mark.parametrize("kwargs, field", [
    ({"nodes": 0}, "nodes"), ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"time": "2 hours"}, "time"), ({"extra_env": {"BAD-NAME": "1"}}, "BAD-NAME"),
])
def test_bad_arguments(kwargs, field):
    args = {"nodes": 2, "gpus_per_node": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        render_sbatch("s.toml", **args)


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_runs_one_sweep_per_node(tmp_path):
    """srun stand-in runs the task once per node with SLURM_NODEID set; every node's mokbench
    gets the same rendezvous and its own node rank."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    # a long host list: a reader that stops after one line would SIGPIPE it (pipefail)
    _stub(bin_dir, "scontrol", 'printf "node-a\\nnode-b\\n"; seq 200000\n')
    _stub(bin_dir, "srun", 'while [[ $1 == --* ]]; do shift; done\n'
          'for i in 0 1; do SLURM_NODEID=$i "$@"; done\n')
    _stub(bin_dir, "mokbench", f'echo "$*" >> {log}\n')
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch("my sweep.toml", nodes=2, gpus_per_node=4,
                                    out_dir=str(tmp_path / "out")))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node-[a-b]"}
    env.pop("MASTER_PORT", None)
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    calls = log.read_text().splitlines()
    common = ("--nproc-per-node 4 --rdzv-endpoint node-a:29500 --out " + str(tmp_path / "out"))
    assert calls == [f"sweep my sweep.toml --nnodes 2 --node-rank {i} {common}" for i in (0, 1)]
    assert (tmp_path / "out").is_dir()
