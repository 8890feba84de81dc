"""The sync-free dispatch: every buffer and split size from the config and T alone, no host read.

EP 1 (any router that routes a token to at most K = topk experts, e.g. ours without capacity
dropping: exactly K): the receiver layout has N = T * K rows. make_slots numbers the routed rows
expert-major, token ascending, which is the dropless layout itself; rows past the last expert's
block (tokens with fewer than K experts) belong to no expert. The experts take device offsets
(``handle.expert_offsets``); host counts are read only by whoever asks (``tokens_per_expert``).

EP > 1, the static-capacity exchange (``DispatchConfig.ep_capacity_factor`` f): the sizes of
``SyncFreeSizes`` fix every buffer, from the plan's T: the largest T of any rank at the first step
of a (group, config), which runs the dropless size exchange once. A rank with fewer tokens pads
with rows that route nowhere; one with more makes every rank re-plan (CPU; see ``dispatch``).
Every chunk of an exchange has a fixed number of rows (so the splits are equal and known), the
valid rows first (the dropless path's rows in its order), then padding rows that route nowhere,
then a status row carrying the sender's check words (words.py). The received rows are in
source rank order, so make_slots' dense numbering over them is again the dropless receiver layout
(expert-major, source ascending, token ascending): while everything fits, every row, order and
sum is the dropless path's, bitwise. Both exchanges, with their status rows: exchange.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from ...config import DispatchConfig
from ...distributed.agreement import DeviceProblem, ErrorLatch, fingerprint_hash, problem_message
from ...distributed.comm import ProcessGroup, group_size_rank
from ...distributed.identity import CallId, StepCounter
from ...distributed.registry import SYNC_FREE_PLANS
from ...ops import RowIdMap, unpermute
from ...ops.permutation import make_slots
from ..dropless.layout import exchange_sizes, own_input_problems
from ..expand import ReturnPath, expand, grad_anchor
from ..payload import received, split_payload, token_payload
from ..plan import DispatchHandle, Plan, Prepared, Returned, Sent
from ..records import check_record_here, record_problem
from .exchange import ToOwners, expert_map_and_route, return_exchange, send_tokens
from .sizes import SyncFreeSizes
from .words import (
    W_GRAD_OFF,
    W_GRAD_ON,
    W_INPUT,
    W_INPUT_RANKS,
    W_MAX_K,
    W_NONFINITE,
    W_SEND,
    W_TOKENS,
    grad_modes_differ,
    latch_words,
    num_words,
    poison,
    raise_latched,
    raise_words,
    set_call_words,
    words_rows,
)


# ---- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SyncFreePlan(Plan):
    """What a sync-free step's own routing decides (plan.Plan).

    Attributes:
        layout: the step's SyncFreeSizes.
        owner_map: RowIdMap of this rank's (token, expert) pairs in the owner buffer (None at EP 1).
        slots, counts: make_slots of routing_map (the EP-1 expert map; counts [E] on the device).
        words: int32 [num_words(P)], this rank's own check words (with its call at EP > 1).
        latch, call: the group's ErrorLatch and this step's call (``identity``), for
            ``strict_call_order``'s host-side check.
        replaced: this rank's inputs were bad: it took part with zeros (see ``prepare``).
        num_real: this rank's own T (at EP > 1 fewer than the layout's T: padded, see ``prepare``).
    """

    config: DispatchConfig
    group: ProcessGroup
    latch: ErrorLatch
    call: CallId
    layout: SyncFreeSizes
    routing_map: torch.Tensor
    hidden_dtype: torch.dtype
    probs_dtype: torch.dtype
    owner_map: Optional[RowIdMap]
    slots: torch.Tensor
    counts: torch.Tensor
    words: torch.Tensor
    replaced: bool = False
    num_real: int = 0
    trailing_rows = True  # N = the plan's capacity: rows after the experts' blocks belong to no expert

    @classmethod
    def prepare(cls, hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup,
                latch: ErrorLatch, *, steps: Optional[StepCounter], experts_grad: Optional[bool] = None,
                call: Optional[CallId] = None) -> Prepared:
        """Checks, then the step's plan; see ``_prepare``. ``call``: a reused handle's call."""
        return _prepare(hidden, routing_map, probs, cfg, group, latch, steps=steps, experts_grad=experts_grad,
                        call=call)

    def check_record(self, prepared: Prepared) -> Prepared:
        """EP 1: the record's own check. EP > 1, with no host read: the exchange has fixed sizes
        and carries every rank's call in its words (another rank's record is a W_ORDER error), so
        a record whose x or probs differ from what prepare recorded takes part as zeros of the
        plan's shapes and sets the input word: that step's outputs are NaN, and every rank raises
        at the next dispatch (CPU) or at ``check_device_errors()``."""
        if self.layout.ep_size == 1:
            check_record_here(prepared)
            return prepared
        if not record_problem(prepared)[0]:
            return prepared
        T, E = self.routing_map.shape
        device = self.routing_map.device
        x = torch.zeros((T, self.config.hidden_size), dtype=self.hidden_dtype, device=device)
        probs = torch.zeros((T, E), dtype=self.probs_dtype, device=device)
        self.words[W_INPUT].fill_(self.rank + 1)  # scalar fills: no host-to-device copy
        self.words[W_INPUT_RANKS + self.rank].fill_(1)
        return dataclasses.replace(prepared, x=x, probs=probs, payload=token_payload(x, self.config, None))

    def send(self, prepared: Prepared, with_routing: bool = True) -> Sent:
        """The forward exchange. On CPU the received words are read (no sync): every rank reads
        the same, so every rank raises at once when the grad modes differ (before a backward could
        wait for a rank that runs none), and every rank re-plans (one size exchange) and sends
        again when a rank had more tokens than the plan's T."""
        recv = send_tokens(prepared.rows, prepared.probs.detach(), self)
        if self.layout.ep_size > 1 and recv.words.device.type == "cpu":
            words = recv.words.tolist()
            if grad_modes_differ(words):
                raise_words(words, self.layout, deferred=False)
            if words[W_TOKENS] > self.layout.T:
                SYNC_FREE_PLANS.pop(self.group, fingerprint_hash(self.config))
                again = _prepare(*prepared.inputs, self.config, self.group, self.latch, steps=None,
                                 experts_grad=prepared.experts_grad, call=self.call)
                return again.plan.send(again)
        shape = prepared.x.shape if self.replaced else prepared.hidden_shape  # replaced: zeros [T, H]
        return Sent(prepared.x, prepared.probs, self, recv, shape, prepared.payload)

    def finish(self, sent: Sent, expert_map: Optional[RowIdMap] = None) -> tuple[Any, DispatchHandle]:
        """(expert_input, the payload type sent, handle). At EP 1 the plan's words are checked here: CPU raises at
        once; CUDA poisons and latches them."""
        route = None
        if expert_map is None or self.layout.ep_size > 1:
            expert_map, route = expert_map_and_route(self, sent.recv, sent.x.shape[1], sent.x.element_size())
        if self.layout.ep_size == 1:
            if self.words.device.type == "cpu":
                raise_words(self.words.tolist(), self.layout, deferred=False)
            else:
                latch_words(self.group, self.words, self.layout)  # before the copy: its kernel sees the status
        elif route is not None and route.words.is_cuda:  # poison this rank's experts early
            latch_words(self.group, route.words, self.layout)
        probs_in = sent.probs if self.config.probs_in_experts else sent.probs.detach()
        send = return_exchange(self, route) if route is not None else None
        path = ReturnPath(send=send, owner_map=self.owner_map if send is not None else None,
                          send_probs_grad=self.config.probs_in_experts, zero_fill=True)
        anchor = grad_anchor(route is not None, sent.x, probs_in)
        rows, row_probs = expand(sent.x, probs_in, received(sent.recv.hidden, sent.payload), sent.recv.probs, path,
                                 expert_map, self.config.probs_in_experts, anchor)
        offsets = torch.cumsum(expert_map.padded_expert_rows, 0).to(torch.int32)  # cut to N (expert_map_and_route)
        owner_map = expert_map if self.owner_map is None else self.owner_map
        return rows, DispatchHandle(plan=self, expert_map=expert_map, owner_map=owner_map, probs=sent.probs,
                                    permuted_probs=row_probs, hidden_shape=sent.hidden_shape, expert_offsets=offsets,
                                    route=route)

    def reuse(self, handle: DispatchHandle, hidden: Any, routing_map: Any,
              probs: Any) -> tuple[Any, DispatchHandle]:
        """A new sync-free dispatch (there is no size exchange to skip), whose routing is compared
        with the handle's on the device; a difference sets the step's input word (NaN outputs,
        then the error; see words.py)."""
        prepared = _prepare(hidden, routing_map, probs, self.config, self.group, self.latch, steps=None,
                            call=self.call)
        sent = prepared.plan.send(prepared)
        new = sent.plan
        old_map, new_map = self.routing_map[:self.num_real], new.routing_map[:new.num_real]  # without the padding
        differs = (new_map != old_map).any() if new_map.shape == old_map.shape else torch.ones((), dtype=torch.bool)
        new.flag_words(new.words, differs)
        return new.finish(sent)

    def flag_words(self, words: torch.Tensor, bad: torch.Tensor) -> None:
        """Record in ``words`` (in place, no host read) that this rank's input was bad where the
        device bool ``bad`` is set: W_INPUT (the largest such rank + 1) and this rank's own word."""
        bad = bad.to(words.device, torch.int32)
        words[W_INPUT] = torch.maximum(words[W_INPUT], bad * (self.rank + 1))
        words[W_INPUT_RANKS + self.rank] = torch.maximum(words[W_INPUT_RANKS + self.rank], bad)

    def flag_input(self, handle: DispatchHandle, problem: DeviceProblem) -> None:
        """At EP > 1 the input words travel in the combine's return exchange (NaN outputs on every
        rank, then the error); at EP 1 on CPU the problem raises at once (reading costs no sync),
        on CUDA the words are latched (NaN outputs, the error at check_device_errors)."""
        bad = problem.code != 0
        if self.layout.ep_size > 1:
            self.flag_words(handle.route.words, bad)
        elif self.words.device.type == "cpu":
            if bool(bad):
                raise ValueError("invalid MoE dispatch input: " + problem_message(
                    int(problem.code), int(problem.expected), int(problem.got)))
        else:
            words = self.words.clone()
            self.flag_words(words, bad)
            latch_words(self.group, words, self.layout)

    def read_host_rows_per_expert(self, handle: DispatchHandle) -> torch.Tensor:
        return handle.rows_per_expert.cpu()  # a host read: only whoever asks pays it

    def source_blocks(self, handle: DispatchHandle) -> torch.Tensor:
        """On the device, no host read: int64 [El, P], the rows of each (local expert, source) block;
        the blocks tile the receiver layout from row 0 (expert-major, source ascending, as make_slots
        numbers the received rows), the trailing rows in none."""
        if handle.route is None:  # EP 1: one source, an expert's block is its rows
            return handle.rows_per_expert.view(-1, 1)
        return handle.route.source_rows

    def flag_expert_output(self, handle: DispatchHandle, expert_output: Any) -> None:
        route = handle.route  # the input word travels in the return exchange's status rows
        route.words[W_INPUT] = torch.clamp(route.words[W_INPUT], min=self.rank + 1)
        route.words[W_INPUT_RANKS + self.rank].fill_(1)

    def return_rows(self, expert_output: torch.Tensor, handle: DispatchHandle) -> Returned:
        """The owner buffer and the step's words from every rank (None at EP 1); the words are latched."""
        route = handle.route
        if route is None:
            return Returned(expert_output)
        hidden, words = ToOwners.apply(expert_output, route, self.layout, grad_anchor(True, expert_output))
        latch_words(self.group, words, self.layout)
        return Returned(hidden, words)

    def owner_sum(self, returned: Returned, handle: DispatchHandle) -> torch.Tensor:
        weights = None if self.config.probs_in_experts else handle.probs  # None: the experts applied them
        out = poison(unpermute(returned.rows, handle.owner_map, weights), returned.words, self.layout)
        if out.shape[0] != self.num_real:  # without the plan's padding rows; a whole-tensor slice would
            out = out[:self.num_real]      # cost its backward a zero fill and a copy of [T, H]
        return out.reshape(handle.hidden_shape)


BAD_INPUT = object()  # hidden_states of a rank whose input was bad (it takes part with zeros)


class _Agreed(NamedTuple):
    """What the first sync-free step of a (group, config) fixed: the plan's T (the largest T of any
    rank then) and this rank's dtypes and device."""

    T: int
    hidden_dtype: torch.dtype
    probs_dtype: torch.dtype
    device: torch.device


def agreed_hidden(group: ProcessGroup, cfg: DispatchConfig) -> Optional[tuple[torch.Size, torch.dtype]]:
    """(shape [T, H], dtype) of the plan's hidden_states at EP > 1, None before its first step."""
    agreed = SYNC_FREE_PLANS.get(group, fingerprint_hash(cfg))
    return None if agreed is None else (torch.Size((agreed.T, cfg.hidden_size)), agreed.hidden_dtype)


def _agree(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup, latch: ErrorLatch,
           call: CallId, experts_grad: Optional[bool]) -> _Agreed:
    """The plan of (group, cfg). Its first step runs the dropless size exchange, which validates
    every rank (raising alike on all) and tells every rank every T: the plan takes the largest
    (an all-empty step plans nothing: the next step agrees again)."""
    fingerprint = fingerprint_hash(cfg)
    agreed = SYNC_FREE_PLANS.get(group, fingerprint)
    if agreed is None:
        layout = exchange_sizes(hidden, routing_map, probs, cfg, group, latch, call=call, experts_grad=experts_grad)
        T = max(layout.num_tokens)
        agreed = _Agreed(max(T, 1), hidden.dtype, probs.dtype, hidden.device)
        if T:
            SYNC_FREE_PLANS.set(group, agreed, fingerprint)
    return agreed


def _prepare(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup,
             latch: ErrorLatch, *, steps: Optional[StepCounter],
             experts_grad: Optional[bool] = None, call: Optional[CallId] = None) -> Prepared:
    """Checks, then the step's plan: Prepared (x [T, H], probs in the wire dtype, the plan).
    No host read (except, at EP > 1, the plan's first step: one size exchange). ``steps``: the
    layer's forward counter (advanced here); ``call``: instead, a reused handle's call. At EP > 1
    fewer tokens than the plan's T are padded with rows that route nowhere (bitwise the same
    results); more, or other dtypes, take part with zeros (``W_TOKENS``, ``W_INPUT``)."""
    P, rank = group_size_rank(group)
    raise_latched(group)
    inputs = (hidden, routing_map, probs)  # the caller's: a re-plan starts from them
    hidden, given = split_payload(hidden, cfg)
    if call is None:
        call = steps.call()
    input_code = grown = 0
    if P == 1:
        problems = own_input_problems(hidden, routing_map, probs, cfg)
        if problems:
            raise ValueError("invalid MoE dispatch input: " + "; ".join(problems))
    else:
        agreed = _agree(hidden, routing_map, probs, cfg, group, latch, call, experts_grad)
        if own_input_problems(hidden, routing_map, probs, cfg) or (hidden.dtype, probs.dtype, hidden.device) != (
                agreed.hidden_dtype, agreed.probs_dtype, agreed.device):
            input_code = rank + 1
        elif routing_map.shape[0] > agreed.T:
            grown = routing_map.shape[0]
        if input_code or grown:  # zeros of the plan's shapes: the collectives still match on every rank
            E, device = cfg.num_experts, agreed.device
            hidden = torch.zeros((agreed.T, cfg.hidden_size), dtype=agreed.hidden_dtype, device=device)
            routing_map = torch.zeros((agreed.T, E), dtype=torch.bool, device=device)
            probs = torch.zeros((agreed.T, E), dtype=agreed.probs_dtype, device=device)
    x = hidden.reshape(-1, hidden.shape[-1])
    wire_probs = probs.to(cfg.wire_probs_dtype(probs.dtype))
    real, shape = x.shape[0], hidden.shape
    if P > 1 and real < agreed.T:
        pad = agreed.T - real
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        wire_probs = torch.cat([wire_probs, wire_probs.new_zeros(pad, wire_probs.shape[1])])
        routing_map = torch.cat([routing_map, routing_map.new_zeros(pad, routing_map.shape[1])])
    plan = make_plan(cfg, group, latch, call, x, wire_probs, routing_map, input_code, grown)
    if steps is not None:
        steps.advance()
    plan = dataclasses.replace(plan, replaced=bool(input_code or grown), num_real=real)
    return Prepared(x, wire_probs, plan, shape, inputs, experts_grad, token_payload(x, cfg, given))


def make_plan(cfg: DispatchConfig, group: ProcessGroup, latch: ErrorLatch, call: CallId, x: torch.Tensor,
              wire_probs: torch.Tensor, routing_map: torch.Tensor, input_code: int = 0,
              grown: int = 0) -> SyncFreePlan:
    P, rank = group_size_rank(group)
    T, E = routing_map.shape
    sizes = SyncFreeSizes.build(cfg, P, rank, T)
    device = routing_map.device
    slots, stats = make_slots(routing_map.contiguous(), 1)
    counts = stats[:E]
    words = torch.zeros(num_words(P), dtype=torch.int32, device=device)
    words[W_NONFINITE] = (~torch.isfinite(wire_probs)).any().to(torch.int32)
    words[W_MAX_K] = stats[E].to(torch.int32)
    words[W_INPUT].fill_(input_code)  # a scalar fill, not ``words[i] = v`` (see set_call_words)
    words[W_INPUT_RANKS + rank].fill_(int(input_code > 0))
    owner_map = None
    if P > 1:
        set_call_words(words, call)
        words[W_TOKENS].fill_(grown)
        words[W_GRAD_ON if torch.is_grad_enabled() else W_GRAD_OFF].fill_(rank + 1)
        El = sizes.num_local_experts
        if cfg.kind == "alltoall":
            words[W_SEND] = routing_map.reshape(T, P, El).any(-1).sum(0).max().to(torch.int32)
        rows_per_chunk = sizes.return_capacity + words_rows(x.shape[1] * x.element_size(), P)
        owner_rank = torch.arange(E, device=device) // El
        before = torch.cumsum(counts, 0) - counts
        shift = owner_rank * rows_per_chunk - before[owner_rank * El]
        rows, experts = slots[:, 1:1 + E], slots[:, 1 + E:]
        moved = torch.where(rows >= 0, rows + shift[experts.clamp(min=0).long()], rows).to(torch.int32)
        owner_map = RowIdMap(torch.cat([slots[:, :1], moved, experts], dim=1), counts, counts, P * rows_per_chunk,
                             True, min(E, cfg.topk))
    return SyncFreePlan(config=cfg, group=group, latch=latch, call=call, layout=sizes, routing_map=routing_map,
                        hidden_dtype=x.dtype, probs_dtype=wire_probs.dtype, owner_map=owner_map, slots=slots,
                        counts=counts, words=words)
