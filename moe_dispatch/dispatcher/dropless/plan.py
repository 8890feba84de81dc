"""The dropless plan: sizes from a size exchange (layout.py), then the step's row maps and
routes, built before any data moves; the rows go out through the kind's exchange (exchange.py)
and come back unreduced to their owners."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...config import DispatchConfig
from ...distributed.agreement import (
    DISPATCH_BACKWARD_CALL,
    EXPERT_DTYPE,
    EXPERT_ROWS,
    REUSED_ROUTING,
    ErrorLatch,
    dtype_code,
)
from ...distributed.comm import ProcessGroup, to_device
from ...distributed.identity import CallId, StepCounter
from ...ops import RowIdMap, unpermute
from ...ops.permutation import make_slots, runs_index
from ..expand import ReturnPath, expand, grad_anchor
from ..payload import received, split_payload, token_payload
from ..plan import DispatchHandle, Plan, Prepared, Returned, Sent, SourceBlocks
from ..records import agree_send, check_record_here
from ..row_format import Received
from ..status_rows import status_rows
from .exchange import KINDS, TAG_BYTES, ReturnRoute, ToOwners, return_tables, send_back
from .layout import Layout, exchange_sizes

Runs = tuple[torch.Tensor, torch.Tensor, int]  # (shifts, lengths) on the device, total positions


@dataclass(frozen=True)
class DroplessPlan(Plan):
    """What one dropless step's routing decides, before any data moves (plan.Plan).

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
        host_rows_per_expert: CPU int64 [El], rows per local expert block (padding included).
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
    host_rows_per_expert: torch.Tensor
    replaced: bool = False

    @property
    def call(self) -> CallId:
        """The step's call (layer, forward), agreed by its size exchange."""
        return self.layout.call

    # ---- dispatch -------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup,
                latch: ErrorLatch, *, steps: StepCounter, experts_grad: Optional[bool] = None) -> Prepared:
        """The size exchange (validates every rank's input, raises alike on all), then the plan.
        ``steps``: the layer's forward counter (advanced once the exchange succeeded)."""
        hidden, given = split_payload(hidden, cfg)
        layout = exchange_sizes(hidden, routing_map, probs, cfg, group, latch, call=steps.call(),
                                experts_grad=experts_grad)
        steps.advance()
        x = hidden.reshape(-1, hidden.shape[-1])
        wire_probs = probs.to(cfg.wire_probs_dtype(probs.dtype))
        plan = make_plan(cfg, group, latch, layout, routing_map, x.dtype, wire_probs.dtype)
        return Prepared(x, wire_probs, plan, hidden.shape, (hidden, routing_map, probs), experts_grad,
                        token_payload(x, cfg, given))

    def check_record(self, prepared: Prepared) -> Prepared:
        """EP 1: the record's own check. EP > 1: the forward exchange's sizes differ by record, so
        the ranks agree on the record first (one fixed-size all-gather and one host read)."""
        if self.layout.ep_size == 1:
            check_record_here(prepared)
        else:
            agree_send(prepared, self.call)
        return prepared

    def send(self, prepared: Prepared, with_routing: bool = True) -> Sent:
        x, probs = prepared.rows, prepared.probs.detach()
        if self.layout.ep_size == 1:
            recv = Received(x, probs, self.routing_map, (0,))
        else:
            recv = KINDS[self.config.kind].send(x, probs, self.routing_map, self.layout, self.group, with_routing)
        return Sent(prepared.x, prepared.probs, self, recv, prepared.hidden_shape, prepared.payload)

    def finish(self, sent: Sent, expert_map: Optional[RowIdMap] = None) -> tuple[Any, DispatchHandle]:
        if expert_map is None:
            expert_map = expert_row_map(self, sent.recv.routing)
        probs_in = sent.probs if self.config.probs_in_experts else sent.probs.detach()
        anchor = grad_anchor(self.route is not None and self.layout.dispatch_backward, sent.x, probs_in)
        send = (functools.partial(send_back, route=self.route, code=DISPATCH_BACKWARD_CALL)
                if self.route is not None else None)
        # The probs gradient travels back only if some rank needs it (layout.probs_grad is agreed):
        # the same collectives everywhere.
        path = ReturnPath(send=send, owner_map=self.owner_map if send is not None else None,
                          send_probs_grad=self.config.probs_in_experts and self.layout.probs_grad,
                          zero_fill=expert_map.has_pad_rows)
        rows, row_probs = expand(sent.x, probs_in, received(sent.recv.hidden, sent.payload), sent.recv.probs, path,
                                 expert_map, self.config.probs_in_experts, anchor)
        offsets = torch.cumsum(expert_map.padded_expert_rows, 0).to(torch.int32)
        owner_map = expert_map if self.owner_map is None else self.owner_map
        return rows, DispatchHandle(plan=self, expert_map=expert_map, owner_map=owner_map, probs=sent.probs,
                                    permuted_probs=row_probs, hidden_shape=sent.hidden_shape, expert_offsets=offsets,
                                    route=self.route)

    def reuse(self, handle: DispatchHandle, hidden: Any, routing_map: Any,
              probs: Any) -> tuple[Any, DispatchHandle]:
        """Check the inputs against the handle without a host sync, then send them again.

        Host checks: shapes, dtypes and device equal to the first dispatch's (at EP 1 a mismatch
        raises; at EP > 1 it is latched, like a differing routing). Device check: routing_map
        equals the handle's, elementwise; if not, the tokens become NaN (so every output of the
        step is NaN) and the next size exchange on the group raises on every rank."""
        T, E = self.routing_map.shape
        H = self.config.hidden_size
        hidden, given = split_payload(hidden, self.config)
        ok = (isinstance(hidden, torch.Tensor) and hidden.dtype == self.hidden_dtype and hidden.shape[-1:] == (H,)
              and hidden.numel() == T * H and isinstance(routing_map, torch.Tensor)
              and routing_map.shape == (T, E) and routing_map.dtype == torch.bool
              and isinstance(probs, torch.Tensor) and probs.shape == (T, E) and probs.is_floating_point()
              and probs.device == routing_map.device == hidden.device == self.routing_map.device)
        device = self.routing_map.device
        if not ok:
            if self.layout.ep_size == 1:
                raise ValueError(f"dispatch(handle=...): hidden_states, routing_map and probs must match the "
                                 f"handle's [T, H] = [{T}, {H}] {self.hidden_dtype}, [T, E] = [{T}, {E}] bool and "
                                 f"float, on {device}")
            self.latch.set(REUSED_ROUTING, device=device)
            x = torch.full((T, H), float("nan"), dtype=self.hidden_dtype, device=device)
            wire_probs = torch.zeros((T, E), dtype=self.probs_dtype, device=device)
        else:
            mismatch = (routing_map != self.routing_map).any()
            self.latch.set(mismatch.long() * REUSED_ROUTING)
            # The tokens carry the poison, not the probs: the ops reject non-finite probs themselves.
            x = hidden.reshape(T, H)
            x = torch.where(mismatch, torch.full((), float("nan"), dtype=x.dtype, device=x.device), x)
            wire_probs = probs.to(self.probs_dtype)
        prepared = Prepared(x, wire_probs, self, handle.hidden_shape, (hidden, routing_map, probs), None,
                            token_payload(x, self.config, given))
        return self.finish(self.send(prepared, with_routing=False), handle.expert_map)

    def read_host_rows_per_expert(self, handle: DispatchHandle) -> torch.Tensor:
        return self.host_rows_per_expert

    def source_blocks(self, handle: DispatchHandle) -> SourceBlocks:
        layout = self.layout
        return tuple(tuple((layout.block_starts[e][s], layout.local_blocks[s][e]) for s in range(layout.ep_size))
                     for e in range(layout.num_local_experts))

    # ---- combine --------------------------------------------------------------------------------
    def flag_expert_output(self, handle: DispatchHandle, expert_output: Any) -> None:
        N, H = handle.expert_map.num_out_tokens, self.config.hidden_size
        device = self.routing_map.device
        if isinstance(expert_output, torch.Tensor) and expert_output.shape == (N, H):
            self.latch.set(EXPERT_DTYPE, dtype_code(self.hidden_dtype), dtype_code(expert_output.dtype),
                           device=device)
        else:  # rows: -1 when not a 2-D tensor of width H (or on another device)
            ok_2d = isinstance(expert_output, torch.Tensor) and expert_output.dim() == 2 and expert_output.shape[1] == H
            self.latch.set(EXPERT_ROWS, N, expert_output.shape[0] if ok_2d else -1, device=device)

    def return_rows(self, expert_output: torch.Tensor, handle: DispatchHandle) -> Returned:
        if self.route is None:
            return Returned(expert_output)
        anchor = grad_anchor(self.layout.combine_backward, expert_output)
        return Returned(ToOwners.apply(expert_output, self.route, anchor))

    def owner_sum(self, returned: Returned, handle: DispatchHandle) -> torch.Tensor:
        weights = None if self.config.probs_in_experts else handle.probs  # None: the experts applied them
        return unpermute(returned.rows, handle.owner_map, weights, restore_shape=handle.hidden_shape)


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


def _owner_runs(layout: Layout, status: int) -> tuple[list[int], list[int]]:
    """Run e (this rank's pairs with global expert e) -> its block in the owner buffer, where each
    other expert rank's segment is followed by ``status`` rows (the return exchange's)."""
    El, me = layout.num_local_experts, layout.rank
    start, at = {}, 0
    for d in (me, *[d for d in range(layout.ep_size) if d != me]):
        for e in range(d * El, (d + 1) * El):
            start[e] = at
            at += layout.owner_blocks[e]
        at += status if d != me else 0
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
              routing_map: torch.Tensor, hidden_dtype: torch.dtype, probs_dtype: torch.dtype) -> DroplessPlan:
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
        status = status_rows(cfg.hidden_size * hidden_dtype.itemsize, TAG_BYTES)
        owner = _owner_runs(layout, status)
        at_owner = (add(owner[0]), add(owner[1]), add(list(layout.owner_blocks)))
        ret = return_tables(layout, status)
        at_route = tuple(add(part) for part in ret)
    dev = to_device(table, device) if table else None
    expert_runs = (dev[at_expert[0]], dev[at_expert[1]], sum(expert[1])) if at_expert else None
    owner_map = route = None
    if P > 1:
        owner_runs = (dev[at_owner[0]], dev[at_owner[1]], sum(owner[1]))
        M = sum(layout.owner_blocks) + status * (P - 1)
        owner_map = _row_map(routing_map, owner_runs, dev[at_owner[2]], M, sum(layout.counts[me]),
                             layout.max_experts_per_token[me])
        send = tuple(0 if d == me else layout.return_send_splits[d] + status for d in range(P))
        recv = tuple(0 if d == me else layout.return_recv_splits[d] + status for d in range(P))
        N = sum(layout.tokens_per_local_expert)
        index = runs_index(dev[at_route[0]], dev[at_route[1]], sum(ret[1]))
        route = ReturnRoute(index=index, gather=index.clamp(max=max(N - 1, 0)), n_self=layout.return_send_splits[me],
                            send_splits=send, recv_splits=recv, num_rows=N, send_status=dev[at_route[2]],
                            recv_status=dev[at_route[3]], group=group, latch=latch, call=layout.call,
                            strict=cfg.strict_call_order)
    return DroplessPlan(config=cfg, group=group, latch=latch, layout=layout, routing_map=routing_map,
                        hidden_dtype=hidden_dtype, probs_dtype=probs_dtype, owner_map=owner_map, route=route,
                        expert_runs=expert_runs, expert_padded=dev[at_padded] if at_padded else None,
                        host_rows_per_expert=torch.tensor(layout.tokens_per_local_expert, dtype=torch.int64))


def expert_row_map(plan: DroplessPlan, recv_routing: torch.Tensor) -> RowIdMap:
    """RowIdMap of the received rows [R] -> the receiver layout, from their routing [R, El]."""
    layout = plan.layout
    base, El = layout.rank * layout.num_local_experts, layout.num_local_experts
    routed = sum(row[e] for row in layout.counts for e in range(base, base + El))
    most = min(El, max(layout.max_experts_per_token))
    return _row_map(recv_routing, plan.expert_runs, plan.expert_padded, sum(layout.tokens_per_local_expert),
                    routed, most)
