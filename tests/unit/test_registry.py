"""The lazy backend registry and capability checks."""

import sys

import pytest

from mokbench.backend import (
    Capabilities,
    RunContext,
    backend_names,
    capability_reason,
    get_backend,
)
from mokbench.scenario import Scenario, ScenarioError, preset

ALL = {"nccl_torch", "nccl_torch_compile", "deepep", "te", "hybridep_megatron",
       "megatron_alltoall", "mok_upstream", "mok"}


def test_every_backend_is_registered():
    assert ALL <= set(backend_names())


def test_registry_is_lazy():
    for mod in [m for m in sys.modules if m.startswith("baselines.nccl_torch")]:
        del sys.modules[mod]
    backend_names()
    assert "baselines.nccl_torch" not in sys.modules
    b = get_backend("nccl_torch")
    assert b.name == "nccl_torch" and "baselines.nccl_torch" in sys.modules


def test_unknown_backend_error():
    with pytest.raises(ScenarioError, match="backend='nope' is unknown: allowed nccl_torch"):
        get_backend("nope")


def test_extra_backends_from_env(monkeypatch):
    monkeypatch.setenv("MOKBENCH_EXTRA_BACKENDS", "fault_raise=tests.fault_backends:RaiseBackend")
    assert get_backend("fault_raise").name == "fault_raise"


def test_capability_reasons():
    scn = Scenario(preset("tiny"), 64, 2, precision="fp8")
    assert "package 'no_such_pkg_xyz'" in capability_reason(Capabilities(
        packages=("no_such_pkg_xyz",)), None, scn)
    assert "world size 2 not supported" in capability_reason(Capabilities(world_sizes=(4, 8)),
                                                             None, scn)
    assert "precision fp8" in capability_reason(Capabilities(), None, scn)
    assert capability_reason(Capabilities(precisions=("bf16", "fp8")), RunContext(), scn) is None


@pytest.mark.parametrize("env, mode", [(None, "default"), ("reduce-overhead", "reduce-overhead")])
def test_compile_mode_is_the_compiled_backends_variant(monkeypatch, env, mode):
    import torch

    from mokbench.inputs import make_weights

    if env is None:
        monkeypatch.delenv("MOKBENCH_COMPILE_MODE", raising=False)
    else:
        monkeypatch.setenv("MOKBENCH_COMPILE_MODE", env)
    scn = Scenario(preset("tiny"), 32, 1)
    b = get_backend("nccl_torch_compile")
    b.setup(scn, RunContext(device=torch.device("cpu")),
            make_weights(scn, 0, torch.device("cpu")))
    assert b.variant == f"mode={mode}"  # CPU default: "default"


def test_compile_mode_option_names_the_variant_over_the_environment(monkeypatch):
    import torch

    from mokbench.inputs import make_weights

    monkeypatch.setenv("MOKBENCH_COMPILE_MODE", "max-autotune")
    scn = Scenario(preset("tiny"), 32, 1)
    b = get_backend("nccl_torch_compile@mode=default")
    ctx = RunContext(device=torch.device("cpu"))
    ctx.extra["options"] = {"mode": "default"}
    b.setup(scn, ctx, make_weights(scn, 0, torch.device("cpu")))
    assert b.variant == "mode=default"


@pytest.mark.parametrize("label, words", [
    ("nccl_torch_compile@mode=fast", ["mode='fast' is invalid", "max-autotune-no-cudagraphs"]),
    ("nccl_torch_compile@modes=default", ["option 'modes' is unknown", "allowed mode"]),
])
def test_compile_options_are_checked_before_launch(label, words):
    from mokbench.sweep import validate_backend_options

    with pytest.raises(ScenarioError) as err:
        validate_backend_options(label, Scenario(preset("tiny"), 32, 1))
    msg = str(err.value)
    assert "\n" not in msg and label in msg
    assert all(w in msg for w in words), msg
    validate_backend_options("nccl_torch_compile@mode=reduce-overhead",
                             Scenario(preset("tiny"), 32, 1))
