"""FSDP2 (``fully_shard``) around EP > 1 layers, EP 2 x DP 2 on 4 gloo ranks (one spawn).

EP groups {0, 1}, {2, 3}; expert-data-parallel groups {0, 2}, {1, 3}. The supported route leaves
the routed experts out (``ignored_params``; tests/parallel/test_data_parallel.py checks its gradients). FSDP2
sharding the experts, over all 4 ranks (whose all-gather would mix different experts) or over the
expert-data-parallel ranks, is the same ValueError on every rank at the first forward, before any
dispatch collective; and ``state_dict()`` of such a model is a ValueError, never a DTensor inside a
DTensor. On the supported route the state dict holds the experts as EP shards and round-trips
through torch.distributed.checkpoint (the resumed forward is bitwise the saved model's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.parallel import expert_parameters
from tests.dispatcher.harness import run_ranks, value_error_of

CONFIG = MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16)


def _ignored_route(ep: dist.ProcessGroup, layer_index: int) -> MoELayer:
    layer = MoELayer(CONFIG, ep, layer_index=layer_index)
    fully_shard(layer, mesh=init_device_mesh("cpu", (4,)), ignored_params={p for _, p in expert_parameters(layer)})
    return layer


def fsdp_worker(rank: int, world_size: int, checkpoint_dir: str) -> dict:
    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))  # edp groups {0, 2}, {1, 3}
    x = torch.randn(6, CONFIG.hidden_size, generator=torch.Generator().manual_seed(rank))
    out: dict = {}

    layer = MoELayer(CONFIG, ep, layer_index=0)  # the experts sharded over all 4 ranks
    fully_shard(layer, mesh=init_device_mesh("cpu", (4,)))
    out["state_dict"] = value_error_of(layer.state_dict)
    out["whole"] = value_error_of(lambda: layer(x))
    out["again"] = value_error_of(lambda: layer(x))  # still refused: never a silent second step

    layer = MoELayer(CONFIG, ep, layer_index=1)  # the experts sharded over the expert-DP ranks
    fully_shard(layer.experts, mesh=mesh["edp"])
    fully_shard(layer, mesh=init_device_mesh("cpu", (4,)))
    out["edp"] = value_error_of(lambda: layer(x))

    # the supported route: the experts left out; its state dict holds the EP shards
    layer = _ignored_route(ep, layer_index=2)
    reference = {n: p.detach().clone() for n, p in MoELayer(CONFIG, ep, layer_index=2).named_parameters()}
    y = layer(x)
    y.sum().backward()
    state = layer.state_dict()
    out["ignored"] = {
        "y": y.detach(),
        "w1": state["experts.weight1"].full_tensor(),
        "w1_local": state["experts.weight1"].to_local(),
        "own_w1": reference["experts.weight1"],
        "router": state["router.weight"].full_tensor(),
        "own_router": reference["router.weight"],
        "ids": state["experts.expert_ids"].full_tensor(),
        "is_dtensor": isinstance(state["router.weight"], DTensor),
    }
    # a round trip through torch.distributed.checkpoint into a zeroed model of the same route
    dcp.save(state, checkpoint_id=checkpoint_dir)
    fresh = _ignored_route(ep, layer_index=2)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=checkpoint_dir)
    fresh.load_state_dict(loaded)
    out["resumed"] = fresh(x).detach()
    return out


def test_fsdp2_sharding_experts_refused_and_ignored_route(tmp_path):
    results = run_ranks(fsdp_worker, 4, str(tmp_path), timeout=240)
    full = MoELayer(CONFIG, layer_index=2)  # EP 1: every expert, the same seed
    for rank, out in enumerate(results):
        for key in ("whole", "again", "edp"):
            assert out[key] == results[0][key], (rank, key)  # the same message on every rank
            assert "fully_shard" in out[key] and "ignored_params" in out[key], (rank, key, out[key])
            assert "expert_parameters" in out[key] and "allreduce_expert_grads" in out[key], (rank, key)
        assert "different experts" in out["whole"], out["whole"]
        assert "state_dict" in out["state_dict"] and "ignored_params" in out["state_dict"], out["state_dict"]
        ours = out["ignored"]
        assert ours["is_dtensor"]
        assert torch.equal(ours["w1"], full.experts.weight1.detach())
        assert torch.equal(ours["w1_local"], ours["own_w1"])
        assert torch.equal(ours["router"], ours["own_router"])
        assert ours["ids"].tolist() == [0, 1, 2, 3]
        assert torch.equal(out["resumed"], ours["y"]), rank
