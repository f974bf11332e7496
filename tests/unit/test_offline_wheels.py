"""benchmarks/offline_wheels.sh: split into batches of bounded size, gather them, and install
--dry-run (reassembles and checks every sha256, prints the pip commands)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "offline_wheels.sh"
MIB = 1 << 20
REAL_WHEEL = Path("/tmp/tew/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("split") is None,
                                reason="needs bash and coreutils")


def sh(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    full = {k: v for k, v in full.items() if v is not None}  # None: unset
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, env=full, timeout=120)


def ok(*args, env: dict | None = None) -> str:
    r = sh(*args, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def dl(tmp_path: Path) -> Path:
    """A download folder of fake files: two split at 1 MiB, one of exactly 1 MiB (not split)."""
    d = tmp_path / "dl"
    d.mkdir()
    rng = random.Random(7)
    sizes = {"big_core-2.20.2-py3-none-manylinux_2_28_x86_64.whl": 2 * MIB + 12345,
             "exact-1.0-py3-none-any.whl": MIB,
             "te_torch-2.20.2.tar.gz": MIB + 1,
             "pydantic-2.0-py3-none-any.whl": 40_000,
             "wheel-0.48.0-py3-none-any.whl": 3_000,
             "packaging-26.4-py3-none-any.whl": 2_000}
    for name, n in sizes.items():
        (d / name).write_bytes(rng.randbytes(n))
    (d / "if-missing.txt").write_text("# only where missing\npackaging>=24.2\nwheel\n")
    return d


def batches(out: Path) -> list[Path]:
    return sorted(out.glob("batch-*"), key=lambda p: int(p.name.split("-")[1]))


def gather_all(out: Path, store: Path, skip: tuple[str, ...] = ()) -> None:
    for b in batches(out):
        if b.name not in skip:
            ok("gather", b, store)


def sha(p: Path) -> str:
    with p.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_usage():
    r = sh()
    assert r.returncode == 2 and "Usage:" in r.stderr
    assert "Usage:" in ok("--help")
    one_line_error(sh("frobnicate"), "unknown subcommand")
    one_line_error(sh("split", "a"), "split takes")


def test_split_batches_respect_the_limit(dl: Path, tmp_path: Path):
    out = tmp_path / "out"
    text = ok("split", dl, out, 1)
    bs = batches(out)
    assert len(bs) >= 4 and f"{len(bs)} batches" in text
    for b in bs:
        assert b.name in text
        assert sum(f.stat().st_size for f in b.iterdir()) <= 1.05 * MIB
        assert (b / "MANIFEST").read_bytes() == (out / "MANIFEST").read_bytes()
    manifest = dict(ln.split("  ")[::-1] for ln in (out / "MANIFEST").read_text().splitlines())
    assert manifest == {f.name: sha(f) for f in dl.iterdir()}
    carried = sorted(f.name for b in bs for f in b.iterdir() if f.name not in
                     ("MANIFEST", "CONTENTS"))
    assert carried == sorted([*(f"big_core-2.20.2-py3-none-manylinux_2_28_x86_64.whl.part-00{i}"
                                for i in range(3)), "te_torch-2.20.2.tar.gz.part-000",
                              "te_torch-2.20.2.tar.gz.part-001", "exact-1.0-py3-none-any.whl",
                              "pydantic-2.0-py3-none-any.whl", "wheel-0.48.0-py3-none-any.whl",
                              "packaging-26.4-py3-none-any.whl", "if-missing.txt"])
    one_line_error(sh("split", dl, out, 1), "OUTDIR must be new or empty")
    one_line_error(sh("split", dl, tmp_path / "o2", "0"), "MIB")


def test_round_trip_is_bit_exact_and_prints_the_install(dl: Path, tmp_path: Path):
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out, 1)
    first = ok("gather", batches(out)[0], store)
    assert "still to gather: batch-2" in first
    gather_all(out, store)
    text = ok("install", "--dry-run", store,
              env={"NVTE_CUDA_ARCHS": None, "MAX_JOBS": "3"})
    for f in dl.iterdir():
        assert (store / f.name).read_bytes() == f.read_bytes(), f.name
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("# dry run:"))
    cmds = [ln for ln in lines[first + 1:] if not ln.startswith("#")]
    assert len(cmds) == 4
    assert "-m pip install --no-index --no-deps --find-links" in cmds[0]
    assert cmds[0].endswith(f"-r {store}/if-missing.txt")
    wheels = cmds[1].split("--no-deps ")[1].split()
    assert sorted(Path(w).name for w in wheels) == [
        "big_core-2.20.2-py3-none-manylinux_2_28_x86_64.whl", "exact-1.0-py3-none-any.whl",
        "pydantic-2.0-py3-none-any.whl"]  # wheel and packaging: only through if-missing.txt
    for piece in ("NVTE_FRAMEWORK=pytorch", "NVTE_CUDA_ARCHS=90", "NVTE_PYTORCH_FORCE_BUILD=TRUE",
                  "MAX_JOBS=3", "nvidia/cudnn/include:", "nvidia/nccl/include",
                  "--no-index --no-deps --no-build-isolation", f"{store}/te_torch-2.20.2.tar.gz"):
        assert piece in cmds[2], piece
    assert cmds[3].endswith("-c 'import transformer_engine.pytorch, megatron.core'")
    # A second run finds everything in place.
    assert "reassembled" not in ok("install", "--dry-run", store)
    arch = ok("install", "--dry-run", store, env={"NVTE_CUDA_ARCHS": "90;100"})
    assert "'NVTE_CUDA_ARCHS=90;100'" in arch


def test_a_corrupted_part_is_named(dl: Path, tmp_path: Path):
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out, 1)
    part = next(out.glob("batch-*/big_core-*.part-001"))
    data = bytearray(part.read_bytes())
    data[1000] ^= 1
    part.write_bytes(bytes(data))
    gather_all(out, store)
    err = one_line_error(sh("install", "--dry-run", store), "sha256 mismatch",
                         "big_core-2.20.2-py3-none-manylinux_2_28_x86_64.whl.part-001",
                         part.parent.name)
    assert "pip" not in err
    # The whole file was never assembled from the bad part.
    assert not (store / "big_core-2.20.2-py3-none-manylinux_2_28_x86_64.whl").exists()


def test_a_missing_part_is_named(dl: Path, tmp_path: Path):
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out, 1)
    part = next(out.glob("batch-*/te_torch-2.20.2.tar.gz.part-001"))
    part.unlink()
    gather_all(out, store)
    one_line_error(sh("install", "--dry-run", store), "missing",
                   "te_torch-2.20.2.tar.gz.part-001", part.parent.name)


def test_a_batch_not_gathered_is_named(dl: Path, tmp_path: Path):
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out, 1)
    last = batches(out)[-1].name
    gather_all(out, store, skip=(last,))
    one_line_error(sh("install", "--dry-run", store), "missing", last)


def test_install_waits_for_the_batches_still_on_their_way(dl: Path, tmp_path: Path):
    """--wait S: the install starts once another process has gathered the last batch."""
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out, 1)
    last = batches(out)[-1]
    gather_all(out, store, skip=(last.name,))
    waiting = subprocess.Popen(["bash", str(SCRIPT), "install", "--dry-run", "--wait", "60",
                                str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHON": sys.executable})
    time.sleep(2)
    assert waiting.poll() is None  # still waiting for the last batch
    ok("gather", last, store)
    stdout, stderr = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, stderr
    assert "# dry run:" in stdout
    for f in dl.iterdir():
        assert (store / f.name).read_bytes() == f.read_bytes(), f.name


def test_install_wait_names_the_batches_that_never_came(dl: Path, tmp_path: Path):
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out, 1)
    last = batches(out)[-1].name
    gather_all(out, store, skip=(last,))
    err = one_line_error(sh("install", "--dry-run", "--wait", "1", store), "after 1 s", last)
    assert "reassembled" not in err
    one_line_error(sh("install", "--wait", "soon", store), "--wait", "'soon'", "seconds")
    # Nothing gathered at all: the store is made and every batch is missing.
    one_line_error(sh("install", "--wait", "0", tmp_path / "empty"), "still not gathered", "all")


def test_gather_refuses_another_bundle(dl: Path, tmp_path: Path):
    ok("split", dl, tmp_path / "a", 1)
    (dl / "pydantic-2.0-py3-none-any.whl").write_bytes(b"other")
    ok("split", dl, tmp_path / "b", 1)
    store = tmp_path / "store"
    ok("gather", tmp_path / "a" / "batch-1", store)
    one_line_error(sh("gather", tmp_path / "b" / "batch-2", store), "another bundle")
    one_line_error(sh("gather", dl, store), "not a batch folder")
    one_line_error(sh("install", tmp_path / "nothing"), "no such folder")


def test_install_refuses_an_environment_without_torch(dl: Path, tmp_path: Path):
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out, 1)
    gather_all(out, store)
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'torch, setuptools'\n")
    fake.chmod(0o755)
    one_line_error(sh("install", store, env={"PYTHON": str(fake)}), "lacks torch, setuptools")
    assert not (store / "te_torch-2.20.2.tar.gz").exists()  # refused before anything else


@pytest.mark.skipif(not REAL_WHEEL.is_file(), reason=f"no {REAL_WHEEL}")
def test_the_real_core_wheel(tmp_path: Path):
    """The 276 MB TE core wheel: five parts at 60 MiB, batches within 63 MiB, reassembled intact."""
    t0 = time.monotonic()
    dl = tmp_path / "dl"
    dl.mkdir()
    if REAL_WHEEL.stat().st_dev == dl.stat().st_dev:
        os.link(REAL_WHEEL, dl / REAL_WHEEL.name)  # split only reads it
    else:
        shutil.copy(REAL_WHEEL, dl)
    out, store = tmp_path / "out", tmp_path / "store"
    ok("split", dl, out)
    parts = sorted(out.glob("batch-*/*.part-*"))
    assert len(parts) == -(-REAL_WHEEL.stat().st_size // (60 * MIB)) == 5
    for b in batches(out):
        assert sum(f.stat().st_size for f in b.iterdir()) <= 63 * MIB
    want = (out / "MANIFEST").read_text().split()[0]
    gather_all(out, store)
    ok("install", "--dry-run", store)
    assert (store / REAL_WHEEL.name).stat().st_size == REAL_WHEEL.stat().st_size
    assert want == sha(store / REAL_WHEEL.name)
    assert time.monotonic() - t0 < 60
