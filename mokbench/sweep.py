"""Sweep files (TOML or YAML) -> validated scenarios -> cells (scenario x backend).

A sweep file::

    name = "quick"
    backends = ["nccl_torch", "mok"]          # default backends of every scenario
    world_sizes = ["auto"]                     # or [1, 2, 4, 8]; "auto" = all local ranks
    [timing]
    warmup = 3
    iters = 10
    [[scenarios]]                              # list-valued fields expand as a grid
    preset = "qwen3-30b-a3b"                   # or name + num_experts/hidden/intermediate/topk
    num_experts = 64                           # overrides the preset's value
    tokens_per_rank = [1024, 4096]
    precision = "bf16"
    routing = ["uniform", "imbalanced"]
    zipf_s = 1.2
    shared_expert = true
    passes = ["forward", "backward", "inference"]  # the default: all three
    backends = ["nccl_torch"]                  # optional per-scenario override

Every error is one line naming the field and what is allowed, raised before anything launches.
"""

from __future__ import annotations

import hashlib
import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mokbench.backend import check_backend_names
from mokbench.scenario import (
    PASSES,
    ModelShape,
    Scenario,
    ScenarioError,
    TimingConfig,
    preset,
)

TOP_KEYS = {"name", "description", "backends", "world_sizes", "timing", "scenarios"}
SHAPE_KEYS = {"preset", "name", "num_experts", "hidden", "intermediate", "topk"}
GRID_KEYS = {"tokens_per_rank", "precision", "routing", "zipf_s", "shared_expert", "seed"}
SCENARIO_KEYS = SHAPE_KEYS | GRID_KEYS | {"passes", "backends", "world_sizes"}
TIMING_KEYS = {"warmup", "iters"}


@dataclass(frozen=True)
class Cell:
    """One launch: a scenario run by one backend at the scenario's world size."""

    scenario: Scenario
    backend: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.scenario.scenario_id, self.backend)

    @property
    def stem(self) -> str:
        """File-name stem of this cell's scratch files (variant options hashed in)."""
        name, _, opts = self.backend.partition("@")
        tag = f"-{hashlib.sha1(opts.encode()).hexdigest()[:8]}" if opts else ""
        return f"{self.scenario.digest()}-{name}{tag}"


@dataclass
class Sweep:
    name: str
    cells: list[Cell] = field(default_factory=list)
    source_text: str = ""
    source_suffix: str = ".toml"


def _unknown(keys: set[str], allowed: set[str], where: str) -> None:
    bad = sorted(set(keys) - allowed)
    if bad:
        allowed_txt = ", ".join(sorted(allowed))
        raise ScenarioError(f"{where} key {bad[0]!r} is unknown: allowed {allowed_txt}")


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def parse_text(text: str, suffix: str) -> dict:
    """TOML (tomllib) or YAML (safe loader) text -> dict."""
    if suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif suffix == ".toml":
        data = tomllib.loads(text)
    else:
        raise ScenarioError(f"sweep file suffix {suffix!r} is unknown: allowed .toml, .yaml, .yml")
    if not isinstance(data, dict):
        raise ScenarioError("sweep file must be a table/mapping at top level")
    return data


def _shape(spec: dict) -> ModelShape:
    if "preset" in spec:
        base = preset(spec["preset"])
        over = {k: spec[k] for k in ("num_experts", "hidden", "intermediate", "topk") if k in spec}
        name = spec.get("name", base.name)
        return ModelShape(name, **{**{k: getattr(base, k) for k in
                                      ("num_experts", "hidden", "intermediate", "topk")}, **over})
    missing = [k for k in ("num_experts", "hidden", "intermediate", "topk") if k not in spec]
    if missing:
        raise ScenarioError(f"scenario field {missing[0]!r} is missing: give a preset or all of "
                            "num_experts, hidden, intermediate, topk")
    return ModelShape(spec.get("name", "custom"), spec["num_experts"], spec["hidden"],
                      spec["intermediate"], spec["topk"])


def resolve_world_sizes(values: list, auto_world: int) -> list[int]:
    out = []
    for v in values:
        if v == "auto":
            out.append(auto_world)
        elif isinstance(v, int) and v > 0:
            out.append(v)
        else:
            raise ScenarioError(f"world_sizes entry {v!r} is invalid: allowed positive integers "
                                "or \"auto\"")
    return sorted(set(out))


def expand(data: dict, auto_world: int, backends_override: list[str] | None = None,
           name: str = "sweep") -> Sweep:
    """Validate a parsed sweep and expand it into cells (scenario-major, backends side by side)."""
    _unknown(set(data), TOP_KEYS, "sweep")
    timing_spec = data.get("timing", {})
    _unknown(set(timing_spec), TIMING_KEYS, "timing")
    timing = TimingConfig(**timing_spec)
    default_backends = backends_override or _as_list(data.get("backends", ["nccl_torch"]))
    default_ws = _as_list(data.get("world_sizes", ["auto"]))
    specs = data.get("scenarios")
    if not specs:
        raise ScenarioError("sweep key 'scenarios' is missing or empty: allowed a list of "
                            "scenario tables")
    sweep = Sweep(str(data.get("name", name)))
    seen: set[tuple[str, str]] = set()
    for spec in specs:
        _unknown(set(spec), SCENARIO_KEYS, "scenario")
        shape = _shape(spec)
        backends = backends_override or _as_list(spec.get("backends", default_backends))
        check_backend_names(backends)
        variants = [b for b in backends if "@" in b]
        passes = tuple(spec.get("passes", PASSES))
        grid_keys = [k for k in sorted(GRID_KEYS) if k in spec]
        if "tokens_per_rank" not in grid_keys:
            raise ScenarioError("scenario field 'tokens_per_rank' is missing: allowed a positive "
                                "integer or a list of them")
        wss = resolve_world_sizes(_as_list(spec.get("world_sizes", default_ws)), auto_world)
        for ws, combo in itertools.product(
                wss, itertools.product(*[_as_list(spec[k]) for k in grid_keys])):
            scn = Scenario(shape=shape, world_size=ws, passes=passes, timing=timing,
                           **dict(zip(grid_keys, combo)))
            for b in variants:
                validate_backend_options(b, scn)
            for b in backends:
                cell = Cell(scn, b)
                if cell.key not in seen:
                    seen.add(cell.key)
                    sweep.cells.append(cell)
    return sweep


def validate_backend_options(label: str, scenario: Scenario) -> None:
    """Check a variant's options before launch, where its backend can (``validate_options``)."""
    from mokbench.backend import get_backend, split_label

    _, options = split_label(label)
    backend = get_backend(label)
    if hasattr(backend, "validate_options"):
        try:
            backend.validate_options(scenario, options)
        except ValueError as exc:
            raise ScenarioError(f"backend {label!r}: {exc}") from None


def load_sweep(path: Path | None, auto_world: int, backends_override: list[str] | None = None,
               default_name: str | None = None) -> Sweep:
    """Load a sweep file, or the embedded default (``default_name``) when ``path`` is None."""
    if path is None:
        from importlib.resources import files

        res = files("mokbench.sweeps").joinpath(f"{default_name}.toml")
        text, suffix, name = res.read_text(), ".toml", default_name
    else:
        p = Path(path)
        if not p.exists():
            raise ScenarioError(f"sweep file {str(p)!r} does not exist")
        text, suffix, name = p.read_text(), p.suffix, p.stem
    sweep = expand(parse_text(text, suffix), auto_world, backends_override, name)
    sweep.source_text, sweep.source_suffix = text, suffix
    return sweep
