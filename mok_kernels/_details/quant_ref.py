"""Reference FP8 quantisers and the dequantisers, in plain torch (CPU or GPU): the ground
truth the Triton kernels of ``tl_quant`` match bit for bit, and what the reference check
uses to compare an FP8 layer with its BF16 reference.

Legend as in ``tl_quant``: T rows, H hidden, E experts, K reduction rows, N output columns.
Every division here is tensor / tensor: torch computes ``scalar / tensor`` on CPU as a
multiplication by a reciprocal, which is not correctly rounded, while the kernels divide
with ``div_rn``.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn
MX_BLOCK = 32  # elements per e8m0 scale in MXFP8
_FP32_MAX = torch.finfo(torch.float32).max


def _finite_amax(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| over dims in fp32 with NaN read as +inf (+inf marks a non-finite block)."""
    a = x.float().abs()
    return torch.where(a.isnan(), torch.inf, a).amax(dim=dims)


def _div(num: float, den: torch.Tensor) -> torch.Tensor:
    return torch.full_like(den, num) / den


def e4m3_scales(amax: torch.Tensor, pow2_scales: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inv, scale) from fp32 amax: x_q = e4m3(x * inv) and x ~ x_q * scale; see tl_quant."""
    inv = torch.where(amax == 0, 1.0, _div(E4M3_MAX, amax))
    inv = torch.where(inv == torch.inf, _FP32_MAX, inv)
    if pow2_scales:
        inv = (inv.view(torch.int32) & 0x7F800000).view(torch.float32)
    inv = torch.where(amax == torch.inf, torch.nan, inv)
    return inv, _div(1.0, inv)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3, nearest even, saturated at +-448 (the GPU's cvt.rn.satfinite); NaN
    stays NaN. The clamp makes the saturation explicit: torch's own cast of values past 448
    is not the same across its code paths."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def ref_quantize_blockwise(x: torch.Tensor, block: int = 128, *, pow2_scales: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (x_q e4m3, scale [..., H/block] fp32), one scale per 1 x block."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    inv, scale = e4m3_scales(_finite_amax(xb, (-1,)), pow2_scales)
    return to_e4m3(xb * inv[..., None]).reshape(x.shape), scale


def ref_quantize_rowwise(x: torch.Tensor, *, pow2_scales: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (x_q e4m3, scale [...] fp32), one scale per row."""
    inv, scale = e4m3_scales(_finite_amax(x, (-1,)), pow2_scales)
    return to_e4m3(x.float() * inv[..., None]), scale


def ref_quantize_colwise(w: torch.Tensor, *, pow2_scales: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] -> (w_q e4m3, scale [E, N] fp32), one scale per output column over K."""
    inv, scale = e4m3_scales(_finite_amax(w, (1,)), pow2_scales)
    return to_e4m3(w.float() * inv[:, None, :]), scale


def ref_quantize_weight_128x128(w: torch.Tensor, *, pow2_scales: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] -> (w_q e4m3, scale [E, K/128, N/128] fp32), one scale per 128x128."""
    E, K, N = w.shape
    wb = w.float().reshape(E, K // 128, 128, N // 128, 128)
    inv, scale = e4m3_scales(_finite_amax(wb, (2, 4)), pow2_scales)
    return to_e4m3(wb * inv[:, :, None, :, None]).reshape(E, K, N), scale


def e8m0_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(code uint8, inv fp32): code = e + 127 for the least 2^e >= amax / 448 (0 for amax
    == 0, 255 for a non-finite block), inv = 2^-e (NaN for 255)."""
    u = (amax / torch.full_like(amax, E4M3_MAX)).view(torch.int32)
    exp = u >> 23
    code = torch.where(exp == 0, (u > 0x400000).int(), exp + ((u & 0x7FFFFF) != 0).int())
    code = torch.where(amax == torch.inf, 255, code)
    inv = ((254 - code) << 23).view(torch.float32)
    return code.to(torch.uint8), torch.where(code == 255, torch.nan, inv)


def ref_quantize_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_q e4m3, scale_u8 [..., K/32] e8m0), rounded-up scales."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    code, inv = e8m0_scales(_finite_amax(xb, (-1,)))
    return to_e4m3(xb * inv[..., None]).reshape(x.shape), code


def dequantize_blockwise(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x_q [..., H], scale [..., H/block]) -> x [..., H] fp32."""
    block = x_q.shape[-1] // scale.shape[-1]
    return x_q.float() * scale.repeat_interleave(block, dim=-1)


def dequantize_rowwise(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x_q [..., H], scale [...]) -> x [..., H] fp32."""
    return x_q.float() * scale[..., None]


def dequantize_colwise(w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(w_q [E, K, N], scale [E, N]) -> w [E, K, N] fp32."""
    return w_q.float() * scale[:, None, :]


def dequantize_weight_128x128(w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(w_q [E, K, N], scale [E, K/128, N/128]) -> w [E, K, N] fp32."""
    s = scale.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    return w_q.float() * s


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 codes -> fp32 2^(code - 127) (code 0 is the subnormal 2^-127; 255 NaN)."""
    c = code.int()
    v = torch.ldexp(torch.ones_like(c, dtype=torch.float32), c - 127)
    return torch.where(c == 255, torch.nan, v)


def dequantize_mx(x_q: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """(x_q [..., K], scale_u8 [..., K/32]) -> x [..., K] fp32."""
    return x_q.float() * e8m0_to_float(scale_u8).repeat_interleave(MX_BLOCK, dim=-1)
