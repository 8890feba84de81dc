"""Optimizer state of expert-parallel experts in checkpoints (torch.distributed.checkpoint).

At EP > 1 the routed experts' weights are DTensor shards of the global [E, ...] tensors in the
model's state dict (`moe_dispatch.experts.mlp`), so DCP saves each expert once and reshards it at
load. An optimizer's state for those weights (AdamW's ``exp_avg``, ``exp_avg_sq``: [E_local, ...]
like the weight) is a plain tensor under the same key on every rank, which DCP would save once,
as if it were replicated, and load on every rank. So the optimizer's state dict exposes it the
same way: in ``optimizer.state_dict()`` every state tensor shaped like a sharded expert weight is
a DTensor ``Shard(0)`` over the EP group of the global [E, ...] (row = global expert id; no copy,
so DCP loads in place), and ``optimizer.load_state_dict`` takes the local rows back. Each expert's
state then follows the expert, at any EP size, through either route, with no call of this module:

    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=path)
    ...  # resume (at any EP size): an optimizer that holds state, see below
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])

    # or: model_sd, optim_sd = get_state_dict(model, optimizer); dcp.save / dcp.load; set_state_dict(...)
    # (torch.distributed.checkpoint.state_dict)

How the optimizer gets its hooks: building an expert module at EP > 1 registers a global
optimizer step pre-hook (`watch_optimizers`); at its first ``step()`` an optimizer that holds
sharded expert weights gets a state_dict post-hook and a load_state_dict pre-hook
(`shard_expert_state`). Every optimizer that has state has therefore stepped and has them.
``shard_expert_state(optimizer)`` installs them at once, for an optimizer that must load a
DTensor state dict before its first step.

A fresh optimizer has no state, so its plain ``state_dict()`` gives DCP nothing to load the
moments into (PyTorch's rule, for any model): create the state first (one step with zero
gradients and lr 0, as get_state_dict does), or use get_state_dict / set_state_dict.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterator, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# expert modules sharded over an EP group; their weights are looked up when needed, so that weights
# replaced since (``to_empty``, a conversion that makes new parameters) are found too
_SHARDED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_WATCHING = False


def register_sharded(experts: torch.nn.Module) -> None:
    """Called by an expert module sharded over an EP group (`moe_dispatch.experts.LocalExperts`):
    its weights' optimizer state is exposed through ``experts.global_shard``."""
    _SHARDED.add(experts)
    watch_optimizers()


def _owners() -> Dict[int, Any]:
    """id(weight) -> its sharded expert module, for every live one."""
    return {id(p): experts for experts in list(_SHARDED) for p in experts.parameters(recurse=False)}


def shard_expert_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Expose ``optimizer``'s state of sharded expert weights as DTensor shards in its state
    dict, and take them back in load_state_dict (module docstring). Idempotent; returns it."""
    if optimizer not in _HOOKED:
        optimizer.register_state_dict_post_hook(_expose_shards)
        optimizer.register_load_state_dict_pre_hook(_take_local_rows)
        _HOOKED.add(optimizer)
    return optimizer


def watch_optimizers() -> None:
    """Register (once per process) the global step pre-hook that calls `shard_expert_state` on
    every optimizer holding sharded expert weights, at its first step."""
    global _WATCHING
    if not _WATCHING:
        register_optimizer_step_pre_hook(_on_step)
        _WATCHING = True


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    groups = len(optimizer.param_groups)
    if optimizer in _HOOKED or _CHECKED.get(optimizer) == groups:
        return  # checked again only when param groups were added
    _CHECKED[optimizer] = groups
    owners = _owners()
    if any(id(p) in owners for group in optimizer.param_groups for p in group["params"]):
        shard_expert_state(optimizer)


def _state_params(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Iterator[Tuple[Any, Any]]:
    """(state key, parameter) pairs, matched as Optimizer.load_state_dict does: by position in the
    param groups (the keys are ids in state_dict(), FQNs in get_state_dict's)."""
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
        yield from zip(saved["params"], group["params"])


def _expose_shards(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    state = state_dict["state"]  # a fresh dict; its values are the optimizer's own: replaced, never changed
    owners = _owners()
    for key, param in _state_params(optimizer, state_dict):
        experts = owners.get(id(param))
        if experts is None or key not in state:
            continue
        state[key] = {name: experts.global_shard(value) if _shaped_like(value, param) else value
                      for name, value in state[key].items()}
    return state_dict


def _take_local_rows(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    state = dict(state_dict["state"])
    owners = _owners()
    for key, param in _state_params(optimizer, state_dict):
        if id(param) not in owners or key not in state:
            continue
        state[key] = {name: value.to_local() if isinstance(value, DTensor) else value
                      for name, value in state[key].items()}
    return {**state_dict, "state": state}


def _shaped_like(value: Any, param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape
