"""tools/benchmarks.py, what the benchmark scripts share, on CPU: the random routing, the layer's
inputs and step (copy_bandwidth needs CUDA and is what scripts/bench_ops.py prints first)."""
from __future__ import annotations

import argparse

import torch

from moe_dispatch import MoEConfig
from moe_dispatch.tools.benchmarks import add_shape_args, layer_inputs, layer_step, routing


def test_routing_takes_k_experts_per_token_with_their_softmax_probs():
    routing_map, probs = routing(64, 8, 3, seed=5, device="cpu")
    assert routing_map.shape == probs.shape == (64, 8) and routing_map.dtype == torch.bool
    assert routing_map.sum(1).eq(3).all()
    assert probs[~routing_map].eq(0).all() and probs[routing_map].gt(0).all() and probs.sum(1).lt(1).all()
    again = routing(64, 8, 3, seed=5, device="cpu")
    assert torch.equal(again[0], routing_map) and torch.equal(again[1], probs)


def test_layer_inputs_and_step():
    args = argparse.ArgumentParser()
    add_shape_args(args)
    assert vars(args.parse_args([])) == dict(tokens=8192, hidden=4096, ffn=1024, experts=64, topk=6)
    x, upstream = layer_inputs(16, 8, "cpu")
    assert x.shape == upstream.shape == (16, 8) and x.dtype == torch.bfloat16 and not torch.equal(x, upstream)
    assert torch.equal(layer_inputs(16, 8, "cpu")[0], x)
    config = MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16, params_dtype=torch.bfloat16)
    layer, step = layer_step(config, x, upstream)
    out, grad = step()
    assert out.shape == grad.shape == (16, 8)
    assert all(p.grad is None for p in layer.parameters())  # the step drops the layer's gradients
    again = step()
    assert torch.equal(again[0], out) and torch.equal(again[1], grad)
