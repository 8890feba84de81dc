"""Data parallelism around expert-parallel layers: the experts are not replicas across EP ranks.

EP rank r of a group holds experts r*E_local.. only, so a data-parallel wrapper over ranks of one
EP group must not broadcast or average the routed experts' weights: they are different experts.
The ranks that hold the *same* experts (the same EP rank in every EP group: the expert-data-
parallel group, Megatron's ``expert_data_parallel_group``) reduce their gradients instead:

    ignore_experts_in_ddp(model)                      # before wrapping
    ddp = DistributedDataParallel(model, process_group=dp_group)
    loss.backward()
    allreduce_expert_grads(model, expert_dp_group, dp_size=dp_group.size())
    optimizer.step()

A `MoELayer` whose routed experts a DistributedDataParallel owns over ranks that hold different
experts raises a ValueError at its first forward inside that wrapper (`check_ddp`).

FSDP2 the same way: ``fully_shard(model, mesh=dp_mesh, ignored_params=set(p for _, p in
expert_parameters(model)))``, then `allreduce_expert_grads` after backward. A `MoELayer` whose
routed experts FSDP2 shards (with the rest of the model, or on their own over the expert-data-
parallel ranks, whose sharded state dict could not name each shard's experts) raises a ValueError
at its first forward, on every rank (`check_fsdp`), and its ``state_dict()`` another.
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from ..experts import LocalExperts

__all__ = ["allreduce_expert_grads", "check_ddp", "check_fsdp", "expert_parameters", "ignore_experts_in_ddp"]

# Gradients allreduce_expert_grads wrote, with their version then: the same tensor at the same
# version at the next call means no backward touched it since (it would accumulate in place, or a
# zero_grad would replace or zero it). Weak keys: nothing here keeps a gradient alive.
_REDUCED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def expert_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert weight in ``model`` that is sharded over an EP group of
    more than one rank (the routed experts of a `MoELayer` at EP > 1). Replicated weights (router,
    shared expert, experts at EP 1) are not listed: data parallelism averages them as usual."""
    out = []
    for module_name, module in model.named_modules():
        if isinstance(module, LocalExperts) and module.ep_group is not None:
            prefix = f"{module_name}." if module_name else ""
            out.extend((prefix + name, p) for name, p in module.named_parameters(recurse=False))
    return out


def ignore_experts_in_ddp(model: nn.Module) -> List[str]:
    """Make a later ``DistributedDataParallel(model, ...)`` leave the sharded expert weights alone
    (no broadcast at construction, no gradient all-reduce); returns their names. Call it on the
    module you wrap, before wrapping; it keeps names the model already asked DDP to ignore."""
    names = [name for name, _ in expert_parameters(model)]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored + [n for n in names
                                                                                          if n not in ignored])
    return names


def allreduce_expert_grads(model: nn.Module, expert_dp_group: dist.ProcessGroup, *, dp_size: int) -> None:
    """Sum each sharded expert weight's gradient over ``expert_dp_group`` (the ranks that hold the
    same experts) and divide it by ``dp_size`` (the number of ranks whose losses the data-parallel
    wrapper averages, e.g. DDP's group size), so expert and non-expert gradients are both the
    gradient of the mean of the ranks' losses. One all-reduce of one flat buffer; a missing
    gradient counts as zeros (every rank then holds one). Call it after backward, on every rank
    of ``expert_dp_group``.

    Raises ValueError (on every rank of the group, before reducing anything) if its ranks hold
    different experts, or if a rank's expert gradients are all the ones an earlier call wrote, with
    no backward since (a second call in one step would reduce and divide them twice)."""
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    params = [p for _, p in expert_parameters(model)]
    if not params:
        return
    layout = _expert_layout(model, params[0].device)
    trained = [p for p in params if p.requires_grad]  # frozen experts' grads are never rewritten by backward
    reduced = bool(trained) and all(p.grad is not None and _REDUCED.get(p.grad) == p.grad._version for p in trained)
    flags = torch.cat([layout, torch.tensor([int(reduced)], dtype=torch.int64, device=layout.device)])
    if dist.get_world_size(expert_dp_group) > 1:
        flags = _agree_layout(flags, expert_dp_group)
    if bool(flags[2]):
        raise ValueError(
            "allreduce_expert_grads was called twice with no backward between: the expert gradients are already "
            "summed over expert_dp_group and divided by dp_size (on at least one rank); call it once per step, "
            "after the last backward"
        )
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_world_size(expert_dp_group) > 1:
        dist.all_reduce(flat, group=expert_dp_group)
    if dp_size > 1:
        flat.div_(dp_size)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        _REDUCED[p.grad] = p.grad._version
        offset += n


def check_ddp(experts: LocalExperts) -> None:
    """ValueError if a DistributedDataParallel forward is running, owns ``experts``' weights and
    spans ranks that hold other experts (checked once per wrapper, with one all-gather on its
    group, which every rank of it runs at the same forward)."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None or experts.ep_group is None:
        return
    checked = experts.__dict__.get("_ddp_checked")
    if checked is not None and checked() is ddp:
        return
    ignored = ddp.parameters_to_ignore
    mine = {id(p) for p in experts.parameters()}
    owned = any(id(p) in mine for name, p in ddp.module.named_parameters() if name not in ignored)
    if owned and dist.get_world_size(ddp.process_group) > 1:
        device = experts.weight1.device
        first = torch.tensor([experts.local_expert_offset], dtype=torch.int64, device=device)
        firsts = [torch.empty_like(first) for _ in range(dist.get_world_size(ddp.process_group))]
        dist.all_gather(firsts, first, group=ddp.process_group)
        ids = [int(f) for f in firsts]
        if len(set(ids)) > 1:
            raise ValueError(
                f"DistributedDataParallel over {len(ids)} ranks owns the routed expert weights of an MoE layer "
                f"whose ranks hold different experts (first expert id per rank: {ids}): DDP broadcast rank 0's "
                "experts to every rank when it was built and would average different experts' gradients. Call "
                "moe_dispatch.parallel.ignore_experts_in_ddp(model) before wrapping (and rebuild or reload the "
                "model: its experts were overwritten), then moe_dispatch.parallel.allreduce_expert_grads(model, "
                "expert_dp_group, dp_size=...) after each backward"
            )
    experts.__dict__["_ddp_checked"] = weakref.ref(ddp)


def check_fsdp(experts: LocalExperts) -> None:
    """ValueError if FSDP2 (``fully_shard``) manages ``experts``' weights at EP > 1. Local, no
    collective: every rank of an FSDP mesh was wrapped alike, so every rank raises alike. Checked
    at each forward until it passes, then again only when the weights are replaced (a new wrap)."""
    if experts.ep_group is None or torch.compiler.is_compiling():  # a compiled graph: the eager calls check
        return
    checked = experts.__dict__.get("_fsdp_checked")
    if checked is not None and checked() is experts.weight1:
        return
    mesh = _fsdp_mesh(experts)
    if mesh is not None:
        ranks = set(mesh.mesh.flatten().tolist())
        mixed = len(ranks & set(dist.get_process_group_ranks(experts.ep_group))) > 1
        why = (f"its all-gather over a mesh of {len(ranks)} ranks would mix different experts (ranks of one EP group "
               "hold different experts)" if mixed else
               f"sharding them over a mesh of {len(ranks)} ranks is not supported (the sharded state dict could not "
               "name each shard's global experts)")
        raise ValueError(
            f"FSDP2 (fully_shard) shards the routed expert weights of an MoE layer at EP "
            f"{dist.get_world_size(experts.ep_group)}: {why}. Leave them out: fully_shard(model, mesh=..., "
            "ignored_params=set(p for _, p in moe_dispatch.parallel.expert_parameters(model))) (rebuild or reload "
            "the model first: its experts were sharded away), then moe_dispatch.parallel.allreduce_expert_grads("
            "model, expert_dp_group, dp_size=...) after each backward"
        )
    experts.__dict__["_fsdp_checked"] = weakref.ref(experts.weight1)


def _fsdp_mesh(experts: LocalExperts) -> Optional[DeviceMesh]:
    """The DeviceMesh over which FSDP2 shards ``experts.weight1``, or None."""
    weight = experts.weight1
    if isinstance(weight, DTensor):  # at rest between FSDP2 forwards: the sharded parameter
        return weight.device_mesh
    # Inside a forward FSDP2 has swapped in the all-gathered plain tensor; its state still names
    # the module. torch exposes no public lookup; these internals exist in torch 2.11 to 2.13.
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        if not isinstance(state, FSDPState):
            continue
        # torch >= 2.13: a list of groups (per-parameter meshes); 2.11: one group or None
        groups = state.__dict__["_fsdp_param_groups"] if "_fsdp_param_groups" in state.__dict__ else \
            [state._fsdp_param_group]
        for group in groups:
            for fsdp_param in group.fsdp_params if group is not None else ():
                if fsdp_param._module_info.module is experts:
                    return fsdp_param.mesh_info.mesh
    return None


def _expert_layout(model: nn.Module, device: torch.device) -> torch.Tensor:
    """int64 [2]: how many sharded expert modules, and a digest of their first ids and sizes."""
    count, digest = 0, 0
    for module in model.modules():
        if isinstance(module, LocalExperts) and module.ep_group is not None:
            count += 1
            digest = (digest * 1000003 + module.local_expert_offset * 1009 + module.num_local_experts) % (2**61 - 1)
    return torch.tensor([count, digest], dtype=torch.int64, device=device)


def _agree_layout(flags: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``flags`` int64 [3] (the layout, then whether this rank's gradients are reduced already)
    -> the layout with the flag OR-ed over ``group``; ValueError if the layouts differ."""
    gathered = torch.empty((dist.get_world_size(group), flags.numel()), dtype=flags.dtype, device=flags.device)
    dist.all_gather_into_tensor(gathered.view(-1), flags, group=group)
    if any(not torch.equal(g[:2], gathered[0, :2]) for g in gathered):
        raise ValueError(
            "expert_dp_group: its ranks hold different experts (or different models); it must hold the "
            "ranks with the same EP rank in each EP group (Megatron's expert_data_parallel_group)"
        )
    return torch.cat([gathered[0, :2], gathered[:, 2].amax().reshape(1)])
