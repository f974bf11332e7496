"""Sweep files (TOML or YAML) -> validated scenarios -> cells (scenario x backend).

A sweep file::

    name = "quick"
    backends = ["nccl_torch", "mok"]          # default backends of every scenario
    world_sizes = ["auto"]                     # or [1, 2, 4, 8]; "auto" = all local ranks
    [timing]
    warmup = 3
    iters = 10
    rounds = 1                                 # each scenario's cells R times, order rotated
    [[scenarios]]                              # list-valued fields expand as a grid
    preset = "qwen3-30b-a3b"                   # or name + num_experts/hidden/intermediate/topk
    num_experts = 64                           # overrides the preset's value
    tokens_per_rank = [1024, 4096]
    precision = "bf16"
    routing = ["uniform", "imbalanced"]
    zipf_s = 1.2
    shared_expert = true
    passes = ["forward", "backward", "inference"]  # the default; also "step" (both, timed together)
    backends = ["nccl_torch"]                  # optional per-scenario override

Every error is one line naming the field and what is allowed, raised before anything launches.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mokbench.backend import check_backend_names
from mokbench.errors import is_int, one_line
from mokbench.scenario import (
    DEFAULT_PASSES,
    ModelShape,
    Scenario,
    ScenarioError,
    TimingConfig,
    preset,
)

TOP_KEYS = {"name", "description", "backends", "world_sizes", "timing", "scenarios", "env"}
SHAPE_KEYS = {"preset", "name", "num_experts", "hidden", "intermediate", "topk"}
GRID_KEYS = {"tokens_per_rank", "precision", "routing", "zipf_s", "shared_expert", "seed"}
SCENARIO_KEYS = SHAPE_KEYS | GRID_KEYS | {"passes", "backends", "world_sizes"}
TIMING_KEYS = {"warmup", "iters", "rounds"}
# A sweep's name names its run folder: one path component, no spaces.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")
NAME_ALLOWED = "letters, digits and . _ + - (one folder name, at most 100 characters)"
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
    """Cells of one sweep, scenario-major; ``env``: environment variables set in every cell's
    processes (the sweep file's ``[env]`` table, e.g. ``PYTORCH_CUDA_ALLOC_CONF``), on top
    of the launching shell's."""

    name: str
    cells: list[Cell] = field(default_factory=list)
    source_text: str = ""
    source_suffix: str = ".toml"
    env: dict[str, str] = field(default_factory=dict)
    rounds: int = 1  # [timing] rounds: each scenario's cells run this often (mokbench.rounds)


def check_rounds(value: object) -> int:
    """``rounds`` checked: a whole number >= 1."""
    if not is_int(value) or value < 1:
        raise ScenarioError(f"rounds={value!r} is invalid: allowed an integer >= 1 (each "
                            "scenario's cells run that many times, the order rotated)")
    return int(value)


def sweep_env(value: object) -> dict[str, str]:
    """A sweep's ``env`` table, checked: variable names, and values as the strings the cell
    processes get (booleans as 0/1)."""
    if not isinstance(value, dict):
        raise ScenarioError(f"env={value!r} is invalid: allowed a table of environment "
                            "variables (NAME = \"value\")")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not ENV_NAME_RE.match(k):
            raise ScenarioError(f"env key {k!r} is invalid: allowed an environment variable "
                                "name (letters, digits and _, not starting with a digit)")
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (str, int, float)):
            raise ScenarioError(f"env.{k}={v!r} is invalid: allowed a string, number or "
                                "boolean")
        out[k] = str(v)
    return out


def _unknown(keys: set[str], allowed: set[str], where: str) -> None:
    bad = sorted((k for k in keys if k not in allowed), key=str)
    if bad:
        allowed_txt = ", ".join(sorted(allowed))
        raise ScenarioError(f"{where} key {bad[0]!r} is unknown: allowed {allowed_txt}")


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def parse_text(text: str, suffix: str, where: str = "sweep file") -> dict:
    """TOML (tomllib) or YAML (safe loader) text -> dict; a syntax error is one line naming
    ``where`` and the parser's own position and reason."""
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            why = getattr(exc, "problem", None) or one_line(str(exc))
            raise ScenarioError(f"{where} is not valid YAML{at}: {why}; allowed a YAML "
                                "mapping of sweep keys") from None
    elif suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"{where} is not valid TOML: {one_line(str(exc))}; allowed a "
                                "TOML table of sweep keys") from None
    else:
        raise ScenarioError(f"sweep file suffix {suffix!r} is unknown: allowed .toml, .yaml, .yml")
    if not isinstance(data, dict):
        raise ScenarioError(f"{where} holds a {type(data).__name__}: allowed a table/mapping "
                            "at top level")
    return data


def sweep_name(value: object) -> str:
    """A sweep's ``name``, checked: it becomes part of the run folder's name."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ScenarioError(f"name={value!r} is invalid: allowed {NAME_ALLOWED}")
    return value


def _name_from_stem(stem: str) -> str:
    """A run-folder-safe name from a file name (``my sweep.toml`` -> ``my-sweep``)."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-.")[:100]
    return name or "sweep"


def _shape(spec: dict) -> ModelShape:
    if "name" in spec and (not isinstance(spec["name"], str) or not spec["name"].strip()):
        raise ScenarioError(f"scenario name={spec['name']!r} is invalid: allowed a non-empty "
                            "string")
    if "preset" in spec:
        if not isinstance(spec["preset"], str):
            raise ScenarioError(f"preset={spec['preset']!r} is invalid: allowed one preset "
                                "name (a string)")
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
        elif is_int(v) and v > 0:
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
    if not isinstance(timing_spec, dict):
        raise ScenarioError(f"timing={timing_spec!r} is invalid: allowed a table with "
                            "warmup, iters and rounds")
    _unknown(set(timing_spec), TIMING_KEYS, "timing")
    rounds = check_rounds(timing_spec.get("rounds", 1))
    timing = TimingConfig(**{k: v for k, v in timing_spec.items() if k != "rounds"})
    default_backends = backends_override or _as_list(data.get("backends", ["nccl_torch"]))
    default_ws = _as_list(data.get("world_sizes", ["auto"]))
    specs = data.get("scenarios")
    if not specs or not isinstance(specs, list):
        raise ScenarioError(f"scenarios={specs!r} is invalid: allowed a non-empty list of "
                            "scenario tables ([[scenarios]])")
    sweep = Sweep(sweep_name(data["name"]) if "name" in data else _name_from_stem(name),
                  env=sweep_env(data.get("env", {})), rounds=rounds)
    seen: set[tuple[str, str]] = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ScenarioError(f"scenarios[{i}]={spec!r} is invalid: allowed a table of "
                                "scenario fields")
        _unknown(set(spec), SCENARIO_KEYS, "scenario")
        shape = _shape(spec)
        backends = backends_override or _as_list(spec.get("backends", default_backends))
        for key, values in (("backends", backends),
                            ("world_sizes", spec.get("world_sizes", default_ws)),
                            *((k, spec[k]) for k in sorted(GRID_KEYS) if k in spec)):
            if values == []:  # an empty grid axis would expand to no cells without a word
                raise ScenarioError(f"{key}=[] is invalid: allowed a value or a non-empty list")
        check_backend_names(backends)
        variants = [b for b in backends if "@" in b]
        passes = tuple(_as_list(spec.get("passes", DEFAULT_PASSES)))
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
    from mokbench.backend import backend_options, get_backend, split_label

    name, options = split_label(label)[0], backend_options(label)
    backend = get_backend(label)
    if options and not hasattr(backend, "validate_options"):
        raise ScenarioError(f"backend={label!r} is invalid: {name} takes no options; allowed "
                            f"{name} or {name}@tag=TEXT (a label only)")
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
        text, suffix, name = read_sweep_text(p), p.suffix, p.stem
    where = "sweep file" if path is None else f"sweep file {str(path)!r}"
    sweep = expand(parse_text(text, suffix, where), auto_world, backends_override, name)
    sweep.source_text, sweep.source_suffix = text, suffix
    return sweep


def read_sweep_text(p: Path) -> str:
    """A sweep file's text; a missing, unreadable or non-UTF-8 file is a one-line error."""
    if p.suffix not in (".toml", ".yaml", ".yml"):
        raise ScenarioError(f"sweep file {str(p)!r} is invalid: allowed a .toml, .yaml or "
                            ".yml file")
    if not p.exists():
        raise ScenarioError(f"sweep file {str(p)!r} does not exist: allowed an existing "
                            ".toml, .yaml or .yml file")
    if not p.is_file():
        raise ScenarioError(f"sweep file {str(p)!r} is not a file: allowed a .toml, .yaml or "
                            ".yml file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"sweep file {str(p)!r} is not UTF-8 text (byte {exc.start}): "
                            "allowed a UTF-8 TOML or YAML file") from None
    except OSError as exc:
        raise ScenarioError(f"sweep file {str(p)!r} cannot be read: {exc.strerror or exc}"
                            ) from None
