"""Correctness of a backend's outputs against the float32 reference layer.

Error measures, per checked tensor (y; and for the backward pass dx, d router weights and the
weight gradients):
    abs_err = max |out - ref|
    rel_err = ||out - ref||_2 / ||ref||_2   (Frobenius norms, in float64)
A row's ``max_abs_err`` / ``max_rel_err`` are the maxima over its tensors. A pass fails when any
rel_err exceeds the tolerance of its precision, when a tensor is missing or misshapen, or when
any output is NaN/Inf (NaN never passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Frobenius-relative tolerance against the float32 reference, by precision. bf16: 8 mantissa
# bits, errors of a few 1e-3 measured. fp8 (e4m3): 3 mantissa bits, a unit roundoff of 2^-4 on
# each of the four quantised GEMM operands of the layer; TE's Float8BlockScaling measured 0.066
# on an H200 (results/20261129-210000-h200), so 0.1.
TOLERANCE = {"bf16": 1e-2, "fp8": 1e-1}


@dataclass
class CheckResult:
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    worst: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def reason(self) -> str:
        return "; ".join(self.problems)


def compare(name: str, out: torch.Tensor | None, ref: torch.Tensor, tol: float,
            result: CheckResult) -> None:
    """Add one tensor's errors to ``result``."""
    if out is None:
        result.problems.append(f"{name}: not produced")
        return
    if tuple(out.shape) != tuple(ref.shape):
        result.problems.append(f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}")
        return
    o, r = out.detach().to(torch.float64), ref.detach().to(ref.device, torch.float64)
    o = o.to(r.device)
    if not torch.isfinite(o).all():
        n_bad = int((~torch.isfinite(o)).sum())
        result.problems.append(f"{name}: {n_bad} non-finite values (unwritten or overflow)")
        result.max_abs_err = result.max_rel_err = float("nan")
        return
    abs_err = float((o - r).abs().max()) if o.numel() else 0.0
    rel_err = float((o - r).norm() / r.norm().clamp_min(1e-30)) if o.numel() else 0.0
    if rel_err >= result.max_rel_err or result.worst == "":
        result.worst = name
    result.max_abs_err = max(result.max_abs_err, abs_err)
    result.max_rel_err = max(result.max_rel_err, rel_err)
    if rel_err > tol:
        result.problems.append(f"{name}: rel_err {rel_err:.3g} > tol {tol:g}")


def check_forward(y_TH: torch.Tensor, ref, precision: str) -> CheckResult:
    res = CheckResult()
    compare("y", y_TH, ref.y_TH, TOLERANCE[precision], res)
    return res


def check_backward(dx_TH, dprobs_TK, dweights: dict[str, torch.Tensor], ref,
                   precision: str, result: CheckResult | None = None) -> CheckResult:
    """Gradients against the reference; expert weight grads on the reference's checked experts.
    ``result``: add to it (a step's forward check) instead of a fresh one."""
    tol = TOLERANCE[precision]
    res = CheckResult() if result is None else result
    compare("dx", dx_TH, ref.dx_TH, tol, res)
    compare("d_router_weights", dprobs_TK, ref.dprobs_TK, tol, res)
    for name, g_ref in ref.dweights.items():
        g = dweights.get(name)
        if g is not None and name.startswith("w") and not name.startswith("ws"):
            g = g[ref.checked_experts]
        compare(name, g, g_ref, tol, res)
    return res
