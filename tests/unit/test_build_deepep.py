"""benchmarks/build_deepep.sh run for real through bash, against stand-ins: a fake DeepEP
checkout, a fake nvcc, a fake torch (and NVSHMEM wheel) importable through PYTHONPATH, and a
python that sees no site-packages, so the machine's own torch or NVSHMEM never leaks in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "build_deepep.sh"
RUNTIME_ENV = ["  export NCCL_NVLS_ENABLE=0", "  export TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
               "  export NVSHMEM_DISABLE_NVLS=1"]
FAKE_TORCH = '''__version__ = "{version}"
class version:
    cuda = {cuda!r}
class cuda:
    @staticmethod
    def is_available():
        return False
    class nccl:
        @staticmethod
        def version():
            return (2, 28, 9)
'''
# a setup.py that shows what it was given and leaves an importable deep_ep behind
FAKE_SETUP = '''import os, sys
print("setup.py", *sys.argv[1:], os.environ["TORCH_CUDA_ARCH_LIST"], os.environ["MAX_JOBS"])
'''


def _write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture
def fakes(tmp_path: Path) -> dict:
    """Paths of the stand-ins and an environment that points at them (torch 2.11 + CUDA 13.0,
    no GPU, no NVSHMEM)."""
    src = tmp_path / "DeepEP"
    _write(src / "setup.py", FAKE_SETUP)
    _write(src / "deep_ep" / "__init__.py", "Buffer = 'fake V1 Buffer'\n")
    _write(src / "deep_ep" / "buffer.py", "")
    cuda = tmp_path / "cuda"
    _write(cuda / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, "
           "V13.0.88'\n", 0o755)
    py = tmp_path / "py"
    _write(py / "torch" / "__init__.py", FAKE_TORCH.format(version="2.11.0+cu130", cuda="13.0"))
    python = _write(tmp_path / "bin" / "python", f'#!/bin/sh\nexec {sys.executable} -S "$@"\n',
                    0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": str(python),
           "CUDA_HOME": str(cuda), "PYTHONPATH": str(py)}
    return {"src": src, "cuda": cuda, "py": py, "tmp": tmp_path, "env": env}


def run(args: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=60)


def one_line_error(r: subprocess.CompletedProcess, code: int = 2) -> str:
    """The script failed with ``code`` and said why on exactly one line of stderr."""
    assert r.returncode == code, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_argument_errors_are_one_line(fakes):
    src, env, tmp = fakes["src"], fakes["env"], fakes["tmp"]
    cases = [
        ([], "error: no DeepEP checkout given"),
        ([tmp / "nowhere"], f"error: DeepEP checkout '{tmp / 'nowhere'}' does not exist: "
                            "clone it first (git clone -b v1.2.1"),
        ([tmp], f"error: '{tmp.resolve()}' is not a DeepEP checkout (no setup.py or no "
                "deep_ep/ folder)"),
        ([src / "setup.py"], "is not a DeepEP checkout: it is a file"),
        (["--arch", "hopper", src], "error: arch='hopper' is invalid: allowed MAJOR.MINOR of "
                                    "at least 8.0"),
        (["--arch=7.5", src], "error: arch='7.5' is invalid"),
        (["--arch", "9", src], "error: arch='9' is invalid"),
        (["--arch"], "error: --arch needs a value"),
        (["--jobs", "--check", src], "error: --jobs needs a value"),
        (["--jobs", "0", src], "error: jobs='0' is invalid: allowed a positive integer"),
        (["--frob", src], "error: option --frob is unknown"),
        ([src, src], "error: one DeepEP checkout expected"),
    ]
    for args, message in cases:
        line = one_line_error(run(args, env))
        assert message in line, (args, line)


def test_a_folder_with_setup_py_but_no_deep_ep_is_not_a_checkout(fakes):
    other = fakes["tmp"] / "other"
    _write(other / "setup.py", "")
    assert "is not a DeepEP checkout" in one_line_error(run([other], fakes["env"]))


def test_environment_errors_are_one_line(fakes):
    src, env, tmp = fakes["src"], fakes["env"], fakes["tmp"]
    line = one_line_error(run([src], {**env, "CUDA_HOME": str(tmp / "nocuda")}))
    assert line.startswith(f"error: nvcc not found ({tmp / 'nocuda' / 'bin' / 'nvcc'})")
    old = _write(tmp / "cuda12" / "bin" / "nvcc", "#!/bin/sh\necho 'release 12.8, V12.8.1'\n",
                 0o755).parents[1]
    line = one_line_error(run([src], {**env, "CUDA_HOME": str(old)}))
    assert "nvcc is CUDA 12.8 but torch 2.11.0+cu130 was built with CUDA 13.0" in line
    no_torch = tmp / "no_torch"
    _write(no_torch / "torch" / "__init__.py", "raise ModuleNotFoundError(\"No module named "
           "'torch'\")\n")
    line = one_line_error(run([src], {**env, "PYTHONPATH": str(no_torch)}))
    assert line.startswith("error: torch is not importable by ") and "No module named" in line
    cpu = tmp / "cpu_torch"
    _write(cpu / "torch" / "__init__.py", FAKE_TORCH.format(version="2.13.0+cpu", cuda=None))
    line = one_line_error(run([src], {**env, "PYTHONPATH": str(cpu)}))
    assert line == "error: torch 2.13.0+cpu is a CPU-only build: DeepEP needs a CUDA build"
    line = one_line_error(run([src], {**env, "PYTHON": str(tmp / "nopython")}))
    assert "not found: set PYTHON" in line
    broken = _write(tmp / "broken" / "bin" / "nvcc", "#!/bin/sh\nexit 1\n", 0o755).parents[1]
    line = one_line_error(run([src], {**env, "CUDA_HOME": str(broken)}))
    assert "--version names no CUDA release" in line
    line = one_line_error(run([src], {**env, "NVSHMEM_DIR": str(tmp / "no_nvshmem")}))
    assert f"NVSHMEM_DIR='{tmp / 'no_nvshmem'}' is not a folder" in line


def _block(out: str, title: str) -> list[str]:
    """The indented lines under ``title:`` in the dry run's output."""
    lines = out.splitlines()
    start = lines.index(f"{title}:") + 1
    block = []
    for ln in lines[start:]:
        if not ln.startswith("  "):
            break
        block.append(ln)
    return block


def test_dry_run_without_nvshmem_builds_intranode_only(fakes):
    src, cuda, env = fakes["src"], fakes["cuda"], fakes["env"]
    r = run(["--dry-run", "--jobs", "3", src], env)
    assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
    assert _block(r.stdout, "environment") == [
        "  export TORCH_CUDA_ARCH_LIST=9.0", "  export MAX_JOBS=3", f"  export CUDA_HOME={cuda}",
        *RUNTIME_ENV]
    assert _block(r.stdout, "build") == [
        f"  cd {src.resolve()} && {sys.executable} -m pip install --no-build-isolation --no-deps ."]
    assert "arch 9.0 (default: no GPU visible); 3 jobs; no NVSHMEM" in r.stdout
    assert "intranode kernels only (-DDISABLE_NVSHMEM)" in r.stdout
    assert "(git: none; V1 Buffer: the deepep backend)" in r.stdout
    assert r.stdout.splitlines()[-1] == "dry run: nothing built"
    assert "setup.py" not in r.stdout  # nothing ran


def test_dry_run_with_the_nvshmem_wheel_puts_cccl_on_cpath(fakes):
    src, cuda, env, tmp = fakes["src"], fakes["cuda"], fakes["env"], fakes["tmp"]
    wheel = tmp / "wheel" / "nvidia" / "nvshmem"
    _write(wheel / "__init__.py", "")
    _write(wheel / "lib" / "libnvshmem_host.so.3", "")
    _write(src / "deep_ep" / "hybrid_ep_buffer.py", "")
    env = {**env, "PYTHONPATH": f"{fakes['py']}:{tmp / 'wheel'}"}
    r = run(["--dry-run", "--inplace", "--check", "--arch", "10.0", "--jobs", "16", src], env)
    assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
    assert _block(r.stdout, "environment") == [
        "  export TORCH_CUDA_ARCH_LIST=10.0", "  export MAX_JOBS=16", f"  export CUDA_HOME={cuda}",
        f"  export CPATH={cuda}/include/cccl:{cuda}/include", *RUNTIME_ENV]
    assert f"NVSHMEM at {wheel}: intranode and internode kernels" in r.stdout
    assert "V1 Buffer + HybridEPBuffer: deepep and hybridep_megatron" in r.stdout
    assert _block(r.stdout, "build") == [
        f"  cd {src.resolve()} && {sys.executable} setup.py build_ext --inplace"]
    assert _block(r.stdout, "check") == [
        f"  cd / && PYTHONPATH={src.resolve()}:{env['PYTHONPATH']} {sys.executable} -c "
        "'import deep_ep; print(deep_ep.Buffer); print(deep_ep.HybridEPBuffer)'"]
    # NVSHMEM_DIR counts as NVSHMEM too, as in DeepEP's setup.py
    r = run(["--dry-run", src], {**fakes["env"], "NVSHMEM_DIR": str(tmp)})
    assert f"  export CPATH={cuda}/include/cccl:{cuda}/include" in r.stdout.splitlines(), r.stderr
    assert f"NVSHMEM at {tmp}:" in r.stdout
    # SM8x drops DeepEP's SM90 features, which DeepEP allows only without NVSHMEM
    line = one_line_error(run(["--dry-run", "--arch", "8.0", src], env))
    assert "arch=8.0 builds DeepEP without its SM90 features" in line


def test_dry_run_warns_about_deepep_main(fakes):
    main = fakes["tmp"] / "main"
    _write(main / "setup.py", "")
    _write(main / "deep_ep" / "buffers" / "elastic.py", "")
    r = run(["--dry-run", main], fakes["env"])
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("warning: this checkout is DeepEP main (V2 API): it needs NCCL "
                               ">= 2.30.4 (torch 2.11.0+cu130 bundles 2.28.9)")


def test_inplace_build_times_itself_and_checks_the_import(fakes):
    src, env = fakes["src"], fakes["env"]
    r = run(["--inplace", "--check", "--jobs", "2", src], env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    out = r.stdout.splitlines()
    assert "setup.py build_ext --inplace 9.0 2" in out
    assert any(ln.startswith("DeepEP (v1) built in place in 0 min ") for ln in out), r.stdout
    assert f"  export PYTHONPATH={src.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}" in out
    assert "fake V1 Buffer" in out  # --check imported the checkout's deep_ep
    _write(src / "setup.py", "raise SystemExit(3)\n")
    line = one_line_error(run(["--inplace", src], env), code=1)
    assert line.startswith("error: the DeepEP build failed after ")


def test_hybrid_ep_build_warns_when_the_cxx_runtime_is_static(fakes):
    """A hybrid-ep build whose hybrid_ep_cpp has no NEEDED libstdc++ gets the LD_PRELOAD
    warning (it would crash in HybridEPBuffer's constructor); one that links it gets none."""
    import importlib.machinery

    from tests.unit.test_native_libs import write_elf

    src, env = fakes["src"], fakes["env"]
    _write(src / "deep_ep" / "hybrid_ep_buffer.py", "")
    ext = src / f"hybrid_ep_cpp{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    write_elf(ext, ["libtorch.so", "libgcc_s.so.1", "libc.so.6"])
    r = run(["--inplace", "--jobs", "2", src], env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    warning = [ln for ln in r.stderr.splitlines() if "statically" in ln]
    assert warning == ["warning: hybrid_ep_cpp links the C++ runtime statically (no "
                       "libstdc++.so.6 among its libraries) and then crashes in HybridEPBuffer's "
                       "constructor; preload the shared one: export "
                       "LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)"], r.stderr
    write_elf(ext, ["libtorch.so", "libstdc++.so.6", "libc.so.6"])
    r = run(["--inplace", "--jobs", "2", src], env)
    assert r.returncode == 0 and "statically" not in r.stderr, (r.stdout, r.stderr)
