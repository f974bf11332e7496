"""The rendered sbatch script: directives, the per-node command, and what each node runs when
the script is executed with stand-ins for srun, scontrol and mokbench."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
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
    with pytest.raises(ValueError, match=field):  # InputError is a ValueError
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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_readme_example_job_runs_every_cell_on_node_0(tmp_path):
    """`mokbench slurm sweeps/gb300-nvl72.toml --nodes 18 --gpus-per-node 4` (the README's
    example), executed as node 0 of the allocation: its `mokbench sweep` (the real CLI, dry run)
    launches every cell on the first 16 nodes (64 ranks); `slurm --dry-run` shows the same
    torchrun commands."""
    from typer.testing import CliRunner

    from mokbench.cli import app

    repo = Path(__file__).resolve().parents[2]
    cli = CliRunner()
    r = cli.invoke(app, ["slurm", "sweeps/gb300-nvl72.toml", "--nodes", "18", "--gpus-per-node",
                         "4", "--out", str(tmp_path / "out")], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "nodes 16..17 take no part" in r.output
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", 'printf "node-a\\nnode-b\\n"\n')
    _stub(bin_dir, "srun", 'while [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=0 "$@"\n')
    _stub(bin_dir, "mokbench", f'cd {repo} && exec {sys.executable} -m mokbench.cli "$@" '
          "--dry-run --device cpu\n")
    script = tmp_path / "job.sbatch"
    script.write_text(r.output)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "18",
           "SLURM_JOB_NODELIST": "node-[a-r]", "PYTHONPATH": str(repo), "COLUMNS": "250"}
    env.pop("MASTER_PORT", None)
    job = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    commands = [ln.strip() for ln in job.stdout.splitlines() if "torch.distributed.run" in ln]
    assert len(commands) == 8 * 7 and "56 cells" in job.stdout  # 4 shapes x 2 precisions
    assert "skipped" not in job.stdout and "takes no part" not in job.stdout
    assert all("--nnodes=16 --node-rank=0 --nproc-per-node=4 --master-addr=node-a "
               "--master-port=295" in c for c in commands), commands[0]
    shown = cli.invoke(app, ["slurm", "sweeps/gb300-nvl72.toml", "--nodes", "18",
                             "--gpus-per-node", "4", "--dry-run"], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    listed = [ln.strip().replace("MASTER_ADDR", "node-a") for ln in shown.output.splitlines()
              if "torch.distributed.run" in ln]
    assert listed == commands


def test_job_nodes_derived_from_the_sweep():
    from mokbench.errors import InputError
    from mokbench.slurm import job_nodes

    assert job_nodes("sweeps/gb300-nvl72.toml", 4)[0] == 16
    assert job_nodes("sweeps/gb300-nvl72.toml", 4, 18)[0] == 18
    with pytest.raises(InputError, match="world_size=64 .* on 15 node"):
        job_nodes("sweeps/gb300-nvl72.toml", 4, 15)
    with pytest.raises(InputError, match="world size 64 is neither <= nor a multiple"):
        job_nodes("sweeps/gb300-nvl72.toml", 6, 12)
