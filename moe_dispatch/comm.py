"""Collectives and host/device transfers the dispatchers use. A group of size 1 (or no process
group at all) never calls torch.distributed, so the single-process path needs no initialisation.

Host transfers: small int tables go to the device in one pinned, non_blocking copy (a pageable
copy stages through a bounce buffer and can block); the one read back per step lands in a pinned
buffer and waits on the current stream once (the step's one host synchronisation).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]


def group_size_rank(group: ProcessGroup) -> tuple[int, int]:
    """(size, rank) of ``group``; (1, 0) without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("ep_group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


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
