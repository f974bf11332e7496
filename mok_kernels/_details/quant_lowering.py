"""Compile the FP8 quantisation kernels of ``tl_quant`` for a GPU architecture on any host
(Triton's compiler and its bundled ptxas), as ``compile_megakernel`` does for the megakernel:
lowering errors, registers, spills, and which conversion instructions the casts became.

Legend: T rows, H hidden (activation rows), K reduction rows and N output columns of weights.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from mok_kernels._details.lowering import Lowered, _ptxas

QUANT_KERNELS = ("blockwise", "rowwise", "rowwise_colmax", "weight_128x128", "colwise", "mx")


def _spec(kernel: str, size: int, pow2_scales: bool, soft_cast: bool, dtype: str
          ) -> tuple[object, dict[str, str], dict[str, object], int]:
    """(jit function, signature of the runtime arguments, constexprs, num_warps) as the host
    wrapper launches ``kernel``; ``size`` is H for activations, K (colwise) or N (128x128)
    for weights, the dimension the kernel is specialised on. A type ending in "/16" is an
    argument the launch sees as a multiple of 16 (pointers from the caching allocator,
    strides and widths at real shapes) and specialises on."""
    from mok_kernels._details import tl_quant as tq

    cast = {"POW2": pow2_scales, "SOFT_CAST": soft_cast}
    ptrs = {"x_ptr": f"*{dtype}/16", "w_ptr": f"*{dtype}/16", "q_ptr": "*fp8e4nv/16",
            "s_ptr": "*u8/16" if kernel == "mx" else "*fp32/16"}
    if kernel == "blockwise":
        return (tq._quant_act_kernel, {**ptrs, "T": "i32"},
                {"H": size, "BLOCK": 128, "BT": tq.act_rows(128), **cast}, 4)
    if kernel in ("rowwise", "rowwise_colmax", "colwise"):
        # the stride that is 1 (contiguous elements of a row, or adjacent columns) is a
        # constant at launch; the lines of colwise are N output columns
        unit, tile, lines = (("line_stride", tq.COL_LINES, "i32/16") if kernel == "colwise"
                             else ("elem_stride", tq.ROW_LINES, "i32"))
        units = {unit: 1, "s_line_stride": 1} | ({"q_line_stride": 1} if unit == "line_stride"
                                                  else {})
        sig = {**ptrs, "LINES": lines, "batch_stride": "i32/16", "line_stride": "i32/16",
               "elem_stride": "i32/16", "q_line_stride": "i32/16", "s_line_stride": "i32"}
        if kernel == "rowwise_colmax":  # with each column's partial max (col_amax_H)
            return (tq._quant_lines_kernel, {**sig, "cmax_ptr": "*fp32/16"},
                    {**units, "LEN": size, **tile, **cast, "CMAX": True}, 4)
        return (tq._quant_lines_kernel, sig,
                {**units, "LEN": size, **tile, **cast, "CMAX": False, "cmax_ptr": None}, 4)
    if kernel == "weight_128x128":
        return tq._quant_w_kernel, ptrs, {"N": size, **cast}, 8
    if kernel == "mx":
        return (tq._quant_mx_kernel, {**ptrs, "T": "i32"},
                {"H": size, "BT": 32, "BH": 128, "SOFT_CAST": soft_cast}, 4)
    raise ValueError(f"kernel={kernel!r} is invalid: allowed {' | '.join(QUANT_KERNELS)}")


def compile_quant_kernel(kernel: str, size: int = 7168, *, arch: int = 90,
                         pow2_scales: bool = False, soft_cast: bool = False,
                         dtype: str = "bf16") -> Lowered:
    """Compile one quantisation kernel (``QUANT_KERNELS``: 1x128 activation blocks, one
    scale per activation row, the same with its column maxima (``col_amax_H``), 128x128
    weight blocks, one per weight output column, MXFP8)
    for ``sm_<arch>`` (90 Hopper, 100 Blackwell) with ``dtype`` input (bf16 | fp16 | fp32)
    as its host wrapper launches it, then run ptxas -v on the PTX."""
    fn, types, consts, warps = _spec(kernel, size, pow2_scales, soft_cast, dtype)
    return _compile(fn, types, consts, {"num_warps": warps}, arch)


FFN_KERNELS = ("gate_up", "down")


def compile_fp8_ffn_kernel(kernel: str, recipe: str, *, arch: int = 90, hidden: int = 7168,
                           intermediate: int = 2048, tiles: dict | None = None) -> Lowered:
    """Compile one FP8 expert-FFN kernel of ``tl_gemm_fp8`` (``FFN_KERNELS``) for a recipe
    (blockwise | rowwise | mx | rowwise_all) and ``sm_<arch>`` with the tiles ``ffn_fp8``
    launches it with (``ffn_fp8.tiles_for``), then run ptxas -v: registers, spills, and (in
    the PTX) which MMA instructions the FP8 dots became."""
    from mok_kernels._details import ffn_fp8
    from mok_kernels._details import tl_gemm_fp8 as tg

    if kernel not in FFN_KERNELS:
        raise ValueError(f"kernel={kernel!r} is invalid: allowed {' | '.join(FFN_KERNELS)}")
    rec = ffn_fp8._check_recipe(recipe)
    t = dict((tiles or ffn_fp8.tiles_for(recipe))[kernel])
    H, I = hidden, intermediate
    mx = rec == tg.MX
    hrec = tg.down_recipe(rec)
    scale = "*u8/16" if mx else "*fp32/16"
    sh = I // 32 if mx else I // 128
    sw1, sw2 = tg.fp8_scale_sizes(H, I, rec)
    opts = {"num_warps": t.pop("num_warps"), "num_stages": t.pop("num_stages")}
    rows16 = rec == tg.ROWWISE_ALL  # h: FP8 rows in the bytes of bf16 rows
    if kernel == "gate_up" and rows16:
        types = {"x_ptr": "*fp8e4nv/16", "sx_ptr": "*fp32/16", "grp_ptr": "*i32/16",
                 "w1_ptr": "*fp8e4nv/16", "sw1_ptr": scale, "h16_ptr": "*bf16/16"}
        consts = {"H": H, "I": I, "SW1": sw1, **t, "POW2": False, "SOFT_CAST": False,
                  "F32_DOT": False}
        return _compile(tg.fp8_gate_up_rows_kernel, types, consts, opts, arch)
    if kernel == "gate_up":
        sx = {tg.BLOCKWISE: H // 128, tg.ROWWISE: 1, tg.MX: H // 32}[rec]
        types = {"x_ptr": "*fp8e4nv/16", "sx_ptr": scale if rec != tg.ROWWISE else "*fp32/16",
                 "grp_ptr": "*i32/16", "w1_ptr": "*fp8e4nv/16", "sw1_ptr": scale,
                 "h_ptr": "*fp8e4nv/16", "sh_ptr": scale}
        consts = {"H": H, "I": I, "SX": sx, "SW1": sw1, "SH": sh, **t, "RECIPE": rec,
                  "H_RECIPE": hrec, "POW2": False, "SOFT_CAST": False, "F32_DOT": False}
        return _compile(tg.fp8_gate_up_kernel, types, consts, opts, arch)
    types = {"h_ptr": "*bf16/16" if rows16 else "*fp8e4nv/16", "sh_ptr": scale,
             "grp_ptr": "*i32/16", "w2_ptr": "*fp8e4nv/16", "sw2_ptr": scale,
             "y_ptr": "*bf16/16"}
    consts = {"H": H, "I": I, "SH": 0 if rows16 else sh, "SW2": sw2, **t, "RECIPE": hrec,
              "F32_DOT": False, "ROWS16": rows16}
    return _compile(tg.fp8_down_kernel, types, consts, opts, arch)


def compile_pull_kernel(kind: str = "bf16", phase: int = 0, *, hidden: int = 7168,
                        arch: int = 90, interleave: bool = False,
                        prequant: bool = False, prefetch: bool = False,
                        cols: int = 0) -> Lowered:
    """Compile the backward's separate pull for sm_<arch> as the backward launches it: kind
    "bf16" (``pull_rows_kernel``: token rows gathered by loaded offsets into [L, P, H] bf16
    rows, PULL_ROWS rows and ``_row_chunk(H)`` columns per step) or "fp8t"
    (``pull_rows_fp8t_kernel``, ``bwd_fp8_wgrad``: the rows' transposed e4m3 copies, 64 rows
    and 128 columns per step, with the bf16 dY rows in phases 1 and 2) or "bf16_by_token"
    (``pull_rows_by_token_kernel``, ``bwd_pull_by_token``: PULL_TOKENS tokens per program,
    their rows written to up to 9 slot rows each); ``phase`` 0 (one pass) or 1 / 2
    (``bwd_pull_dedup``); ``interleave`` ("fp8t" only, ``bwd_pull_interleave``): each
    program's row block from the block order; ``prequant`` ("fp8t" only,
    ``bwd_fp8_prequant``): the rows already e4m3 at home, moved as bytes (every row buffer
    a byte view); ``prefetch`` ("fp8t", phase 0, ``bwd_pull_prefetch``): the next chunk's
    rows loaded before the current one is stored; ``cols`` (the bf16 kinds,
    ``bwd_pull_cols``): columns per step, 0 for ``_row_chunk(hidden)``."""
    from mok_kernels._details.backward import PULL_ROWS, PULL_TOKENS
    from mok_kernels._details.forward import _row_chunk
    from mok_kernels._details.tl_backward_pull import (
        pull_rows_by_token_kernel,
        pull_rows_fp8t_kernel,
        pull_rows_kernel,
    )

    a = "/16"  # 16-byte aligned pointers, as the caching allocator gives
    types = {"src_ptr": "*i32" + a, "total_ptr": "*i32" + a, "x_base": "*bf16" + a,
             "x_tab": "*i64" + a, "dy_base": "*bf16" + a, "tab16": "*i64" + a,
             "xg_ptr": "*bf16" + a, "dyg_ptr": "*bf16" + a, "first_ptr": "*i32" + a,
             "xqT_ptr": "*fp8e4nv" + a, "dyqT_ptr": "*fp8e4nv" + a, "gxam_ptr": "*fp32" + a,
             "gdyam_ptr": "*fp32" + a, "T": "i32", "P": "i32" + a,
             "slot_rows_ptr": "*i32" + a, "N": "i32", "order_ptr": "*i32" + a}
    if kind == "fp8t":
        fn = pull_rows_fp8t_kernel
        consts: dict[str, object] = {"BR": 64, "CH": 128, "DY16": phase > 0, "POW2": False,
                                     "SOFT_CAST": False, "ORDER": interleave}
        if not interleave:
            consts["order_ptr"] = None
        if phase == 0:
            consts["xg_ptr"] = None
        consts["PRE"] = prequant
        consts["AHEAD"] = prefetch
        if prequant:
            types.update({name: "*u8" + a for name in ("x_base", "dy_base", "xg_ptr",
                                                       "dyg_ptr", "xqT_ptr", "dyqT_ptr")})
    elif kind == "bf16":
        fn = pull_rows_kernel
        consts = {"BR": PULL_ROWS, "CH": cols or _row_chunk(hidden), "WHICH": 0}
    elif kind == "bf16_by_token" and phase == 0:
        fn = pull_rows_by_token_kernel
        consts = {"BT": PULL_TOKENS, "CH": cols or _row_chunk(hidden), "S": 9}
    else:
        raise ValueError(f"kind={kind!r}, phase={phase} is invalid: allowed bf16 | fp8t "
                         "(phase 0, 1, 2) | bf16_by_token (phase 0)")
    if (interleave or prequant) and kind != "fp8t":
        raise ValueError(f"interleave / prequant with kind={kind!r} is invalid: allowed with "
                         "fp8t only")
    consts = {"S": 16, **consts, "H": hidden, "PHASE": phase}
    if phase == 0:
        consts["first_ptr"] = None
    return _compile(fn, {k: v for k, v in types.items() if k in fn.arg_names}, consts,
                    {"num_warps": 4}, arch)


def _compile(fn, types: dict[str, str], consts: dict[str, object], options: dict,
             arch: int) -> Lowered:
    """triton.compile ``fn`` for sm_<arch> with the runtime argument ``types`` ("/16": known
    multiple of 16) and ``consts``, then ptxas -v on its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], object] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            sig[name] = types[name].removesuffix("/16")
            if types[name].endswith("/16"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 64 if arch == 90 else 32)
    c = triton.compile(src, target=target, options=options)
    ptx = c.asm["ptx"]
    suffix = "a" if arch in (90, 100) else ""
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.ptx"
        f.write_text(ptx)
        out = subprocess.run([_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", str(f),
                              "-o", str(Path(tmp) / "k.cubin")], capture_output=True,
                             text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{arch}: {out.stderr[-2000:]}")
    return Lowered(c.asm["ttgir"], ptx, int(c.metadata.shared), out.stdout + out.stderr)
