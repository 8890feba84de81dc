"""Functional dispatch / combine, in the steps the Megatron-style classes call one by one:

    prepare  -> validate, exchange sizes (one all-gather, one host sync), build the owner's map
    exchange -> send tokens, routing rows and fp32/fp64 probs (alltoall or allgather)
    expand   -> one row per (token, local expert), the layout the experts get
    combine  -> rows back to their owners unreduced, then the owner's fixed-order fp32 sum
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..ops import unpermute
from .allgather import send_allgather
from .alltoall import send_alltoall
from .comm import ProcessGroup
from .common import DispatchHandle, expand, owner_row_id_map, send_to_owners, to_source_major
from .layout import exchange_layout, wire_probs_dtype

KINDS = ("alltoall", "allgather")


def prepare(hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, config: Any,
            group: ProcessGroup, kind: str) -> tuple[torch.Tensor, DispatchHandle]:
    """Validate on every rank, exchange the routing counts and build the handle.

    Returns (hidden viewed as [T, H], handle). Raises ValueError on every rank of the group if
    any rank's input is bad (before any data is exchanged).
    """
    if kind not in KINDS:
        raise ValueError(f"dispatcher kind must be one of {KINDS}, got {kind!r}")
    layout = exchange_layout(hidden, routing_map, probs, config, group)
    x = hidden.reshape(-1, hidden.shape[-1])
    handle = DispatchHandle(
        layout=layout, group=group, kind=kind, owner_map=owner_row_id_map(routing_map, layout),
        routing_map=routing_map, probs=probs.to(wire_probs_dtype(config, probs.dtype)),
        probs_in_experts=bool(getattr(config, "probs_in_experts", False)), hidden_shape=hidden.shape,
        tokens_per_expert=torch.tensor(layout.tokens_per_local_expert(), dtype=torch.int64),
    )
    return x, handle


def exchange(x: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> (tokens [R, H], routing [R, El] bool, probs [R, El]) this rank's experts need,
    grouped by source rank. Detached: the gradient flows through ``expand``."""
    send = send_alltoall if handle.kind == "alltoall" else send_allgather
    return send(x, handle)


def dispatch(hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, config: Any,
             ep_group: ProcessGroup = None, kind: Optional[str] = None,
             ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send tokens to the ranks of their experts.

    Args:
        hidden: [T, H] or [S, B, H] (T = S * B) float32/float16/bfloat16, this rank's tokens.
        routing_map: [T, E] bool. probs: [T, E] float (sent as fp32, or fp64 for an fp64 router).
        config: needs num_experts, and optionally dispatcher, router_dtype, probs_in_experts,
            pad_multiple, pad_to_capacity, capacity_factor, topk.
        ep_group: the expert-parallel process group (None: the default group, or a single process).
        kind: 'alltoall' or 'allgather' (default: config.dispatcher).

    Returns:
        expert_input [N, H]: rows for the local experts, expert-major; within an expert ascending
            (source rank, token); padding rows (pad_multiple / capacity) are zero.
        tokens_per_expert: CPU int64 [El], rows per local expert (padding included).
        handle: for ``combine``; handle.permuted_probs [N] holds the rows' probs (differentiable
            only when config.probs_in_experts; otherwise the combine applies the probs).
    """
    kind = kind or getattr(config, "dispatcher", "alltoall")
    x, handle = prepare(hidden, routing_map, probs, config, ep_group, kind)
    recv_x, recv_map, recv_probs = exchange(x, handle)
    rows, handle.permuted_probs = expand(x, handle.probs, recv_x, recv_map, recv_probs, handle)
    return rows, handle.tokens_per_expert, handle


def combine(expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """expert_output [N, H] (rows as given by dispatch) -> [T, H] or [S, B, H] like the input.

    out[t] = sum over t's experts e, ascending, of probs[t, e] * y[t, e] (probs omitted when the
    experts applied them), in fp32 (fp64 for fp64 probs), rounded once to expert_output.dtype.
    """
    expected = int(handle.tokens_per_expert.sum())
    if expert_output.dim() != 2 or expert_output.shape[0] != expected:
        raise ValueError(f"expert_output must be [N, H] with N = sum(tokens_per_expert) = {expected}, "
                         f"got {list(expert_output.shape)}")
    rows, _ = to_source_major(expert_output, handle.layout)
    rows = send_to_owners(rows, handle.layout, handle.group, autograd=True)
    return unpermute(rows, handle.owner_map, handle.combine_weights(), restore_shape=handle.hidden_shape)
