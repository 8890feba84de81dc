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

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from ..experts import LocalExperts
from ..experts.wrappers import check_ddp, check_fsdp

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
