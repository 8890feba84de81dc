"""Collectives the dispatchers use: group size/rank, an uneven all-to-all with a mirrored backward,
and an all-gather of equal-size rows. A group of size 1 (or no process group at all) never calls
torch.distributed, so the single-process path needs no initialisation.
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
                    group: ProcessGroup) -> torch.Tensor:
    """Uneven all-to-all of rows: send x's chunk i (in_splits[i] rows) to rank i, receive
    out_splits[j] rows from rank j, concatenated in rank order. No autograd."""
    size, _ = group_size_rank(group)
    if size == 1:
        return x
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """all_to_all_rows whose backward is the mirror all-to-all: rows are moved, never summed."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return all_to_all_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all_rows_autograd(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                             group: ProcessGroup) -> torch.Tensor:
    """all_to_all_rows with autograd (the backward sends the gradient rows back the same way)."""
    if group_size_rank(group)[0] == 1:
        return x
    return _AllToAllRows.apply(x, list(out_splits), list(in_splits), group)
