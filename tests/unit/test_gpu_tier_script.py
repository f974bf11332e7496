"""benchmarks/gpu_tier.sh --dry-run under a fake nvidia-smi: the one-GPU test files of tests/gpu/
spread over the GPUs (each exactly once), the multi-GPU tests only in phase 2, the 0-GPU error."""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_tier.sh"
GPU_DIR = REPO / "tests" / "gpu"
HARNESS_ALL_GPUS = "tests/gpu/test_harness_gpu.py::test_default_sweep_nccl_torch_on_all_gpus"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def fake_smi(tmp_path: Path, n: int) -> Path:
    bin_dir = tmp_path / f"bin{n}"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-fake-{i})'\n" for i in range(n))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(0o755)
    return bin_dir


def run(tmp_path: Path, n: int, *args: str, env: dict | None = None):
    full = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
            "PATH": f"{fake_smi(tmp_path, n)}{os.pathsep}{os.environ.get('PATH', '')}"}
    full.pop("CUDA_VISIBLE_DEVICES", None)
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True,
                          text=True, env=full, timeout=120, cwd=tmp_path)


def parse(stdout: str):
    """{gpu index: (CUDA_VISIBLE_DEVICES, argv, log)} for phase 1, (argv, log) or None for 2."""
    phase1, phase2 = {}, None
    one = re.compile(r"phase1 gpu(\d+) \(weight \d+\): CUDA_VISIBLE_DEVICES=(\S+) (.*) > (\S+)$")
    for line in stdout.splitlines():
        if m := one.match(line):
            phase1[int(m[1])] = (m[2], shlex.split(m[3]), m[4])
        elif m := re.match(r"phase2 all: (.*) > (\S+)$", line):
            assert phase2 is None, stdout
            phase2 = (shlex.split(m[1]), m[2])
    return phase1, phase2


def positional_tests(argv: list[str]) -> list[str]:
    return [a for i, a in enumerate(argv)
            if a.startswith("tests/gpu/") and argv[i - 1] != "--deselect"]


def deselected(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--deselect"]


def two_gpu_tests() -> set[str]:
    """Every test of tests/gpu/ marked skipif(... device_count() < 2 ...), read from the source."""
    found = set()
    for path in sorted(GPU_DIR.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    "skipif" in ast.unparse(d) and re.search(r"device_count\(\)\s*<\s*2",
                                                             ast.unparse(d))
                    for d in node.decorator_list):
                found.add(f"tests/gpu/{path.name}::{node.name}")
    return found


GPU_FILES = sorted(f"tests/gpu/{p.name}" for p in GPU_DIR.glob("test_*.py"))
MULTI = two_gpu_tests() | {HARNESS_ALL_GPUS}


def test_the_known_two_gpu_tests_are_found():
    assert {"tests/gpu/test_mok_backward.py::test_real_ep_over_two_gpus",
            "tests/gpu/test_baselines_gpu.py::test_dispatch_baseline_at_ep2_passes_check"} <= MULTI


@pytest.mark.parametrize("n", [1, 2, 3])
def test_split_over_gpus(tmp_path, n):
    r = run(tmp_path, n, "--timeout", "300", "-x")
    assert r.returncode == 0, r.stderr
    phase1, phase2 = parse(r.stdout)
    # One pytest per GPU (none left without a file here), CUDA_VISIBLE_DEVICES its own index.
    assert sorted(phase1) == list(range(n))
    assert all(cvd == str(g) for g, (cvd, _, _) in phase1.items())
    assigned = [t for _, argv, _ in phase1.values() for t in positional_tests(argv)]
    assert sorted(assigned) == GPU_FILES  # every one-GPU file exactly once
    for g, (_, argv, log) in phase1.items():
        assert log == str(tmp_path / "out" / f"gpu{g}.log")
        assert argv[:3] == [sys.executable, "-m", "pytest"] and "-m" in argv[3:]
        assert argv[argv.index("-m", 3) + 1] == "gpu"
        assert argv[-1] == "-x" and argv[argv.index("--timeout") + 1] == "300"
        mine = set(positional_tests(argv))
        # Multi-GPU tests: never run in phase 1; deselected wherever their file runs.
        assert not any("::" in t for t in mine)
        assert set(deselected(argv)) == {t for t in MULTI if t.split("::")[0] in mine}
    if n >= 2:  # the two heavy files on different GPUs
        heavy = [g for g, (_, argv, _) in phase1.items()
                 if {"tests/gpu/test_mok_forward.py", "tests/gpu/test_mok_backward.py"}
                 & set(positional_tests(argv))]
        assert len(heavy) == 2
    # Phase 2: exactly the multi-GPU tests, all GPUs visible, no xdist.
    assert phase2 is not None, r.stdout
    argv, log = phase2
    assert log == str(tmp_path / "out" / "multi.log")
    assert set(positional_tests(argv)) == MULTI and len(positional_tests(argv)) == len(MULTI)
    assert "-n" not in argv and not deselected(argv) and argv[-1] == "-x"
    assert "CUDA_VISIBLE_DEVICES" not in r.stdout.split("phase 2:")[1]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_no_gpu_is_a_one_line_error(tmp_path):
    r = run(tmp_path, 0)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "GPU" in lines[0], r.stderr


def test_xdist_workers_when_importable(tmp_path):
    fake = tmp_path / "site"
    (fake / "xdist").mkdir(parents=True)
    (fake / "xdist" / "__init__.py").write_text("")
    r = run(tmp_path, 2, "--workers", "3", env={"PYTHONPATH": str(fake)})
    assert r.returncode == 0, r.stderr
    phase1, phase2 = parse(r.stdout)
    for _, argv, _ in phase1.values():
        assert argv[argv.index("-n") + 1] == "3"
    assert "-n" not in phase2[0]
    serial = tmp_path / "serial"
    serial.mkdir()
    r = run(serial, 2, "--workers", "0", env={"PYTHONPATH": str(fake)})
    assert r.returncode == 0, r.stderr
    assert all("-n" not in argv for _, argv, _ in parse(r.stdout)[0].values())


def test_cuda_visible_devices_names_the_gpus(tmp_path):
    r = run(tmp_path, 8, env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert r.returncode == 0, r.stderr
    phase1, _ = parse(r.stdout)
    assert [cvd for cvd, _, _ in phase1.values()] == ["3", "5"]


def test_bad_workers_is_a_usage_error(tmp_path):
    r = run(tmp_path, 2, "--workers", "many")
    assert r.returncode == 2 and "error:" in r.stderr and r.stdout == ""
