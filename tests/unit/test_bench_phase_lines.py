"""benchmarks/bench_common.phase_lines: the profiling script's per-kind breakdown of the
backward (each phase mask's time beyond mask 0 and its items' FLOP rate; the dA epilogue's
share from masks 1 and 17), checked on the medians the lease of 2026-12-02 10:35 timed at
DeepSeek-V4-Pro (results/20261202-104039-h200-mok-presets-knobs/NOTE.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_common import phase_lines  # noqa: E402

F = 2.0 * 16384 * 7 * 7168 * 3072  # one GEMM: rows (top-6 + shared) x H x I, twice


def _ms(line: str) -> float:
    return float(line.split(" ms beyond")[0].split()[-1])


def _rate(line: str) -> float:
    return float(line.split("TFLOP/s")[0].split()[-1])


def test_each_mask_beyond_mask_zero_at_its_own_flops():
    lines = phase_lines({0: 1.739, 1: 11.025, 3: 27.248, 5: 19.943, 9: 27.282}, F)
    assert len(lines) == 4
    da, da_dx, da_dwd, da_dwgu = lines
    assert "dA " in da and _ms(da) == pytest.approx(9.286)
    assert _rate(da) == pytest.approx(F / 9.286e-3 / 1e12, rel=1e-3)
    assert "dA+dX" in da_dx and _rate(da_dx) == pytest.approx(3 * F / 25.509e-3 / 1e12, rel=1e-3)
    assert "dA+dW_down" in da_dwd and _rate(da_dwd) == pytest.approx(2 * F / 18.204e-3 / 1e12,
                                                                     rel=1e-3)
    assert "dA+dW_gate_up" in da_dwgu


def test_epilogue_share_from_the_k_loop_mask():
    lines = phase_lines({0: 2.0, 1: 12.0, 17: 9.0}, F)
    assert "K loop only" in lines[1] and _ms(lines[1]) == pytest.approx(7.0)
    assert lines[-1].startswith("dA epilogue share 0.300 ")


def test_q_items_alone_from_mask_33():
    lines = phase_lines({0: 2.0, 1: 12.0, 33: 13.5}, F)
    assert "dA+Q " in lines[1] and _ms(lines[1]) == pytest.approx(11.5)
    assert lines[-1] == "Q items 1.500 ms (mask 33 less mask 1)"


def test_nothing_without_mask_zero():
    assert phase_lines({1: 11.0, 17: 9.0}, F) == []
