"""Bad flags and inconsistent flag sets through the real CLI: out-of-range counts and times,
unknown devices, an empty backend list, a rendezvous without a port, an output folder that is a
file or cannot be written, and the same for run, plan, backends, calibrate and slurm. Each is
one line naming the field, exit code 2, before anything launches."""

from __future__ import annotations

import pathlib
from pathlib import Path

import pytest

from tests.unit.cli_errors import assert_one_line_error, invoke
from tests.unit.test_bad_sweep_files import GOOD


@pytest.fixture
def sweep_file(tmp_path: Path) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(GOOD)
    return path


@pytest.mark.parametrize("flags, needles", [
    (["--timeout-s", "0"], ("timeout_s=0.0", "> 0")),
    (["--timeout-s", "-5"], ("timeout_s=-5.0",)),
    (["--timeout-s", "inf"], ("timeout_s=inf",)),
    (["--nproc-per-node", "0"], ("nproc_per_node=0",)),
    (["--nnodes", "0"], ("nnodes=0",)),
    (["--device", "gpu"], ("device='gpu'", "auto | cpu")),
    (["--backends", ""], ("backends=''",)),
    (["--backends", " , "], ("backends=' , '",)),
    (["--node-rank", "5", "--nnodes", "2"], ("node_rank=5", "0..1")),
    (["--node-rank", "-1"], ("node_rank=-1",)),
    (["--rounds", "0"], ("rounds=0", "integer >= 1")),
    (["--rounds", "2", "--parallel", "2"], ("parallel=2", "rounds 2", "allowed 1")),
    (["--nnodes", "2", "--rdzv-endpoint", "host"], ("rdzv_endpoint='host'", "HOST:PORT")),
    (["--nnodes", "2", "--rdzv-endpoint", "host:port"], ("rdzv_endpoint='host:port'",)),
    (["--nnodes", "2", "--rdzv-endpoint", "host:70000"], ("rdzv_endpoint='host:70000'",)),
])
def test_bad_sweep_flags(sweep_file, flags, needles):
    assert_one_line_error(invoke("sweep", sweep_file, "--dry-run", "--device", "cpu", *flags),
                          *needles)


def test_out_is_a_file(sweep_file, tmp_path):
    (tmp_path / "taken").write_text("")
    r = invoke("sweep", sweep_file, "--device", "cpu", "--out", tmp_path / "taken")
    assert_one_line_error(r, "out=", "is a file")
    assert (tmp_path / "taken").read_text() == ""


def test_out_cannot_be_written(sweep_file, tmp_path, monkeypatch):
    """A read-only folder (simulated: this suite may run as root, which writes anywhere)."""
    blocked = tmp_path / "ro"
    real_mkdir = pathlib.Path.mkdir

    def mkdir(self, *args, **kwargs):
        if str(self).startswith(str(blocked)):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    r = invoke("sweep", sweep_file, "--device", "cpu", "--out", blocked)
    assert_one_line_error(r, "out=", "not writable", "Permission denied")


@pytest.mark.parametrize("args, needles", [
    (["run", "--world-size", "0"], ("world_size=0",)),
    (["run", "--tokens", "0"], ("tokens_per_rank=0",)),
    (["run", "--zipf-s", "inf"], ("zipf_s=inf",)),
    (["run", "--iters", "0"], ("iters=0",)),
    (["run", "--device", "gpu"], ("device='gpu'",)),
    (["run", "--timeout-s", "0"], ("timeout_s=0.0",)),
    (["run", "--backends", ""], ("backends=''",)),
    (["run", "--backends", "nccl_torch@foo=1"], ("nccl_torch@foo=1", "takes no options")),
    (["run", "--passes", "sideways"], ("passes=('sideways',)",)),
    (["plan", "--block-m", "0"], ("block_m=0",)),
    (["plan", "--block-n", "-1"], ("block_n=-1",)),
    (["plan", "--hidden", "0"], ("hidden=0",)),
    (["plan", "--sms", "0"], ("sms=0",)),
    (["plan", "--comm-sms", "200", "--sms", "132"], ("comm_sms=200",)),
    (["backends", "--world-size", "0"], ("world_size=0",)),
    (["calibrate", "--nproc-per-node", "0"], ("nproc_per_node=0",)),
    (["calibrate", "--device", "gpu"], ("device='gpu'",)),
])
def test_bad_command_flags(args, needles):
    assert_one_line_error(invoke(*args), *needles)


def test_calibrate_out_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    assert_one_line_error(invoke("calibrate", "--out", tmp_path / "f", "--device", "cpu"),
                          "out=", "is a file")


@pytest.mark.parametrize("flags, needles", [
    (["--nodes", "0"], ("nodes=0",)),
    (["--gpus-per-node", "0"], ("gpus_per_node=0",)),
    (["--time", "abc"], ("time='abc'",)),
    (["--partition", "a b"], ("partition='a b'",)),
    (["--nodes", "1", "--gpus-per-node", "1"], ("world_size=2", "1 node(s) x 1 GPU(s)")),
    (["--gpus-per-node", "4", "--script", "/nonexistent-dir/job.sbatch"], ("script=",)),
])
def test_bad_slurm_flags(sweep_file, flags, needles):
    args = ["slurm", sweep_file, *flags]
    if "--gpus-per-node" not in flags:
        args += ["--gpus-per-node", "4"]
    assert_one_line_error(invoke(*args), *needles)


@pytest.mark.parametrize("name, text, needles", [
    ("missing.toml", None, ("does not exist",)),
    ("broken.toml", "[[scenarios]\n", ("not valid TOML",)),
    ("bad.toml", GOOD + 'seed = "abc"\n', ("seed='abc'",)),
])
def test_slurm_reads_the_sweep(tmp_path, name, text, needles):
    if text is not None:
        (tmp_path / name).write_text(text)
    r = invoke("slurm", tmp_path / name, "--nodes", "2", "--gpus-per-node", "4")
    assert_one_line_error(r, *needles)
