"""The sync-free step's exchanges (EP > 1), every chunk of a fixed size with its status rows
(words.py): the forward exchange of the tokens, and the return route of the receiver
layout's rows back to their owners with its mirror in the backward. plan.py plans the step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ...config import DispatchConfig
from ...distributed.agreement import COMBINE_BACKWARD_CALL, COMBINE_CALL, DISPATCH_BACKWARD_CALL, check_call
from ...distributed.comm import ProcessGroup, all_gather_rows, all_to_all_rows
from ...distributed.identity import CallId
from ...numerics.autograd import refuse_double_backward
from ...ops import RowIdMap
from ...ops.permutation import make_slots
from ..expand import SendBack
from ..row_format import Received, RowFormat
from ..status_rows import read_status, write_status
from .sizes import SyncFreeSizes
from .words import (
    DISPATCH_CODE,
    ORDER_CODE,
    W_CALL,
    W_RECV,
    W_RETURN,
    fold_call,
    latch_words,
    num_words,
    poison,
    words_rows,
)


class SyncFreeStep(Protocol):
    """What these exchanges read of a sync-free step's plan (plan.SyncFreePlan is one): defined here,
    so that the plan imports its exchanges and not the other way round."""

    config: DispatchConfig
    group: ProcessGroup
    call: CallId
    layout: SyncFreeSizes
    routing_map: torch.Tensor  # [T, E] bool, this rank's
    slots: torch.Tensor  # make_slots of routing_map, and its counts (the EP-1 expert map)
    counts: torch.Tensor
    words: torch.Tensor  # int32 [NUM_WORDS], this rank's check words


@dataclass(frozen=True)
class SyncFreeRoute:
    """Receiver-layout rows -> their owners, in fixed chunks (EP > 1).

    Attributes:
        index: int64 [P * chunk]: the receiver-layout row at each position of the return buffer
            (N, a dummy row, at padding and status positions).
        gather: index clamped into [0, N) (padding positions copy some row; never read).
        chunk, valid: rows of each chunk, and of them the rows before the status rows.
        num_rows: N.
        words: int32 [num_words(P)], this rank's words with everything it received (sent back), and
            the handle's call in the W_CALL slots (every return exchange compares it).
        call, strict: for ``strict_call_order``'s host-side ``agreement.check_call``.
        source_rows: int64 [El, P] on the device, the rows of each (local expert, source rank) block
            of the receiver layout, cut so that the blocks end by row N (``DispatchHandle.source_blocks``).
    """

    index: torch.Tensor
    gather: torch.Tensor
    chunk: int
    valid: int
    num_rows: int
    words: torch.Tensor
    group: ProcessGroup
    call: CallId
    strict: bool
    source_rows: Optional[torch.Tensor] = None

    def check_call_strict(self, code: int, device: torch.device) -> None:
        """strict_call_order: raise on every rank before a return exchange of another call's rows
        (one host synchronisation); otherwise the status rows compare the calls (fold_call)."""
        if self.strict:
            check_call(self.group, self.call, code, device)


@torch.no_grad()
def send_tokens(x: torch.Tensor, probs: torch.Tensor, plan: SyncFreeStep) -> Received:
    """x [T, H], probs [T, E] (wire dtype) -> every source's rows for this rank's experts, in
    source rank order, each source's chunk padded to its capacity (padding routes nowhere); the
    routing is a contiguous copy; ``words``: the max of every source's words."""
    sizes = plan.layout
    P, El, me = sizes.ep_size, sizes.num_local_experts, sizes.rank
    if P == 1:
        return Received(x.detach(), probs.detach(), plan.routing_map, (0,), plan.words)
    T, H = x.shape
    E = plan.config.num_experts
    if plan.config.kind == "allgather":
        fmt = RowFormat(H, x.dtype, E, probs.dtype, True)
        width = fmt.empty(0, x.device).shape[1]
        valid, chunk = T, T + words_rows(width, P)
        buf = fmt.empty(chunk, x.device)
        buf[T:].zero_()
        fmt.pack(buf[:T], x, probs, plan.routing_map)
        write_status(buf, 1, chunk, valid, plan.words)
        recv = all_gather_rows(buf, plan.group)
        hidden, all_probs, all_routing = fmt.views(recv)
        cols = slice(me * El, (me + 1) * El)
        rprobs, routing = all_probs[:, cols], all_routing[:, cols].contiguous()
    else:
        fmt = RowFormat(H, x.dtype, El, probs.dtype, True)
        width = fmt.empty(0, x.device).shape[1]
        valid, chunk = sizes.send_capacity, sizes.send_capacity + words_rows(width, P)
        local = plan.routing_map.reshape(T, P, El)
        rank_map = local.any(-1)  # [T, P]
        pos = torch.cumsum(rank_map, 0) - 1  # the token's row in its chunk to each rank
        ok = rank_map & (pos < valid)
        dummy = P * chunk
        target = torch.where(ok, torch.arange(P, device=x.device) * chunk + pos, dummy)
        token = torch.zeros(dummy + 1, dtype=torch.int64, device=x.device)
        token.scatter_(0, target.flatten(), torch.arange(T, device=x.device)[:, None].expand(T, P).flatten())
        used = torch.zeros(dummy + 1, dtype=torch.bool, device=x.device)
        used.scatter_(0, target.flatten(), ok.flatten())
        token, used = token[:dummy], used[:dummy]
        dest = torch.arange(dummy, device=x.device) // chunk
        send = fmt.empty(dummy, x.device)
        h, p, r = fmt.views(send)
        torch.index_select(x, 0, token, out=h)
        p.copy_(torch.where(used[:, None], probs.reshape(T, P, El)[token, dest], 0))
        r.copy_(local[token, dest] & used[:, None])
        write_status(send, P, chunk, valid, plan.words)
        recv = all_to_all_rows(send, [chunk] * P, [chunk] * P, plan.group)
        hidden, rprobs, routing = fmt.views(recv)
        routing = routing.contiguous()
    words = fold_call(read_status(recv, P, chunk, valid, num_words(P)), DISPATCH_CODE)
    routing.view(P, chunk, El)[:, valid:] = False  # the status rows route nowhere
    return Received(hidden, rprobs, routing, tuple(range(P)), words)


def _fitting(counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """counts [El] cut so that the blocks end by row num_rows (an overflowing step's GEMMs stay
    inside the buffer; the step is poisoned anyway)."""
    ends = torch.cumsum(counts, 0).clamp(max=num_rows)
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


def expert_map_and_route(plan: SyncFreeStep, recv: Received, hidden_size: int,
                         hidden_itemsize: int) -> tuple[RowIdMap, Optional[SyncFreeRoute]]:
    """The receiver layout's RowIdMap (padded_expert_rows: the blocks' rows, cut to N) and,
    at EP > 1, the return route."""
    sizes = plan.layout
    P, El, N, K = sizes.ep_size, sizes.num_local_experts, sizes.recv_rows, sizes.topk
    if P == 1:
        return RowIdMap(plan.slots, plan.counts, _fitting(plan.counts, N), N, True, min(El, K)), None
    routing = recv.routing
    R = routing.shape[0]
    slots, stats = make_slots(routing, 1)
    counts = stats[:El]
    expert_map = RowIdMap(slots, counts, _fitting(counts, N), N, True, min(El, K))
    per_source = R // P
    cnt = routing.view(P, per_source, El).sum(1, dtype=torch.int64)  # [P, El]: rows of (source, expert)
    flat = cnt.t().flatten()  # expert-major, source-minor: the receiver layout's blocks
    block_start = (torch.cumsum(flat, 0) - flat).view(El, P)
    ret_start = torch.cumsum(cnt, 1) - cnt  # [P, El]: expert e's first row in the chunk back to s
    chunk = sizes.return_capacity + words_rows(hidden_size * hidden_itemsize, P)
    valid = sizes.return_capacity
    rows, experts = slots[:, 1:1 + El].long(), slots[:, 1 + El:].long().clamp(min=0)
    source = (torch.arange(R, device=routing.device) // per_source)[:, None]
    pos = ret_start[source, experts] + rows - block_start[experts, source]
    ok = (rows >= 0) & (rows < N) & (pos < valid)
    dummy = P * chunk
    target = torch.where(ok, source * chunk + pos, dummy)
    index = torch.full((dummy + 1,), N, dtype=torch.int64, device=routing.device)
    index.scatter_(0, target.flatten(), torch.where(ok, rows, N).flatten())
    index = index[:dummy]
    words = recv.words.clone()
    words[W_RECV] = torch.maximum(words[W_RECV], counts.sum().to(torch.int32))
    words[W_RETURN] = torch.maximum(words[W_RETURN], cnt.sum(1).max().to(torch.int32))
    words[W_CALL:W_CALL + 4] = plan.words[W_CALL:W_CALL + 4]
    route = SyncFreeRoute(index=index, gather=index.clamp(max=N - 1), chunk=chunk, valid=valid, num_rows=N,
                        words=words, group=plan.group, call=plan.call,
                        strict=plan.config.strict_call_order, source_rows=_fitting(flat, N).view(El, P))
    return expert_map, route


def send_back(rows: torch.Tensor, row_probs: Optional[torch.Tensor], route: SyncFreeRoute,
              code: int = COMBINE_CALL) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """rows [N, H] (receiver layout), row_probs [N] or None -> the owner buffer [P * chunk, H]
    (and [P * chunk]), chunks by expert rank; and the max of every expert rank's words, the calls
    compared (``code``: which return exchange, agreement.RETURN_CHECKS)."""
    P = route.index.shape[0] // route.chunk
    route.check_call_strict(code, rows.device)
    fmt = RowFormat(rows.shape[1], rows.dtype, 1, row_probs.dtype if row_probs is not None else None, False)
    send = fmt.empty(route.index.shape[0], rows.device)
    fmt.pack(send, rows, row_probs[:, None] if row_probs is not None else None, None, route.gather)
    write_status(send, P, route.chunk, route.valid, route.words)
    out = all_to_all_rows(send, [route.chunk] * P, [route.chunk] * P, route.group)
    hidden, probs, _ = fmt.views(out)
    words = fold_call(read_status(out, P, route.chunk, route.valid, num_words(P)), ORDER_CODE[code])
    return hidden, (probs[:, 0] if probs is not None else None), words


def send_forth(grad: torch.Tensor, route: SyncFreeRoute, sizes: SyncFreeSizes) -> torch.Tensor:
    """Mirror of send_back: the owner's rows [P * chunk, H] -> receiver layout [N, H]. The status
    rows carry the handle's call (a copy of grad: autograd's gradient is not ours to write);
    another call's rows make the result NaN (and the error is latched)."""
    P = route.index.shape[0] // route.chunk
    route.check_call_strict(COMBINE_BACKWARD_CALL, grad.device)
    send = grad.clone(memory_format=torch.contiguous_format)
    write_status(send, P, route.chunk, route.valid, route.words)
    recv = all_to_all_rows(send, [route.chunk] * P, [route.chunk] * P, route.group)
    words = fold_call(read_status(recv, P, route.chunk, route.valid, num_words(P)),
                      ORDER_CODE[COMBINE_BACKWARD_CALL])
    latch_words(route.group, words, sizes)
    out = grad.new_zeros((route.num_rows + 1, grad.shape[1]))  # row N: the padding and status rows' dummy
    out.index_copy_(0, route.index, recv)
    return poison(out[:route.num_rows], words, sizes)


class ToOwners(torch.autograd.Function):
    """rows [N, H] (receiver layout) -> (the owner buffer [P * chunk, H], the max of every expert
    rank's words): ``send_back`` with autograd, whose backward is ``send_forth``. ``anchor``: a
    leaf that requires grad (``expand.grad_anchor``), so that every rank's backward runs the
    mirror exchange."""

    @staticmethod
    def forward(ctx, rows, route, sizes, anchor):
        ctx.route, ctx.sizes = route, sizes
        hidden, _, words = send_back(rows, None, route)
        ctx.mark_non_differentiable(words)
        return hidden, words

    @staticmethod
    def backward(ctx, grad, _grad_words):
        refuse_double_backward("sync_free.ToOwners")
        return send_forth(grad, ctx.route, ctx.sizes), None, None, None


def return_exchange(plan: SyncFreeStep, route: SyncFreeRoute) -> SendBack:
    """Expand's return path over the sync-free route: the rows' gradients and the words; a bad step's
    are latched (CUDA: before unpermute, whose kernel sees them) and poisoned."""
    sizes = plan.layout

    def send(rows: torch.Tensor, probs: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        rows, probs, words = send_back(rows, probs, route, DISPATCH_BACKWARD_CALL)
        latch_words(plan.group, words, sizes)
        return poison(rows, words, sizes), poison(probs, words, sizes) if probs is not None else None
    return send
