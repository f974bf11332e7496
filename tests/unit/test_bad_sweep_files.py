"""Bad sweep files through the real `mokbench sweep` (dry run, so a check that were missing
would let it exit 0): unreadable files, broken syntax, wrong types, out-of-range values, names
that are not one folder and options a backend does not take. Each is one line naming the field
before anything launches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.cli_errors import assert_one_line_error, invoke

REPO = Path(__file__).resolve().parents[2]

GOOD = """name = "t"
backends = ["nccl_torch"]
world_sizes = [2]
[timing]
warmup = 1
iters = 2
[[scenarios]]
preset = "tiny"
tokens_per_rank = 32
"""


def _sweep(tmp_path: Path, text: str, suffix: str = ".toml") -> Path:
    path = tmp_path / f"s{suffix}"
    path.write_text(text)
    return path


def _dry(path: Path):
    return invoke("sweep", path, "--dry-run", "--device", "cpu")


def test_the_good_sweep_passes(tmp_path):
    r = _dry(_sweep(tmp_path, GOOD))
    assert r.exit_code == 0 and "1 cells" in r.output, r.output


def test_a_sweep_env_table_is_shown_in_the_dry_run(tmp_path):
    r = _dry(_sweep(tmp_path, GOOD + '[env]\nPYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True"'
                                      "\nMY_FLAG = true\n"))
    assert r.exit_code == 0, r.output
    assert "env: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MY_FLAG=1" in r.output


@pytest.mark.parametrize("edit, needles", [
    # broken syntax
    (lambda t: t + "[[scenarios]\n", ("not valid TOML", "line")),
    # wrong types (a bool is not an integer)
    (lambda t: t.replace("[timing]\nwarmup = 1\niters = 2\n", "timing = 5\n"), ("timing=5",)),
    (lambda t: "scenarios = [1, 2]\n" + t.split("[[scenarios]]")[0], ("scenarios[0]=1",)),
    (lambda t: t + 'shared_expert = "no"\n', ("shared_expert='no'", "true | false")),
    (lambda t: t.replace("tokens_per_rank = 32", "tokens_per_rank = true"),
     ("tokens_per_rank=True",)),
    (lambda t: t.replace("iters = 2", "iters = true"), ("iters=True",)),
    (lambda t: t + 'seed = "abc"\n', ("seed='abc'",)),
    (lambda t: t + "num_experts = true\n", ("num_experts=True",)),
    (lambda t: t.replace("world_sizes = [2]", "world_sizes = [true]"), ("world_sizes", "True")),
    (lambda t: t + "preset_typo = 1\n", ("preset_typo",)),
    (lambda t: t.replace('backends = ["nccl_torch"]', "backends = [1]"), ("backend=1",)),
    (lambda t: t + "passes = [1]\n", ("passes=(1,)",)),
    # empty grid axes (no cells without a word)
    (lambda t: t.replace("tokens_per_rank = 32", "tokens_per_rank = []"),
     ("tokens_per_rank=[]",)),
    (lambda t: t.replace('backends = ["nccl_torch"]', "backends = []"), ("backends=[]",)),
    (lambda t: t.replace("world_sizes = [2]", "world_sizes = []"), ("world_sizes=[]",)),
    # out of range
    (lambda t: t + "zipf_s = inf\n", ("zipf_s=inf", "finite")),
    (lambda t: t + "zipf_s = -1.0\n", ("zipf_s=-1.0",)),
    (lambda t: t + "seed = -1\n", ("seed=-1",)),
    (lambda t: t.replace("iters = 2", "iters = 0"), ("iters=0",)),
    (lambda t: t.replace("iters = 2", "iters = 2\nrounds = 0"), ("rounds=0", "integer >= 1")),
    (lambda t: t.replace("iters = 2", "iters = 2\nrounds = 1.5"), ("rounds=1.5",)),
    # a name that is not one folder
    (lambda t: t.replace('name = "t"', 'name = "a/b"'), ("name='a/b'",)),
    (lambda t: t.replace('name = "t"', "name = 5"), ("name=5",)),
    # an [env] table that cannot be a process environment
    (lambda t: "env = 5\n" + t, ("env=5", "table of environment variables")),
    (lambda t: t + '[env]\n"1X" = "a"\n', ("env key '1X'", "environment variable name")),
    (lambda t: t + "[env]\nA = [1]\n", ("env.A=[1]", "a string, number or boolean")),
    # options on a backend that takes none
    (lambda t: t.replace('["nccl_torch"]', '["nccl_torch@foo=1"]'),
     ("nccl_torch@foo=1", "takes no options")),
])
def test_bad_sweep_file_is_one_line(tmp_path, edit, needles):
    assert_one_line_error(_dry(_sweep(tmp_path, edit(GOOD))), *needles)


def test_yaml_keys_of_mixed_types(tmp_path):
    path = _sweep(tmp_path, "1: a\nb: 2\nscenarios: [{preset: tiny, tokens_per_rank: 8}]\n",
                  ".yaml")
    assert_one_line_error(_dry(path), "sweep key 1 is unknown")


def test_broken_yaml(tmp_path):
    path = _sweep(tmp_path, "name: y\nscenarios: [\n  - {preset: tiny\n", ".yaml")
    assert_one_line_error(_dry(path), "not valid YAML", "line")


@pytest.mark.parametrize("make, needles", [
    (lambda d: d / "missing.toml", ("does not exist",)),
    (lambda d: (d / "dir.toml").mkdir() or d / "dir.toml", ("is not a file",)),
    (lambda d: (d / "latin1.toml").write_bytes(b'name = "caf\xe9"\n') and d / "latin1.toml",
     ("not UTF-8",)),
    (lambda d: (d / "s.json").write_text("{}") and d / "s.json", ("s.json",)),
])
def test_unreadable_sweep_file(tmp_path, make, needles):
    assert_one_line_error(_dry(make(tmp_path)), "sweep file", *needles)


def test_a_label_may_carry_a_tag_on_any_backend(tmp_path):
    text = GOOD.replace('["nccl_torch"]', '["nccl_torch", "nccl_torch@tag=b"]')
    r = _dry(_sweep(tmp_path, text))
    assert r.exit_code == 0 and "2 cells" in r.output, r.output


@pytest.mark.parametrize("text", [GOOD + "[[scenarios]\n", GOOD + 'seed = "abc"\n'])
def test_no_traceback_from_the_installed_command(tmp_path, text):
    """The same through a real process: one line on stdout, nothing on stderr."""
    path = _sweep(tmp_path, text)
    r = subprocess.run([sys.executable, "-m", "mokbench.cli", "sweep", str(path), "--dry-run",
                        "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(REPO), "COLUMNS": "250",
                                         "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and r.stderr == ""
    assert len(r.stdout.strip().splitlines()) == 1 and r.stdout.startswith("error:")
