"""Device error codes are defined once, in errors.py: every code a kernel can record is one of
its ``ERR_*`` names and reads back as a named message (not "unknown device error code")."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

pytest.importorskip("triton")

import mok_kernels._details as details  # noqa: E402
from mok_kernels._details import errors  # noqa: E402

# Every Triton module (tl_*), found rather than listed, so a module split off later is scanned.
KERNEL_MODULES = tuple(importlib.import_module(f"{details.__name__}.{m.name}")
                       for m in pkgutil.iter_modules(details.__path__)
                       if m.name.startswith("tl_"))
CODE_ARG = {"wait_geq": 4, "_spin": 4, "record_error": 1,
            "_wait_flags": 4}  # where the calls take the code
NAMED = {v: k for k, v in vars(errors).items() if k.startswith("ERR_") and k != "ERR_NONE"}


def recorded_codes(module: ModuleType) -> dict[str, int]:
    """Global name -> value of every code the module's functions pass to a call that records
    one; a code passed through from the function's own parameters is the caller's."""
    found: dict[str, int] = {}
    for fn in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(fn, ast.FunctionDef):
            continue
        params = {a.arg for a in fn.args.args}
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id in CODE_ARG):
                continue
            arg = call.args[CODE_ARG[call.func.id]]
            assert isinstance(arg, ast.Name), f"{module.__name__}: literal code {ast.unparse(arg)}"
            if arg.id in params:
                continue
            value = getattr(module, arg.id)
            found[arg.id] = getattr(value, "value", value)  # tl.constexpr holds its value
    return found


def test_every_recorded_code_has_a_name_and_a_message():
    assert {"tl_mega", "tl_backward", "tl_backward_dgrad", "tl_backward_wgrad",
            "tl_sync"} <= {m.__name__.rsplit(".", 1)[1] for m in KERNEL_MODULES}
    codes = {name: code for m in KERNEL_MODULES for name, code in recorded_codes(m).items()}
    assert set(codes) >= {"_E_RING_FREE", "_E_DGRAD_GROUP"}, codes  # the scan finds them
    for name, code in codes.items():
        assert code in NAMED, f"{name} = {code} is not an ERR_* code of errors.py"
        message = str(errors.describe(0, code, 1, 2))
        assert "unknown" not in message and errors.WAIT_NAMES[code] in message, (name, message)
    assert set(codes.values()) == set(errors.WAIT_NAMES), "a wait code no kernel records"


def test_kernel_codes_are_taken_from_errors_py():
    """No kernel module writes a code's number itself: each ``_E_*`` constant is built from
    the ``errors.ERR_*`` of the same value."""
    for module in KERNEL_MODULES:
        for node in ast.parse(inspect.getsource(module)).body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and node.target.id.startswith("_E_")):
                continue
            used = [n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id == "errors"]
            assert len(used) == 1 and used[0] in vars(errors), (module.__name__, node.target.id)


def test_a_literal_code_is_found(monkeypatch):
    """The scan rejects a code written as a number instead of a name from errors.py."""
    src = "def k(c, e, b):\n    wait_geq(c, 1, e, b, 3, 0)\n"
    module = ModuleType("fake_kernels")
    monkeypatch.setattr(inspect, "getsource", lambda m: src)
    with pytest.raises(AssertionError, match="literal code 3"):
        recorded_codes(module)
