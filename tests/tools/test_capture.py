"""CUDA-graph capture of the sync-free MoELayer step (EP 1) and the ops' deferred errors under
capture. GPU only (marked ``gpu``)."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.dispatcher import AllToAllDispatcher
from moe_dispatch.ops import check_device_errors, permute
from moe_dispatch.tools.capture import capture_step

pytestmark = pytest.mark.gpu


def _config(**changes) -> MoEConfig:
    base = dict(hidden_size=256, num_experts=16, topk=4, ffn_hidden_size=128, params_dtype=torch.bfloat16,
                shared_expert_ffn_hidden_size=64)
    return MoEConfig(**{**base, **changes})


def _eager(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    out = layer(xx)
    out.backward(upstream)
    return [out.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]


def _capture(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor):
    """(graph, static output, static gradients [x, *parameters]): forward + backward with the
    gradients reset (each replay writes the graph's own .grad tensors, kept here)."""
    def step() -> torch.Tensor:
        out = layer(x)
        out.backward(upstream)
        return out

    graph, out = capture_step(layer, x, step)
    return graph, out, [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("probs_in_experts,fp8", [(False, None), (True, None), (False, "e4m3"), (True, "e4m3")])
def test_graph_replay_is_bitwise_eager(probs_in_experts, fp8):
    """The sync-free EP-1 step captures, bf16 and FP8 (whose weight gradient lays out its padding on
    the device), and each replay on new tokens is bitwise the eager step: output and every gradient."""
    layer = MoELayer(_config(probs_in_experts=probs_in_experts, fp8=fp8), layer_index=0).cuda()
    assert layer.dispatcher.sync_free
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    graph, out, grads = _capture(layer, x, upstream)
    for _ in range(2):  # new tokens in the static input, then replay
        fresh = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            x.copy_(fresh)
        graph.replay()
        replayed = [out.detach().clone()] + [g.clone() for g in grads]
        for i, (a, b) in enumerate(zip(replayed, _eager(layer, fresh, upstream))):
            assert torch.equal(a, b), i
    check_device_errors()


@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_graph_replay_equals_dropless_eager(fp8):
    """The captured sync-free step is bitwise the dropless dispatch's eager step (host counts)."""
    layer = MoELayer(_config(fp8=fp8), layer_index=0).cuda()
    dropless = MoELayer(_config(fp8=fp8), layer_index=0).cuda()
    dropless.dispatcher = AllToAllDispatcher(_config(fp8=fp8))
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    graph, out, grads = _capture(layer, x, upstream)
    graph.replay()
    replayed = [out.detach().clone()] + [g.clone() for g in grads]
    for i, (a, b) in enumerate(zip(replayed, _eager(dropless, x.detach(), upstream))):
        assert torch.equal(a, b), i


def test_make_graphed_callables_is_bitwise_eager():
    layer = MoELayer(_config(shared_expert_ffn_hidden_size=None), layer_index=0).cuda()
    twin = MoELayer(_config(shared_expert_ffn_hidden_size=None), layer_index=0).cuda()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    fresh = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer.zero_grad(set_to_none=True)
    out = graphed(fresh)
    out.backward(upstream)
    got = [out.detach(), fresh.grad] + [p.grad for p in layer.parameters()]
    for i, (a, b) in enumerate(zip(got, _eager(twin, fresh.detach(), upstream))):
        assert torch.equal(a, b), i


def test_replay_with_bad_input_poisons_and_check_raises():
    """A replay whose tokens are NaN (so are the router's probs): outputs NaN, and
    check_device_errors() raises the sync-free dispatch's error; a good replay after it is clean."""
    layer = MoELayer(_config(), layer_index=0).cuda()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    graph, out, _ = _capture(layer, x, upstream)
    good = x.detach().clone()
    with torch.no_grad():
        x[3, 7] = float("nan")
    graph.replay()
    assert torch.isnan(out).any()
    with pytest.raises(ValueError, match="probs contain NaN or inf"):
        check_device_errors()
    with torch.no_grad():
        x.copy_(good)
    graph.replay()
    assert torch.isfinite(out).all()
    check_device_errors()


def test_ops_deferred_error_under_capture():
    """permute(tokens_per_expert=...) captured with the right counts; a replay on a routing map
    that no longer matches them poisons its output and check_device_errors() raises."""
    T, E, H = 64, 8, 128
    tokens = torch.randn(T, H, device="cuda")
    routing_map = torch.zeros(T, E, dtype=torch.bool, device="cuda")
    routing_map[torch.arange(T), torch.arange(T) % E] = True
    counts = [T // E] * E
    permute(tokens, routing_map, tokens_per_expert=counts)  # warm up outside the capture
    check_device_errors()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, _ = permute(tokens, routing_map, tokens_per_expert=counts)
    graph.replay()
    torch.cuda.synchronize()
    check_device_errors()
    assert torch.isfinite(out).all()
    routing_map[0] = False
    routing_map[0, 1] = True  # expert 0 now has one token fewer than given
    graph.replay()
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="tokens_per_expert"):
        check_device_errors()


def test_capture_step_collects_a_dead_graph_before_capturing():
    """A CUDA graph left in a reference cycle (make_graphed_callables leaves its graphs in one) is
    collected before capture_step's capture, never during it, even with the collector set to run at
    nearly every allocation: a collection inside a capture runs finalizers, and any that calls CUDA
    invalidates it. torch.cuda.graph alone lets collections start (scripts/measure/capture_gc.py)."""
    import gc

    src = torch.ones(1 << 20, device="cuda")
    old_graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        src * 2
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(old_graph):
        doubled = src * 2
    holder = {"graph": old_graph, "out": doubled}
    holder["self"] = holder
    del holder, old_graph, doubled

    layer = MoELayer(_config(), layer_index=0).cuda()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    collections_while_capturing = []

    def watch(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            collections_while_capturing.append(info)

    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1, 1, 1)
    try:
        graph, out, _ = _capture(layer, x, upstream)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert collections_while_capturing == []
    graph.replay()
    replayed = out.detach().clone()
    assert torch.equal(replayed, _eager(layer, x.detach(), upstream)[0])
