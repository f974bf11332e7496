"""Do the backward megakernel's dA K loop and a standalone Triton kernel of the same loop
compile to the same SASS? (No GPU needed: Triton's compiler and its bundled ptxas and
cuobjdump run on any host.)

The two builds compared, at the Kimi K2 48 x 16384 shape (hidden 7168, intermediate 2048):
  * the megakernel's backward with phase mask 17 (the dA items' K loop, no epilogue), at the
    mok backend's one-rank defaults, with ``--options`` on top (e.g. ``{"num_stages": 3}``);
  * benchmarks/gluon_da_probe.py's ``plain_noepi``: a persistent Triton kernel of the same
    [128, 256] tile K loop, at ``--probe-stages``.

For each it prints the shortest loop that holds an MMA (the K loop: ``mma_loop`` in
mok_kernels/_details/lowering.py), its instruction count and opcode counts, then whether the
two loops' skeletons match (MMAs, their waits, barriers, mbarrier operations, TMA loads,
branches, in order). Same skeleton: per K step both issue the same tensor-core, TMA and
synchronisation work, and a gap between their timed rates lies outside the loop's code
(clock, the operands' path through L2, what runs beside the loop). Run it under the Triton
the GPU runs (the device's is 3.6):

    python benchmarks/kloop_sass.py [--probe-stages 3] [--options JSON] [--diff]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

KIMI_48 = dict(hidden=7168, intermediate=2048, tokens=16384, topk=8, experts=48)


def megakernel_loop(options: dict, phases: int = 17):
    """(label, SassLoop, ptxas summary) of the megakernel backward's dA K loop."""
    from mok_kernels._details.backward import split_launches
    from mok_kernels._details.config import MoKConfig
    from mok_kernels._details.lowering import compile_megakernel, mma_loop
    from mokbench.mok_backend import default_config_fields

    s = KIMI_48
    fields = default_config_fields(s["hidden"], s["intermediate"], s["tokens"], s["topk"], 132,
                                   1, local_experts=s["experts"])
    fields.update(options)
    cfg = MoKConfig(**fields)
    split, mask = split_launches(cfg, phases)[0]
    lw = compile_megakernel(cfg, s["hidden"], s["intermediate"], kernel="backward",
                            phases=mask, split=split)
    label = f"megakernel, phase mask {phases}, {cfg.num_stages} stages"
    return label, mma_loop(lw.sass()), f"{lw.registers} registers, {lw.shared_bytes} B shared"


def probe_loop(stages: int):
    """(label, SassLoop, ptxas summary) of the probe's plain_noepi K loop."""
    import gluon_da_probe as gp

    from mok_kernels._details.lowering import cuobjdump, mma_loop

    v = next(v for v in gp.select_variants("plain_noepi", stages))
    c = gp.build_variant(v, gp.KIMI)
    tools = Path(gp._ptxas_path()).parent
    sass = cuobjdump(c.asm["cubin"], tools)
    regs = re.search(r"REG:(\d+)", cuobjdump(c.asm["cubin"], tools, "-res-usage"))
    return (f"probe plain_noepi, {stages} stages", mma_loop(sass),
            f"{regs[1] if regs else '?'} registers, {c.metadata.shared} B shared")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe-stages", type=int, default=3, metavar="N",
                    help="the probe's pipeline stages (2 to 4; default 3, as it was timed)")
    ap.add_argument("--options", default="{}", metavar="JSON",
                    help='megakernel config fields over the defaults, e.g. \'{"num_stages": 3}\'')
    ap.add_argument("--diff", action="store_true",
                    help="also print the two loops' mnemonics side by side where they differ")
    a = ap.parse_args()
    try:
        options = json.loads(a.options)
    except json.JSONDecodeError as exc:
        ap.error(f"--options: not JSON ({exc}); allowed a JSON object of config fields")
    if not isinstance(options, dict):
        ap.error(f"--options: got {a.options!r}; allowed a JSON object of config fields")
    if not 2 <= a.probe_stages <= 4:
        ap.error(f"--probe-stages: got {a.probe_stages}; allowed 2, 3 or 4")
    import triton

    print(f"triton {triton.__version__}, sm_90, Kimi K2 48 x 16384 (hidden 7168, "
          "intermediate 2048), [128, 256] tiles")
    builds = [megakernel_loop(options), probe_loop(a.probe_stages)]
    for label, loop, summary in builds:
        ops = ", ".join(f"{k} {n}" for k, n in sorted(loop.counts.items()))
        print(f"{label}: {summary}\n  K loop {loop.start:#x}-{loop.end:#x}, "
              f"{len(loop.mnemonics)} instructions: {ops}")
    (_, mega, _), (_, probe, _) = builds
    same = mega.skeleton() == probe.skeleton()
    print(f"skeleton per K step: {' '.join(mega.skeleton())}")
    print("same skeleton: " + ("yes" if same else f"NO; probe's: {' '.join(probe.skeleton())}"))
    if a.diff:
        import difflib

        print("\n".join(difflib.unified_diff(probe.mnemonics, mega.mnemonics, "probe",
                                             "megakernel", lineterm="", n=0)))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
