"""``Expand``: the received rows -> the expert layout (one row per (received token, local expert)),
the autograd function of both plans' dispatch: the dropless plan (dropless/) and the
sync-free plan (sync_free/). They differ only in how the backward returns the rows' gradients to
the tokens' owners: ``ReturnPath``.

Backward: every row's gradient goes back to its owner unreduced, where ``unpermute`` without
probs sums a token's rows in ascending expert order in fp32 (the fixed order of the contract).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..numerics.autograd import refuse_double_backward
from ..ops import RowIdMap, unpermute
from ..ops.fp8_rows import Fp8Rows
from ..ops.permutation import permute_rows
from .payload import Payload

# (row gradients [N, H], probs gradients [N] or None) -> the same at the owners, in owner_map's rows
SendBack = Callable[[torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, Optional[torch.Tensor]]]


@dataclass(frozen=True)
class ReturnPath:
    """How ``Expand``'s backward returns the rows' gradients to the tokens' owners.

    send: the return exchange, with ``owner_map`` the owner's RowIdMap of what arrives; both None
        at EP 1, where the rows stay and the receiver's map is the owner's.
    send_probs_grad: the probs gradient travels back. Decided alike on every rank (so every rank
        runs the same collectives), even where this rank's own probs need no gradient.
    zero_fill: permute zero-fills the rows first (some rows may belong to no token).
    """
    send: Optional[SendBack]
    owner_map: Optional[RowIdMap]
    send_probs_grad: bool
    zero_fill: bool


def grad_anchor(needed: bool, tensor: torch.Tensor, *others: torch.Tensor) -> Optional[torch.Tensor]:
    """A leaf that requires grad, when some rank's backward runs an exchange (``needed``: agreed
    in the size exchange, or always at EP > 1 for the sync-free plan, which has none) but none of
    this rank's inputs to it requires grad. Given to the exchange's autograd function, it makes
    the output require grad, so this rank's backward runs the exchange too. Its own gradient is
    never computed. None when not needed."""
    if needed and torch.is_grad_enabled() and not any(t.requires_grad for t in (tensor, *others)):
        return torch.zeros((), device=tensor.device, requires_grad=True)
    return None


def pairs_to_dense(values: torch.Tensor, row_id_map: RowIdMap) -> torch.Tensor:
    """values [N] in row_id_map's row order -> [T, X] with out[t, x] = values[row(t, x)], 0 elsewhere.
    Every (t, x) has at most one row, so this is a pure scatter: no sums."""
    T, X = row_id_map.num_tokens, row_id_map.num_experts
    if values.numel() == 0 or T == 0:
        return values.new_zeros((T, X))
    slots = row_id_map.slots
    rows, cols = slots[:, 1:1 + X].long(), slots[:, 1 + X:].long()
    valid = rows >= 0
    picked = torch.where(valid, values[rows.clamp(min=0)], values.new_zeros(()))
    out = values.new_zeros((T, X + 1))  # column X collects the unused slots (all writing 0)
    out.scatter_(1, torch.where(valid, cols, X), picked)
    return out[:, :X]


class Expand(torch.autograd.Function):
    """Inputs: x [T, H] and probs [T, E] are the owner's tensors that autograd links to; the
    received payload ``received`` (a tensor [R, H], or ``Fp8Rows`` whose wire rows [R, W] move)
    and recv_probs [R, E] (detached, views of the exchange's buffer) carry the values; expert_map:
    the receiver's RowIdMap; probs_in_experts: the experts multiply by the returned row probs [N]
    (else they are returned non-differentiable, for inspection); anchor: a leaf that makes the
    output require grad, or None (the plans' anchors). Returns (rows [N, H] or the wire rows
    [N, W], row_probs [N], sink); ``expand`` makes them the payload type received.

    ``Fp8Rows`` (quantised bytes): the rows carry no gradient; the third output, sink [N, H] zeros
    in x's dtype, does (the expert rows' ``grad_sink``): its gradient is the rows'. A tensor: the
    rows carry their gradient and sink is None."""

    @staticmethod
    def forward(ctx, x, probs, received: Payload, recv_probs, path: ReturnPath, expert_map: RowIdMap,
                probs_in_experts: bool, anchor):
        quantised = isinstance(received, Fp8Rows)
        recv_rows = received.packed() if quantised else received
        rows, row_probs = permute_rows(recv_rows, expert_map.slots, recv_probs, expert_map.num_out_tokens,
                                       path.zero_fill)
        ctx.path, ctx.expert_map, ctx.x_shape, ctx.probs_dtype = path, expert_map, x.shape, recv_probs.dtype
        if not probs_in_experts:
            ctx.mark_non_differentiable(row_probs)
        ctx.payload_type = type(received)
        ctx.x_dtype, ctx.x_device = x.dtype, x.device
        if not quantised:
            return rows, row_probs, None
        ctx.mark_non_differentiable(rows)
        # The wire rows take no gradient: with autograd's default (grads materialised) the backward
        # would get a zero-filled [N, W] tensor for them.
        ctx.set_materialize_grads(False)
        sink = x.new_zeros(()).expand(rows.shape[0], x.shape[1])  # no memory: a stride-0 view
        return rows, row_probs, sink

    @staticmethod
    def backward(ctx, grad_rows, grad_row_probs, grad_sink=None):
        refuse_double_backward("Expand")
        if issubclass(ctx.payload_type, Fp8Rows):  # the rows' gradient reached their grad_sink
            grad_rows = grad_sink if grad_sink is not None else torch.zeros(
                (ctx.expert_map.num_out_tokens, ctx.x_shape[1]), dtype=ctx.x_dtype, device=ctx.x_device)
        path = ctx.path
        if not path.send_probs_grad:
            grad_row_probs = None
        elif grad_row_probs is None:
            grad_row_probs = torch.zeros(grad_rows.shape[0], dtype=ctx.probs_dtype, device=grad_rows.device)
        rows, owner_probs, owner_map = grad_rows.contiguous(), grad_row_probs, ctx.expert_map
        if path.send is not None:
            rows, owner_probs = path.send(rows, owner_probs)
            owner_map = path.owner_map
        grad_x = grad_probs = None
        if ctx.needs_input_grad[0]:  # else this rank ran the exchange for the others only
            grad_x = unpermute(rows, owner_map, None).view(ctx.x_shape)
        if owner_probs is not None and ctx.needs_input_grad[1]:
            grad_probs = pairs_to_dense(owner_probs, owner_map)
        return grad_x, grad_probs, None, None, None, None, None, None


def expand(x: torch.Tensor, probs: torch.Tensor, received: Payload, recv_probs: torch.Tensor, path: ReturnPath,
           expert_map: RowIdMap, probs_in_experts: bool,
           anchor: Optional[torch.Tensor]) -> tuple[Payload, torch.Tensor]:
    """``Expand`` -> (the expert rows as the payload type received: a tensor [N, H], or ``Fp8Rows``
    whose data and scales view the permuted wire rows [N, W] and whose grad_sink carries their
    gradient; row_probs [N])."""
    rows, row_probs, sink = Expand.apply(x, probs, received, recv_probs, path, expert_map, probs_in_experts, anchor)
    if isinstance(received, Fp8Rows):
        rows = Fp8Rows.from_wire(rows, received.hidden_size, received.fp8_dtype, sink)
    return rows, row_probs
