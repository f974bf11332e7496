"""The ``mok`` backend: our MoK-style Triton megakernels (BF16; FP8 forward), one rank of the
EP group.

Legend: T tokens on this rank, H hidden, I intermediate, E local experts, K top-k.

Knobs: defaults fit the shape (``MoKConfig.for_shape``: minibatch / macrobatch sized from the
two-waves rule on this GPU's SM count); override any field with the JSON in
$MOKBENCH_MOK_CONFIG, e.g. ``{"minibatch": 4096, "fwd_comm_sms": 8}``; the extra key
``"cuda_graph"`` (default false) replays schedule + forward as one CUDA graph (inference
only).

With autograd on and x or the router weights requiring grad, the forward is the training
forward (``mok_kernels.forward_train``: it keeps the gate/up pre-activations and SwiGLU rows)
inside a ``torch.autograd.Function`` whose backward is the backward megakernel, so
``y.backward(dy)`` gives dx, the router-weight gradient and the weight gradients. Under
``torch.no_grad()`` (or with no input requiring grad) it is the inference forward, which keeps
nothing.

FP8 (``precision = "fp8"``): the forward runs the megakernel's FP8 path
(``MoKConfig.fp8``; knob ``fp8`` = blockwise | rowwise | mx | rowwise_all, default
``default_fp8_recipe``), with the weights quantised once at setup (not timed); the backward
runs its dA / dX / weight-gradient items in FP8 as the knobs ``bwd_fp8_da`` / ``bwd_fp8_dx``
/ ``bwd_fp8_wgrad`` say (all three by default on Hopper, ``fp8_backward_fields``; the
row's variant says ``bwd=fp8_da_dx_wgrad``, ``fp8_da``, ...; the weights' FP8 copies the
dgrad items read made once at setup, ``quantize_backward_weights``), else the BF16 backward
megakernel on the BF16 weights (``bwd=bf16``).
"""

from __future__ import annotations

import json
import os

import torch

from mokbench.backend import BackendBase, Capabilities

CONFIG_ENV = "MOKBENCH_MOK_CONFIG"


def default_fp8_recipe(arch: int = 90) -> str:
    """The FP8 recipe a cell gets without the ``fp8`` knob. Hopper: "rowwise_all" (one scale
    per activation row and weight column in both GEMMs, each applied after a pure tensor-core
    K loop; the gate+up item that completes a row block requantises its h rows), at 128-row
    blocks. Training forward in ms, rowwise_all at 128-row blocks against rowwise at 64 (the
    default before) and TE's own FP8, one H200 (results/20261130-234427-h200-fp8-gpu0, -gpu1,
    results/20261130-234702-h200-fp8, results/20261130-234703-h200-fp8): Kimi 48 x 16384 12.382
    / 17.301 / 19.969; Kimi K2.7 Code 48 x 16384 13.732 / 19.583 / 22.022; Kimi 384 x 4096
    5.510 / 7.482 / 57.249; Qwen3.5 64 x 16384 5.775 / 7.701 / 16.762, at 6.5e-02 of the
    float32 layer (TE 6.6e-02). Blackwell (``arch`` 100 and up): "mx", MXFP8, the block-scaled
    tensor-core format there (unverified on hardware)."""
    return "mx" if arch >= 100 else "rowwise_all"


def fp8_config_fields(arch: int = 90, recipe: str | None = None) -> dict:
    """What the FP8 path needs on top of the defaults: the recipe, interleaved gate/up,
    block_n 256, block_k 128 (one scale step per K step), K-major e4m3 weight tiles through
    TMA (pipelined; the pointer-load build of the blockwise tiles spills on sm_90); one tile per
    work item (not measured yet). Row blocks: 128 for rowwise_all on Hopper (its sm_90 build
    does not spill there, rowwise's 1x128 h tiles do; its timings: ``default_fp8_recipe``, and
    the profiling script ``benchmarks/fp8_ffn_recipes.py`` in notes/mok-kernel.md) and for
    MXFP8 on Blackwell (the M of a block-scaled tcgen05 MMA); 64 for blockwise and rowwise on
    Hopper (their 128-row tiles spill). The backward (the BF16 one) at 128-row blocks
    whatever the forward's (``bwd_block_m``): at Kimi 48 x 16384 on one H200 it took 48.781
    ms after the FP8 forward at 64-row blocks (results/20261130-215158-h200-fp8) and 41.129
    at 128 (results/20261130-234427-h200-fp8-gpu0). K loops four stages deep, as in every
    FP8 run so far (the bf16 cells' three-stage forward is untimed in FP8)."""
    recipe = recipe or default_fp8_recipe(arch)
    bm = 128 if recipe == "rowwise_all" or (recipe == "mx" and arch >= 100) else 64
    return {"fp8": recipe, "gate_up_interleaved": True, "block_n": 256, "block_k": 128,
            "tma": True, "block_m": bm, "gate_up_tiles": 1, "down_tiles": 1, "num_stages": 4,
            "bwd_block_m": 128 if bm < 128 else 0}


def fp8_backward_fields(arch: int = 90, world_size: int = 1) -> dict:
    """The FP8 backward with ``precision = "fp8"`` on Hopper: the dA, dX and weight-gradient
    items in e4m3 (``bwd_fp8_da``, ``bwd_fp8_dx``, ``bwd_fp8_wgrad``) with 128-deep steps
    (``bwd_fp8_block_k``), as TE's and Megatron's FP8 rows run their backward in FP8.
    Why: at EP 1 the sweep results/20261201-081217-h200-fp8-backward put it at 1.063x /
    1.027x TE's FP8 backward (Kimi K2 48 x 16384, Kimi K2.7 Code) and 1.367x Megatron's
    (Qwen3.5), within TE's error, where mok's bf16 backward trailed TE
    (results/20261201-013037-h200-fp8); the profiling script ``benchmarks/mok_backward_time.py``
    timed the 128-deep steps faster than 64 (not a sweep; notes/mok-kernel.md). At EP 2
    (results/20261201-101615-h200x2-fp8, both with ``bwd_pull_dedup``) it took 20.544 /
    11.725 / 4.239 ms against the bf16 backward's 24.613 / 13.670 / 4.131 at Kimi K2.7 Code,
    DeepSeek-V4-Pro and Qwen3.5 (2.6% slower at the smallest shape, Qwen3.5). Not on Blackwell
    (unverified there): the bf16 backward. Any of these knobs can be set back by a variant
    (``mok@bwd_fp8_wgrad=false``). The weight-gradient and dX tiles per item are the bf16
    cells' (``default_config_fields``: four of each on one Hopper rank at the shapes timed):
    in results/20261204-015950-h200-fp8-backward the FP8 backward took 27.637 ms against
    28.524 with one of each, as it ran before, at Kimi K2 48 x 16384, and 30.603 against
    31.755 at Kimi K2.7 Code (lower medians, overlapping p10-p90 spreads; the profiling
    script had it faster too, notes/mok-kernel.md); the four-tile FP8 weight-gradient items
    spill more (312 against 164 bytes at Kimi K2, Triton 3.9). And the row pull, not
    the bf16 pull by token (``bwd_pull_by_token``), which the FP8 weight gradients' pull
    replaces. The Q items tell a group's padding rows from its row count
    (``bwd_q_count_rows``) instead of loading each step's slot ids: in
    results/20261204-102834-h200-fp8-backward the backward took 27.065 against 27.638 ms at
    Kimi K2 48 x 16384, 30.191 against 30.691 at Kimi K2.7 Code, 12.437 against 12.767 at
    Qwen3.5 and 28.009 against 28.605 at Kimi K2 384 (two earlier sweeps' logs and the item
    trace agree: notes/mok-kernel.md, the leases of 2026-12-04 10:02-10:27). On one rank
    (``world_size`` 1) the dgrad and weight-gradient items run in two launches
    (``bwd_split_launch``) and the FP8 pull's programs take row blocks by their place in their
    group (``bwd_pull_interleave``): in results/20261204-183317-h200-fp8-backward the backward
    took 27.115 / 29.976 / 12.154 ms against 27.287 / 30.400 / 12.582 at Kimi K2 48 x 16384,
    Kimi K2.7 Code and Qwen3.5 (28.291 against 28.175 at Kimi K2 384, where no baseline has a
    backward); unmeasured at EP > 1, where the two stay off. Also on one rank the
    weight-gradient items store their tiles through TMA (``bwd_dw_tma_store``): in
    results/20261205-015933-h200-fp8-backward (its first two scenarios) the backward took
    24.714 / 27.674 ms against 26.609 / 29.440 at Kimi K2 48 x 16384 and Kimi K2.7 Code
    (1.252x / 1.258x TE's there, against 1.163x / 1.182x); the profiling script on the same
    machine 11.217 and 11.266 against 11.998 and 11.946 at Qwen3.5 and 22.488 against 28.139
    at Kimi K2 384 x 4096 (notes/mok-kernel.md). In bf16 cells it timed within noise: off
    there."""
    if arch >= 100:
        return {}
    one_rank = ({"bwd_split_launch": True, "bwd_pull_interleave": True,
                 "bwd_dw_tma_store": True} if world_size == 1 else {})
    return {"bwd_fp8_da": True, "bwd_fp8_dx": True, "bwd_fp8_wgrad": True,
            "bwd_dx_gluon": False, "bwd_dx_rows": False, "bwd_stages": 0,
            "bwd_fp8_block_k": 128, "bwd_pull_by_token": False, "bwd_q_count_rows": True,
            **one_rank}


def default_config_fields(hidden: int, intermediate: int, tokens: int, topk: int,
                          num_sms: int, world_size: int = 1,
                          local_experts: int | None = None, arch: int = 90) -> dict:
    """Defaults for a shape: minibatch from the two-waves rule (at least 4096 rows, at most
    the rows one rank can hold), three ring slots; no communication programs on one rank, 16
    on several; TMA weight tiles, gate/up columns interleaved (the backend converts its
    weights once at setup), four pipeline stages, the schedule through torch.compile; four
    gate+up and four down tiles per work item where experts are well loaded (at least 2048
    rows per local expert on average: tokens x topk / local_experts), else one, and one
    without ``local_experts`` or on Blackwell (``arch`` 100 and up: compute capability x 10);
    the backward's dX items read their dG/dU rows through TMA (``bwd_dx_tma``) on Hopper,
    where the profiling script ``benchmarks/mok_backward_time.py`` timed it faster (its
    figures in notes/mok-kernel.md; sweeps/h200-bf16-train.toml times it beside the copies),
    unmeasured on Blackwell; and its dA items cover
    block_n intermediate columns (``bwd_wide_da``) on Hopper: backward 41.711 / 30.017 /
    46.921 / 16.517 ms against 41.736 / 30.065 / 47.018 / 16.840 with block_n / 2 in the four
    scenarios of sweeps/h200-bf16-train.toml (results/20261130-213907-h200-bf16-train,
    results/20261130-214015-h200-bf16-train), unmeasured on Blackwell. On several ranks the
    backward's pull fetches a token's x and dY rows once per rank (``bwd_pull_dedup``): at
    EP 2 on two H200s (results/20261201-102706-h200x2-mok-ep, bf16, with ``dispatch_dedup``
    in the same cells' forwards) backward 4.142 / 25.225 / 14.007 / 13.578 ms against
    4.612 / 26.376 / 14.293 / 14.051 without, at Qwen3.5, Kimi K2.7 Code, DeepSeek-V4-Pro
    uniform and rank_local; the forward's ``dispatch_dedup`` stays off (slower in every cell
    of those runs). Its schedule work (a token's first row, a min over its slots) is in the
    forward; the forward with ``bwd_pull_dedup`` alone has not been timed apart. The
    forward's down items come after the next minibatch's gate+up items (``skew_down``) on
    one Hopper rank: at Qwen3.5 64 x 16384 with the shared expert on one H200, where a
    minibatch holds 66 gate+up items for 132 programs, the profiling script timed the bf16
    training forward at 8.247 ms against 10.839 (inference 7.778 against 10.706;
    notes/mok-kernel.md); unmeasured with communication programs (EP > 1), where gate+up
    items claimed earlier may wait on dispatch instead, and on Blackwell. The backward's dX
    items run in bands of 16 row blocks, H tiles outer (``bwd_dx_band``), on one Hopper rank:
    at Kimi K2 48 x 16384 on one H200 the profiling script timed the bf16 backward at 40.043
    ms (bands of 8: 40.301, of 32: 40.513) against 41.523 and 41.398 ms row block by row
    block (notes/mok-kernel.md); unmeasured in FP8, at EP > 1 and on Blackwell. On one
    Hopper rank each bf16 weight-gradient item covers four tiles (``bwd_dw_tiles``; two or
    one where four do not divide the shape's tiles) in loops four and three stages deep
    (``bwd_dw_stages``): with two-stage loops, at Kimi K2 384 x 4096 (about 85 rows per
    expert) the backward took 28.373 ms against 32.197 with one tile
    (results/20261201-200246-h200-mok-dw-tiles) but was slower where experts are well
    loaded; with the deeper loops the profiling script timed it faster at every shape it ran
    (Kimi K2 48 x 16384: 39.548 and 39.840 ms against 40.434, and 40.043 in an earlier
    session, the one-tile build of this one spilling; Qwen3.5: 17.165 against 17.458; Kimi
    K2 384 x 4096: 27.031, notes/mok-kernel.md); in the sweep at 2b6be5e
    (results/20261201-223055-h200-bf16-train) 40.556 against 41.414 ms at Kimi K2 48 x 16384
    and 45.981 against 46.193 at Kimi K2.7 Code, 17.756 against 17.525 at Qwen3.5 (each
    inside the other's spread); in FP8 cells too (``fp8_backward_fields``), unmeasured at
    EP > 1 and on Blackwell. And each dX item covers four H tiles (``bwd_dx_tiles``; two or
    one where four do not divide them) on one Hopper rank: at Kimi K2 48 x 16384 the
    profiling script timed the backward at 39.648 and 39.498 ms against 39.954 and 40.134
    (alternating, notes/mok-kernel.md); with the shared expert its sm_90 build spills less
    (none at Kimi K2.7 Code against 48 bytes, Triton 3.9); in the sweep at cc46318
    (results/20261202-014259-h200-bf16-train) 40.585 against 41.088 ms at Kimi K2 48 x 16384
    and 17.516 against 17.732 at Qwen3.5 (28.228 against 28.106 at Kimi K2 384 x 4096, inside
    each other's spread); in FP8 cells too, unmeasured at EP > 1 and on Blackwell. And the
    backward's separate pull goes token by token (``bwd_pull_by_token``: a token's x and dY
    rows read once, not once per slot) on one Hopper rank: at Qwen3.5 (64 x 16384, top-10,
    shared expert) the profiling script timed the bf16 backward at 16.478 and 16.489 ms
    against 17.013 and 17.087 (alternating; under torch.profiler the pull took 0.900 ms
    against 1.472), at Kimi K2 48 x 16384 40.528 and 40.366 against 40.463 and 40.593
    (notes/mok-kernel.md); not yet a sweep, off in FP8 cells (the FP8 weight gradients read
    the FP8 pull's copies), unmeasured at EP > 1 (where ``bwd_pull_dedup`` reads a token once
    per rank) and on Blackwell. And on one Hopper rank (sm_90, with Triton's Gluon API) the
    bf16 backward's dX GEMM runs as a warp-specialised Gluon launch after the megakernel's
    (``bwd_dx_gluon``): at Kimi K2 48 x 16384 on one H100 the profiling script timed the
    backward at 37.750 and 37.794 ms against 40.212 and 39.814 (alternating; its gradients
    bitwise the B items' in the GPU tests; notes/mok-kernel.md); on one H200, in
    results/20261206-031710-h200-bf16-train, within the spread of the dX items at Kimi K2 48
    and Kimi K2 384 (38.997 and 26.579 ms against 39.060 and 26.633) and faster at Qwen3.5
    (15.982 against 16.340); off in FP8 cells (the FP8 dX items), at EP > 1 (unmeasured) and
    on Blackwell (sm_90 code). With it, the launch stores its tiles whole through TMA in the
    schedule's row order and the dX sum gathers each token's rows (``bwd_dx_rows``; one
    process only): on one H100 the profiling script timed the bf16 backward at Kimi K2 48 x
    16384 at 38.250 and 38.087 ms against 38.872 and 38.590, at Qwen3.5 at 15.819 and 15.795
    against 15.947 and 15.954 (alternating; dx bitwise the slot path's in the GPU tests;
    notes/mok-kernel.md, the lease of 2026-12-06 05:30), and in the sweep
    results/20261206-061629-h100-mok-dx-rows at 39.103 and 16.118 ms against 39.584 and
    16.319 (inside each other's spread; unmeasured on an H200). And on one Hopper rank the
    bf16 backward's K loops run three stages deep (``bwd_stages``, whatever the forward's):
    the backward kernel at three stages had the lower median in ten of the fifteen
    backward cells that timed it beside four, each inside the other's spread: on one H200 at
    Kimi K2 48 x 16384, Kimi K2 384 x 4096 and Qwen3.5
    38.713 / 26.463 / 15.963 ms against 38.997 / 26.579 / 15.982
    (results/20261206-031710-h200-bf16-train), on one H100 at Kimi K2 48 and Qwen3.5 38.836
    / 16.164 against 39.103 / 16.118
    (results/20261206-061629-h100-mok-dx-rows) and 38.741 / 16.104 against 38.956 / 16.195
    (results/20261206-081356-h100-bf16-train); on one H200 at 28e36df four won all three
    cells, 39.112 / 27.442 / 16.103 against 39.137 / 27.524 / 16.254
    (results/20261206-100314-h200-bf16-train); on one H100 at 85f053d three won both,
    38.885 / 16.191 against 39.167 / 16.223 (results/20261206-132810-h100-bf16-train); on
    one H200 at 96cdbb4 three won two of three, 38.893 / 26.726 / 16.153 against 38.918 /
    26.569 / 16.166 (results/20261206-201917-h200-bf16-train).
    Off (the forward's depth) in FP8 cells, whose dgrad launch at three stages is untimed,
    at EP above 1 and on Blackwell. The bf16 forward's K loops run three stages deep too on
    one Hopper rank where the experts are well loaded (four tiles per item; ``num_stages``), four
    elsewhere: at Kimi K2 48 x 16384 the training forward at three had the lower median in eight
    of twelve comparisons (the sweeps' ``mok@num_stages=3`` rows: 20.384 against 20.510 ms and
    20.145 against 20.102 on one H200, results/20261206-100314-h200-bf16-train and
    results/20261206-031710-h200-bf16-train; the default against ``mok@num_stages=4``, 19.855
    against 19.933 on one H100, results/20261206-132810-h100-bf16-train; 19.770 against 20.172
    and 19.655 against 20.026 on one H100, results/20261206-081356-h100-bf16-train and
    results/20261206-061629-h100-mok-dx-rows; the profiling script on one H100, 19.664 against
    19.833 and 19.222 against 19.881, and with this rule in place 19.748 against 20.088 and
    19.522 against 19.791, alternating, notes/mok-kernel.md; but on one H200 at 96cdbb4 the
    default's 20.667 and the same forward's 20.395 and 20.278 in the ``mok@bwd_dx_rows=false``
    and ``mok@bwd_stages=4`` rows against ``mok@num_stages=4``'s 20.252,
    results/20261206-201917-h200-bf16-train), the inference forward in the three H200 runs
    (20.033 against 20.349, 19.708 against 20.119, and at 96cdbb4 19.825, 19.965 and 20.210
    against 20.248), in the H100 sweep at 85f053d (19.514 against 20.073) and in both of those
    last pairs (19.178 against 19.847, 19.188 against 20.452); at Qwen3.5 (64 x 16384, four
    tiles too) the five sweeps before 96cdbb4 put them within 0.03 ms of each other, and that
    one's three-stage rows were 0.015 to 0.086 ms ahead of four; at Kimi K2 384 x 4096 (about
    85 rows per expert, one tile per item) three was
    slower in both H200 runs (9.120 against 8.947, 8.729 against 8.499), so four stay there. The
    build at three stages holds 180248 bytes of shared memory against 229408 (Kimi K2 48,
    sm_90), leaving the SM more L1; why that or the shallower ring helps is not measured. FP8
    cells keep four (``fp8_config_fields``; their K loops untimed at three).

    Why: each measured faster on Hopper than its alternatives (the forward's three stages on
    H100; on H200 the two depths are within noise of each other at Kimi K2 48, the three runs
    above splitting them), and the tile rule keeps to where it was measured
    (notes/mok-kernel.md, "Why the mok backend's defaults are what they are")."""
    from mok_kernels import plan

    bound = plan(hidden, intermediate, num_sms, 0).minibatch
    rows = tokens * (topk + 1)
    mb = max(4096, bound)
    mb = min(mb, -(-rows // 128) * 128)
    loaded = bool(local_experts) and tokens * topk >= 2048 * local_experts
    tiles = 4 if loaded and arch < 100 else 1
    one_hopper = arch < 100 and world_size == 1
    gluon_dx = one_hopper and arch == 90 and gluon_dx_available()
    return {"minibatch": mb, "macrobatch": 3 * mb, "fwd_comm_sms": 0 if world_size == 1 else 16,
            "tma": True, "gate_up_interleaved": True,
            "num_stages": 3 if one_hopper and loaded else 4,
            "compile_schedule": True, "gate_up_tiles": tiles, "down_tiles": tiles,
            "bwd_dx_tma": arch < 100, "bwd_wide_da": arch < 100,
            "bwd_pull_dedup": world_size > 1, "skew_down": one_hopper,
            "bwd_dx_band": 16 if one_hopper else 0,
            "bwd_dw_tiles": _dw_tiles(hidden, intermediate) if one_hopper else 1,
            "bwd_dw_stages": 4 if one_hopper else 2,
            "bwd_dx_tiles": _dx_tiles(hidden, intermediate) if one_hopper else 1,
            "bwd_pull_by_token": one_hopper,
            "bwd_dx_gluon": gluon_dx, "bwd_dx_rows": gluon_dx,
            "bwd_stages": 3 if one_hopper else 0}


def gluon_dx_available() -> bool:
    """Whether this Triton has the Gluon Hopper API that ``bwd_dx_gluon``'s launch is
    written against (Triton 3.6 and later)."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:
        return False
    return hasattr(tma, "async_load") or hasattr(tma, "async_copy_global_to_shared")


def _dw_tiles(hidden: int, intermediate: int) -> int:
    """Weight-gradient tiles per backward item: the most of 4, 2, 1 that divide both the H
    and the 2I tiles at the shape's block_n."""
    return _most_tiles(hidden, 2 * intermediate, block_n=_block_n(hidden, intermediate))


def _dx_tiles(hidden: int, intermediate: int) -> int:
    """H tiles per backward dX item: the most of 4, 2, 1 that divide the H tiles at the
    shape's block_n."""
    return _most_tiles(hidden, block_n=_block_n(hidden, intermediate))


def _block_n(hidden: int, intermediate: int) -> int:
    from mok_kernels import MoKConfig

    return MoKConfig.for_shape(hidden, intermediate).block_n


def _most_tiles(*widths: int, block_n: int) -> int:
    """The most of 4, 2, 1 tiles per item that divide every width's count of block_n tiles."""
    return next((d for d in (4, 2) if all(w // block_n % d == 0 for w in widths)), 1)


def graph_option(options: dict | None = None) -> bool:
    """Replay the forward as one CUDA graph: "cuda_graph" in the options or
    $MOKBENCH_MOK_CONFIG; default off: eager measured faster (its launches queue ahead of the
    GPU; the graph adds copies into and out of its static buffers; notes/mok-kernel.md, "Why
    the mok backend's defaults are what they are")."""
    over = {**env_overrides(), **(options or {})}
    return bool(over.get("cuda_graph", False))


def env_overrides() -> dict:
    """The JSON object in $MOKBENCH_MOK_CONFIG ({} when unset)."""
    from mok_kernels import MoKConfigError

    raw = os.environ.get(CONFIG_ENV, "").strip()
    if not raw:
        return {}
    try:
        over = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise MoKConfigError(f"{CONFIG_ENV}={raw!r} is invalid: allowed a JSON object "
                             f"({exc.msg})") from None
    if not isinstance(over, dict):
        raise MoKConfigError(f"{CONFIG_ENV}={raw!r} is invalid: allowed a JSON object")
    return over


_NO_SEPARATE_PULL = ("bwd_fused_pull",)
"""Backward knobs that replace the separate pull, which ``bwd_pull_dedup`` needs (and
``bwd_fp8_wgrad``, except under ``bwd_fused_pull`` with ``bwd_fp8_da``, whose pull items write
its copies): set by the user, they turn those off where only a default set them.
``bwd_pull_by_token`` (the bf16 separate pull token by token, which reads a token once per
rank as ``bwd_pull_dedup`` does) turns off a default ``bwd_pull_dedup`` the same way, and any
of these, ``bwd_pull_dedup`` or ``bwd_fp8_wgrad`` asked for turns off a default
``bwd_pull_by_token``."""


def config_from_env(hidden: int, intermediate: int, defaults: dict,
                    options: dict | None = None):
    """MoKConfig from shape defaults, then $MOKBENCH_MOK_CONFIG, then the backend label's
    options (``mok@minibatch=2048``); a minibatch without a macrobatch gets 3 ring slots, and
    a knob that replaces the backward's separate pull (``_NO_SEPARATE_PULL``) turns off the
    defaults that need it unless they are asked for too (then the conflict is the error; the
    pull by token yields the same way to ``bwd_pull_dedup`` and ``bwd_fp8_wgrad``),
    one ring slot (macrobatch = minibatch) turns off the default ``skew_down`` the same
    way, a backward without FP8 weight gradients the defaults ``bwd_q_count_rows`` and
    ``bwd_pull_interleave`` (which ``bwd_fused_pull`` turns off too), one
    weight-gradient tile per item the default ``bwd_dw_tma_store``, and FP8 dX items, the
    side sum or row blocks other than 128 the default ``bwd_dx_gluon``, and a dX without the
    Gluon launch the default ``bwd_dx_rows``."""
    from mok_kernels import MoKConfig

    fields = dict(defaults)
    over = {**env_overrides(), **(options or {})}
    over.pop("cuda_graph", None)  # a backend option, not a kernel knob
    def yield_defaults(keys: tuple[str, ...], value) -> None:
        """Set the defaults among ``keys`` to ``value``; what was asked for stays."""
        fields.update({k: value for k in keys if k not in over})

    if any(over.get(k) for k in _NO_SEPARATE_PULL):  # asked for: defaults needing it yield
        fp8_pull_items = (over.get("bwd_fused_pull")
                          and over.get("bwd_fp8_da", fields.get("bwd_fp8_da")))
        yield_defaults(("bwd_pull_dedup", "bwd_pull_interleave")
                       + (() if fp8_pull_items else ("bwd_fp8_wgrad",)), False)
    if over.get("bwd_pull_by_token"):
        yield_defaults(("bwd_pull_dedup",), False)
    if any(over.get(k) for k in _NO_SEPARATE_PULL + ("bwd_pull_dedup", "bwd_fp8_wgrad")):
        yield_defaults(("bwd_pull_by_token",), False)  # a pull the token pull cannot be
    if not over.get("bwd_fp8_wgrad", fields.get("bwd_fp8_wgrad")):
        # no Q items and no FP8 pull to order without the FP8 weight gradients
        yield_defaults(("bwd_q_count_rows", "bwd_pull_interleave"), False)
    if "minibatch" in over and "macrobatch" not in over:
        fields["macrobatch"] = 3 * over["minibatch"]
    fields.update(over)
    if fields["macrobatch"] < 2 * fields["minibatch"]:
        yield_defaults(("skew_down",), False)  # one ring slot: the default order needs two
    if (fields.get("bwd_fp8_dx") or fields.get("bwd_side_sum")
            or (fields.get("bwd_block_m") or fields.get("block_m", 128)) != 128):
        yield_defaults(("bwd_dx_gluon",), False)  # the launch's row blocks and bf16 rows
    if not fields.get("bwd_dx_gluon"):
        yield_defaults(("bwd_dx_rows",), False)  # a mode of the Gluon dX launch
    if fields.get("bwd_dw_tiles", 1) <= 1:
        yield_defaults(("bwd_dw_tma_store",), False)  # its stores overlap within the items'
        # tile loops only
    return MoKConfig.for_shape(hidden, intermediate, **fields)


def scenario_config(scenario, options: dict | None = None, num_sms: int = 132,
                    arch: int = 90):
    """The MoKConfig of a cell: shape defaults (FP8 ones for ``precision = "fp8"``: recipe
    from the ``fp8`` knob, ``fp8_backward_fields``), then $MOKBENCH_MOK_CONFIG, then the
    variant's options. A knob that contradicts the precision is a one-line error."""
    from mok_kernels import MoKConfigError

    s = scenario.shape
    defaults = default_config_fields(s.hidden, s.intermediate, scenario.tokens_per_rank, s.topk,
                                     num_sms, scenario.world_size, scenario.local_experts, arch)
    fp8 = scenario.precision == "fp8"
    if fp8:
        recipe = {**env_overrides(), **(options or {})}.get("fp8") or None
        defaults.update(fp8_config_fields(arch, recipe))
        defaults.update(fp8_backward_fields(arch, scenario.world_size))
    cfg = config_from_env(s.hidden, s.intermediate, defaults, options)
    if fp8 != (cfg.fp8 != "none"):
        raise MoKConfigError(f"fp8={cfg.fp8!r} is invalid for precision {scenario.precision!r}:"
                             " allowed none for bf16, blockwise | rowwise | mx | rowwise_all "
                             "for fp8")
    return cfg


def backward_kind(cfg) -> str:
    """The backward's precision for a row's variant: "bf16", or which items run FP8
    ("fp8_da", "fp8_dx", "fp8_wgrad", "fp8_da_dx", ..., "fp8_da_dx_wgrad")."""
    items = [n for n, on in (("da", cfg.bwd_fp8_da), ("dx", cfg.bwd_fp8_dx),
                             ("wgrad", cfg.bwd_fp8_wgrad)) if on]
    return "fp8_" + "_".join(items) if items else "bf16"


def variant_text(c, hidden: int, intermediate: int, *, fp8: bool, graphed: bool) -> str:
    """A row's ``variant``: the knobs the mok backend ran with (config ``c`` at this hidden
    and intermediate size), those that are off or at their plain value left out."""
    import mok_kernels

    bwd = backward_kind(c)
    return (f"comm_sms={c.fwd_comm_sms},minibatch={c.minibatch},"
            f"macrobatch={c.macrobatch},graph={int(graphed)},"
            f"tma={int(c.tma)},down_tiles={mok_kernels.down_tiles(c, hidden)},"
            f"gate_up_tiles={mok_kernels.gate_up_tiles(c, intermediate)},"
            f"num_stages={c.num_stages},"
            f"interleaved={int(c.gate_up_interleaved)},"
            f"prefetch={int(c.prefetch_ticket)},"
            + ("skew_down=1," if c.skew_down else "")
            + ("pre_tma_store=1," if c.pre_tma_store else "") +
            f"compiled_schedule={int(c.compile_schedule)},"
            f"fused_sum={int(c.fused_sum)},wide_da={int(c.bwd_wide_da)}"
            + (",fused_pull=1" if c.bwd_fused_pull else "")
            + (f",pull_programs={c.bwd_pull_programs}"
               if c.bwd_pull_programs else "")
            + (f",dx_tiles={c.bwd_dx_tiles}" if c.bwd_dx_tiles > 1 else "")
            + (f",dx_band={c.bwd_dx_band}" if c.bwd_dx_band > 1 else "")
            + (",q_count_rows=1" if c.bwd_q_count_rows else "")
            + (",fused_colmax=1" if c.bwd_fused_colmax else "")
            + (f",q_cols={c.bwd_q_cols}" if c.bwd_q_cols else "")
            + (",prequant=1" if c.bwd_fp8_prequant else "")
            + (",pull_interleave=1" if c.bwd_pull_interleave else "")
            + (",pull_prefetch=1" if c.bwd_pull_prefetch else "")
            + (f",pull_cols={c.bwd_pull_cols}" if c.bwd_pull_cols else "")
            + (",split_launch=1" if c.bwd_split_launch else "")
            + (f",side_sms={c.bwd_side_sms}" if c.bwd_side_sms else "")
            + (",side_sum=1" if c.bwd_side_sum else "")
            + (",pull_by_token=1" if c.bwd_pull_by_token else "")
            + (f",dw_tiles={c.bwd_dw_tiles}" if c.bwd_dw_tiles > 1 else "")
            + (f",dw_stages={c.bwd_dw_stages}" if c.bwd_dw_stages != 2 else "")
            + (",dw_tma_store=1" if c.bwd_dw_tma_store else "")
            + (f",stages={c.bwd_stages}" if c.bwd_stages else "")
            + (",dx_gluon=1" if c.bwd_dx_gluon else "")
            + (",dw_gluon=1" if c.bwd_dw_gluon else "")
            + (",dx_rows=1" if c.bwd_dx_rows else "")
            + (f",da_tiles={c.bwd_da_tiles}" if c.bwd_da_tiles > 1 else "")
            + (",dx_tma=1" if c.bwd_dx_tma else "")
            + ("" if c.bwd_lean_epilogue else ",lean_epilogue=0")
            + (",dispatch_dedup=1" if c.dispatch_dedup else "")
            + (",remote_only=1" if c.dispatch_remote_only else "")
            + (",combine_direct=1" if c.combine_direct else "")
            + (",pull_dedup=1" if c.bwd_pull_dedup else "")
            + (f",fp8={c.fp8},block_m={c.block_m},bwd={bwd}" if fp8 else "")
            + (f",bwd={bwd}" if bwd != "bf16" and not fp8 else "")
            + (f",bwd_block_m={c.bwd_block_m}" if c.bwd_block_m else "")
            + (f",bwd_fp8_block_k={c.bwd_fp8_block_k}"
               if c.bwd_fp8_block_k != 64 and bwd != "bf16" else "")
            + (",block_colmax=1" if c.bwd_fp8_block_colmax else ""))


class _MoKLayer(torch.autograd.Function):
    """y = MoE(x, router weights); backward through the backward megakernel. The weights are
    not autograd inputs: their gradients land in ``backend.grads`` (canonical layout)."""

    @staticmethod
    def forward(fctx, x_TH, topk_weights_TK, backend, topk_idx_TK):
        import mok_kernels

        sched = mok_kernels.build_schedule(backend.ws, topk_idx_TK)
        y, saved = mok_kernels.forward_train(backend.config, backend.ws, sched, x_TH,
                                             topk_weights_TK, *backend.w_fwd)
        fctx.saved_mok = saved
        fctx.backend = backend
        fctx.p_dtype = topk_weights_TK.dtype
        return y

    @staticmethod
    def backward(fctx, dy_TH):
        import mok_kernels

        b = fctx.backend
        g = mok_kernels.backward(b.config, b.ws, fctx.saved_mok, dy_TH.contiguous(), *b.w,
                                 fp8_weights=b.w_bwd8)
        fctx.saved_mok = None  # its pre-activations now hold their gradients
        b.accumulate({"w1_EHF": g.w_gate_up, "w2_EIH": g.w_down,
                      "ws1_HF": g.shared_gate_up, "ws2_IH": g.shared_down})
        return g.dx_TH, g.d_router_weights_TK.to(fctx.p_dtype), None, None


class MoKBackend(BackendBase):
    """Pull dispatch, fused SwiGLU grouped GEMM and push combine in one persistent kernel."""

    name = "mok"
    capabilities = Capabilities(
        passes=("forward", "backward"), precisions=("bf16", "fp8"), needs_gpu=True,
        min_cc=(9, 0), packages=("triton",), is_baseline=False,
        notes="Triton persistent megakernels, forward and backward; fp8 = FP8 forward "
              "(weights quantised at setup) and, on Hopper, FP8 backward (bf16 backward on "
              "Blackwell until a GPU has run it there)")

    def setup(self, scenario, ctx, weights) -> None:
        import mok_kernels

        s = scenario.shape
        dev = torch.device(ctx.device)
        props = torch.cuda.get_device_properties(dev)
        options = ctx.extra.get("options", {})
        fp8 = scenario.precision == "fp8"
        self.config = scenario_config(scenario, options, props.multi_processor_count,
                                      10 * props.major + props.minor)
        group = ctx.group if ctx.world_size > 1 else None
        self.ws = mok_kernels.get_workspace(
            self.config, tokens=scenario.tokens_per_rank, hidden=s.hidden,
            intermediate=s.intermediate, local_experts=scenario.local_experts, topk=s.topk,
            shared=weights.ws1_HF is not None, device=dev, group=group)
        # The gate+up weights in the layout the kernel reads (set up once, not timed).
        lay = (mok_kernels.interleave_gate_up if self.config.gate_up_interleaved
               else torch.Tensor.contiguous)
        self.w = (lay(weights.w1_EHF), weights.w2_EIH.contiguous(),
                  None if weights.ws1_HF is None else lay(weights.ws1_HF),
                  None if weights.ws2_IH is None else weights.ws2_IH.contiguous())
        # FP8: the forward's weights quantised once (not timed); the backward keeps bf16.
        self.w_fwd = mok_kernels.quantize_weights(self.config, *self.w) if fp8 else self.w
        # bwd_fp8_da: W_down's FP8 copy for the backward's dA items, also once at setup.
        self.w_bwd8 = mok_kernels.quantize_backward_weights(self.config, self.w[1], self.w[3],
                                                            self.w[0], self.w[2])
        self.params = {}
        self.grads: dict = {}
        self.graphed = (mok_kernels.GraphedForward(self.config, self.ws, self.w_fwd)
                        if graph_option(options) else None)
        self.variant = variant_text(self.config, s.hidden, s.intermediate, fp8=fp8,
                                    graphed=self.graphed is not None)

    def validate_options(self, scenario, options: dict) -> None:
        """Build the configuration a variant asks for (``mok@minibatch=512``) on the host, so
        a bad knob is a one-line error before launch (SM count assumed 132 when no GPU)."""
        from mok_kernels import MoKConfigError

        cfg = scenario_config(scenario, options)
        if cfg.fused_sum and scenario.world_size > 1:
            raise MoKConfigError(f"fused_sum=True is invalid at world_size "
                                 f"{scenario.world_size}: allowed only at world_size 1 (every "
                                 "combine slot in one process)")

    def accumulate(self, grads: dict) -> None:
        """Add one backward's weight gradients (None entries skipped) to ``self.grads``."""
        for name, g in grads.items():
            if g is None:
                continue
            self.grads[name] = g if name not in self.grads else self.grads[name] + g

    def weight_grads(self) -> dict:
        return dict(self.grads)

    def zero_grad(self) -> None:
        self.grads = {}

    def forward(self, x_TH, topk_idx_TK, topk_weights_TK):
        import mok_kernels

        training = torch.is_grad_enabled() and (x_TH.requires_grad
                                                or topk_weights_TK.requires_grad)
        if training:
            return _MoKLayer.apply(x_TH, topk_weights_TK, self, topk_idx_TK)
        with torch.no_grad():
            if self.graphed is not None:
                return self.graphed(x_TH.detach(), topk_idx_TK, topk_weights_TK.detach())
            sched = mok_kernels.build_schedule(self.ws, topk_idx_TK)
            return mok_kernels.forward(self.config, self.ws, sched, x_TH.detach(),
                                       topk_weights_TK.detach(), *self.w_fwd)

    def check(self) -> None:
        """Raise the first error the kernels recorded on the device (one host sync)."""
        import mok_kernels

        mok_kernels.check_errors(self.ws)

    def teardown(self) -> None:
        self.grads = {}
        self.graphed = None
        self.ws = None
        self.w = self.w_fwd = ()
        self.params = {}
