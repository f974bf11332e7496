"""Finding a GEMM's K loop in SASS (``mma_loop`` in mok_kernels/_details/lowering.py) and
benchmarks/kloop_sass.py: the backward megakernel's dA K loop against a standalone Triton
kernel of the same loop, both built for sm_90 on this CPU host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mok_kernels._details.lowering import mma_loop, sass_instructions

REPO = Path(__file__).resolve().parents[2]

# cuobjdump -sass lines: an outer loop (0x0010-0x00a0) around an inner one (0x0030-0x0070)
# that holds the MMA, an out-of-line wait (0x00b0-0x00c0) that branches back into the inner
# loop, and a forward branch.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/              @!P0 BRA 0xb0 ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6+0x30000], R11 ;
        /*0040*/                   WARPGROUP.ARRIVE ;
        /*0050*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0070*/              @!UP1 BRA 0x30 ;
        /*0080*/                   IMAD R2, R0, 0x4, RZ ;
        /*0090*/                   STG.E [R2.64], R24 ;
        /*00a0*/               @P2 BRA 0x10 ;
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6+0x30000], R11 ;
        /*00c0*/                   BRA 0x40 ;
        /*00d0*/                   EXIT ;
"""


def test_sass_instructions_keep_offsets_and_modifiers_without_predicates() -> None:
    ins = sass_instructions(SASS)
    assert ins[0] == (0x0, "MOV")
    assert (0x70, "BRA") in ins
    assert (0x50, "HGMMA.64x256x16.F32.BF16") in ins
    assert len(ins) == 14


def test_mma_loop_is_the_shortest_loop_holding_an_mma() -> None:
    loop = mma_loop(SASS)
    assert (loop.start, loop.end) == (0x30, 0x70)  # not the outer loop, not 0x40-0xc0
    assert loop.counts == {"SYNCS": 1, "WARPGROUP": 2, "HGMMA": 1, "BRA": 1}
    assert loop.skeleton() == ("SYNCS.PHASECHK.TRANS64.TRYWAIT", "WARPGROUP.ARRIVE",
                               "HGMMA.64x256x16.F32.BF16", "WARPGROUP.DEPBAR.LE", "BRA")


def test_mma_loop_refuses_sass_without_an_mma_loop() -> None:
    no_mma = SASS.replace("HGMMA.64x256x16.F32.BF16", "FFMA")
    with pytest.raises(ValueError, match="no loop with a tensor-core MMA"):
        mma_loop(no_mma)


def test_megakernel_da_loop_has_the_standalone_kernels_skeleton() -> None:
    """The script builds both for sm_90 (mask 17 at the backend's defaults; the probe's
    plain_noepi at 3 stages) and exits 0 only when their K loops' skeletons match."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kloop_sass.py")],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "same skeleton: yes" in out.stdout
    assert out.stdout.count("HGMMA.64x256x16.F32.BF16") == 4  # four MMAs per 64-wide K step


def test_kloop_sass_rejects_bad_options_in_one_line() -> None:
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kloop_sass.py"),
                          "--probe-stages", "5"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith("--probe-stages: got 5; allowed 2, 3 or 4")
