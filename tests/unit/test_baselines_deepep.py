"""DeepEP adapter on CPU: reasons, buffer sizing, FP8 cast, slot grouping, and the whole layer
(forward and backward through the dispatch/combine autograd functions) against the float32
reference, with a fake single-rank ``deep_ep`` module standing in for the library."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from baselines import deepep
from mokbench.backend import RunContext
from mokbench.check import check_backward, check_forward
from mokbench.inputs import make_inputs, make_weights
from mokbench.reference import reference_layer
from mokbench.scenario import Scenario, preset


def test_import_and_reason_without_library():
    if "deep_ep" in sys.modules or __import__("importlib").util.find_spec("deep_ep"):
        pytest.skip("deep_ep is installed here")
    why = deepep.DeepEPBackend().unavailable_reason(RunContext(), None)
    assert "package 'deep_ep' is not installed" in why
    assert "v1.2.1" in why and "benchmarks/build_deepep.sh" in why


def test_reason_world_size_precision_hidden():
    r = deepep.deepep_reason
    assert r(1, "bf16", 128, installed=True) == "needs 2, 4 or 8 GPUs (world size 1)"
    assert r(16, "bf16", 128, installed=True) == "needs 2, 4 or 8 GPUs (world size 16)"
    assert r(8, "bf16", 128, installed=True) is None
    assert "SM90" in r(4, "fp8", 128, installed=True, sm90_compiled=False)
    assert "multiple of 128" in r(4, "fp8", 96, installed=True)
    assert r(4, "fp8", 256, installed=True) is None
    assert "V2" in r(4, "bf16", 128, installed=True, has_v1_buffer=False)


def test_comm_sms_knob():
    assert deepep.comm_sms({}) == 24
    assert deepep.comm_sms({deepep.SMS_ENV: "32"}) == 32
    for bad in ("23", "0", "-2"):
        with pytest.raises(ValueError, match=deepep.SMS_ENV):
            deepep.comm_sms({deepep.SMS_ENV: bad})


class _Cfg:
    def __init__(self, nvl: int, rdma: int) -> None:
        self.nvl, self.rdma, self.calls = nvl, rdma, []

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        self.calls.append((hidden_bytes, num_ranks))
        return self.nvl * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return self.rdma


def test_buffer_sizing_takes_largest_hint():
    assert deepep.hidden_bytes(7168, 2) == 14336
    assert deepep.hidden_bytes(7168, 1) == 14336  # fp8 rows still sized for the bf16 combine
    a, b = _Cfg(3, 0), _Cfg(5, 7)
    assert deepep.buffer_bytes([a, b], 100, 8) == (500, 7)
    assert a.calls == [(100, 8)]


def test_fp8_cast_round_trip():
    x = torch.randn(5, 256, dtype=torch.bfloat16) * 3
    q, s = deepep.per_token_cast_to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s.dtype == torch.float32
    back = deepep.fp8_to_bf16(q, s)
    assert (back.float() - x.float()).norm() / x.float().norm() < 0.05


def test_group_received_orders_slots_by_expert():
    idx_RK = torch.tensor([[1, -1], [0, 1], [-1, 0], [2, -1]])
    rows, ks = deepep.group_received(idx_RK, [2, 2, 1])
    assert rows.tolist() == [1, 2, 0, 1, 3]
    assert ks.tolist() == [0, 1, 0, 1, 0]
    assert idx_RK[rows, ks].tolist() == [0, 0, 1, 1, 2]


class _FakeBuffer:
    """One rank holding every expert: dispatch receives all tokens; combine sums rows back."""

    num_sms = 20
    made: list[_FakeBuffer] = []

    def __init__(self, group, nvl, rdma, explicitly_destroy=False):
        self.args = (nvl, rdma, explicitly_destroy)
        self.destroyed = False
        _FakeBuffer.made.append(self)

    @staticmethod
    def set_num_sms(n):
        _FakeBuffer.num_sms = n

    @staticmethod
    def get_dispatch_config(W):
        return _Cfg(2, 0)

    @staticmethod
    def get_combine_config(W):
        return _Cfg(3, 0)

    @staticmethod
    def is_sm90_compiled():
        return True

    def get_dispatch_layout(self, topk_idx, num_experts):
        assert topk_idx.dtype == torch.int64
        return "per_rank", None, "per_expert", "in_rank", None

    def dispatch(self, x, handle=None, topk_idx=None, topk_weights=None, **kw):
        if handle is not None:  # cached mode (combine's backward)
            return x.clone(), None, None, None, None, None
        assert kw["num_tokens_per_rank"] == "per_rank" and kw["is_token_in_rank"] == "in_rank"
        assert topk_weights.dtype == torch.float32
        E = self.num_experts
        counts = torch.bincount(topk_idx.reshape(-1), minlength=E).tolist()
        xs = tuple(t.clone() for t in x) if isinstance(x, tuple) else x.clone()
        return xs, topk_idx.clone(), topk_weights.clone(), counts, ("handle",), None

    def combine(self, x, handle, topk_weights=None):
        assert handle == ("handle",)
        return x.clone(), None if topk_weights is None else topk_weights.clone(), None

    def destroy(self):
        self.destroyed = True


@pytest.fixture
def fake_deep_ep(monkeypatch):
    mod = types.ModuleType("deep_ep")
    mod.Buffer = _FakeBuffer
    monkeypatch.setitem(sys.modules, "deep_ep", mod)
    _FakeBuffer.made.clear()
    return mod


class _Group:
    def size(self):
        return 1


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_layer_matches_reference_through_fake_deepep(fake_deep_ep, monkeypatch, precision):
    monkeypatch.setenv(deepep.SMS_ENV, "26")
    sc = Scenario(preset("tiny"), tokens_per_rank=24, world_size=1, precision=precision)
    ctx = RunContext(group=_Group())
    weights, inputs = make_weights(sc, 0, "cpu"), make_inputs(sc, 0, "cpu")
    ref = reference_layer(inputs, weights)
    _FakeBuffer.num_experts = sc.shape.num_experts
    be = deepep.DeepEPBackend()
    be.setup(sc, ctx, weights)
    buf = _FakeBuffer.made[-1]
    assert _FakeBuffer.num_sms == 26 and buf.args[2] is True  # explicitly_destroy
    assert buf.args[0] == 3 * deepep.hidden_bytes(sc.shape.hidden, 2)  # largest hint
    x = inputs.x_TH.clone().requires_grad_(True)
    p = inputs.topk_weights_TK.clone().requires_grad_(True)
    y = be.forward(x, inputs.topk_idx_TK, p)
    assert check_forward(y, ref, precision).ok, check_forward(y, ref, precision).reason()
    be.zero_grad()
    y.backward(inputs.dy_TH)
    res = check_backward(x.grad, p.grad, be.weight_grads(), ref, precision)
    assert res.ok, res.reason()
    assert ("fp8" in be.variant) == (precision == "fp8")
    be.teardown()
    assert buf.destroyed
