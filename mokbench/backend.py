"""The protocol every backend meets, its capability record, and the lazy registry.

A backend implements one full MoE layer (dispatch, expert SwiGLU FFN, combine, router-weighted
sum, plus the shared expert) for one rank. The worker calls, in order:

    reason = backend.unavailable_reason(ctx)      # None when it can run here
    backend.setup(scenario, ctx, weights)         # build buffers, copy/convert weights
    y_TH = backend.forward(x_TH, topk_idx_TK, topk_weights_TK)
    y_TH.backward(dy_TH)                          # when "backward" in capabilities.passes
    with torch.no_grad(): backend.forward(...)    # the inference pass (see Capabilities.runs)
    backend.weight_grads()                        # canonical-layout dW for the check
    backend.teardown()                            # explicit: some libraries hang in destructors

In the forward (training) pass ``x_TH`` and ``topk_weights_TK`` require grad and autograd is on:
the forward keeps what its backward needs and returns ``y_TH`` with its graph (not detached), as
in training; the backward pass must produce their grads through autograd. In the inference pass
the forward runs under ``torch.no_grad()`` on inputs that do not require grad. Weight gradients
are returned in the canonical layout of :class:`mokbench.inputs.MoEWeights` (names ``w1_EHF``,
``w2_EIH``, ``ws1_HF``, ``ws2_IH``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from mokbench.inputs import MoEWeights
    from mokbench.scenario import Scenario


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run. ``world_sizes=None`` means any; ``min_cc=None`` runs on CPU too.

    ``passes`` lists "forward" and/or "backward"; the "inference" pass (the forward under
    ``torch.no_grad()``) runs wherever the forward does, unless ``inference=False`` opts out,
    and the "step" pass (forward and backward timed together) wherever both run.
    """

    passes: tuple[str, ...] = ("forward", "backward")
    inference: bool = True
    precisions: tuple[str, ...] = ("bf16",)
    world_sizes: tuple[int, ...] | None = None
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    needs_gpu: bool = False
    packages: tuple[str, ...] = ()  # importable module names it needs
    is_baseline: bool = True
    notes: str = ""

    def runs(self, pass_: str) -> bool:
        """Whether this backend runs ``pass_`` (inference: wherever forward runs, unless opted
        out; step: wherever forward and backward run; so a backend need not list them)."""
        if pass_ == "step":
            return "forward" in self.passes and "backward" in self.passes
        if pass_ == "inference":
            return self.inference and ("inference" in self.passes or "forward" in self.passes)
        return pass_ in self.passes


@dataclass
class RunContext:
    """Where a backend runs: this rank, the EP group, the device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: Any = "cpu"  # torch.device
    group: Any = None  # torch.distributed ProcessGroup (None: no process group)
    dist_backend: str = "gloo"
    extra: dict = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return str(self.device).startswith("cuda")


@runtime_checkable
class Backend(Protocol):
    name: str
    capabilities: Capabilities

    def unavailable_reason(self, ctx: RunContext | None, scenario: Scenario | None = None
                           ) -> str | None: ...

    def setup(self, scenario: Scenario, ctx: RunContext, weights: MoEWeights) -> None: ...

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor,
                topk_weights_TK: torch.Tensor) -> torch.Tensor: ...

    def weight_grads(self) -> dict[str, torch.Tensor]: ...

    def zero_grad(self) -> None: ...

    def teardown(self) -> None: ...


def _device_facts() -> tuple[int, tuple[int, int] | None]:
    """(number of visible GPUs, compute capability of GPU 0) without initialising CUDA twice."""
    import torch

    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_capability(0)


def capability_reason(caps: Capabilities, ctx: RunContext | None,
                      scenario: Scenario | None = None) -> str | None:
    """Generic reasons a backend cannot run: missing package, no/too few GPUs, compute
    capability, world size, precision or pass. ``None`` when nothing generic stops it."""
    for pkg in caps.packages:
        if importlib.util.find_spec(pkg) is None:
            return f"package {pkg!r} is not installed"
    ngpu, cc = _device_facts()
    if caps.needs_gpu or caps.min_cc is not None:
        if ngpu == 0:
            return "needs a CUDA GPU; none is visible"
        if caps.min_cc is not None and cc is not None and cc < caps.min_cc:
            need = ".".join(map(str, caps.min_cc))
            return f"needs compute capability >= {need}; GPU has {cc[0]}.{cc[1]}"
        if caps.max_cc is not None and cc is not None and cc > caps.max_cc:
            need = ".".join(map(str, caps.max_cc))
            return f"needs compute capability <= {need}; GPU has {cc[0]}.{cc[1]}"
    ws = scenario.world_size if scenario is not None else (ctx.world_size if ctx else None)
    if ws is not None and caps.world_sizes is not None and ws not in caps.world_sizes:
        return f"world size {ws} not supported: allowed {', '.join(map(str, caps.world_sizes))}"
    if scenario is not None and scenario.precision not in caps.precisions:
        return f"precision {scenario.precision} not supported: allowed {', '.join(caps.precisions)}"
    return None


class BackendBase:
    """Shared defaults: generic availability check, no-op teardown, grads from ``params``."""

    name = "base"
    capabilities = Capabilities()

    def __init__(self) -> None:
        self.params: dict[str, torch.nn.Parameter] = {}

    def unavailable_reason(self, ctx: RunContext | None, scenario: Scenario | None = None
                           ) -> str | None:
        return capability_reason(self.capabilities, ctx, scenario)

    def install_hint(self) -> str | None:
        """How to install what this backend lacks here, as one line (None: nothing to say).
        Optional: `mokbench backends` prints it below its table for the backends that have one."""
        return None

    def weight_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of ``self.params`` (already in the canonical layout)."""
        return {k: p.grad for k, p in self.params.items() if p.grad is not None}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def teardown(self) -> None:
        self.params = {}


# name -> "module:attr". Imported only when used, so the CLI starts fast without heavy libraries.
REGISTRY: dict[str, str] = {
    "nccl_torch": "baselines.nccl_torch:NcclTorchBackend",
    "nccl_torch_compile": "baselines.nccl_torch:NcclTorchCompileBackend",
    "deepep": "baselines.deepep:DeepEPBackend",
    "te": "baselines.transformer_engine:TEBackend",
    "hybridep_megatron": "baselines.hybridep_megatron:HybridEPMegatronBackend",
    "megatron_alltoall": "baselines.hybridep_megatron:MegatronAlltoallBackend",
    "mok_upstream": "baselines.mok_upstream:MoKUpstreamBackend",
    "mok": "mokbench.mok_backend:MoKBackend",
}

EXTRA_ENV = "MOKBENCH_EXTRA_BACKENDS"  # "name=module:attr,name2=module:attr" (tests, plugins)

# Options any backend's label may carry that never reach the backend: ``tag`` tells two cells of
# one backend apart in a run (``nccl_torch@tag=rerun``). Other options need the backend's own
# ``validate_options``; a backend without one takes none.
LABEL_OPTIONS = ("tag",)


def registry() -> dict[str, str]:
    """The built-in registry plus any backends named in $MOKBENCH_EXTRA_BACKENDS."""
    reg = dict(REGISTRY)
    for item in filter(None, os.environ.get(EXTRA_ENV, "").split(",")):
        name, _, target = item.partition("=")
        reg[name.strip()] = target.strip()
    return reg


def backend_names() -> list[str]:
    return list(registry())


def split_label(label: str) -> tuple[str, dict]:
    """``"mok@minibatch=2048,fwd_comm_sms=16"`` -> ``("mok", {"minibatch": 2048, ...})``.

    A backend label is a registry name, optionally followed by ``@`` and comma-separated
    ``key=value`` options (values read as JSON where they parse: numbers, true/false; else
    strings). Each variant is its own backend in rows, tables and charts; the options reach the
    backend as ``ctx.extra["options"]``.
    """
    from mokbench.scenario import ScenarioError

    if not isinstance(label, str) or not label.strip():
        raise ScenarioError(f"backend={label!r} is invalid: allowed a backend name (a string; "
                            "`mokbench backends` lists them)")
    name, at, rest = label.partition("@")
    if at and not rest.strip(" ,"):
        raise ScenarioError(f"backend={label!r} is invalid: allowed name or "
                            "name@key=value,key=value")
    options: dict = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ScenarioError(f"backend={label!r} is invalid: allowed name@key=value,key=value")
        try:
            options[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            options[key.strip()] = raw.strip()
    return name.strip(), options


def backend_options(label: str) -> dict:
    """The options a backend receives from its label (label-only ones such as ``tag`` left
    out)."""
    return {k: v for k, v in split_label(label)[1].items() if k not in LABEL_OPTIONS}


def check_backend_names(labels: list[str]) -> None:
    """One-line error for an unknown backend name (options after ``@`` are checked by the
    backend's ``validate_options`` where it has one, see mokbench.sweep)."""
    from mokbench.scenario import ScenarioError

    known = registry()
    for label in labels:
        n, _ = split_label(label)
        if n not in known:
            raise ScenarioError(f"backend={n!r} is unknown: allowed {', '.join(known)}")


def get_backend(label: str) -> Backend:
    """Import and instantiate a backend by registry name (options after ``@`` are ignored
    here; the worker hands them over through the run context)."""
    check_backend_names([label])
    module, _, attr = registry()[split_label(label)[0]].partition(":")
    return getattr(importlib.import_module(module), attr)()
