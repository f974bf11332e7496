"""Model shapes, scenarios and timing settings: the frozen description of one benchmark cell.

Everything here is plain data, validated on construction, so a bad sweep is rejected with one
line naming the field and the allowed values before any process is launched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

from mokbench.errors import InputError, is_int, is_number

# forward: a training forward (autograd on, inputs require grad, each backend keeps what its
# backward needs); backward: y.backward(dy) after an untimed forward; inference: the forward
# under torch.no_grad() on inputs that do not require grad; step (asked for by name, not a
# default): the training forward and its backward timed together, as a training step runs
# them (on a GPU at its power limit what runs before a backward sets its clock, so a step is
# not always the sum of the other two).
PASSES = ("forward", "backward", "inference", "step")
DEFAULT_PASSES = ("forward", "backward", "inference")
PASS_LABELS = {"forward": "forward (training)", "backward": "backward",
               "inference": "inference (no_grad)", "step": "step (forward + backward)"}
PRECISIONS = ("bf16", "fp8")
ROUTINGS = ("uniform", "imbalanced", "rank_local")
DEFAULT_SEED = 1234
DIM_ALIGN = 16  # hidden / intermediate multiple of this (16-byte rows, tensor-core tiles)


class ScenarioError(InputError):
    """A bad field in a scenario or sweep; one-line message: field, value, what is allowed."""


def _check(cond: bool, field_name: str, value: object, allowed: str) -> None:
    if not cond:
        raise ScenarioError(f"{field_name}={value!r} is invalid: allowed {allowed}")


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer's dimensions. ``num_experts`` counts experts over all EP ranks."""

    name: str
    num_experts: int
    hidden: int
    intermediate: int
    topk: int

    def __post_init__(self) -> None:
        for f in ("num_experts", "hidden", "intermediate", "topk"):
            v = getattr(self, f)
            _check(is_int(v) and v > 0, f, v, "a positive integer")
        for f in ("hidden", "intermediate"):
            v = getattr(self, f)
            _check(v % DIM_ALIGN == 0, f, v, f"a multiple of {DIM_ALIGN}")
        _check(self.topk <= self.num_experts, "topk", self.topk,
               f"1..num_experts ({self.num_experts})")


# Published / well-known MoE layer shapes (routed experts; the shared expert is a scenario flag).
PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("kimi-k2.7-code", 384, 7168, 2048, 8),
        ModelShape("glm-5.2", 256, 6144, 2048, 8),
        ModelShape("qwen3.5-397b", 512, 4096, 1024, 10),
        ModelShape("deepseek-v4-pro", 384, 7168, 3072, 6),
        ModelShape("deepseek-v3", 256, 7168, 2048, 8),
        ModelShape("kimi-k2", 384, 7168, 2048, 8),
        ModelShape("qwen3-30b-a3b", 128, 2048, 768, 8),
        ModelShape("mixtral-8x7b", 8, 4096, 14336, 2),
        # Tiny shape for CPU runs and tests (not a real model).
        ModelShape("tiny", 8, 128, 64, 2),
    )
}


def modes_recorded(rows) -> bool:
    """Whether a run's rows (a DataFrame) record the forward's mode (``keeps_graph``, or an
    inference pass beside it): runs made before the training/inference split do not, and
    their forward rows are not all training forwards (the mok backend then timed an
    inference forward)."""
    cols = getattr(rows, "columns", ())
    if "keeps_graph" in cols and bool(rows["keeps_graph"].notna().any()):
        return True
    return "pass" in cols and bool((rows["pass"] == "inference").any())


def pass_label(pass_: str, rows=None) -> str:
    """How tables and charts name a pass ("forward (training)", "inference (no_grad)"); with
    ``rows`` of a run that does not record the forward's mode, plain "forward"."""
    if pass_ == "forward" and rows is not None and not modes_recorded(rows):
        return "forward"
    return PASS_LABELS.get(pass_, pass_)


def preset(name: str) -> ModelShape:
    """Look up a preset by name; unknown names get the list of known ones."""
    if name not in PRESETS:
        raise ScenarioError(f"preset={name!r} is unknown: allowed {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


@dataclass(frozen=True)
class TimingConfig:
    """Warm-up and timed iteration counts (per pass)."""

    warmup: int = 10
    iters: int = 20

    def __post_init__(self) -> None:
        _check(is_int(self.warmup) and self.warmup >= 0, "warmup", self.warmup,
               "an integer >= 0")
        _check(is_int(self.iters) and self.iters >= 1, "iters", self.iters, "an integer >= 1")


@dataclass(frozen=True)
class Scenario:
    """One layer configuration at one EP size. Tokens are per rank; experts are split evenly.

    ``zipf_s`` only matters for ``routing="imbalanced"``: expert popularity follows a Zipf law
    with that exponent (0 = uniform popularity). ``routing="rank_local"`` puts all top-k
    experts of a token on one EP rank (so it needs top-k <= local experts): the extreme of
    node-limited routing, and the case where a token crosses the links at most once.
    """

    shape: ModelShape
    tokens_per_rank: int
    world_size: int
    precision: str = "bf16"
    routing: str = "uniform"
    shared_expert: bool = True
    zipf_s: float = 1.0
    seed: int = DEFAULT_SEED
    passes: tuple[str, ...] = DEFAULT_PASSES
    timing: TimingConfig = field(default_factory=TimingConfig)

    def __post_init__(self) -> None:
        _check(is_int(self.tokens_per_rank) and self.tokens_per_rank > 0,
               "tokens_per_rank", self.tokens_per_rank, "a positive integer")
        _check(is_int(self.world_size) and self.world_size > 0, "world_size",
               self.world_size, "a positive integer")
        _check(self.shape.num_experts % self.world_size == 0, "num_experts",
               self.shape.num_experts, f"a multiple of world_size ({self.world_size})")
        _check(self.precision in PRECISIONS, "precision", self.precision, " | ".join(PRECISIONS))
        _check(self.routing in ROUTINGS, "routing", self.routing, " | ".join(ROUTINGS))
        if self.routing == "rank_local" and self.shape.topk > self.local_experts:
            allowed = " | ".join(r for r in ROUTINGS if r != "rank_local")
            raise ScenarioError(f"routing='rank_local' is invalid with topk {self.shape.topk} > "
                                f"{self.local_experts} local experts: allowed {allowed}")
        _check(is_number(self.zipf_s) and self.zipf_s >= 0, "zipf_s", self.zipf_s,
               "a finite number >= 0")
        _check(isinstance(self.shared_expert, bool), "shared_expert", self.shared_expert,
               "true | false")
        _check(is_int(self.seed) and 0 <= self.seed < 2**32, "seed", self.seed,
               "an integer in 0..2**32-1")
        _check(len(self.passes) > 0 and all(isinstance(p, str) and p in PASSES
                                            for p in self.passes), "passes",
               self.passes, "a non-empty list of " + ", ".join(PASSES))

    @property
    def local_experts(self) -> int:
        return self.shape.num_experts // self.world_size

    @property
    def scenario_id(self) -> str:
        """Readable, unique id of everything that changes the numbers (not the timing counts)."""
        s = self.shape
        rt = {"uniform": "uniform", "rank_local": "ranklocal"}.get(self.routing,
                                                                   f"zipf{self.zipf_s:g}")
        se = "+se" if self.shared_expert else ""
        seed = "" if self.seed == DEFAULT_SEED else f"-seed{self.seed}"  # old ids stay valid
        return (f"{s.name}-E{s.num_experts}H{s.hidden}I{s.intermediate}k{s.topk}{se}"
                f"-T{self.tokens_per_rank}-ep{self.world_size}-{self.precision}-{rt}{seed}")

    def flops(self, pass_: str) -> float:
        """Layer FLOPs per rank as published: forward 6*(T + T*k)*H*I with the shared expert
        (6*T*k*H*I without), backward twice the forward, a step both (three times the
        forward); inference does the forward's GEMMs, so it counts the forward's FLOPs."""
        s = self.shape
        tokens = self.tokens_per_rank * s.topk + (self.tokens_per_rank if self.shared_expert else 0)
        fwd = 6.0 * tokens * s.hidden * s.intermediate
        return {"backward": 2.0, "step": 3.0}.get(pass_, 1.0) * fwd

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> Scenario:
        d = dict(d)
        d["shape"] = ModelShape(**d["shape"])
        d["timing"] = TimingConfig(**d.get("timing", {}))
        d["passes"] = tuple(d.get("passes", DEFAULT_PASSES))
        return Scenario(**d)

    def with_(self, **changes) -> Scenario:
        return replace(self, **changes)

    def digest(self) -> str:
        """Short hash of the full scenario, for file names."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:10]

