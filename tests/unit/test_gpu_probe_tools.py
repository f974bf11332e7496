"""benchmarks/clocks.sh under a fake nvidia-smi (the busy samples' clock and power, the
command's status kept, bad arguments), and benchmarks/gluon_da_probe.py's variant selection
(--only, --plain-stages): the tools of a lease that compares kernel rates across timings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLOCKS = REPO / "benchmarks" / "clocks.sh"


def fake_smi(tmp_path: Path, samples: list[str]) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f"echo '{s}'\n" for s in samples)
    smi.write_text("#!/bin/sh\n" + lines + "sleep 30\n")
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def clocks(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLOCKS), *args], capture_output=True, text=True,
                          env=env, timeout=60)


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
def test_clocks_reports_busy_samples_and_keeps_the_command_status(tmp_path: Path) -> None:
    env = fake_smi(tmp_path, ["1980, 120.5", "1755, 690.1", "1740, 700.0", "1800, 650.2",
                              "1980, 80.0"])
    out = clocks(env, "--", "bash", "-c", "sleep 0.5; echo timed; exit 3")
    assert out.returncode == 3, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "timed"
    # the two idle samples (< 300 W) are left out; nearest-rank quantiles of the other three
    assert lines[-1] == ("clocks: 3 busy samples (>= 300 W): SM clock p10 1740, p50 1755, "
                         "p90 1755 MHz; power p50 690.1, max 700 W")


@needs_bash
def test_clocks_says_when_no_sample_was_busy(tmp_path: Path) -> None:
    env = fake_smi(tmp_path, ["1980, 120.5"])
    out = clocks(env, "--busy-w", "900", "--", "bash", "-c", "sleep 0.3")
    assert out.returncode == 0
    assert out.stdout.splitlines()[-1] == "clocks: no sample at or above 900 W"


@needs_bash
@pytest.mark.parametrize(("args", "message"), [
    (["--busy-w", "x", "--", "true"], "clocks.sh: --busy-w: got 'x'; allowed watts as an integer"),
    (["--watts", "3"], "clocks.sh: unknown argument '--watts'; allowed --busy-w, then -- COMMAND"),
    ([], "clocks.sh: no command; usage: clocks.sh [--busy-w W] -- COMMAND"),
])
def test_clocks_rejects_bad_arguments_in_one_line(tmp_path: Path, args: list[str],
                                                  message: str) -> None:
    out = clocks(fake_smi(tmp_path, []), *args)
    assert out.returncode == 2
    assert out.stderr.strip() == message


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gluon_da_probe
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return gluon_da_probe


def test_probe_selects_named_variants_in_order_with_the_plain_stages(probe) -> None:
    picked = probe.select_variants("gluon_ws, plain_noepi", plain_stages=4)
    assert [v.name for v in picked] == ["plain_noepi", "gluon_ws"]
    assert picked[0].stages == 4  # plain: the override
    assert picked[1].stages == probe.WS_STAGES  # Gluon: its own ring, unchanged
    assert [v.name for v in probe.select_variants("")] == [v.name for v in probe.VARIANTS]


@pytest.mark.parametrize(("only", "stages", "message"), [
    ("plain,bogus", 3, "--only: unknown variant 'bogus'; allowed plain, plain_noepi, "),
    ("", 5, "--plain-stages: got 5; allowed 2, 3 or 4"),
])
def test_probe_rejects_unknown_variants_and_stage_counts(probe, only: str, stages: int,
                                                         message: str) -> None:
    with pytest.raises(ValueError) as err:
        probe.select_variants(only, plain_stages=stages)
    assert str(err.value).startswith(message)


def test_probe_lists_the_cooperative_variant_last(probe) -> None:
    """gluon_coop_noepi (the plain loop's tile and ring, warp-specialised) is selectable and
    keeps its own 4-stage ring whatever --plain-stages says."""
    (coop,) = probe.select_variants("gluon_coop_noepi", plain_stages=2)
    assert coop.gluon and coop.coop and not coop.epi
    assert (coop.bn, coop.stages) == (probe.PLAIN_BN, probe.COOP_STAGES)
    assert probe.variant_kernel(coop) is probe.gluon_coop_da_kernel
    assert probe.VARIANTS[-1].name == "gluon_coop_noepi"


@pytest.mark.parametrize(("args", "message"), [
    (["--time", "--only", "plain,fast"],
     "--only: unknown variant 'fast'; allowed plain, coop, coop_tma, plain_nostore, "
     "coop_nostore"),
    (["--time", "--back-to-back", "0"], "--back-to-back: got 0; allowed an integer >= 1"),
])
def test_wgrad_probe_rejects_bad_arguments_in_one_line(args: list[str], message: str) -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gluon_wgrad_probe.py"),
                          *args], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(message)


def test_wgrad_probe_stores_through_tma_only_in_coop_tma_with_a_shallower_ring() -> None:
    """coop_tma's two 32 KB store buffers cost it a ring stage (3 x 48 KB + 64 KB fits sm_90's
    227 KB, 4 x 48 KB + 64 KB does not); every other variant keeps 4 stages and no buffer."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gluon_wgrad_probe as w
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    tma = w._constexprs("coop_tma", w.KIMI)
    assert (tma["TMA_STORE"], tma["STORE"], tma["STAGES"]) == (True, True, w.STAGES_TMA)
    ring_kb, buffers_kb = 48 * tma["STAGES"], 2 * 32
    assert ring_kb + buffers_kb <= 227 < 48 * (tma["STAGES"] + 1) + buffers_kb
    for name in ("coop", "coop_nostore"):
        c = w._constexprs(name, w.KIMI)
        assert (c["TMA_STORE"], c["STAGES"]) == (False, w.STAGES)
    assert "TMA_STORE" not in w._constexprs("plain", w.KIMI)


@pytest.mark.parametrize(("args", "message"), [
    (["--check", "--only", "coop,coop_tma"],
     "--only: unknown variant 'coop_tma'; allowed plain, coop, coop_smem, plain_nostore, "
     "coop_nostore"),
    (["--time", "--back-to-back", "-1"], "--back-to-back: got -1; allowed an integer >= 1"),
])
def test_dx_probe_rejects_bad_arguments_in_one_line(args: list[str], message: str) -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gluon_dx_probe.py"),
                          *args], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(message)


def test_dx_probe_stages_through_shared_memory_only_in_coop_smem() -> None:
    """coop_smem's two [64, 128] bf16 buffers (32 KB) fit beside the 4 x 48 KB ring under
    sm_90's 227 KB, so it keeps the other variants' ring depth; its tiles are the
    megakernel's dX tiles and the FLOPs those of 2 P H 2I."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gluon_dx_probe as dx
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    smem = dx._constexprs("coop_smem", dx.KIMI)
    assert (smem["SMEM_STORE"], smem["STORE"], smem["STAGES"]) == (True, True, dx.STAGES)
    assert 48 * 1024 * dx.STAGES + 2 * 64 * 128 * 2 <= 232448
    assert dx._constexprs("coop", dx.KIMI)["SMEM_STORE"] is False
    assert dx._constexprs("coop_nostore", dx.KIMI)["STORE"] is False
    assert "SMEM_STORE" not in dx._constexprs("plain", dx.KIMI)
    assert dx.num_tiles(dx.KIMI) == 48 * (2816 // 128) * (7168 // 256)
    assert dx.dx_flops(dx.KIMI) == 2 * dx.KIMI.P * 7168 * 2 * 2048
