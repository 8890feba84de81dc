"""Expert identity in checkpoints, on 4 gloo ranks with EP subgroups (one spawn): a
torch.distributed.checkpoint (DCP) checkpoint saved at EP 2 loads at EP 1 and EP 4 and back, and
the loaded model's outputs equal the saved model's bitwise, at the same tokens; a plain
state_dict() of one rank loaded on a rank holding other experts is a ValueError naming the ids;
a full (EP 1) state dict loads on any EP rank, each taking its own experts by id; the EP ranks
agree on layer_index at the first forward."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from moe_dispatch import MoEConfig, MoELayer
from tests.dispatcher.harness import run_ranks

CONFIG = MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16, activation="swiglu")


class TwoLayers(nn.Module):
    """Two MoE layers of one model (layer_index 0 and 1) on one EP group."""

    def __init__(self, config: MoEConfig, ep_group: dist.ProcessGroup) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(config, ep_group, layer_index=i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(6, CONFIG.hidden_size, generator=torch.Generator().manual_seed(100 + rank))


def checkpoint_worker(rank: int, world_size: int, root: str) -> dict:
    # every rank creates every group, in one order
    ep1 = [dist.new_group([r]) for r in range(4)][rank]
    ep2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    groups = {1: ep1, 2: ep2, 4: dist.group.WORLD}
    x = _tokens(rank)
    out: dict = {}

    saved = TwoLayers(CONFIG, groups[2])
    with torch.no_grad():
        reference = saved(x)
    out["layers_differ"] = not torch.equal(saved.layers[0].router.weight, saved.layers[1].router.weight) and \
        not torch.equal(saved.layers[0].experts.weight1, saved.layers[1].experts.weight1)
    dcp.save(saved.state_dict(), checkpoint_id=os.path.join(root, "ep2"))

    # EP 2 -> EP 4 -> EP 2 and EP 2 -> EP 1 -> EP 2, each into a model built from another seed
    for path in ((2, 4, 2), (2, 1, 2)):
        for src, dst in zip(path, path[1:]):
            model = TwoLayers(CONFIG.replace(init_seed=7 + dst), groups[dst])
            state = model.state_dict()
            dcp.load(state, checkpoint_id=os.path.join(root, f"ep{src}"))
            model.load_state_dict(state)
            with torch.no_grad():
                out[f"{path}: ep{src}->ep{dst}"] = torch.equal(model(x), reference)
            if dst != path[-1]:
                dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, f"ep{dst}"))

    # plain torch.save of one rank's state dict, loaded on another rank of the EP group
    if rank == 0:
        torch.save(saved.state_dict(), os.path.join(root, "rank0.pt"))
    dist.barrier()
    other = TwoLayers(CONFIG, groups[2])
    try:
        other.load_state_dict(torch.load(os.path.join(root, "rank0.pt")))
        out["rank0 file"] = "loaded"
    except ValueError as exc:
        out["rank0 file"] = str(exc)
    # a full state dict (EP 1: plain tensors, every expert) on an EP-2 rank: rows by id
    full = TwoLayers(CONFIG, groups[1]).state_dict()
    target = TwoLayers(CONFIG.replace(init_seed=3), groups[2])
    target.load_state_dict(full)
    with torch.no_grad():
        out["full on ep2"] = torch.equal(target(x), reference)
    # the EP ranks agree on layer_index at the first forward (layers called in another order)
    try:
        MoELayer(CONFIG, groups[2], layer_index=rank % 2)(x)
        out["layer order"] = "ran"
    except ValueError as exc:
        out["layer order"] = str(exc)
    return out


def test_dcp_reshards_and_plain_state_dicts_check_identity(tmp_path):
    results = run_ranks(checkpoint_worker, 4, str(tmp_path), timeout=240)
    for rank, out in enumerate(results):
        assert out["layers_differ"], rank
        for key, value in out.items():
            if key.startswith("("):
                assert value is True, (rank, key)
        assert out["full on ep2"] is True, rank
        assert "layer_index" in out["layer order"], (rank, out["layer order"])
        if rank % 2 == 0:  # holds rank 0's experts: the file is its own
            assert out["rank0 file"] == "loaded", rank
        else:
            assert "expert_ids" in out["rank0 file"] and "[0, 1]" in out["rank0 file"] and \
                "[2, 3]" in out["rank0 file"], (rank, out["rank0 file"])
