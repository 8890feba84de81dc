"""Guards the MoE layer runs at each forward: its routed experts under a data-parallel wrapper.

The experts of one EP group's ranks differ, so DistributedDataParallel or FSDP2 over those ranks
would broadcast, average or shard different experts as if they were replicas. These checks raise
before that happens; `moe_dispatch.parallel` holds the remedies (``ignore_experts_in_ddp``,
``expert_parameters``, ``allreduce_expert_grads``) and re-exports them.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .mlp import LocalExperts

__all__ = ["check_ddp", "check_fsdp"]


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
