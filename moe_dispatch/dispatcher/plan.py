"""A dropless step's Plan: its row maps and routes, built from the size exchange's Layout, before
any data moves (functional.py runs the steps; the sync-free plan is static.py's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import DispatchConfig
from ..distributed.agreement import ErrorLatch
from ..distributed.comm import ProcessGroup, to_device
from ..ops import RowIdMap
from ..ops.permutation import make_slots, runs_index
from .exchange import KINDS, ReturnRoute, return_runs
from .layout import Layout

Runs = tuple[torch.Tensor, torch.Tensor, int]  # (shifts, lengths) on the device, total positions


@dataclass(frozen=True)
class Plan:
    """What one step's routing decides, before any data moves; reused by dispatch(handle=...).

    Attributes:
        config, group, layout: the dispatcher's settings, the EP group, the step's sizes.
        latch: the group's ErrorLatch, for errors found after the size exchange.
        routing_map: [T, E] bool, this rank's tokens.
        hidden_dtype, probs_dtype: dtypes of the rows and of the wire probs.
        owner_map: RowIdMap of this rank's (token, expert) pairs in the owner buffer (None at EP 1:
            the expert map serves).
        route: the return exchange (None at EP 1).
        expert_runs: how the receiver layout's row map shifts make_slots' dense rows (None: it
            does not).
        expert_padded: [El] int64 rows per local expert block on the device (None: the counts).
        tokens_per_expert: CPU int64 [El], rows per local expert (padding included).
    """

    config: DispatchConfig
    group: ProcessGroup
    latch: ErrorLatch
    layout: Layout
    routing_map: torch.Tensor
    hidden_dtype: torch.dtype
    probs_dtype: torch.dtype
    owner_map: Optional[RowIdMap]
    route: Optional[ReturnRoute]
    expert_runs: Optional[Runs]
    expert_padded: Optional[torch.Tensor]
    tokens_per_expert: torch.Tensor


# ---- row maps -----------------------------------------------------------------------------------
def _expert_runs(layout: Layout, order: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """make_slots numbers the received routed rows densely (local expert-major, then buffer row
    order, i.e. segment ``order``); run (e, s) moves to its block in the receiver layout."""
    base = layout.rank * layout.num_local_experts
    shifts, lengths, dense = [], [], 0
    for e in range(layout.num_local_experts):
        for s in order:
            n = layout.counts[s][base + e]
            shifts.append(layout.block_starts[e][s] - dense)
            lengths.append(n)
            dense += n
    return shifts, lengths


def _owner_runs(layout: Layout) -> tuple[list[int], list[int]]:
    """Run e (this rank's pairs with global expert e) -> its block in the owner buffer."""
    El, me = layout.num_local_experts, layout.rank
    start, at = {}, 0
    for d in (me, *[d for d in range(layout.ep_size) if d != me]):
        for e in range(d * El, (d + 1) * El):
            start[e] = at
            at += layout.owner_blocks[e]
    shifts, lengths, dense = [], [], 0
    for e in range(layout.num_experts):
        shifts.append(start[e] - dense)
        lengths.append(layout.counts[me][e])
        dense += layout.counts[me][e]
    return shifts, lengths


def _row_map(routing_map: torch.Tensor, runs: Optional[Runs], padded: Optional[torch.Tensor], num_out: int,
             routed: int, max_per_row: int) -> RowIdMap:
    """RowIdMap of routing_map [R, X] whose dense rows (make_slots) move by ``runs``."""
    slots, stats = make_slots(routing_map.contiguous(), 1)  # stats: [X] counts, then max n_t
    X = routing_map.shape[1]
    if runs is not None and routed > 0:
        lut = runs_index(*runs)
        rows = slots[:, 1:1 + X]
        moved = torch.where(rows >= 0, lut[rows.clamp(min=0).long()].to(torch.int32), rows)
        slots = torch.cat([slots[:, :1], moved, slots[:, 1 + X:]], dim=1)
    counts = stats[:X]
    return RowIdMap(slots, counts, counts if padded is None else padded, num_out, num_out > routed,
                    max(1, max_per_row))


def _nonzero_shifts(runs: tuple[list[int], list[int]]) -> bool:
    return any(s != 0 for s, n in zip(*runs) if n)


def make_plan(cfg: DispatchConfig, group: ProcessGroup, latch: ErrorLatch, layout: Layout,
              routing_map: torch.Tensor, hidden_dtype: torch.dtype, probs_dtype: torch.dtype) -> Plan:
    """Row maps and routes of one step. Their host tables cross to the device in one copy."""
    P, El, me = layout.ep_size, layout.num_local_experts, layout.rank
    device = routing_map.device
    order = KINDS[cfg.kind].order(P, me)
    table: list[int] = []

    def add(values: list[int]) -> slice:
        table.extend(values)
        return slice(len(table) - len(values), len(table))

    expert = _expert_runs(layout, order)
    padded_needed = P > 1 or layout.tokens_per_local_expert != tuple(layout.counts[me][:El])
    at_expert = (add(expert[0]), add(expert[1])) if _nonzero_shifts(expert) else None
    at_padded = add(list(layout.tokens_per_local_expert)) if padded_needed else None
    at_owner = at_route = None
    if P > 1:
        owner = _owner_runs(layout)
        at_owner = (add(owner[0]), add(owner[1]), add(list(layout.owner_blocks)))
        ret = return_runs(layout)
        at_route = (add(ret[0]), add(ret[1]))
    dev = to_device(table, device) if table else None
    expert_runs = (dev[at_expert[0]], dev[at_expert[1]], sum(expert[1])) if at_expert else None
    owner_map = route = None
    if P > 1:
        owner_runs = (dev[at_owner[0]], dev[at_owner[1]], sum(owner[1]))
        M = sum(layout.owner_blocks)
        owner_map = _row_map(routing_map, owner_runs, dev[at_owner[2]], M, sum(layout.counts[me]),
                             layout.max_experts_per_token[me])
        send = tuple(0 if d == me else layout.return_send_splits[d] for d in range(P))
        recv = tuple(0 if d == me else layout.return_recv_splits[d] for d in range(P))
        route = ReturnRoute(runs_index(dev[at_route[0]], dev[at_route[1]], sum(ret[1])),
                            layout.return_send_splits[me], send, recv, sum(layout.tokens_per_local_expert), group,
                            latch, layout.call, cfg.strict_call_order)
    return Plan(config=cfg, group=group, latch=latch, layout=layout, routing_map=routing_map, hidden_dtype=hidden_dtype,
                probs_dtype=probs_dtype, owner_map=owner_map, route=route, expert_runs=expert_runs,
                expert_padded=dev[at_padded] if at_padded else None,
                tokens_per_expert=torch.tensor(layout.tokens_per_local_expert, dtype=torch.int64))


def expert_row_map(plan: Plan, recv_routing: torch.Tensor) -> RowIdMap:
    """RowIdMap of the received rows [R] -> the receiver layout, from their routing [R, El]."""
    layout = plan.layout
    base, El = layout.rank * layout.num_local_experts, layout.num_local_experts
    routed = sum(row[e] for row in layout.counts for e in range(base, base + El))
    most = min(El, max(layout.max_experts_per_token))
    return _row_map(recv_routing, plan.expert_runs, plan.expert_padded, sum(layout.tokens_per_local_expert),
                    routed, most)
