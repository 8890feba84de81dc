"""Collectives and host/device transfers the dispatchers use. A group of size 1 (or no process
group at all) never calls torch.distributed, so the single-process path needs no initialisation.

Host transfers: small int tables go to the device in one pinned, non_blocking copy (a pageable
copy stages through a bounce buffer and can block); the one read back per step lands in a pinned
buffer and waits on the current stream once (the step's one host synchronisation).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]


def group_key(group: ProcessGroup) -> Any:
    """A dict key for ``group``: None and the default group are one group."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def weakly_referable(obj: Any) -> bool:
    """Whether ``obj`` takes a weak reference: a ProcessGroup does; None and the int new_group
    returns to a rank outside the group do not."""
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


class WeakGroup:
    """A process group (or None) held weakly by an object that lives as long as a user's model;
    calling it gives the group. Torch keeps every live group in its own registry until
    ``destroy_process_group``, so a weak reference loses nothing while the group can be used; a
    strong one would keep a destroyed group alive to interpreter exit, where gloo's threads abort
    the process ("terminate called without an active exception") after the user's code finished."""

    __slots__ = ("_ref", "_plain", "name")

    def __init__(self, group: ProcessGroup, name: str = "ep_group") -> None:
        """name: the argument the group came from, for the error once it is destroyed."""
        self.name = name
        self._ref: Optional[weakref.ref] = None
        self._plain: Any = group  # None, or the int placeholder: nothing to keep alive
        if weakly_referable(group):
            self._ref, self._plain = weakref.ref(group), None

    def __call__(self) -> ProcessGroup:
        if self._ref is None:
            return self._plain
        group = self._ref()
        if group is None:
            raise ValueError(f"{self.name} is not a live process group (destroyed with destroy_process_group?): "
                             f"build the layer again on a live group")
        return group


def group_size_rank(group: ProcessGroup, name: str = "ep_group") -> tuple[int, int]:
    """(size, rank) of ``group``; (1, 0) without an initialised process group. Raises ValueError
    naming ``name`` (the argument) if this process is not in the group or the group was destroyed:
    torch would answer -1 (and the sizes computed from it fail far from the cause) or its own error."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(f"{name} was given but torch.distributed is not initialised")
        return 1, 0
    try:
        rank = dist.get_rank(group)
    except (ValueError, RuntimeError):  # torch: "Group <address> is not registered"
        raise ValueError(f"{name} is not a live process group (destroyed with destroy_process_group?): "
                         f"expected a group from torch.distributed.new_group") from None
    if rank < 0:
        raise ValueError(f"{name} does not contain this process (global rank {dist.get_rank()}): every rank "
                         f"must pass a group it is a member of (new_group returns a placeholder on the others)")
    return dist.get_world_size(group), rank


def to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints -> int64 [len] on ``device``: one copy, pinned and non_blocking on CUDA."""
    if device.type != "cuda":
        return torch.tensor(list(values), dtype=torch.int64, device=device)
    staged = torch.tensor(list(values), dtype=torch.int64, pin_memory=True)
    return staged.to(device, non_blocking=True)


def read_host(t: torch.Tensor) -> list:
    """t (int64, any device) -> nested host lists. On CUDA: one copy into pinned memory and one
    wait on the current stream (the caller's one host synchronisation)."""
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.tolist()


def all_gather_rows(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[n, ...] on every rank -> [P * n, ...], rank-major. Every rank must pass the same shape."""
    size, _ = group_size_rank(group)
    if size == 1:
        return x
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    group: ProcessGroup, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Uneven all-to-all of rows: send x's chunk i (in_splits[i] rows) to rank i, receive
    out_splits[j] rows from rank j, concatenated in rank order (into ``out`` if given, which must
    be contiguous with sum(out_splits) rows). No autograd."""
    if out is None:
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out
