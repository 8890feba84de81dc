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
from moe_dispatch.checkpoint import shard_expert_state
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


# ---- optimizer state: plain state dicts and torch.distributed.checkpoint.state_dict ------------------

def _step_tokens(step: int) -> torch.Tensor:
    # the same tokens on every rank: the EP groups are then replicas of one model, so every rank's
    # checkpointed values (router replicated, experts sharded) are the state of one run
    return torch.randn(6, CONFIG.hidden_size, generator=torch.Generator().manual_seed(500 + step))


def _new_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = model(_step_tokens(step)).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _init_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A fresh optimizer has no state to load into (the plain route's rule): one step with zero
    gradients and lr 0 creates it (what get_state_dict does)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.param_groups[0]["lr"] = 0.0
    optimizer.step()
    optimizer.param_groups[0]["lr"] = lr
    optimizer.zero_grad()


def _expert_state(model: nn.Module, optimizer: torch.optim.Optimizer, group) -> dict:
    """name -> {exp_avg, exp_avg_sq: [E, ...] of every expert (gathered over ``group``), step}."""
    out = {}
    for name, p in model.named_parameters():
        if "experts.weight" not in name or "shared" in name:
            continue
        state = optimizer.state[p]
        entry = {"step": state["step"].clone()}
        for key in ("exp_avg", "exp_avg_sq"):
            local = state[key]
            full = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
            dist.all_gather_into_tensor(full, local.contiguous(), group=group)
            entry[key] = full
        out[name] = entry
    return out


def _state_matches(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> bool:
    """Each local expert's AdamW state equals the saved state of the same global expert, bitwise."""
    params = dict(model.named_parameters())
    for name, entry in saved.items():
        experts = model.get_submodule(name.rsplit(".", 1)[0])
        ids = list(experts.global_expert_ids)
        state = optimizer.state[params[name]]
        if not torch.equal(state["step"], entry["step"]):
            return False
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(state[key], entry[key][ids]):
                return False
    return True


def optimizer_worker(rank: int, world_size: int, root: str) -> dict:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ep1 = [dist.new_group([r]) for r in range(4)][rank]
    ep2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    groups = {1: ep1, 2: ep2, 4: dist.group.WORLD}
    out: dict = {}

    model = TwoLayers(CONFIG, groups[2])
    optimizer = _new_optimizer(model)
    _train(model, optimizer, range(2))
    saved = _expert_state(model, optimizer, groups[2])
    out["ranks differ"] = not torch.equal(optimizer.state[model.layers[0].experts.weight1]["exp_avg"],
                                          saved["layers.0.experts.weight1"]["exp_avg"][[2, 3] if rank % 2 == 0
                                                                                       else [0, 1]])
    exposed = optimizer.state_dict()
    out["exposed"] = [(type(v).__name__, tuple(v.shape)) for v in exposed["state"][1].values() if v.dim() > 0]
    # an optimizer that has not stepped takes the shards back when given shard_expert_state
    twin = TwoLayers(CONFIG, groups[2])
    copied = shard_expert_state(_new_optimizer(twin))
    copied.load_state_dict(exposed)
    mine, theirs = copied.state[twin.layers[0].experts.weight1], optimizer.state[model.layers[0].experts.weight1]
    out["copied state"] = all(type(mine[k]) is torch.Tensor and torch.equal(mine[k], theirs[k]) for k in theirs)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
             checkpoint_id=os.path.join(root, "plain"))
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "dsd"))
        out["dsd save"] = "saved"
    except (Exception, CheckpointException) as exc:  # reported per rank to the test
        out["dsd save"] = f"{type(exc).__name__}: {exc}"
    losses = _train(model, optimizer, range(2, 4))  # the uninterrupted run
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    for route in ("plain", "dsd") if out["dsd save"] == "saved" else ("plain",):
        for ep in (2, 1, 4):
            fresh = TwoLayers(CONFIG.replace(init_seed=20 + ep), groups[ep])
            fresh_optimizer = _new_optimizer(fresh)
            try:
                if route == "plain":
                    _init_state(fresh, fresh_optimizer)
                    state = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
                    dcp.load(state, checkpoint_id=os.path.join(root, route))
                    fresh.load_state_dict(state["model"])
                    fresh_optimizer.load_state_dict(state["optim"])
                else:
                    model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
                    state = {"model": model_sd, "optim": optim_sd}
                    dcp.load(state, checkpoint_id=os.path.join(root, route))
                    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"],
                                   optim_state_dict=state["optim"])
            except (Exception, CheckpointException) as exc:  # reported per rank to the test
                out[f"{route} ep{ep}"] = f"{type(exc).__name__}: {exc}"
                continue
            out[f"{route} ep{ep}"] = "state by id" if _state_matches(fresh, fresh_optimizer, saved) else "other state"
            if ep == 2:  # the resumed run is the uninterrupted one
                resumed = _train(fresh, fresh_optimizer, range(2, 4))
                out[f"{route} resumed"] = all(torch.equal(a, b) for a, b in zip(resumed, losses)) and all(
                    torch.equal(p, params[name]) for name, p in fresh.named_parameters())
    return out


def test_optimizer_state_follows_experts_through_dcp(tmp_path):
    """Plain state dicts and get_state_dict/set_state_dict: saved at EP 2, each expert's AdamW
    state loads by global id at EP 2, 1 and 4, and the resumed EP-2 run is bitwise the uninterrupted one."""
    results = run_ranks(optimizer_worker, 4, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        assert out["ranks differ"], rank
        # parameter 1 is layers.0.experts.weight1 [2, 8, 32] here: its exp_avg(_sq) are shards of [4, 8, 32]
        assert out["exposed"] == [("DTensor", (4, 8, 32))] * 2, (rank, out["exposed"])
        assert out["copied state"] is True, rank
        for route in ("plain", "dsd"):
            assert route == "plain" or out["dsd save"] == "saved", (rank, out["dsd save"])
            for ep in (2, 1, 4):
                assert out[f"{route} ep{ep}"] == "state by id", (rank, route, ep, out[f"{route} ep{ep}"])
            assert out[f"{route} resumed"] is True, (rank, route)
