"""Compile the megakernel for a GPU architecture without a GPU (Triton's compiler and the
bundled ptxas run on any host): lowering errors, shared memory, registers and spills, and
ptxas's performance warnings for a config and shape, e.g. on a CI machine or before a run.

The kernel is compiled with the arguments its launch passes: the launch's own argument dict
(``forward_kernel_args`` / ``backward_kernel_args``) built over ``meta`` tensors, from which
the signature's types follow, so the two cannot drift apart.

Legend: H hidden, I intermediate, K top-k, S combine slots per token (K, +1 shared expert).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mok_kernels._details.config import MoKConfig


def cuobjdump(cubin: bytes, tools: str | Path, flag: str = "-sass") -> str:
    """``cuobjdump FLAG`` of a cubin (``-sass``: its SASS; ``-res-usage``: registers, stack
    and shared memory per kernel), by the cuobjdump in ``tools``, the folder of the ptxas
    that built it, so the disassembler matches the assembler."""
    tool = Path(tools) / "cuobjdump"
    if not cubin or not tool.exists():
        raise RuntimeError(f"no cubin, or no cuobjdump at {tool}: cannot run cuobjdump {flag}")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.cubin"
        f.write_bytes(cubin)
        return subprocess.run([str(tool), flag, str(f)], capture_output=True, text=True,
                              check=True).stdout


@dataclass(frozen=True)
class Lowered:
    """One compiled megakernel: its intermediate forms and what ptxas reported."""

    ttgir: str
    ptx: str
    shared_bytes: int
    ptxas_log: str  # ptxas -v output for this architecture
    cubin: bytes = field(default=b"", repr=False)  # ptxas's output
    tools: str = ""  # the folder of the ptxas that built it (cuobjdump beside it)

    def sass(self) -> str:
        """The cubin's SASS as text (``cuobjdump``)."""
        return cuobjdump(self.cubin, self.tools)

    def sass_opcodes(self) -> Counter[str]:
        """How many SASS instructions of each opcode (``FMUL``, ``MUFU``, ``LDS``, ...; the
        part before the first dot) the cubin holds, static counts over the whole kernel. Of
        a build of one item kind (``phases``), less a build without its epilogue, they say
        what that epilogue costs per thread: e.g. how the dA items' SwiGLU backward fell from
        6328 to 3024 with ``bwd_lean_epilogue`` (notes/mok-kernel.md)."""
        return Counter(m.split(".")[0] for _, m in sass_instructions(self.sass()))

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


_SASS_LINE = re.compile(
    r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[\w.]+)?)(.*)$", re.M)


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(byte offset, mnemonic) of every instruction in ``cuobjdump -sass`` text, in order;
    the mnemonic with its modifiers (``HGMMA.64x256x16.F32.BF16``), without predicate or
    operands."""
    return [(int(m[1], 16), m[2]) for m in _SASS_LINE.finditer(sass)]


SKELETON = frozenset({"HGMMA", "WARPGROUP", "SYNCS", "BAR", "UTMALDG", "UTMAPF", "BRA",
                      "UTCHMMA", "UTCQMMA", "UTCBAR", "DEPBAR", "LDGSTS"})


@dataclass(frozen=True)
class SassLoop:
    """One loop of a kernel's SASS: the instructions from a backward branch's target (byte
    offset ``start``) through the branch itself (``end``), their mnemonics in order."""

    start: int
    end: int
    mnemonics: tuple[str, ...]

    @property
    def counts(self) -> Counter[str]:
        """Instructions of each opcode (the mnemonic's part before the first dot)."""
        return Counter(m.split(".")[0] for m in self.mnemonics)

    def skeleton(self, opcodes: frozenset[str] = SKELETON) -> tuple[str, ...]:
        """The mnemonics, in order, of the instructions that decide a K step's time: MMAs,
        their waits, barriers, mbarrier operations, TMA loads and branches (``opcodes``);
        the scalar address arithmetic between them left out."""
        return tuple(m for m in self.mnemonics if m.split(".")[0] in opcodes)


def mma_loop(sass: str) -> SassLoop:
    """The shortest loop of ``sass`` (``cuobjdump -sass`` text of one kernel) that holds a
    tensor-core MMA (``HGMMA`` on Hopper; an opcode ending in ``MMA``): a GEMM's K loop. Two
    builds whose K loops are the same opcodes in the same order run the same instructions
    per K step, so a speed gap between them lies outside the loop's code (its clock, its
    operands' path through L2, what runs beside it)."""
    ins = sass_instructions(sass)
    at = {off: i for i, (off, _) in enumerate(ins)}
    best: tuple[int, int] | None = None
    for m in _SASS_LINE.finditer(sass):
        if m[2].split(".")[0] != "BRA":
            continue
        target = re.search(r"0x([0-9a-f]+)", m[3])
        end, start = int(m[1], 16), int(target[1], 16) if target else -1
        if not 0 <= start <= end or start not in at:
            continue
        body = ins[at[start]:at[end] + 1]
        if any(mn.split(".")[0].endswith("MMA") for _, mn in body) and (
                best is None or end - start < best[1] - best[0]):
            best = (start, end)
    if best is None:
        raise ValueError("no loop with a tensor-core MMA in this SASS")
    return SassLoop(best[0], best[1], tuple(m for _, m in ins[at[best[0]]:at[best[1]] + 1]))


def _ptxas(arch: int):
    """The ptxas Triton itself uses for ``arch`` (its choice differs between releases)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch)
    except ImportError:
        from triton import knobs

        return knobs.nvidia.ptxas_blackwell if arch >= 100 else knobs.nvidia.ptxas


def kernel_args(config: MoKConfig, hidden: int, intermediate: int, *, topk: int = 8,
                shared: bool = False, comm_programs: int = 0, programs: int = 132,
                kernel: str = "forward", phases: int = 15,
                trace: bool = False, split: int = 0,
                training: bool = False) -> dict[str, object]:
    """The argument dict the launch would pass (``forward_kernel_args`` /
    ``backward_kernel_args``), built over a workspace, schedule and weights on the ``meta``
    device (shapes and dtypes, no memory): one logical rank, one minibatch of tokens, one
    local expert. ``trace``: with the item trace (``backward(_trace=...)``,
    ``forward(_trace=...)``); ``training``: the training forward's (``forward_train``:
    the gate+up tiles also store their pre-activations)."""
    from mok_kernels._details.backward import (
        BackwardFp8Weights,
        backward_kernel_args,
        backward_scratch,
        backward_trace_capacity,
    )
    from mok_kernels._details.ffn_fp8 import Fp8Weight
    from mok_kernels._details.forward import forward_kernel_args, forward_trace_capacity
    from mok_kernels._details.schedule import build_schedule_tensors
    from mok_kernels._details.tl_gemm_fp8 import fp8_scale_sizes
    from mok_kernels._details.workspace import get_workspace

    if kernel not in ("forward", "backward"):
        raise ValueError(f"kernel={kernel!r} is invalid: allowed forward | backward")
    cfg, H, I, bf = config, hidden, intermediate, torch.bfloat16
    ws = get_workspace(cfg, tokens=cfg.minibatch, hidden=H, intermediate=I, local_experts=1,
                       topk=topk, shared=shared, device="meta")
    st = build_schedule_tensors(ws.gather_idx(), ws.ranks_L, tokens=ws.T, local_experts=ws.E,
                                shared=shared, block_m=cfg.block_m, capacity=ws.P,
                                align=cfg.row_align, first_rows=cfg.dispatch_dedup)

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=bf, device="meta")

    w = (meta(ws.E, H, 2 * I), meta(ws.E, I, H), meta(H, 2 * I) if shared else None,
         meta(I, H) if shared else None)
    if kernel == "forward" and cfg.fp8 != "none":  # e4m3 weights and their scales
        sw1, sw2 = fp8_scale_sizes(H, I, cfg.quant)
        sdt = torch.uint8 if cfg.fp8 == "mx" else torch.float32

        def fp8(t: torch.Tensor | None, scales: int) -> Fp8Weight | None:
            if t is None:
                return None
            *lead, k, n = t.shape  # the e4m3 weight is K-major ([..., N, K])
            return Fp8Weight(torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn, device="meta"),
                             torch.empty(*lead, scales, dtype=sdt, device="meta"))

        w = (fp8(w[0], sw1), fp8(w[1], sw2), fp8(w[2], sw1), fp8(w[3], sw2))
    if kernel == "forward":
        p_NK = torch.empty(ws.T, ws.K, dtype=torch.float32, device="meta")
        args = forward_kernel_args(ws, st, *w, y_NH=meta(ws.T, H), p_NK=p_NK, x_LTH=ws.x_LTH,
                                   pre_LPF=meta(1, ws.P, 2 * I) if training else None,
                                   withhold=0, programs=programs,
                                   comm=comm_programs, interpreting=False)
        if trace:
            args.update(_meta_trace(forward_trace_capacity(ws)))
        return args
    fp8_weights = None
    if cfg.bwd_fp8_da or cfg.bwd_fp8_dx:  # the FP8 dgrad items' e4m3 weight rows + scales

        def e4m3(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.float8_e4m3fn, device="meta")

        def f32(n: int) -> torch.Tensor:
            return torch.empty(n, dtype=torch.float32, device="meta")

        fp8_weights = BackwardFp8Weights()
        if cfg.bwd_fp8_da:
            fp8_weights.w2q_NH, fp8_weights.sw2_N = e4m3(ws.E * I, H), f32(ws.E * I)
            if shared:
                fp8_weights.ws2q_IH, fp8_weights.sws2_I = e4m3(I, H), f32(I)
        if cfg.bwd_fp8_dx:
            fp8_weights.w1q_NF, fp8_weights.sw1_N = e4m3(ws.E * H, 2 * I), f32(ws.E * H)
            if shared:
                fp8_weights.ws1q_HF, fp8_weights.sws1_H = e4m3(H, 2 * I), f32(H)
    args = backward_kernel_args(ws, st, meta(1, ws.P, 2 * I), w,
                                backward_scratch(ws), withhold=0, programs=programs,
                                phases=phases, interpreting=False, split=split,
                                fp8_weights=fp8_weights)
    if trace:
        args.update(_meta_trace(backward_trace_capacity(ws)))
    return args


def _meta_trace(rows: int) -> dict[str, object]:
    """The trace arguments over a ``meta`` buffer of one logical rank's ``rows``."""
    from mok_kernels._details.forward import trace_args

    return trace_args(torch.empty(1, rows, 4, dtype=torch.int64, device="meta"), 1, rows)


_ELEMENT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
            torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8"}


def signature(kern, args: dict[str, object]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attributes) for ``triton.compiler.ASTSource`` from the
    launch's argument dict: a tensor is a pointer to its dtype (16-byte aligned, as the
    caching allocator gives and the launch specialises), a TMA descriptor its dtype and
    box, an int an i32 (known a multiple of 16 where it is one, as the launch specialises
    it), a constexpr parameter (or None) its value."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    sig: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], object] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, param in enumerate(kern.params):
        value = args[param.name]
        if param.is_constexpr or value is None:
            sig[param.name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = f"*{_ELEMENT[value.dtype]}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, TensorDescriptor):
            rows, cols = value.block_shape
            sig[param.name] = f"tensordesc<{_ELEMENT[value.base.dtype]}[{rows}, {cols}]>"
        elif isinstance(value, int):
            sig[param.name] = "i32"
            if value % 16 == 0:  # as the launch specialises an int that 16 divides
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{param.name}: no Triton type for {type(value).__name__}")
    return sig, constexprs, attrs


def compile_megakernel(config: MoKConfig, hidden: int, intermediate: int, *, topk: int = 8,
                       shared: bool = False, comm_programs: int = 0, programs: int = 132,
                       arch: int = 90, kernel: str = "forward", phases: int = 15,
                       trace: bool = False, split: int = 0, training: bool = False) -> Lowered:
    """Compile ``mok_forward_kernel`` (``kernel="backward"``: ``mok_backward_kernel``; with
    ``trace`` their item trace; ``split``: one launch of ``bwd_split_launch``, with
    ``phases`` its share of the mask, ``backward.split_launches``; ``training``: the
    training forward, which stores the pre-activations) as the launch would for
    this config and shape, for
    ``sm_<arch>`` (90 Hopper, 100 Blackwell), then run ptxas -v on its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mok_kernels._details.backward import backward_stages
    from mok_kernels._details.tl_backward import mok_backward_kernel
    from mok_kernels._details.tl_mega import mok_forward_kernel

    config.check_shape(hidden, intermediate)
    args = kernel_args(config, hidden, intermediate, topk=topk, shared=shared,
                       comm_programs=comm_programs, programs=programs, kernel=kernel,
                       phases=phases, trace=trace, split=split, training=training)
    kern = mok_forward_kernel if kernel == "forward" else mok_backward_kernel
    stages = config.num_stages if kernel == "forward" else backward_stages(config)
    sig, constexprs, attrs = signature(kern, args)
    src = ASTSource(fn=kern, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 64 if arch == 90 else 32)
    c = triton.compile(src, target=target, options={"num_warps": config.num_warps,
                                                    "num_stages": stages})
    return _assemble(c, arch)


def compile_dx_gluon(hidden: int, intermediate: int, *, rows: int, slots: int, band: int = 16,
                     shared: bool = False, store_rows: bool = False) -> Lowered:
    """Compile the Gluon dX launch of ``bwd_dx_gluon`` (``gl_dx``) for sm_90 at this shape
    (``rows`` per rank: the workspace's P; ``slots`` per token: S; ``store_rows``: as
    ``bwd_dx_rows`` stores), then run ptxas -v on its PTX. Needs Triton's Gluon Hopper API."""
    from mok_kernels._details.gl_dx import compile_sm90

    return _assemble(compile_sm90(rows, hidden, intermediate, slots, band, shared, store_rows),
                     90)


def compile_dw_gluon(hidden: int, intermediate: int, *, rows: int, groups: int,
                     shared: bool = False, interleaved: bool = True) -> Lowered:
    """Compile the Gluon weight-gradient launch of ``bwd_dw_gluon`` (``gl_dw``) for sm_90 at
    this shape (``rows`` per rank: the workspace's P; ``groups``: E, +1 with the shared
    expert), then run ptxas -v on its PTX. Needs Triton's Gluon Hopper API."""
    from mok_kernels._details.gl_dw import compile_sm90

    return _assemble(compile_sm90(rows, hidden, intermediate, groups, shared, interleaved), 90)


def _assemble(c, arch: int) -> Lowered:
    """A Triton build ``c`` as ``Lowered``: ptxas -v (the ptxas Triton uses for ``arch``)
    on its PTX, for the register, spill and serialisation report and the cubin."""
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
        cubin = (Path(tmp) / "k.cubin").read_bytes()
    return Lowered(c.asm["ttgir"], ptx, int(c.metadata.shared), out.stdout + out.stderr, cubin,
                   str(Path(ptxas.path).parent))
