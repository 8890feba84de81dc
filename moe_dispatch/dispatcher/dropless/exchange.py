"""The exchange: moving rows between EP ranks, per dispatcher kind (``KINDS``), and back.

Forward (dispatch). Each kind delivers to every rank the tokens, probs and routing rows of its
local experts, grouped by source rank, in ONE collective: a row is packed as bytes
``[probs | hidden | routing]`` (``RowFormat``; each part at an offset aligned for its dtype), and
the receiver reads strided views of the packed buffer without unpacking copies.
- ``alltoall``: a token crosses the wire once per destination rank that owns any of its experts
  (deduplicated), with that rank's El probs and routing bits. The rank's own tokens never enter
  the collective: they are packed straight into the head of the receive buffer, which holds the
  segments in the order (own rank, then the others ascending).
- ``allgather``: every rank gathers every rank's [T_max, E] probs, routing and tokens (rows past
  a rank's T route nowhere) and keeps its own experts' columns; segments in rank order.
Adding a kind: its name in ``config.DISPATCHER_KINDS``, and here a send function of the same
signature, registered in ``KINDS``.

Return (combine, and the dispatch's backward): every expert row goes back unreduced to its
token's owner (``send_back``). The reorder from the receiver layout (expert-major) to destination
order is fused into the packing copy (one ``index_select`` per part straight into the send
buffer); the owner's own rows are copied into the head of the owner's buffer, never through the
collective. The kernels that produce these rows are the experts' GEMMs, so the reorder cannot be
folded into a kernel of ours; a zero-copy alternative would be one send per (expert, destination)
block. Mirror (``ToOwners.backward``): the owner's gradient rows go back the same way.
Each return exchange is one all-to-all: every chunk to another rank ends with status rows that
carry the handle's call tag, so every rank receives every other rank's call (chunks without rows
too). Rows of another call (a micro-batch combined out of order on some rank) become NaN, and the
error is raised on every rank at the next size exchange; with ``strict_call_order`` a host-side
all-gather of the tags first (``agreement.check_call``) raises at once, before any row moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ...config import DISPATCHER_KINDS
from ...distributed.agreement import (
    COMBINE_BACKWARD_CALL,
    COMBINE_CALL,
    ErrorLatch,
    check_call,
    latch_call_mismatch,
)
from ...distributed.comm import ProcessGroup, all_gather_rows, all_to_all_rows
from ...distributed.identity import CallId
from ...numerics.autograd import refuse_double_backward
from ..row_format import Received, RowFormat
from ..status_rows import read_status_at, write_status_at

if TYPE_CHECKING:
    from .layout import Layout


@torch.compiler.disable
def _received(fmt: RowFormat, buf: torch.Tensor, cols: Optional[slice], with_routing: bool,
              order: tuple[int, ...]) -> Received:
    """The Received views of buf (the columns ``cols`` of probs and routing, all without it), taken
    outside any compiled graph: under torch.compile(dynamic=True) AOT autograd cannot rebuild a
    graph output that views a graph input's bytes in another dtype (buf is one after a graph break
    in the exchange), and torch 2.11's inductor cannot lower a view of uint8 as bool."""
    hidden, probs, routing = fmt.views(buf)
    if cols is not None:
        probs, routing = probs[:, cols], routing[:, cols]
    return Received(hidden, probs, routing if with_routing else None, order)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices [count, mask.dim()] of mask's True entries, row-major. ``count`` (a host int) lets
    CUDA skip nonzero's size synchronisation."""
    if mask.is_cuda:
        return torch.nonzero_static(mask, size=count)
    return mask.nonzero()


@torch.no_grad()
def send_alltoall(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, layout: "Layout",
                  group: ProcessGroup, with_routing: bool) -> Received:
    """x [T, H], probs [T, E], routing_map [T, E] -> this rank's rows, segments (me, others asc.)."""
    P, El, me = layout.ep_size, layout.num_local_experts, layout.rank
    T, H = x.shape
    local = routing_map.reshape(T, P, El)
    probs3 = probs.reshape(T, P, El)
    fmt = RowFormat(H, x.dtype, El, probs.dtype, with_routing)
    rank_map = local.any(-1)  # [T, P]
    n_self = layout.sent[me][me]
    in_splits = [0 if d == me else layout.sent[me][d] for d in range(P)]
    out_splits = [0 if s == me else layout.sent[s][me] for s in range(P)]
    recv = fmt.empty(n_self + sum(out_splits), x.device)
    token = _nonzero(rank_map[:, me], n_self)[:, 0]
    fmt.pack(recv[:n_self], x, probs3[:, me], local[:, me], token)
    others = torch.cat([rank_map[:, :me], rank_map[:, me + 1:]], dim=1).t()  # [P - 1, T]
    pairs = _nonzero(others, sum(in_splits))  # destination-major, then token ascending
    dest = pairs[:, 0] + (pairs[:, 0] >= me).long()
    token = pairs[:, 1]
    send = fmt.empty(sum(in_splits), x.device)
    fmt.write(send, x, probs3[token, dest], local[token, dest] if with_routing else None, token)
    all_to_all_rows(send, out_splits, in_splits, group, out=recv[n_self:])
    return _received(fmt, recv, None, with_routing, _own_first(P, me))


@torch.no_grad()
def send_allgather(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, layout: "Layout",
                   group: ProcessGroup, with_routing: bool) -> Received:
    """x [T, H], probs [T, E], routing_map [T, E] -> every rank's rows (padded to T_max; pad
    rows route nowhere), this rank's expert columns, segments in rank order."""
    P, El, me = layout.ep_size, layout.num_local_experts, layout.rank
    T, H = x.shape
    E = routing_map.shape[1]
    fmt = RowFormat(H, x.dtype, E, probs.dtype, True)  # routing: the pad rows must route nowhere
    t_max = max(layout.num_tokens)
    buf = fmt.empty(t_max, x.device)
    fmt.pack(buf[:T], x, probs, routing_map)
    buf[T:].zero_()
    cols = slice(me * El, (me + 1) * El)
    return _received(fmt, all_gather_rows(buf, group), cols, with_routing, _rank_order(P, me))


@dataclass(frozen=True)
class Kind:
    """A dispatcher kind: its forward exchange, and the source rank of each segment it delivers
    (``order(P, rank)``), which the receiver layout's row map needs before the data arrives."""

    send: Callable[..., Received]
    order: Callable[[int, int], tuple[int, ...]]


def _own_first(P: int, me: int) -> tuple[int, ...]:
    return (me, *[s for s in range(P) if s != me])


def _rank_order(P: int, me: int) -> tuple[int, ...]:
    return tuple(range(P))


# Each name of DISPATCHER_KINDS -> its implementation.
KINDS: dict[str, Kind] = {"alltoall": Kind(send_alltoall, _own_first), "allgather": Kind(send_allgather, _rank_order)}
if set(KINDS) != set(DISPATCHER_KINDS):
    raise ImportError(f"exchange.KINDS {sorted(KINDS)} must implement exactly config.DISPATCHER_KINDS "
                      f"{DISPATCHER_KINDS}")


# ---- the return exchange ------------------------------------------------------------------------
TAG_BYTES = 8  # the call tag (int64) in each chunk's status rows


@dataclass(frozen=True)
class ReturnRoute:
    """Receiver-layout rows -> their owners. Each chunk to another rank ends with S status rows
    (``status_rows(H * itemsize, TAG_BYTES)``: a row of any return format holds as many bytes) that
    carry the sender's call tag, so every rank receives every other rank's, even without rows.

    Attributes:
        index: int64 [n_self + sum(send_splits)] on the device: receiver-layout rows, first this
            rank's own (expert-major), then the chunks to the other owners (destination-major,
            expert-minor, then the chunk's status rows, whose entries are N: a dummy row).
        gather: index clamped into [0, N) (status positions copy some row, then are overwritten).
        n_self: rows this rank keeps (its own tokens' rows on its own experts).
        send_splits / recv_splits: [P] rows sent to / received from each rank, status rows
            included (0 for itself).
        num_rows: N, rows of the receiver layout (padding included).
        send_status / recv_status: int64 [(P - 1) * S] on the device, the status rows' positions
            in the chunks sent / received (after the n_self rows).
        group: the EP process group.
        latch: the group's ErrorLatch; call: the dispatch's call, carried in the status rows and
            compared by every receiver (``agreement.latch_call_mismatch``); strict: compare it on
            the host first (``agreement.check_call``, ``DispatchConfig.strict_call_order``).
    """

    index: torch.Tensor
    gather: torch.Tensor
    n_self: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    num_rows: int
    send_status: torch.Tensor
    recv_status: torch.Tensor
    group: ProcessGroup
    latch: ErrorLatch
    call: CallId
    strict: bool

    @property
    def exchanges(self) -> bool:
        return len(self.send_splits) > 1  # False: a one-rank route (nothing crosses the wire)

    def before(self, code: int, device: torch.device) -> None:
        """strict_call_order: raise on every rank before the exchange ``code`` (RETURN_CHECKS) of
        another call's rows."""
        if self.strict:
            check_call(self.group, self.call, code, device)

    def write_call(self, send: torch.Tensor, status: torch.Tensor) -> None:
        """The handle's call tag into the status rows ``status`` of the chunks in send."""
        tag = torch.full((1,), self.call.tag, dtype=torch.int64, device=send.device)  # a fill: no copy
        write_status_at(send, status, len(self.send_splits) - 1, tag)

    def senders_differ(self, recv: torch.Tensor, status: torch.Tensor, code: int) -> torch.Tensor:
        """The senders' call tags from the status rows ``status`` of the chunks in recv, compared
        with the handle's: a device bool, True when another call's rows arrived (latched)."""
        tags = read_status_at(recv, status, len(self.send_splits) - 1, 1, torch.int64)[:, 0]
        return latch_call_mismatch(self.latch, self.call, code, tags)


def return_tables(layout: "Layout", status: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(shifts, lengths) of ReturnRoute.index as runs (position i of run r is row i + shifts[r];
    a status position is a run of its own, to row N), and the positions of the status rows
    (``status`` per chunk) in the chunks sent and received."""
    P, El, me = layout.ep_size, layout.num_local_experts, layout.rank
    N = sum(layout.tokens_per_local_expert)
    shifts, lengths, out = [], [], 0
    send_status, recv_status, received = [], [], 0
    for d in [me] + [d for d in range(P) if d != me]:
        for e in range(El):
            shifts.append(layout.block_starts[e][d] - out)
            lengths.append(layout.local_blocks[d][e])
            out += layout.local_blocks[d][e]
        if d != me:
            received += layout.return_recv_splits[d]
            for _ in range(status):
                shifts.append(N - out)
                lengths.append(1)
                send_status.append(out - layout.return_send_splits[me])
                recv_status.append(received)
                out += 1
                received += 1
    return shifts, lengths, send_status, recv_status


def _nan_if(bad: Optional[torch.Tensor], *parts: Optional[torch.Tensor]) -> None:
    if bad is not None:  # another call's rows: the whole exchange's rows become NaN
        for part in parts:
            if part is not None:
                part.masked_fill_(bad, float("nan"))


def send_back(rows: torch.Tensor, row_probs: Optional[torch.Tensor], route: ReturnRoute,
              code: int = COMBINE_CALL) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """rows [N, H] (receiver layout), row_probs [N] or None -> the owner's buffer [M, H] (and
    [M]), segments (own experts, then the other expert ranks ascending, each followed by its status
    rows, which no token references). No autograd. ``code``: which exchange this is
    (``agreement.RETURN_CHECKS``: the combine, or the dispatch's backward)."""
    fmt = RowFormat(rows.shape[1], rows.dtype, 1, row_probs.dtype if row_probs is not None else None, False)
    probs2 = row_probs[:, None] if row_probs is not None else None
    n_self = route.n_self
    out = fmt.empty(n_self + sum(route.recv_splits), rows.device)
    bad = None
    if route.exchanges:
        route.before(code, rows.device)
    fmt.pack(out[:n_self], rows, probs2, None, route.index[:n_self])
    if route.exchanges:
        send = fmt.empty(sum(route.send_splits), rows.device)
        if rows.shape[0]:  # else only status rows go out
            fmt.pack(send, rows, probs2, None, route.gather[n_self:])
        route.write_call(send, route.send_status)
        all_to_all_rows(send, route.recv_splits, route.send_splits, route.group, out=out[n_self:])
        bad = route.senders_differ(out[n_self:], route.recv_status, code)
    hidden, probs, _ = fmt.views(out)
    _nan_if(bad, hidden, probs)
    return hidden, (probs[:, 0] if probs is not None else None)


def send_forth(grad: torch.Tensor, route: ReturnRoute) -> torch.Tensor:
    """Mirror of send_back: the owner's rows [M, H] -> receiver layout [N, H] (pad rows 0)."""
    grad = grad.contiguous()
    n_self, N = route.n_self, route.num_rows
    # Rows outside the index (the experts' tail padding) get a zero gradient; without any, every
    # row is written below and needs no fill. Row N: the status rows' dummy.
    covered = route.index.shape[0] - route.send_status.shape[0] == N
    out = (grad.new_empty if covered else grad.new_zeros)((N + 1, grad.shape[1]))
    bad = None
    if route.exchanges:
        route.before(COMBINE_BACKWARD_CALL, grad.device)
        send = grad[n_self:].clone()  # with the status rows: autograd's gradient is not ours to write
        route.write_call(send, route.recv_status)
        recv = all_to_all_rows(send, route.send_splits, route.recv_splits, route.group)
        bad = route.senders_differ(recv, route.send_status, COMBINE_BACKWARD_CALL)
        out.index_copy_(0, route.index[n_self:], recv)
    out.index_copy_(0, route.index[:n_self], grad[:n_self])
    out = out[:N]
    _nan_if(bad, out)
    return out


class ToOwners(torch.autograd.Function):
    """rows [N, H] (receiver layout) -> the owner's buffer [M, H]: ``send_back`` with autograd,
    whose backward moves the gradient rows back (``send_forth``; never sums them). ``anchor``: a
    leaf that requires grad, to make the output require grad when rows does not (so that this
    rank's backward runs the mirror exchange that other ranks' backward runs); None: no anchor."""

    @staticmethod
    def forward(ctx, rows, route, anchor):
        ctx.route = route
        return send_back(rows, None, route)[0]

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("dropless.ToOwners")
        return send_forth(grad, ctx.route), None, None
