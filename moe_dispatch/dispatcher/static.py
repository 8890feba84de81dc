"""The sync-free dispatch: every buffer and split size from the config and T alone, no host read.

EP 1 (any router that routes a token to at most K = topk experts, e.g. ours without capacity
dropping: exactly K): the receiver layout has N = T * K rows. make_slots numbers the routed rows
expert-major, token ascending, which is the dropless layout itself; rows past the last expert's
block (tokens with fewer than K experts) belong to no expert. The experts take device offsets
(``handle.expert_offsets``); host counts are read only by whoever asks (``tokens_per_expert``).

EP > 1, the static-capacity exchange (``DispatchConfig.ep_capacity_factor`` f): the sizes of
``StaticSizes`` fix every buffer. Every chunk of an exchange has a fixed number of rows (so the
splits are equal and known), the valid rows first (the dropless path's rows in its order), then
padding rows that route nowhere, then a status row (``_STATUS_BYTES``) carrying the sender's
check words. The received rows are in source rank order, so make_slots' dense numbering over
them is again the dropless receiver layout (expert-major, source ascending, token ascending):
while everything fits, every row, order and sum is the dropless path's, bitwise.

Checks that need device data cannot raise without a host read. They become int32 words (``W_*``):
probs finite, at most K experts per token, and the three capacities' needed sizes. The words
travel in the exchanges' status rows: the dispatch carries the senders' words to every rank, the
combine carries every expert rank's words (with what it received) to every owner, so after the
combine every rank holds the same maximum of every rank's words. A bad step:
- its outputs are NaN on every rank (CUDA: the ops' sticky status word, see ops/guard.py, so every
  later kernel of ours writes NaN too; CPU: the combine's output is multiplied by NaN);
- the ValueError (the same on every rank: same words) is raised by ``check_device_errors()`` and,
  on CPU, by the next sync-free dispatch on the group (reading a CPU tensor costs no sync). On
  CUDA the next dispatch does not read the words: that would be the per-step host sync this mode
  removes, and a read that does not wait could find them ready on one rank and not on another
  (raising at different calls, a hang). At EP 1 on CPU the dispatch raises at once.
Call identity (``identity.CallId``, the dropless path's size exchange carries it): every exchange's
status rows carry the sender's call (the dispatch's, or for the combine and both backward
exchanges the handle's) as min/max-encoded words (``W_CALL``). A receiver sees every rank's (the
chunks come from every rank), so calls that differ (layers called in another order, a skipped
forward, micro-batches combined out of order) set the ``W_ORDER`` words: NaN and the same error
everywhere, like any bad word. ``strict_call_order`` adds the host-side ``agreement.check_call``
before each return exchange (a synchronisation per exchange; it raises before rows move). Unlike
the size exchange, the mismatched step has run (deferred error), so the ranks' forward counts
stay apart afterwards: rebuild the layers. Under CUDA-graph replay the calls are those of the
capture (no Python runs): only the captured order is checked.
Inputs whose shapes or dtypes differ from the first step's (EP > 1: the first step runs the
dropless size exchange once, which validates every rank and fixes T) take part with zeros and
set ``W_INPUT``, so no rank waits alone.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..agreement import (
    COMBINE_BACKWARD_CALL,
    COMBINE_CALL,
    DISPATCH_BACKWARD_CALL,
    RETURN_CHECKS,
    ErrorLatch,
    check_call,
    fingerprint_hash,
)
from ..autograd import refuse_double_backward
from ..comm import ProcessGroup, all_gather_rows, all_to_all_rows, group_key, group_size_rank
from ..config import DispatchConfig
from ..identity import CallId, StepCounter, layer_name
from ..ops import RowIdMap, guard
from ..ops.permutation import make_slots
from .exchange import Received, RowFormat
from .expand import Expand, ReturnPath, SendBack

# Check words (int32, combined across ranks by max). W_CALL: 4 words, the sender's call of one
# exchange (_call_words); W_ORDER: which exchange found different calls (an _ORDER_WHAT key), then
# the 4 call words of that exchange (max/min over the ranks).
W_NONFINITE, W_MAX_K, W_SEND, W_RECV, W_RETURN, W_INPUT, W_CALL, W_ORDER = 0, 1, 2, 3, 4, 5, 6, 10
NUM_WORDS = 16
_CALL_RANGE = 1 << 30  # call words: v (max over ranks: the largest) and _CALL_RANGE - v (the smallest)
# W_ORDER codes, larger for earlier exchanges of a step: the max names the first that found it.
_DISPATCH_CALL = 4
_ORDER_WHAT = {_DISPATCH_CALL: "dispatch", 3: RETURN_CHECKS[COMBINE_CALL], 2: RETURN_CHECKS[COMBINE_BACKWARD_CALL],
               1: RETURN_CHECKS[DISPATCH_BACKWARD_CALL]}
_ORDER_CODE = {COMBINE_CALL: 3, COMBINE_BACKWARD_CALL: 2, DISPATCH_BACKWARD_CALL: 1}
_STATUS_BYTES = NUM_WORDS * 4


@dataclass(frozen=True)
class StaticSizes:
    """The sizes of one sync-free step, host ints from the config and T alone (equal on every
    rank). Field names shared with ``layout.Layout`` mean the same.

    Attributes:
        num_tokens: [P], T of every rank (all equal).
        send_capacity: tokens one rank sends to one rank (alltoall): min(T, ceil(f * T * K / P));
            the allgather sends every token (T).
        recv_rows: N, (token, local expert) rows a rank's experts receive: T * K at EP 1, else
            min(P * T * min(K, El), ceil(f * T * K)) (T * K is the balanced load).
        return_capacity: rows one expert rank returns to one owner: min(T * min(K, El),
            ceil(f * T * K / P)) (unused at EP 1).
        probs_grad: the probs gradient travels back (probs_in_experts), whether or not this rank's
            probs require grad: the collectives must match on every rank without an exchange.
    """

    ep_size: int
    rank: int
    num_experts: int
    num_local_experts: int
    topk: int
    num_tokens: tuple[int, ...]
    factor: Optional[float]
    send_capacity: int
    recv_rows: int
    return_capacity: int
    probs_grad: bool

    @classmethod
    def build(cls, cfg: DispatchConfig, ep_size: int, rank: int, num_tokens: int) -> "StaticSizes":
        P, T, K = ep_size, num_tokens, cfg.topk
        El = cfg.num_experts // P
        f = cfg.ep_capacity_factor
        if P == 1:
            send, recv, ret = T, T * K, T * K
        else:
            if f is None:
                raise ValueError(f"the sync-free dispatch at EP size {P} needs ep_capacity_factor (a finite number "
                                 f"> 0), got None")
            pair = math.ceil(f * T * K / P)
            send = T if cfg.kind == "allgather" else max(1, min(T, pair))
            recv = max(1, min(P * T * min(K, El), math.ceil(f * T * K)))
            ret = max(1, min(T * min(K, El), pair))
        return cls(ep_size=P, rank=rank, num_experts=cfg.num_experts, num_local_experts=El, topk=K,
                   num_tokens=(T,) * P, factor=f, send_capacity=send, recv_rows=recv, return_capacity=ret,
                   probs_grad=cfg.probs_in_experts)

    @property
    def T(self) -> int:
        return self.num_tokens[0]


def status_rows(row_bytes: int) -> int:
    """Rows that hold the status bytes in a buffer of ``row_bytes``-byte rows."""
    return -(-_STATUS_BYTES // row_bytes)


def _row_bytes(buf: torch.Tensor) -> int:
    return buf.shape[1] * buf.element_size()


def _write_status(buf: torch.Tensor, chunks: int, chunk_rows: int, valid_rows: int, words: torch.Tensor) -> None:
    """Write words (int32 [NUM_WORDS]) into the status rows (after ``valid_rows``) of each chunk."""
    raw = buf.view(torch.uint8).view(chunks, chunk_rows, -1)[:, valid_rows:].reshape(chunks, -1)
    raw[:, :_STATUS_BYTES].copy_(words.to(torch.int32).view(torch.uint8).expand(chunks, -1))


def _read_status(buf: torch.Tensor, chunks: int, chunk_rows: int, valid_rows: int) -> torch.Tensor:
    """The max over the chunks of their status words: int32 [NUM_WORDS]."""
    raw = buf.view(torch.uint8).view(chunks, chunk_rows, -1)[:, valid_rows:].reshape(chunks, -1)
    return raw[:, :_STATUS_BYTES].contiguous().view(torch.int32).amax(0)


# ---- call identity ------------------------------------------------------------------------------
def set_call_words(words: torch.Tensor, call: CallId) -> None:
    """Write ``call`` into words' W_CALL slots with scalar fills (kernels that take the value as an
    argument: no host-to-device copy, capture-safe). ``words[i] = v`` would not be: a 0-dim
    destination makes torch copy a CPU scalar tensor, a synchronising copy that capture refuses."""
    for i, v in enumerate((call.layer + 1, call.step % _CALL_RANGE)):
        words[W_CALL + 2 * i].fill_(v)
        words[W_CALL + 2 * i + 1].fill_(_CALL_RANGE - v)


def fold_call(words: torch.Tensor, what: int) -> torch.Tensor:
    """Words received in an exchange (max over the senders) -> a copy whose W_ORDER words record
    that the senders' calls differ (``what``: an _ORDER_WHAT key), and whose W_CALL slots are 0."""
    c = words[W_CALL:W_CALL + 4].to(torch.int64)
    differs = ((c[0] + c[1] > _CALL_RANGE) | (c[2] + c[3] > _CALL_RANGE)).to(torch.int32)
    out = words.clone()
    out[W_ORDER] = torch.maximum(out[W_ORDER], differs * what)
    out[W_ORDER + 1:W_ORDER + 5] = torch.maximum(out[W_ORDER + 1:W_ORDER + 5], words[W_CALL:W_CALL + 4] * differs)
    out[W_CALL:W_CALL + 4] = 0
    return out


def _order_message(words: list[int]) -> str:
    what = _ORDER_WHAT[words[W_ORDER]]
    lo_layer, hi_layer = _CALL_RANGE - words[W_ORDER + 2] - 1, words[W_ORDER + 1] - 1
    lo_step, hi_step = _CALL_RANGE - words[W_ORDER + 4], words[W_ORDER + 3]
    if lo_layer != hi_layer:
        return (f"MoE layers called in a different order across the EP group: a sync-free {what} paired "
                f"{layer_name(lo_layer)} with {layer_name(hi_layer)} (every rank must build its MoE layers on an EP "
                f"group in the same order, which numbers them, and call them in the same order)")
    return (f"{layer_name(hi_layer)} is at different forwards across the EP group: a sync-free {what} paired its "
            f"forwards {lo_step} and {hi_step} (a rank skipped or repeated a forward, or combined or backpropagated "
            f"micro-batches in another order)")


# ---- errors -----------------------------------------------------------------------------------
def bad_words(words: torch.Tensor, sizes: StaticSizes) -> torch.Tensor:
    """A 0-dim bool on the device: the words record a problem (scalar compares: no copies). The
    W_CALL slots are an exchange's raw calls: only their folded W_ORDER words count."""
    w = words.to(torch.int64)
    return ((w[W_NONFINITE] > 0) | (w[W_MAX_K] > sizes.topk) | (w[W_SEND] > sizes.send_capacity)
            | (w[W_RECV] > sizes.recv_rows) | (w[W_RETURN] > sizes.return_capacity) | (w[W_INPUT] > 0)
            | (w[W_ORDER] > 0))


def messages(words: list[int], sizes: StaticSizes, deferred: bool = True) -> list[str]:
    """The ValueError's parts for host words (the same on every rank: the same words)."""
    T, K, P, f = sizes.T, sizes.topk, sizes.ep_size, sizes.factor
    load = T * K
    out = []
    if words[W_ORDER]:  # the ranks were in different calls: name that first, it explains the rest
        out.append(_order_message(words))
    if words[W_INPUT]:
        out.append(f"EP rank {words[W_INPUT] - 1} passed inputs whose shapes, dtypes or devices differ from the first "
                   f"sync-free step's (T = {T} on every rank), or a wrong expert_output / routing_map to reuse")
    if words[W_NONFINITE]:
        out.append("probs contain NaN or inf (are the router's logits finite?)")
    if words[W_MAX_K] > K:
        out.append(f"a token is routed to {words[W_MAX_K]} experts, more than topk={K} (the sync-free dispatch sizes "
                   f"its buffers for at most topk experts per token)")

    def over(what: str, need: int, cap: int, formula: str, per: float) -> None:
        out.append(f"static-capacity overflow (ep_capacity_factor={f}): {what} needed {need}, more than its capacity "
                   f"{cap} = {formula}; an ep_capacity_factor of at least {need / per:.4g} fits this step")

    if words[W_SEND] > sizes.send_capacity:
        over("the tokens one EP rank sends to one EP rank", words[W_SEND], sizes.send_capacity,
             "min(T, ceil(f * T * topk / P))", load / P)
    if words[W_RECV] > sizes.recv_rows:
        over("the (token, expert) rows one EP rank's experts receive", words[W_RECV], sizes.recv_rows,
             "ceil(f * T * topk)", load)
    if words[W_RETURN] > sizes.return_capacity:
        over("the rows one EP rank's experts return to one EP rank", words[W_RETURN], sizes.return_capacity,
             "ceil(f * T * topk / P)", load / P)
    if out and deferred:
        out[-1] += " (that step's outputs were NaN)"
    return out


def _raise(words: list[int], sizes: StaticSizes, deferred: bool = True) -> None:
    found = messages(words, sizes, deferred)
    if found:
        guard.fail(["invalid MoE dispatch input (sync-free): " + "; ".join(found)])


# group -> [words buffer (device, int32 [NUM_WORDS], max of the steps' words), sizes]
_LATCHED: dict = {}
# (group, fingerprint) -> the first step's input description, EP > 1
_AGREED: dict = {}


def _latch(group: ProcessGroup, words: torch.Tensor, sizes: StaticSizes) -> None:
    """Keep the step's words (max with earlier ones, in place: capture-safe) and poison on CUDA."""
    entry = _LATCHED.get(group_key(group))
    if entry is None or entry[0].device != words.device:
        entry = _LATCHED[group_key(group)] = [torch.zeros(NUM_WORDS, dtype=torch.int32, device=words.device), sizes]
    entry[0].copy_(torch.maximum(entry[0], words))
    entry[1] = sizes
    if words.is_cuda:  # every later kernel of ours writes NaN (ops/guard.py)
        word = guard.status(words.device)[guard.STEP:guard.STEP + 1]
        word.copy_(torch.maximum(word, bad_words(words, sizes).to(torch.int32).view(1)))


def raise_latched(group: ProcessGroup) -> None:
    """At a sync-free dispatch: raise an earlier step's problem on CPU (no sync there)."""
    entry = _LATCHED.get(group_key(group))
    if entry is not None and entry[0].device.type == "cpu":
        _raise(entry[0].tolist(), entry[1])


def _pending_messages() -> list[str]:
    found = []
    for buf, sizes in list(_LATCHED.values()):
        found += messages(buf.tolist(), sizes)
    return ["invalid MoE dispatch input (sync-free): " + "; ".join(found)] if found else []


def _clear() -> None:
    for buf, _ in _LATCHED.values():
        buf.zero_()


guard.register_check(_pending_messages, _clear)


# ---- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StaticPlan:
    """What a sync-free step's own routing decides (see functional.Plan, whose names it shares).

    Attributes:
        layout: the step's StaticSizes.
        owner_map: RowIdMap of this rank's (token, expert) pairs in the owner buffer (None at EP 1).
        slots, counts: make_slots of routing_map (the EP-1 expert map; counts [E] on the device).
        words: int32 [NUM_WORDS], this rank's own check words (with its call at EP > 1).
        latch, call: the group's ErrorLatch and this step's call (``identity``), for
            ``strict_call_order``'s host-side check.
    """

    config: DispatchConfig
    group: ProcessGroup
    latch: ErrorLatch
    call: CallId
    layout: StaticSizes
    routing_map: torch.Tensor
    hidden_dtype: torch.dtype
    probs_dtype: torch.dtype
    owner_map: Optional[RowIdMap]
    slots: torch.Tensor
    counts: torch.Tensor
    words: torch.Tensor
    replaced: bool = False  # this rank's inputs were bad: it took part with zeros (see prepare)
    route = None  # the static return route is made with the expert map (``StaticRoute``)
    tokens_per_expert = None  # read lazily (DispatchHandle.tokens_per_expert)


BAD_INPUT = object()  # hidden_states of a rank whose input was bad (it takes part with zeros)


def agreed_hidden(group: ProcessGroup, cfg: DispatchConfig) -> Optional[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of the first sync-free step's hidden_states at EP > 1, None before it."""
    agreed = _AGREED.get((group_key(group), fingerprint_hash(cfg)))
    return None if agreed is None else (torch.Size(agreed[0][0]), agreed[0][1])


def _describe(hidden: Any, routing_map: Any, probs: Any) -> tuple:
    def d(x: Any) -> Any:
        return (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else type(x)
    return d(hidden), d(routing_map), d(probs)


def _host_problems(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig) -> list[str]:
    from .layout import _HOST_FIELDS, _input_problems
    from .layout import _describe as describe
    prefix = [0] * _HOST_FIELDS.index("hidden_T")  # tag, fingerprint, call, caller's problem: unused here
    fields = dict(zip(_HOST_FIELDS, [*prefix, *describe(hidden, routing_map, probs, True)]))
    return _input_problems(fields, cfg)


def prepare(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup,
            latch: ErrorLatch, *, steps: Optional[StepCounter], experts_grad: Optional[bool] = None,
            call: Optional[CallId] = None) -> tuple[torch.Tensor, torch.Tensor, StaticPlan]:
    """Checks, then the step's plan; returns (hidden [T, H], probs in the wire dtype, plan).
    No host read (except, at EP > 1, the first step's one size exchange per group). ``steps``:
    the layer's forward counter (advanced here); ``call``: instead, a reused handle's call."""
    P, rank = group_size_rank(group)
    raise_latched(group)
    if call is None:
        call = steps.call()
    input_code = 0
    if P == 1:
        problems = _host_problems(hidden, routing_map, probs, cfg)
        if problems:
            raise ValueError("invalid MoE dispatch input: " + "; ".join(problems))
    else:
        from .layout import exchange_sizes
        key = (group_key(group), fingerprint_hash(cfg))
        if key not in _AGREED:
            # The first step: the dropless size exchange validates every rank (raising alike on all)
            # and tells every rank every T.
            layout = exchange_sizes(hidden, routing_map, probs, cfg, group, latch, call=call,
                                    experts_grad=experts_grad)
            if len(set(layout.num_tokens)) > 1:
                raise ValueError(f"the static-capacity exchange (ep_capacity_factor) needs the same T on every EP "
                                 f"rank, got T = {list(layout.num_tokens)} by rank")
            _AGREED[key] = _describe(hidden, routing_map, probs)
        agreed = _AGREED[key]
        if _describe(hidden, routing_map, probs) != agreed:
            # Take part with zeros of the agreed shapes: the collectives still match on every rank.
            (h_shape, h_dtype, device), (m_shape, _, _), (p_shape, p_dtype, _) = agreed
            hidden = torch.zeros(h_shape, dtype=h_dtype, device=device)
            routing_map = torch.zeros(m_shape, dtype=torch.bool, device=device)
            probs = torch.zeros(p_shape, dtype=p_dtype, device=device)
            input_code = rank + 1
    x = hidden.reshape(-1, hidden.shape[-1])
    wire = probs.to(cfg.wire_probs_dtype(probs.dtype))
    plan = make_plan(cfg, group, latch, call, x, wire, routing_map, input_code)
    if steps is not None:
        steps.advance()
    return x, wire, dataclasses.replace(plan, replaced=True) if input_code else plan


def make_plan(cfg: DispatchConfig, group: ProcessGroup, latch: ErrorLatch, call: CallId, x: torch.Tensor,
              wire: torch.Tensor, routing_map: torch.Tensor, input_code: int = 0) -> StaticPlan:
    P, rank = group_size_rank(group)
    T, E = routing_map.shape
    sizes = StaticSizes.build(cfg, P, rank, T)
    device = routing_map.device
    slots, stats = make_slots(routing_map.contiguous(), 1)
    counts = stats[:E]
    words = torch.zeros(NUM_WORDS, dtype=torch.int32, device=device)
    words[W_NONFINITE] = (~torch.isfinite(wire)).any().to(torch.int32)
    words[W_MAX_K] = stats[E].to(torch.int32)
    words[W_INPUT].fill_(input_code)  # a scalar fill, not ``words[i] = v`` (see set_call_words)
    owner_map = None
    if P > 1:
        set_call_words(words, call)
        El = sizes.num_local_experts
        if cfg.kind == "alltoall":
            words[W_SEND] = routing_map.reshape(T, P, El).any(-1).sum(0).max().to(torch.int32)
        rows_per_chunk = sizes.return_capacity + status_rows(x.shape[1] * x.element_size())
        owner_rank = torch.arange(E, device=device) // El
        before = torch.cumsum(counts, 0) - counts
        shift = owner_rank * rows_per_chunk - before[owner_rank * El]
        rows, experts = slots[:, 1:1 + E], slots[:, 1 + E:]
        moved = torch.where(rows >= 0, rows + shift[experts.clamp(min=0).long()], rows).to(torch.int32)
        owner_map = RowIdMap(torch.cat([slots[:, :1], moved, experts], dim=1), counts, counts, P * rows_per_chunk,
                             True, min(E, cfg.topk))
    return StaticPlan(config=cfg, group=group, latch=latch, call=call, layout=sizes, routing_map=routing_map,
                      hidden_dtype=x.dtype, probs_dtype=wire.dtype, owner_map=owner_map, slots=slots, counts=counts,
                      words=words)


# ---- the forward exchange -------------------------------------------------------------------------
@torch.no_grad()
def send_tokens(x: torch.Tensor, probs: torch.Tensor, plan: StaticPlan) -> Received:
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
        valid, chunk = T, T + status_rows(width)
        buf = fmt.empty(chunk, x.device)
        buf[T:].zero_()
        fmt.pack(buf[:T], x, probs, plan.routing_map)
        _write_status(buf, 1, chunk, valid, plan.words)
        recv = all_gather_rows(buf, plan.group)
        hidden, all_probs, all_routing = fmt.views(recv)
        cols = slice(me * El, (me + 1) * El)
        rprobs, routing = all_probs[:, cols], all_routing[:, cols].contiguous()
    else:
        fmt = RowFormat(H, x.dtype, El, probs.dtype, True)
        width = fmt.empty(0, x.device).shape[1]
        valid, chunk = sizes.send_capacity, sizes.send_capacity + status_rows(width)
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
        _write_status(send, P, chunk, valid, plan.words)
        recv = all_to_all_rows(send, [chunk] * P, [chunk] * P, plan.group)
        hidden, rprobs, routing = fmt.views(recv)
        routing = routing.contiguous()
    words = fold_call(_read_status(recv, P, chunk, valid), _DISPATCH_CALL)
    routing.view(P, chunk, El)[:, valid:] = False  # the status rows route nowhere
    return Received(hidden, rprobs, routing, tuple(range(P)), words)


# ---- the receiver layout and the return route --------------------------------------------------
@dataclass(frozen=True)
class StaticRoute:
    """Receiver-layout rows -> their owners, in fixed chunks (EP > 1).

    Attributes:
        index: int64 [P * chunk]: the receiver-layout row at each position of the return buffer
            (N, a dummy row, at padding and status positions).
        gather: index clamped into [0, N) (padding positions copy some row; never read).
        chunk, valid: rows of each chunk, and of them the rows before the status rows.
        num_rows: N.
        words: int32 [NUM_WORDS], this rank's words with everything it received (sent back), and
            the handle's call in the W_CALL slots (every return exchange compares it).
        latch, call, strict: for ``strict_call_order``'s host-side ``agreement.check_call``.
    """

    index: torch.Tensor
    gather: torch.Tensor
    chunk: int
    valid: int
    num_rows: int
    words: torch.Tensor
    group: ProcessGroup
    latch: ErrorLatch
    call: CallId
    strict: bool

    def check_call_strict(self, code: int, device: torch.device) -> None:
        """strict_call_order: raise on every rank before a return exchange of another call's rows
        (one host synchronisation); otherwise the status rows compare the calls (fold_call)."""
        if self.strict:
            check_call(self.group, self.latch, self.call, code, True, device)


@dataclass(frozen=True)
class StaticStep:
    """The handle's sync-free part: the return route (None at EP 1) and the plan."""

    plan: StaticPlan
    route: Optional[StaticRoute]


def _fitting(counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """counts [El] cut so that the blocks end by row num_rows (an overflowing step's GEMMs stay
    inside the buffer; the step is poisoned anyway)."""
    ends = torch.cumsum(counts, 0).clamp(max=num_rows)
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


def expert_map_and_route(plan: StaticPlan, recv: Received, hidden_size: int,
                         hidden_itemsize: int) -> tuple[RowIdMap, Optional[StaticRoute]]:
    """The receiver layout's RowIdMap (padded_tokens_per_expert: the blocks' rows, cut to N) and,
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
    chunk = sizes.return_capacity + status_rows(hidden_size * hidden_itemsize)
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
    route = StaticRoute(index=index, gather=index.clamp(max=N - 1), chunk=chunk, valid=valid, num_rows=N,
                        words=words, group=plan.group, latch=plan.latch, call=plan.call,
                        strict=plan.config.strict_call_order)
    return expert_map, route


def send_back(rows: torch.Tensor, row_probs: Optional[torch.Tensor], route: StaticRoute,
              code: int = COMBINE_CALL) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """rows [N, H] (receiver layout), row_probs [N] or None -> the owner buffer [P * chunk, H]
    (and [P * chunk]), chunks by expert rank; and the max of every expert rank's words, the calls
    compared (``code``: which return exchange, agreement.RETURN_CHECKS)."""
    P = route.index.shape[0] // route.chunk
    route.check_call_strict(code, rows.device)
    fmt = RowFormat(rows.shape[1], rows.dtype, 1, row_probs.dtype if row_probs is not None else None, False)
    send = fmt.empty(route.index.shape[0], rows.device)
    fmt.pack(send, rows, row_probs[:, None] if row_probs is not None else None, None, route.gather)
    _write_status(send, P, route.chunk, route.valid, route.words)
    out = all_to_all_rows(send, [route.chunk] * P, [route.chunk] * P, route.group)
    hidden, probs, _ = fmt.views(out)
    words = fold_call(_read_status(out, P, route.chunk, route.valid), _ORDER_CODE[code])
    return hidden, (probs[:, 0] if probs is not None else None), words


def send_forth(grad: torch.Tensor, route: StaticRoute, sizes: StaticSizes) -> torch.Tensor:
    """Mirror of send_back: the owner's rows [P * chunk, H] -> receiver layout [N, H]. The status
    rows carry the handle's call (a copy of grad: autograd's gradient is not ours to write);
    another call's rows make the result NaN (and the error is latched)."""
    P = route.index.shape[0] // route.chunk
    route.check_call_strict(COMBINE_BACKWARD_CALL, grad.device)
    send = grad.clone(memory_format=torch.contiguous_format)
    _write_status(send, P, route.chunk, route.valid, route.words)
    recv = all_to_all_rows(send, [route.chunk] * P, [route.chunk] * P, route.group)
    words = fold_call(_read_status(recv, P, route.chunk, route.valid), _ORDER_CODE[COMBINE_BACKWARD_CALL])
    _latch(route.group, words, sizes)
    out = grad.new_zeros((route.num_rows + 1, grad.shape[1]))  # row N: the padding and status rows' dummy
    out.index_copy_(0, route.index, recv)
    return poison(out[:route.num_rows], words, sizes)


class _ReturnRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, route, sizes, anchor):
        ctx.route, ctx.sizes = route, sizes
        hidden, _, words = send_back(rows, None, route)
        ctx.mark_non_differentiable(words)
        return hidden, words

    @staticmethod
    def backward(ctx, grad, _grad_words):
        refuse_double_backward("static._ReturnRows")
        return send_forth(grad, ctx.route, ctx.sizes), None, None, None


def _return_exchange(step: StaticStep) -> SendBack:
    """Expand's return path over the static route: the rows' gradients and the words; a bad step's
    are latched (CUDA: before unpermute, whose kernel sees them) and poisoned."""
    sizes = step.plan.layout

    def send(rows: torch.Tensor, probs: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        rows, probs, words = send_back(rows, probs, step.route, DISPATCH_BACKWARD_CALL)
        _latch(step.plan.group, words, sizes)
        return poison(rows, words, sizes), poison(probs, words, sizes) if probs is not None else None
    return send


def _anchor(step: StaticStep, *tensors: torch.Tensor) -> Optional[torch.Tensor]:
    """A leaf that requires grad when none of ``tensors`` does, under grad mode at EP > 1: without a
    size exchange no rank knows whether another rank's backward runs the exchanges, so every rank's
    output requires grad and every rank's backward runs them (functional._grad_anchor). Grad mode
    itself is compared only at the first step's size exchange: every rank must keep it equal."""
    if step.route is None or not torch.is_grad_enabled() or any(t.requires_grad for t in tensors):
        return None
    return torch.zeros((), device=tensors[0].device, requires_grad=True)


def expand(x: torch.Tensor, probs: torch.Tensor, recv: Received, plan: StaticPlan,
           expert_map: Optional[RowIdMap] = None) -> tuple[torch.Tensor, torch.Tensor, RowIdMap, StaticStep]:
    """(expert_input [N, H], permuted_probs [N], expert_map, step). At EP 1 the plan's words are
    checked here: CPU raises at once; CUDA poisons and latches them."""
    route = None
    if expert_map is None or plan.layout.ep_size > 1:
        expert_map, route = expert_map_and_route(plan, recv, x.shape[1], x.element_size())
    if plan.layout.ep_size == 1:
        if plan.words.device.type == "cpu":
            _raise(plan.words.tolist(), plan.layout, deferred=False)
        else:
            _latch(plan.group, plan.words, plan.layout)  # before the copy: its kernel sees the status
    elif route is not None and route.words.is_cuda:  # poison this rank's experts early
        _latch(plan.group, route.words, plan.layout)
    step = StaticStep(plan, route)
    probs_in = probs if plan.config.probs_in_experts else probs.detach()
    send = _return_exchange(step) if route is not None else None
    path = ReturnPath(send=send, owner_map=plan.owner_map if send is not None else None,
                      send_probs_grad=plan.config.probs_in_experts, zero_fill=True)
    rows, row_probs = Expand.apply(x, probs_in, recv.hidden, recv.probs, path, expert_map,
                                   plan.config.probs_in_experts, _anchor(step, x, probs_in))
    return rows, row_probs, expert_map, step


def return_to_owners(expert_output: torch.Tensor, step: StaticStep) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Checked expert rows [N, H] -> (the owner buffer, the step's words from every rank; None at
    EP 1); the words are latched."""
    if step.route is None:
        return expert_output, None
    hidden, words = _ReturnRows.apply(expert_output, step.route, step.plan.layout, _anchor(step, expert_output))
    _latch(step.plan.group, words, step.plan.layout)
    return hidden, words


def poison(out: torch.Tensor, words: Optional[torch.Tensor], sizes: "StaticSizes") -> torch.Tensor:
    """CPU at EP > 1: NaN outputs (and gradients) for a bad step; CUDA poisons through the status."""
    if words is None or out.is_cuda:
        return out
    return out * torch.where(bad_words(words, sizes), float("nan"), 1.0).to(out.dtype)
