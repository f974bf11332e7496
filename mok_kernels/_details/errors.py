"""Device error words: codes the kernels and the schedule write, and their host-side reading.

Each logical rank owns four int32 words: [code, detail, detail2, unused]. The first error
wins (compare-and-swap from 0); ``check_errors`` reads them (one host sync, called by the user
after the output), raises :class:`MoKError` naming what happened, and clears them.
"""

from __future__ import annotations

ERR_NONE = 0
# Bounded waits that expired (detail = minibatch or row-block index).
ERR_WAIT_RING_FREE = 1  # dispatch waited for combine to release a ring slot
ERR_WAIT_DISPATCHED = 2  # gate+up GEMM waited for "minibatch m is in the ring"
ERR_WAIT_ROWBLOCK = 3  # down GEMM waited for "row block b of SwiGLU output ready"
ERR_WAIT_OUTPUT = 4  # combine waited for "minibatch m output ready"
ERR_WAIT_HSLOT_FREE = 5  # gate+up GEMM (no comm programs) waited for a SwiGLU ring slot
ERR_WAIT_DGRAD_ROWBLOCK = 6  # backward dgrad gate+up waited for the row block's dA tiles
ERR_WAIT_DGRAD_GROUP = 7  # backward gate+up weight gradient waited for its expert's dA tiles
ERR_WAIT_BWD_PULLED = 8  # backward dA GEMM waited for its row block's pulled dY (and x) rows
ERR_WAIT_BWD_XPULLED = 9  # backward weight gradient waited for its expert's pulled rows
ERR_WAIT_DEDUP = 10  # dispatch waited for a token's first row on this rank to be pulled
ERR_WAIT_WGRAD_QUANT = 11  # backward FP8 weight gradient waited for its expert's FP8 columns
ERR_CAPACITY = 16  # routing needed more schedule rows than capacity_mult allows

WAIT_NAMES = {
    ERR_WAIT_RING_FREE: "dispatch <- combine: ring slot released",
    ERR_WAIT_DISPATCHED: "gate+up GEMM <- dispatch: minibatch in the ring",
    ERR_WAIT_ROWBLOCK: "down GEMM <- gate+up GEMM: row block ready",
    ERR_WAIT_OUTPUT: "combine <- down GEMM: minibatch output ready",
    ERR_WAIT_HSLOT_FREE: "gate+up GEMM <- down GEMM: SwiGLU ring slot released",
    ERR_WAIT_DGRAD_ROWBLOCK: "backward dX GEMM <- dA GEMM: row block ready",
    ERR_WAIT_DGRAD_GROUP: "backward gate+up weight gradient <- dA GEMM: expert rows ready",
    ERR_WAIT_BWD_PULLED: "backward dA GEMM <- pull: row block's rows pulled",
    ERR_WAIT_BWD_XPULLED: "backward weight gradient <- pull: expert's rows pulled",
    ERR_WAIT_DEDUP: "dispatch <- dispatch: token's first row pulled into the token cache",
    ERR_WAIT_WGRAD_QUANT: "backward FP8 weight gradient <- quantise: expert's columns in FP8",
}


class MoKError(RuntimeError):
    """An error the MoK kernels recorded on the device."""


class MoKTimeoutError(MoKError):
    """A bounded spin-wait expired inside the megakernel."""


class MoKCapacityError(MoKError):
    """Routing sent more rows to one rank than the schedule capacity holds."""


def describe(rank: int, code: int, detail: int, detail2: int) -> MoKError:
    """The exception for one rank's error words."""
    if code == ERR_CAPACITY:
        return MoKCapacityError(
            f"MoK rank {rank}: routing needs {detail} schedule rows but capacity is {detail2};"
            " raise capacity_mult (1.0 always fits)")
    if code in WAIT_NAMES:
        what = {ERR_WAIT_ROWBLOCK: "row block", ERR_WAIT_DGRAD_ROWBLOCK: "row block",
                ERR_WAIT_DGRAD_GROUP: "expert group", ERR_WAIT_BWD_PULLED: "row block",
                ERR_WAIT_BWD_XPULLED: "expert group", ERR_WAIT_DEDUP: "token",
                ERR_WAIT_WGRAD_QUANT: "expert group"
                }.get(code, "minibatch")
        return MoKTimeoutError(
            f"MoK rank {rank}: wait '{WAIT_NAMES[code]}' timed out at {what} {detail}"
            " (spin_budget exhausted; a signal never came)")
    return MoKError(f"MoK rank {rank}: unknown device error code {code} (detail {detail})")


def raise_if_errors(words_L4: list[list[int]], rank_base: int) -> None:
    """Raise for the first logical rank whose code is not 0."""
    for i, (code, detail, detail2, _) in enumerate(words_L4):
        if code != ERR_NONE:
            raise describe(rank_base + i, code, detail, detail2)


def check_errors(ws) -> None:
    """Read a workspace's device error words (the one host sync, called after the output, not
    part of the forward), clear them, and raise the first error."""
    words = ws.errors_L4.tolist()
    ws.errors_L4.zero_()
    raise_if_errors(words, ws.rank_base)
