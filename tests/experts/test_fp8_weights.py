"""The experts' FP8 weights quantised once (moe_dispatch/experts/fp8_weights.py): bitwise the
per-call quantisation's results, for the GEMM, the layer over micro-batches and at EP 2 with both
dispatchers; a stale or foreign handle is a ValueError, on every EP rank."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.experts import fp8_expert_gemm, quantize_weight
from tests.dispatcher.harness import run_ranks, value_error_of

H, F = 32, 48


def _config(**overrides) -> MoEConfig:
    base = dict(hidden_size=H, num_experts=4, topk=2, ffn_hidden_size=F, fp8="e4m3", params_dtype=torch.bfloat16,
                init_seed=3)
    return MoEConfig(**{**base, **overrides})


def _batches(seed: int, sizes=(9, 14)) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, H, generator=gen).to(torch.bfloat16), torch.randn(t, H, generator=gen).to(torch.bfloat16))
            for t in sizes]


def _micro_batches(layer: MoELayer, batches: list, once: bool) -> list:
    """Forward + backward of each (x, upstream), the gradients accumulating as between two optimizer
    steps; with ``once``, one handle for all of them. -> outputs, input gradients, then every
    parameter's accumulated gradient."""
    weights = layer.quantize_fp8_weights() if once else None
    outs, gxs = [], []
    for x, upstream in batches:
        x = x.clone().requires_grad_()
        out = layer(x, fp8_weights=weights)
        out.backward(upstream)
        outs.append(out.detach())
        gxs.append(x.grad)
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return outs + gxs + grads


def test_gemm_with_weight_operands_is_bitwise_per_call():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3, H, F, generator=gen) / 6).to(torch.bfloat16)
    counts = torch.tensor([4, 0, 7])
    x = torch.randn(11, H, generator=gen).to(torch.bfloat16)
    upstream = torch.randn(11, F, generator=gen).to(torch.bfloat16)
    results = []
    for operands in (None, quantize_weight(w)):
        wi, xi = w.clone().requires_grad_(), x.clone().requires_grad_()
        out = fp8_expert_gemm(xi, None, wi, counts, weight_operands=operands)
        out.backward(upstream)
        results.append((out.detach(), xi.grad, wi.grad))
    for per_call, once in zip(*results):
        assert torch.equal(per_call, once)


def test_bad_weight_operands_name_the_argument():
    w = torch.randn(3, H, F).to(torch.bfloat16)
    x = torch.randn(5, H).to(torch.bfloat16)
    counts = torch.tensor([2, 2, 1])
    q = quantize_weight(w)
    for bad in (q[:2], (q[2], q[3], q[0], q[1]), quantize_weight(w[:2]), (q[0].float(), *q[1:]), "q"):
        with pytest.raises(ValueError, match="weight_operands must be quantize_weight"):
            fp8_expert_gemm(x, None, w, counts, weight_operands=bad)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_micro_batches_with_one_handle_are_bitwise_per_call(dispatcher):
    config = _config(dispatcher=dispatcher, shared_expert_ffn_hidden_size=16, probs_in_experts=True)
    per_call = _micro_batches(MoELayer(config, layer_index=0), _batches(1), once=False)
    once = _micro_batches(MoELayer(config, layer_index=0), _batches(1), once=True)
    assert len(per_call) == len(once)
    for a, b in zip(per_call, once):
        assert torch.equal(a, b)


def _stale(case: str, layer: MoELayer, other: MoELayer):
    """A handle ``layer`` must refuse after ``case``."""
    weights = layer.quantize_fp8_weights()
    if case.startswith("adamw"):  # fused AdamW changes no autograd version: the step hook sees it
        kind = case.split("-")[1]
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3, **{kind: True} if kind != "loop" else {})
        layer(_batches(2)[0][0]).sum().backward()
        optimizer.step()
    elif case == "other optimizer":  # any optimizer step: whether it held these weights is not asked
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.1).step()
    elif case == "copy_":
        with torch.no_grad():
            layer.experts.weight2.copy_(layer.experts.weight2 * 2)
    elif case == ".data =":  # no autograd version changes; the storage does
        layer.experts.weight1.data = layer.experts.weight1.data.clone()
    elif case == "load_state_dict":
        layer.load_state_dict(other.state_dict())
    elif case == "replaced":
        layer.experts.weight1 = nn.Parameter(layer.experts.weight1.detach().clone())
    elif case == "another layer's":
        weights = other.quantize_fp8_weights()
    elif case == "not a handle":
        weights = (weights.weight1, weights.weight2)
    return weights


STALE = {"adamw-loop": "1 optimizer step", "adamw-foreach": "1 optimizer step", "adamw-fused": "1 optimizer step",
         "other optimizer": "1 optimizer step", "copy_": "weight2 changed in place or moved",
         "load_state_dict": "weight1 changed in place", ".data =": "weight1 changed in place or moved",
         "replaced": "other experts' weights",
         "another layer's": "other experts' weights", "not a handle": "must be the Fp8ExpertWeights"}


@pytest.mark.parametrize("case", list(STALE))
def test_a_stale_or_foreign_handle_is_refused(case):
    layer, other = MoELayer(_config(), layer_index=0), MoELayer(_config(init_seed=4), layer_index=1)
    weights = _stale(case, layer, other)
    x = _batches(3)[0][0]
    message = value_error_of(lambda: layer(x, fp8_weights=weights))
    assert message is not None and STALE[case] in message, message
    if case != "not a handle":
        assert "quantise" in message or "other experts" in message
    layer(x, fp8_weights=layer.quantize_fp8_weights())  # quantised again: accepted


def test_not_for_a_bf16_layer_and_nothing_to_quantise():
    fp8 = MoELayer(_config(), layer_index=0)
    bf16 = MoELayer(_config(fp8=None), layer_index=1)
    x = _batches(3)[0][0]
    assert "layer is not FP8" in value_error_of(lambda: bf16(x, fp8_weights=fp8.quantize_fp8_weights()))
    assert "not FP8" in value_error_of(bf16.quantize_fp8_weights)


def test_compiled_layer_takes_a_handle_and_still_refuses_a_stale_one():
    """torch.compile (aot_eager, EP 1): bitwise eager with a handle; the check runs at every call."""
    layer = MoELayer(_config(), layer_index=0)
    x = _batches(4)[0][0]
    weights = layer.quantize_fp8_weights()
    compiled = torch.compile(layer, backend="aot_eager")
    assert torch.equal(compiled(x, fp8_weights=weights), layer(x, fp8_weights=weights))
    _stale("other optimizer", layer, layer)
    assert "1 optimizer step" in value_error_of(lambda: compiled(x, fp8_weights=weights))


def _ep2_worker(rank: int, world_size: int) -> dict:
    """Both dispatchers, dropless and sync-free: two micro-batches per-call and with one handle; then
    rank 1 alone steps an optimizer, so its handle is stale and every rank must raise."""
    out = {}
    for kind in ("alltoall", "allgather"):
        for sync_free in (False, True):
            config = _config(dispatcher=kind, ep_capacity_factor=2.0 if sync_free else None)
            batches = _batches(10 + rank, sizes=(5 + rank, 8 - rank))
            case = {"bitwise": [torch.equal(a, b) for a, b in zip(
                _micro_batches(MoELayer(config, layer_index=0), batches, once=False),
                _micro_batches(MoELayer(config, layer_index=0), batches, once=True))]}
            layer = MoELayer(config, layer_index=0)
            weights = layer.quantize_fp8_weights()
            if rank == 1:
                p = nn.Parameter(torch.ones(2))
                p.grad = torch.ones(2)
                torch.optim.SGD([p], lr=0.1).step()
            x = batches[0][0]
            case["error"] = value_error_of(lambda: layer(x, fp8_weights=weights).sum().backward())
            if sync_free and case["error"] is None:  # after its first step: NaN, and the next call raises
                case["error"] = value_error_of(lambda: layer(x))
            out[(kind, sync_free)] = case
    return out


def test_ep2_bitwise_and_a_stale_handle_raises_on_every_rank():
    ranks = run_ranks(_ep2_worker, 2, timeout=300)
    for key in ranks[0]:
        for rank, result in enumerate(ranks):
            assert result[key]["bitwise"] and all(result[key]["bitwise"]), (key, rank, result[key]["bitwise"])
            # sync-free after its first step: the peers are in no size exchange; the flag names the rank
            expected = "EP rank 1 passed inputs" if key[1] else "1 optimizer step"
            assert result[key]["error"] is not None and expected in result[key]["error"], (key, rank)
        assert ranks[0][key]["error"] == ranks[1][key]["error"], key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_once_is_bitwise_per_call_eager_and_captured():
    """On CUDA (torch._scaled_grouped_mm, the Triton quantisers): with one handle, two micro-batches
    bitwise the per-call ones for both dispatchers, and a CUDA-graph replay bitwise its eager step."""
    from moe_dispatch.tools.capture import capture_step

    dev = torch.device("cuda")
    kw = dict(hidden_size=256, num_experts=16, topk=4, ffn_hidden_size=128, params_dtype=torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(7)
    batches = [tuple(torch.randn(t, 256, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
               for t in (300, 512)]
    results = {}
    for kind in ("alltoall", "allgather"):
        config = MoEConfig(fp8="e4m3", dispatcher=kind, **kw)
        results[kind] = _micro_batches(MoELayer(config, layer_index=0).to(dev), batches, once=False)
        once = _micro_batches(MoELayer(config, layer_index=0).to(dev), batches, once=True)
        assert all(torch.equal(a, b) for a, b in zip(results[kind], once)), kind
    per_call = results["alltoall"]
    layer = MoELayer(MoEConfig(fp8="e4m3", **kw), layer_index=0).to(dev)
    weights = layer.quantize_fp8_weights()
    x, upstream = batches[1]
    xs = x.clone().requires_grad_()

    def step() -> torch.Tensor:
        out = layer(xs, fp8_weights=weights)
        out.backward(upstream)
        return out
    graph, out = capture_step(layer, xs, step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, per_call[1]) and torch.equal(xs.grad, per_call[3])
