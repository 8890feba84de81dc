"""copy.deepcopy of an EP-2 MoELayer (e.g. EMA weights) and of dispatch handles, on 2 gloo ranks
(one spawn).

A copy of a layer holds the same experts on the same EP group: it shares the group and copies the
weights. Its dispatcher is a new layer of the group (the next layer id, as a layer built at the
copy would be; every rank copies in the same order), so the copy and the original never pass for
each other's calls: run in the same order on every rank both work, the copy bitwise like the
original for equal weights; run in swapped order, every rank raises the same ValueError.
A handle is immutable: its deep copy is the handle itself, and combine gives the same result."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.dispatcher import build_dispatcher
from tests.dispatcher.harness import run_ranks

CONFIG = MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16, activation="swiglu")


def _outcome(fn) -> str:
    try:
        fn()
        return "ran"
    except ValueError as exc:
        return f"ValueError: {exc}"


def copy_worker(rank: int, world_size: int) -> dict:
    x = torch.randn(6, CONFIG.hidden_size, generator=torch.Generator().manual_seed(rank))
    out: dict = {}
    layer = MoELayer(CONFIG, dist.group.WORLD, layer_index=0)
    reference = layer(x)
    layer.state_dict()  # builds the experts' DeviceMesh (checkpoints), which a copy shares too
    ema = copy.deepcopy(layer)
    out["shares group"] = ema.experts.ep_group is layer.experts.ep_group and \
        ema.experts._ep_mesh is layer.experts._ep_mesh and layer.experts._ep_mesh is not None and \
        ema.dispatcher.ep_group is layer.dispatcher.ep_group and ema.dispatcher.latch is layer.dispatcher.latch
    out["own weights"] = ema.experts.weight1 is not layer.experts.weight1 and \
        ema.experts.weight1.data_ptr() != layer.experts.weight1.data_ptr() and \
        torch.equal(ema.experts.weight1, layer.experts.weight1)
    out["layer ids"] = (layer.dispatcher.layer_id, ema.dispatcher.layer_id)
    ema_out = ema(x)
    out["copy output"] = torch.equal(ema_out, reference)
    ema_out.sum().backward()
    # an EMA update, then both in one order on every rank, and a layer built after the copy
    with torch.no_grad():
        for p_ema, p in zip(ema.parameters(), layer.parameters()):
            p_ema.mul_(0.5).add_(p, alpha=0.5)
    later = MoELayer(CONFIG, dist.group.WORLD, layer_index=1)
    out["same order"] = _outcome(lambda: (layer(x), ema(x), later(x)))
    # swapped order on one rank: the calls are of different layers, never paired silently
    first, second = (layer, ema) if rank == 0 else (ema, layer)
    out["swapped order"] = _outcome(lambda: (first(x), second(x)))
    with torch.no_grad():
        out["after error"] = _outcome(lambda: (layer(x), ema(x)))  # both work again

    # handles of both dispatchers: a deep copy combines to the same result
    for kind in ("alltoall", "allgather"):
        dispatcher = build_dispatcher(CONFIG.replace(dispatcher=kind), dist.group.WORLD)
        probs, routing_map = layer.router(x)
        rows, _, handle = dispatcher.dispatch(x, routing_map, probs)
        copied = copy.deepcopy(handle)
        out[f"{kind} combine"] = torch.equal(dispatcher.combine(rows * 2, copied),
                                             dispatcher.combine(rows * 2, handle)) and copy.copy(handle) is handle
    return out


def test_deepcopy_of_layer_and_handles():
    results = run_ranks(copy_worker, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out["shares group"] and out["own weights"], rank
        layer_id, copy_id = out["layer ids"]
        assert copy_id != layer_id and out["layer ids"] == results[0]["layer ids"], (rank, out["layer ids"])
        assert out["copy output"] is True, rank
        assert out["same order"] == "ran", (rank, out["same order"])
        assert out["swapped order"].startswith("ValueError") and "MoE layer #" in out["swapped order"], \
            (rank, out["swapped order"])
        assert out["swapped order"] == results[0]["swapped order"], rank
        assert out["after error"] == "ran", (rank, out["after error"])
        for kind in ("alltoall", "allgather"):
            assert out[f"{kind} combine"] is True, (rank, kind)
