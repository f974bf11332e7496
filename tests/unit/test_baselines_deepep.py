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
    for bad in ("23", "0", "-2", "many"):
        with pytest.raises(ValueError, match=deepep.SMS_ENV):
            deepep.comm_sms({deepep.SMS_ENV: bad})


def test_reason_import_error_and_pynvml():
    r = deepep.deepep_reason
    why = r(2, "bf16", 128, installed=True, import_error="ImportError: libnvshmem.so")
    assert why == "package 'deep_ep' does not import: ImportError: libnvshmem.so"
    assert "nvidia-ml-py" in r(2, "bf16", 128, installed=True, pynvml_missing=True)
    for ok in (None, "", "0,1", "3,2,"):
        assert r(2, "bf16", 128, installed=True, visible_devices=ok) is None
    why = r(2, "bf16", 128, installed=True, visible_devices="GPU-1a2b,GPU-3c4d")
    assert "CUDA_VISIBLE_DEVICES as GPU indices" in why and "GPU-1a2b" in why


def test_hybrid_ep_buffer_needs_pynvml():
    class V121Buffer:  # v1.2.1: pynvml only on PCIe GPUs
        def __init__(
            self,
            group,
            num_nvl_bytes=0,
            num_rdma_bytes=0,
            low_latency_mode=False,
            num_qps_per_rank=24,
            allow_nvlink_for_low_latency_mode=True,
            allow_mnnvl=False,
            explicitly_destroy=False,
            comm=None,
        ):
            pass

    assert deepep.buffer_needs_pynvml(_FakeBuffer)  # the hybrid-ep branch's signature
    assert not deepep.buffer_needs_pynvml(V121Buffer)


class _Cfg:
    """A size-hint stand-in with chosen hints (``deep_ep.Config`` exposes only the hints)."""

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


class _FakeConfig:
    """``deep_ep.Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``: its NVLink hint
    keeps the main term of the real one (channels x ranks x recv tokens x hidden bytes);
    intranode (<= 8 ranks) needs no RDMA buffer."""

    def __init__(
        self, num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int = 6, rdma_recv: int = 256
    ) -> None:
        assert num_sms >= 0 and 0 < nvl_send < nvl_recv
        self.num_sms, self.nvl_recv = num_sms, nvl_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return (self.num_sms // 2) * num_ranks * self.nvl_recv * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class _Event:
    """``deep_ep.EventOverlap``."""


class _FakeBuffer:
    """The V1 ``deep_ep.Buffer`` of the hybrid-ep branch, intranode, as one rank holding every
    expert: the same constructor, static SM count and configs (read at call time), return
    tuples and argument checks as the real one; dispatch receives every token, combine sums rows
    back. The real config tables start at 2 ranks; this single-rank stand-in reuses EP 2's."""

    num_sms = 20
    made: list[_FakeBuffer] = []
    _DISPATCH = {2: (24, 256), 4: (6, 256), 8: (6, 256)}
    _COMBINE = {2: (10, 256), 4: (9, 256), 8: (4, 256)}

    def __init__(
        self,
        group,
        num_nvl_bytes=0,
        num_rdma_bytes=0,
        low_latency_mode=False,
        num_qps_per_rank=24,
        allow_nvlink_for_normal_mode=True,
        allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False,
        use_fabric=False,
        explicitly_destroy=False,
        comm=None,
    ):
        self.group_size = group.size()
        self.args = (num_nvl_bytes, num_rdma_bytes, explicitly_destroy)
        self.explicitly_destroy, self.runtime = explicitly_destroy, object()
        _FakeBuffer.made.append(self)

    @staticmethod
    def set_num_sms(new_num_sms):
        assert new_num_sms % 2 == 0, "The SM count must be even"
        _FakeBuffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        return _FakeConfig(_FakeBuffer.num_sms, *_FakeBuffer._DISPATCH[max(num_ranks, 2)])

    @staticmethod
    def get_combine_config(num_ranks):
        return _FakeConfig(_FakeBuffer.num_sms, *_FakeBuffer._COMBINE[max(num_ranks, 2)])

    @staticmethod
    def is_sm90_compiled():
        return True

    def get_dispatch_layout(
        self,
        topk_idx,
        num_experts,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2
        per_expert = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).int()
        per_rank = torch.tensor([topk_idx.shape[0]], dtype=torch.int32)
        in_rank = torch.ones(topk_idx.shape[0], self.group_size, dtype=torch.bool)
        return per_rank, None, per_expert, in_rank, _Event()

    def _channels(self, config):
        config = config or self.get_dispatch_config(self.group_size)
        assert config.num_sms % 2 == 0
        return config.num_sms // 2

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment=1,
        num_worst_tokens=0,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        channels = self._channels(config)
        xs, scales = x if isinstance(x, tuple) else (x, None)
        assert xs.dim() == 2 and xs.is_contiguous()
        if scales is not None:
            assert xs.element_size() == 1 and scales.dtype == torch.float32
            assert scales.shape == (xs.shape[0], xs.shape[1] // 128)
        else:
            assert xs.dtype == torch.bfloat16
        recv = (xs.clone(), scales.clone()) if scales is not None else xs.clone()
        if handle is not None:  # cached mode (combine's backward)
            assert topk_idx is None and topk_weights is None
            assert handle[1].shape[1] == channels, "SM count changed since the dispatch"
            return recv, None, None, None, None, _Event()
        assert num_tokens_per_rank.dtype == torch.int32 and is_token_in_rank.dtype == torch.bool
        assert num_tokens_per_expert.dtype == torch.int32
        assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
        assert topk_idx.dtype == torch.int64 and topk_idx.is_contiguous()
        counts = num_tokens_per_expert.tolist()  # one rank: every expert is local
        W, T = self.group_size, xs.shape[0]
        matrix = torch.zeros(W, channels, dtype=torch.int32)
        handle = (
            torch.zeros(W, W, dtype=torch.int32),
            matrix,
            matrix.clone(),
            torch.arange(T, dtype=torch.int32),
            is_token_in_rank,
            torch.zeros(T, W, dtype=torch.int32),
        )
        return recv, topk_idx.clone(), topk_weights.clone(), counts, handle, _Event()

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16
        assert len(handle) == 6 and handle[2].shape[1] == self._channels(config)
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32
        w = None if topk_weights is None else topk_weights.clone()
        return x.clone(), w, _Event()

    def destroy(self):
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self.runtime = None


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
    be = deepep.DeepEPBackend()
    be.setup(sc, ctx, weights)
    buf = _FakeBuffer.made[-1]
    assert _FakeBuffer.num_sms == 26 and buf.args[2] is True  # explicitly_destroy
    hint = 13 * 1 * 256 * deepep.hidden_bytes(sc.shape.hidden, 2)  # sized with 26 SMs
    assert buf.args[:2] == (hint, 0)
    assert be.variant.startswith(f"sms=26,nvl_buffer_mib={hint / 2**20:.0f}")
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
    assert buf.runtime is None  # destroyed
