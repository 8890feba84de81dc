"""moe_dispatch.tools.profiling.gpu_idle on a hand-made trace (the CPU suite has no CUDA kernels), and
median_ms on a hand-made clock."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from moe_dispatch.tools import profiling
from moe_dispatch.tools.profiling import gpu_idle


def _event(name, start, end, device=DeviceType.CPU, id=0, linked=0, thread=1, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, id=id,
                           linked_correlation_id=linked, thread=thread, is_user_annotation=annotation)


def _trace():
    """Two steps, as kineto links them: a kernel's linked_correlation_id is the id of the runtime
    call that launched it. Kernels: k1 [0, 10], k2 [10.5, 20] (a 0.5 us gap: jitter), k3 [50, 60]
    launched at 45 inside 'experts' by aten::mm (30 us idle), k4 [55, 70] overlapping k3, k5
    [100, 110] launched at 95 by aten::add_ in AccumulateGrad's backward node (30 us idle). The
    'experts' range also shows on the GPU timeline; it is no kernel."""
    cuda = DeviceType.CUDA
    return [
        _event("step", 0, 200, annotation=True),
        _event("experts", 40, 48, annotation=True),
        _event("aten::mm", 44, 46, id=3),
        _event("cudaLaunchKernel", 45, 45.5, id=13),
        _event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 90, 99, thread=2),
        _event("aten::add_", 94, 96, id=5, thread=2),
        _event("cudaLaunchKernel", 95, 95.2, id=15, thread=2),
        _event("k1", 0, 10, cuda, id=101, linked=11),
        _event("k2", 10.5, 20, cuda, id=102, linked=12),
        _event("experts", 30, 70, cuda, id=106, annotation=True),
        _event("k3", 50, 60, cuda, id=103, linked=13),
        _event("k4", 55, 70, cuda, id=104, linked=14),
        _event("k5", 100, 110, cuda, id=105, linked=15),
    ]


def test_gpu_idle_attributes_gaps_to_the_launching_phase():
    result = gpu_idle(_trace(), steps=2)
    assert result["busy_us"] == pytest.approx((10 + 9.5 + 20 + 10) / 2)
    assert result["idle_us"] == pytest.approx((30 + 30) / 2)  # the 0.5 us gap is under min_gap_us
    rows = {key: (idle, count) for key, idle, count in result["rows"]}
    assert rows == {"step / experts / aten::mm": (15.0, 0.5),
                    "torch::autograd::AccumulateGrad / aten::add_": (15.0, 0.5)}


def test_gpu_idle_untraced_launch_and_depth():
    events = [e for e in _trace() if e.name != "cudaLaunchKernel"]  # launches not traced
    rows = [key for key, _, _ in gpu_idle(events, steps=1, depth=1)["rows"]]
    assert rows == ["(launch not traced) -> k3", "(launch not traced) -> k5"]
    rows = [key for key, _, _ in gpu_idle(_trace(), steps=1, depth=1)["rows"]]
    assert "experts / aten::mm" in rows


def test_median_ms_times_each_call_after_the_warmup_and_the_hook(monkeypatch):
    """Off CUDA the host clock times each call: the warm-up calls are untimed, ``before`` runs once
    between them and the timed calls, and the result is the median of the timed calls in ms."""
    clock = iter([0.0, 0.005, 1.0, 1.001, 2.0, 2.010])  # three timed calls: 5, 1 and 10 ms
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(clock))
    calls = []
    ms = profiling.median_ms(lambda: calls.append("call"), iters=3, warmup=2, device="cpu",
                             before=lambda: calls.append("before"))
    assert calls == ["call", "call", "before", "call", "call", "call"]
    assert ms == pytest.approx(5.0)
