"""Compile the megakernel for a GPU architecture without a GPU (Triton's compiler and the
bundled ptxas run on any host): lowering errors, shared memory, registers and spills, and
ptxas's performance warnings for a config and shape, e.g. on a CI machine or before a run.

Legend: H hidden, I intermediate, K top-k, S combine slots per token (K, +1 shared expert).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mok_kernels._details.config import MoKConfig

# Kernel pointer arguments and their element types (the launch passes tensors there).
_POINTERS = {"x_base": "*bf16", "x_tab": "*i64", "comb_base": "*bf16", "comb_tab": "*i64",
             "src_ptr": "*i32", "group_ptr": "*i32", "total_ptr": "*i32", "ring_ptr": "*bf16",
             "h_ptr": "*bf16", "out_ptr": "*bf16", "ctr_ptr": "*i32", "err_ptr": "*i32",
             "pre_ptr": "*bf16", "hs_ptr": "*bf16", "dy_base": "*bf16", "tab16": "*i64",
             "p_base": "*fp32", "drp_base": "*fp32", "tab32": "*i64", "gstart_ptr": "*i32",
             "dw1_ptr": "*bf16", "dw2_ptr": "*bf16", "dws1_ptr": "*bf16", "dws2_ptr": "*bf16",
             "y_ptr": "*bf16", "p_ptr": "*fp32", "sum_ptr": "*i32",
             "w1_ptr": "*bf16", "w2_ptr": "*bf16", "ws1_ptr": "*bf16", "ws2_ptr": "*bf16"}


@dataclass(frozen=True)
class Lowered:
    """One compiled megakernel: its intermediate forms and what ptxas reported."""

    ttgir: str
    ptx: str
    shared_bytes: int
    ptxas_log: str  # ptxas -v output for this architecture

    @property
    def spills(self) -> bool:
        """Any register spill reported by ptxas ("N bytes spill stores" with N > 0)."""
        return bool(re.search(r"[1-9]\d* bytes spill (stores|loads)", self.ptxas_log))

    @property
    def registers(self) -> int:
        """Registers per thread (ptxas's "Used N registers"; 0 if not reported)."""
        m = re.search(r"Used (\d+) registers", self.ptxas_log)
        return int(m.group(1)) if m else 0

    @property
    def mma_instructions(self) -> list[str]:
        """Distinct tensor-core MMA instructions in the PTX (wgmma on Hopper, tcgen05.mma
        on Blackwell)."""
        found = re.findall(r"^\s*(?:@!?%\w+\s+)?((?:wgmma\.mma_async|tcgen05\.mma)\S*)",
                           self.ptx, re.M)  # predicated ones too: "@%p1 tcgen05.mma..."
        return sorted(set(found))

    @property
    def mma_serialized(self) -> bool:
        """ptxas warning C7515: wgmma instructions serialised (Hopper)."""
        return "C7515" in self.ptxas_log


def _ptxas(arch: int):
    """The ptxas Triton itself uses for ``arch`` (its choice differs between releases)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch)
    except ImportError:
        from triton import knobs

        return knobs.nvidia.ptxas_blackwell if arch >= 100 else knobs.nvidia.ptxas


def compile_megakernel(config: MoKConfig, hidden: int, intermediate: int, *, topk: int = 8,
                       shared: bool = False, comm_programs: int = 0, programs: int = 132,
                       arch: int = 90, kernel: str = "forward", phases: int = 15) -> Lowered:
    """Compile ``mok_forward_kernel`` (``kernel="backward"``: ``mok_backward_kernel``) as the
    launch would for this config and shape, for ``sm_<arch>`` (90 Hopper, 100 Blackwell),
    then run ptxas -v on its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mok_kernels._details.backward import (
        backward_constants,
        backward_stages,
        da_cols,
        wgrad_rows,
    )
    from mok_kernels._details.forward import descriptor_boxes, kernel_constants
    from mok_kernels._details.tl_backward import mok_backward_kernel
    from mok_kernels._details.tl_mega import mok_forward_kernel

    cfg = config
    cfg.check_shape(hidden, intermediate)
    if kernel not in ("forward", "backward"):
        raise ValueError(f"kernel={kernel!r} is invalid: allowed forward | backward")
    if kernel == "forward":
        kern = mok_forward_kernel
        consts = kernel_constants(cfg, hidden=hidden, intermediate=intermediate,
                                  slots=topk + int(shared), shared=shared, programs=programs,
                                  comm=comm_programs)
        descs = descriptor_boxes(cfg)
    else:
        kern = mok_backward_kernel
        consts = backward_constants(cfg, hidden=hidden, intermediate=intermediate,
                                    slots=topk + int(shared), shared=shared,
                                    programs=programs, phases=phases)
        w1, w2 = [cfg.block_n, cfg.block_k], [da_cols(cfg, intermediate), cfg.block_k]
        q, bkw = cfg.block_n // 4, wgrad_rows(cfg)
        descs = {"w1_desc": w1, "w2_desc": w2, "ws1_desc": w1, "ws2_desc": w2,
                 "pre_a_desc": [cfg.block_m, 2 * q if cfg.gate_up_interleaved else q],
                 "hs_a_desc": [cfg.block_m, q], "hs_c_desc": [bkw, cfg.block_n // 2],
                 "pre_d_desc": [bkw, cfg.block_n], "dyg_a_desc": [cfg.block_m, cfg.block_k],
                 "dyg_c_desc": [bkw, cfg.block_n], "xg_d_desc": [bkw, cfg.block_n // 2]}
        # the backward always reads weight tiles through TMA, with its own stage count
        cfg = cfg.__class__(**{**cfg.__dict__, "tma": True, "num_stages": backward_stages(cfg)})
    sig: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], object] = {}
    for i, name in enumerate(kern.arg_names):
        if name in _POINTERS:
            sig[name] = _POINTERS[name]
        elif name in descs:
            if (cfg.tma or kernel == "backward") and (shared or not name.startswith("ws")):
                sig[name] = f"tensordesc<bf16[{descs[name][0]}, {descs[name][1]}]>"
            else:
                sig[name], constexprs[(i,)] = "constexpr", None
        elif name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            sig[name] = "i32"
    # Tensors from the caching allocator are 16-byte aligned, as the launch specialises.
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in _POINTERS
             if n in kern.arg_names}
    src = ASTSource(fn=kern, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 64 if arch == 90 else 32)
    c = triton.compile(src, target=target, options={"num_warps": cfg.num_warps,
                                                    "num_stages": cfg.num_stages})
    ptx = c.asm["ptx"]
    suffix = "a" if arch in (90, 100) else ""
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.ptx"
        f.write_text(ptx)
        ptxas = _ptxas(arch)
        out = subprocess.run([ptxas.path, f"-arch=sm_{arch}{suffix}", "-v", str(f),
                              "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{arch}: {out.stderr[-2000:]}")
    return Lowered(c.asm["ttgir"], ptx, int(c.metadata.shared), out.stdout + out.stderr)
