"""dispatch / combine: one frozen handle from the first to the second (DeepEP style).

    dispatch: size exchange + layout (layout.py; skipped with handle=previous), row maps (plan.py),
              the forward exchange (exchange.py), expand to one row per (token, local expert)
    combine:  rows back to their owners unreduced (exchange.py), the owner's fixed-order fp32 sum
An error found after the size exchange (a wrong expert_output, a reused handle whose routing
differs) is latched on the group's ErrorLatch (agreement.py) and raises at the next exchange.

Why the results are bitwise invariant (rank, dispatcher, EP size, batch):
- every local expert receives its rows in the order (source rank ascending, token ascending), and
  the expert's computation of a row must not depend on the other rows (row-stable);
- expert outputs return UNREDUCED to the token's owner, whose ``unpermute`` sums a token's rows in
  ascending expert order in fp32 (fp64 for fp64 probs), whatever P, the dispatcher or the batch;
- the dispatch's backward is the same path: the gradient of every (token, expert) row goes back
  to the owner unreduced and is summed there in the same fixed order.

Backward on every rank: the exchanges of the backward are collectives, so a rank whose own
tensors need no gradient must still run them when another rank's do. The size exchange agrees on
it (``Layout.dispatch_backward`` / ``combine_backward``); such a rank's dispatch and combine
outputs are then made to require grad (``_grad_anchor``), so its backward, which must reach the
layer's output, runs the exchanges too. Every rank calls backward, or none does.

Receiver layout (rows given to the local experts, [N, H]): for each local expert e, for each
source rank s ascending, a block of rows (s's tokens ascending, then capacity padding), then the
expert's tail padding (pad_multiple). Owner buffer (rows returned to the owner, [M, H]): for each
expert rank (own rank first, then the others ascending) its experts' blocks, each the owner's
tokens ascending (then capacity padding). At EP size 1 both are the same buffer and nothing moves.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import DispatchConfig, MoEConfig, as_dispatch_config
from ..distributed.agreement import (
    DISPATCH_BACKWARD_CALL,
    EXPERT_DTYPE,
    EXPERT_ROWS,
    GROUP_LATCHES,
    REUSED_ROUTING,
    ErrorLatch,
    InputProblem,
    agree_config,
    dtype_code,
)
from ..distributed.comm import ProcessGroup
from ..distributed.identity import StepCounter, functional_counter
from ..ops import RowIdMap, unpermute
from . import static
from .exchange import KINDS, Received, return_rows, send_back
from .expand import Expand, ReturnPath
from .layout import exchange_sizes
from .plan import Plan, expert_row_map, make_plan
from .static import StaticPlan, StaticStep
from .static_words import W_INPUT, poison


@dataclass(frozen=True)
class DispatchHandle:
    """What the combine (and the dispatch's backward) needs; returned by ``dispatch``. Immutable.

    Attributes:
        plan: the step's Plan (config, group, layout, routing, tokens_per_expert, routes).
        expert_map: RowIdMap of the receiver layout (the rows given to the experts).
        owner_map: RowIdMap of this rank's (token, expert) pairs in the rows that return to it
            (at EP 1 the expert map: nothing moves).
        probs: [T, E] fp32/fp64 (the wire dtype), with autograd to the caller's probs.
        permuted_probs: [N] probs of the rows given to the experts (differentiable only with
            probs_in_experts; otherwise the combine applies the probs).
        hidden_shape: shape of the caller's hidden states ([T, H] or [S, B, H]).
        expert_offsets: int32 [El] on the device, cumulative rows per local expert (the offsets
            torch._grouped_mm takes: no host-to-device copy of tokens_per_expert).
        static: the sync-free dispatch's part (its return route), None for the dropless path.
        expert_rows: sync-free, from ``dispatch`` (host counts): the experts were given only the
            rows of their blocks, sum(tokens_per_expert); the combine takes those (None: all N).

    ``copy.copy`` and ``copy.deepcopy`` return the handle itself: it is immutable, its group
    cannot be copied, and its probs carry the step's autograd graph, which a copy would cut.
    """

    plan: Plan | StaticPlan
    expert_map: RowIdMap
    owner_map: RowIdMap
    probs: torch.Tensor
    permuted_probs: torch.Tensor
    hidden_shape: torch.Size
    expert_offsets: torch.Tensor
    static: Optional[StaticStep] = None
    expert_rows: Optional[int] = None

    def __copy__(self) -> "DispatchHandle":
        return self

    def __deepcopy__(self, memo: dict) -> "DispatchHandle":
        return self

    @property
    def expert_counts(self) -> torch.Tensor:
        """int64 [El] on the device, rows per local expert (padding included): no host read."""
        return self.expert_map.padded_tokens_per_expert

    @property
    def source_blocks(self) -> Optional[tuple[tuple[tuple[int, int], ...], ...]]:
        """Host ints [El][P]: (first row, rows) of each (local expert, source EP rank) block of the
        receiver layout (capacity padding included; an expert's tail padding after its blocks is in
        none). A block holds that source's tokens alone, in token order. None for the sync-free plan."""
        if self.static is not None:
            return None
        layout = self.plan.layout
        return tuple(tuple((layout.block_starts[e][s], layout.local_blocks[s][e]) for s in range(layout.ep_size))
                     for e in range(layout.num_local_experts))

    @property
    def trailing_rows(self) -> bool:
        """Sync-free: rows after the last expert's block (up to N) belong to no expert."""
        return self.static is not None

    @property
    def input_replaced(self) -> bool:
        """Sync-free at EP > 1: this rank's inputs were bad and it took part with zeros (NaN results)."""
        return isinstance(self.plan, StaticPlan) and self.plan.replaced


def with_host_counts(rows: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """dispatch's return from dispatch_rows': (rows, tokens_per_expert, handle). Sync-free, the
    rows after the experts' blocks belong to no expert: the experts get rows [sum(tokens_per_expert),
    H], whose counts sum to their rows as every expert implementation checks (``expert_rows``)."""
    counts = host_tokens_per_expert(handle)
    if handle.static is None:
        return rows, counts, handle
    n = int(counts.sum())
    return rows[:n], counts, dataclasses.replace(handle, expert_rows=n)


def host_tokens_per_expert(handle: DispatchHandle) -> torch.Tensor:
    """CPU int64 [El], rows per local expert (padding included): the dropless plan's, or for a
    sync-free handle read from the device now (a host sync on CUDA; only whoever asks pays it)."""
    if handle.plan.tokens_per_expert is None:
        return handle.expert_counts.cpu()
    return handle.plan.tokens_per_expert


# ---- the steps ----------------------------------------------------------------------------------
def prepare(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup,
            latch: ErrorLatch, problem: Optional[InputProblem] = None, *, steps: StepCounter,
            experts_grad: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor, Plan]:
    """Size exchange (validates every rank's input, raises alike on all) and the step's Plan.
    Returns (hidden as [T, H], probs in the wire dtype with autograd, plan). ``steps``: the
    layer's forward counter (``identity``; advanced once the exchange succeeded); ``experts_grad``:
    see ``exchange_sizes``. ``cfg.sync_free``: the sync-free plan instead (static.py: no size
    exchange per step; the call travels in the exchanges' status rows)."""
    if cfg.sync_free:
        return static.prepare(hidden, routing_map, probs, cfg, group, latch, steps=steps, experts_grad=experts_grad)
    layout = exchange_sizes(hidden, routing_map, probs, cfg, group, latch, problem, call=steps.call(),
                            experts_grad=experts_grad)
    steps.advance()
    x = hidden.reshape(-1, hidden.shape[-1])
    wire = probs.to(cfg.wire_probs_dtype(probs.dtype))
    return x, wire, make_plan(cfg, group, latch, layout, routing_map, x.dtype, wire.dtype)


def send_tokens(x: torch.Tensor, probs: torch.Tensor, plan: Plan, with_routing: bool = True) -> Received:
    """x [T, H], probs [T, E] (wire dtype) -> this rank's rows, grouped by source (no autograd)."""
    if isinstance(plan, StaticPlan):
        return static.send_tokens(x, probs, plan)
    if plan.layout.ep_size == 1:
        return Received(x.detach(), probs.detach(), plan.routing_map, (0,))
    kind = KINDS[plan.config.kind]
    return kind.send(x.detach(), probs.detach(), plan.routing_map, plan.layout, plan.group, with_routing)


def _grad_anchor(needed: bool, tensor: torch.Tensor, *others: torch.Tensor) -> Optional[torch.Tensor]:
    """A leaf that requires grad, when some rank's backward runs an exchange (``needed``, agreed in
    the size exchange) but none of this rank's inputs to it requires grad: given to the exchange's
    autograd function, it makes the output require grad, so this rank's backward runs the exchange
    too. Its own gradient is never computed. None when not needed."""
    if needed and torch.is_grad_enabled() and not any(t.requires_grad for t in (tensor, *others)):
        return torch.zeros((), device=tensor.device, requires_grad=True)
    return None


def finish(x: torch.Tensor, probs: torch.Tensor, recv: Received, plan: Plan, hidden_shape: torch.Size,
           expert_map: Optional[RowIdMap] = None) -> tuple[torch.Tensor, DispatchHandle]:
    """Expand the received rows into the receiver layout; returns (expert_input [N, H], handle)."""
    if isinstance(plan, StaticPlan):
        rows, row_probs, expert_map, step = static.expand(x, probs, recv, plan, expert_map)
        offsets = torch.cumsum(expert_map.padded_tokens_per_expert, 0).to(torch.int32)  # cut to N (static.py)
        owner_map = expert_map if plan.owner_map is None else plan.owner_map
        handle = DispatchHandle(plan=plan, expert_map=expert_map, owner_map=owner_map, probs=probs,
                                permuted_probs=row_probs, hidden_shape=hidden_shape, expert_offsets=offsets,
                                static=step)
        return rows, handle
    if expert_map is None:
        expert_map = expert_row_map(plan, recv.routing)
    probs_in = probs if plan.config.probs_in_experts else probs.detach()
    anchor = _grad_anchor(plan.route is not None and plan.layout.dispatch_backward, x, probs_in)
    send = (functools.partial(send_back, route=plan.route, code=DISPATCH_BACKWARD_CALL)
            if plan.route is not None else None)
    # The probs gradient travels back only if some rank needs it (layout.probs_grad is agreed):
    # the same collectives everywhere.
    path = ReturnPath(send=send, owner_map=plan.owner_map if send is not None else None,
                      send_probs_grad=plan.config.probs_in_experts and plan.layout.probs_grad,
                      zero_fill=expert_map.has_pad_rows)
    rows, row_probs = Expand.apply(x, probs_in, recv.hidden, recv.probs, path, expert_map,
                                   plan.config.probs_in_experts, anchor)
    offsets = torch.cumsum(expert_map.padded_tokens_per_expert, 0).to(torch.int32)
    owner_map = expert_map if plan.owner_map is None else plan.owner_map
    handle = DispatchHandle(plan=plan, expert_map=expert_map, owner_map=owner_map, probs=probs,
                            permuted_probs=row_probs, hidden_shape=hidden_shape, expert_offsets=offsets)
    return rows, handle


def _reuse(previous: DispatchHandle, hidden: Any, routing_map: Any, probs: Any,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Check dispatch(handle=previous)'s inputs against the handle, without a host sync.

    Host checks: shapes, dtypes and device equal to the first dispatch's (at EP 1 a mismatch
    raises; at EP > 1 it is latched, like a differing routing). Device check: routing_map equals
    the handle's, elementwise; if not, the tokens become NaN (so every output of the step is NaN)
    and the next size exchange on the group raises on every rank."""
    plan = previous.plan
    T, E = plan.routing_map.shape
    H = plan.config.hidden_size
    ok = (isinstance(hidden, torch.Tensor) and hidden.dtype == plan.hidden_dtype and hidden.shape[-1:] == (H,)
          and hidden.numel() == T * H and isinstance(routing_map, torch.Tensor)
          and routing_map.shape == (T, E) and routing_map.dtype == torch.bool
          and isinstance(probs, torch.Tensor) and probs.shape == (T, E) and probs.is_floating_point()
          and probs.device == routing_map.device == hidden.device == plan.routing_map.device)
    if not ok:
        if plan.layout.ep_size == 1:
            raise ValueError(f"dispatch(handle=...): hidden_states, routing_map and probs must match the handle's "
                             f"[T, H] = [{T}, {H}] {plan.hidden_dtype}, [T, E] = [{T}, {E}] bool and float, on "
                             f"{plan.routing_map.device}")
        plan.latch.set(REUSED_ROUTING, device=plan.routing_map.device)
        device = plan.routing_map.device
        nan = torch.full((T, H), float("nan"), dtype=plan.hidden_dtype, device=device)
        return nan, torch.zeros((T, E), dtype=plan.probs_dtype, device=device)
    mismatch = (routing_map != plan.routing_map).any()
    plan.latch.set(mismatch.long() * REUSED_ROUTING)
    # The tokens carry the poison, not the probs: the ops reject non-finite probs themselves.
    x = hidden.reshape(T, H)
    return torch.where(mismatch, torch.full((), float("nan"), dtype=x.dtype, device=x.device), x), probs.to(
        plan.probs_dtype)


def _reuse_static(previous: DispatchHandle, hidden: Any, routing_map: Any, probs: Any,
                  ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """dispatch(handle=previous) in the sync-free mode: a new sync-free dispatch (there is no
    size exchange to skip), whose routing is compared with the handle's on the device; a
    difference sets the step's input word (NaN outputs, then the error; see static.py)."""
    plan = previous.plan
    x, wire, new_plan, recv = static.dispatch(hidden, routing_map, probs, plan.config, plan.group, plan.latch,
                                              steps=None, call=plan.call)
    old, new = plan.routing_map[:plan.num_real], new_plan.routing_map[:new_plan.num_real]  # without the padding
    differs = (new != old).any() if new.shape == old.shape else torch.ones((), dtype=torch.bool)
    rank = new_plan.layout.rank
    new_plan.words[W_INPUT] = torch.maximum(new_plan.words[W_INPUT],
                                                   differs.to(new_plan.words.device, torch.int32) * (rank + 1))
    shape = x.shape if new_plan.replaced else hidden.shape
    return finish(x, wire, recv, new_plan, shape)


def device_of(hidden: Any) -> torch.device:
    """Where a step's small messages live: the hidden states' device (the CPU for a non-tensor)."""
    return hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")


def dispatch(hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
             config: MoEConfig | DispatchConfig, ep_group: ProcessGroup = None, kind: Optional[str] = None,
             handle: Optional[DispatchHandle] = None, *, latch: Optional[ErrorLatch] = None, agreed: bool = False,
             steps: Optional[StepCounter] = None, experts_grad: Optional[bool] = None,
             ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send tokens to the ranks of their experts.

    Args:
        hidden: [T, H] or [S, B, H] (T = S * B) float32/float16/bfloat16, this rank's tokens.
        routing_map: [T, E] bool. probs: [T, E] float (sent as fp32, or fp64 for an fp64 router).
        config: a MoEConfig or a DispatchConfig.
        ep_group: the expert-parallel process group (None: the default group, or a single process).
        kind: 'alltoall' or 'allgather' (default: the config's).
        handle: a previous dispatch's handle with the same routing (activation recomputation): the
            configuration check, the size exchange and the row maps are skipped; only the data
            moves. The routing is compared on the device, without a host sync (see ``_reuse``).
        latch: the group's ErrorLatch (default: ``GROUP_LATCHES.of(ep_group)``).
        agreed: the caller (a dispatcher object) has already agreed on the configuration.
        steps: the caller's (a layer's) forward counter (default: the functional dispatches' on
            the group; ``identity``).
        experts_grad: whether the experts that will run on the rows have trainable weights (None:
            assumed under grad mode); see ``layout.exchange_sizes``.

    Returns:
        expert_input [N, H]: rows for the local experts, expert-major; within an expert ascending
            (source rank, token); padding rows (pad_multiple / capacity) are zero.
        tokens_per_expert: CPU int64 [El], rows per local expert (padding included).
        handle: for ``combine`` (frozen).

    Unless ``agreed``, the configuration is agreed (one small fixed-size exchange at EP > 1) on
    every call; the dispatcher objects do it once, at their first dispatch. A sync-free config
    (``sync_free``): tokens_per_expert is read from the device (``dispatch_rows`` reads nothing).
    """
    rows, new = dispatch_rows(hidden, routing_map, probs, config, ep_group, kind, handle, latch=latch, agreed=agreed,
                              steps=steps, experts_grad=experts_grad)
    return with_host_counts(rows, new)


def dispatch_rows(hidden: Any, routing_map: torch.Tensor, probs: torch.Tensor, config: MoEConfig | DispatchConfig,
                  ep_group: ProcessGroup = None, kind: Optional[str] = None, handle: Optional[DispatchHandle] = None,
                  *, latch: Optional[ErrorLatch] = None, agreed: bool = False,
                  steps: Optional[StepCounter] = None, experts_grad: Optional[bool] = None,
                  ) -> tuple[torch.Tensor, DispatchHandle]:
    """``dispatch`` without the host counts: (expert_input [N, H], handle). Sync-free configs make
    no host read here (the experts take ``handle.expert_counts`` / ``handle.expert_offsets``)."""
    if handle is not None and handle.static is not None:
        return _reuse_static(handle, hidden, routing_map, probs)
    if handle is not None:
        x, wire = _reuse(handle, hidden, routing_map, probs)
        recv = send_tokens(x, wire, handle.plan, with_routing=False)
        return finish(x, wire, recv, handle.plan, handle.hidden_shape, handle.expert_map)
    cfg = as_dispatch_config(config, kind)
    if not agreed:
        agree_config(cfg, ep_group, device_of(hidden))
    latch = GROUP_LATCHES.of(ep_group) if latch is None else latch
    steps = functional_counter(ep_group) if steps is None else steps
    if cfg.sync_free:  # its forward exchange can re-plan (static.dispatch)
        x, wire, plan, recv = static.dispatch(hidden, routing_map, probs, cfg, ep_group, latch, steps=steps,
                                              experts_grad=experts_grad)
        return finish(x, wire, recv, plan, x.shape if plan.replaced else hidden.shape)  # replaced: zeros [T, H]
    x, wire, plan = prepare(hidden, routing_map, probs, cfg, ep_group, latch, steps=steps, experts_grad=experts_grad)
    return finish(x, wire, send_tokens(x, wire, plan), plan, hidden.shape)


def check_expert_output(expert_output: Any, handle: DispatchHandle) -> torch.Tensor:
    """expert_output if it is [N, H] in the dispatch's dtype and device. Otherwise: at EP 1 raise
    ValueError; at EP > 1 latch the error for the next size exchange on the group (where every rank
    raises it) and return NaN rows of the right shape, so that this step's collectives still match
    on every rank (no hang) and its outputs are NaN on the owners of the rows (no silent result)."""
    N, H = handle.expert_map.num_out_tokens, handle.plan.config.hidden_size
    dtype, device = handle.plan.hidden_dtype, handle.plan.routing_map.device
    given = N if handle.expert_rows is None else handle.expert_rows
    ok = (isinstance(expert_output, torch.Tensor) and expert_output.shape == (given, H)
          and expert_output.dtype == dtype and expert_output.device == device)
    if ok and given < N:  # the rows after the experts' blocks: never read (static.py)
        return torch.cat([expert_output, expert_output.new_zeros(N - given, H)])
    if ok:
        return expert_output
    got = list(expert_output.shape) if isinstance(expert_output, torch.Tensor) else type(expert_output).__name__
    if handle.plan.layout.ep_size == 1:
        raise ValueError(f"expert_output must be [N, H] = [{given}, {H}] {dtype} on {device} "
                         f"(N = sum(tokens_per_expert)), got {got}"
                         + (f" {expert_output.dtype}" if isinstance(expert_output, torch.Tensor) else ""))
    if handle.static is not None:  # travels in the return exchange's status rows
        route = handle.static.route
        route.words[W_INPUT] = torch.clamp(route.words[W_INPUT], min=handle.plan.layout.rank + 1)
    elif isinstance(expert_output, torch.Tensor) and expert_output.shape == (N, H) and expert_output.dtype != dtype:
        handle.plan.latch.set(EXPERT_DTYPE, dtype_code(dtype), dtype_code(expert_output.dtype), device=device)
    else:  # rows: -1 when not a 2-D tensor of width H (or on another device)
        ok_2d = isinstance(expert_output, torch.Tensor) and expert_output.dim() == 2 and expert_output.shape[1] == H
        handle.plan.latch.set(EXPERT_ROWS, N, expert_output.shape[0] if ok_2d else -1, device=device)
    nan = torch.full((N, H), float("nan"), dtype=dtype, device=device)
    if isinstance(expert_output, torch.Tensor) and expert_output.requires_grad and expert_output.is_floating_point():
        # keep the graph to the experts and the dispatch: their backward collectives must still run
        nan = nan + (expert_output.sum() * 0).to(device=device, dtype=dtype)
    return nan


def return_with_words(expert_output: torch.Tensor, handle: DispatchHandle,
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(owner buffer [M, H], the sync-free step's check words from every rank, or None)."""
    if handle.static is not None:
        return static.return_to_owners(expert_output, handle.static)
    if handle.plan.route is None:
        return expert_output, None
    anchor = _grad_anchor(handle.plan.layout.combine_backward, expert_output)
    return return_rows(expert_output, handle.plan.route, anchor), None


def return_to_owners(expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Checked expert rows [N, H] -> the owner buffer [M, H] (the expert rows themselves at EP 1)."""
    return return_with_words(expert_output, handle)[0]


def owner_sum(rows: torch.Tensor, handle: DispatchHandle, words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The owner's fixed-order weighted sum of its rows [M, H] -> hidden_states' shape (NaN for a
    bad sync-free step: ``words`` from return_with_words)."""
    weights = None if handle.plan.config.probs_in_experts else handle.probs  # None: the experts applied them
    if handle.static is None:
        return unpermute(rows, handle.owner_map, weights, restore_shape=handle.hidden_shape)
    out = poison(unpermute(rows, handle.owner_map, weights), words, handle.plan.layout)
    return out[:handle.plan.num_real].reshape(handle.hidden_shape)  # without the plan's padding rows


def combine(expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """expert_output [N, H] (rows as given by dispatch) -> [T, H] or [S, B, H] like the input.

    out[t] = sum over t's experts e, ascending, of probs[t, e] * y[t, e] (probs omitted when the
    experts applied them), in fp32 (fp64 for fp64 probs), rounded once to expert_output.dtype.
    A wrong expert_output: see ``check_expert_output`` (no hang; NaN, then the same error on every
    rank at the next dispatch on the group).
    """
    rows, words = return_with_words(check_expert_output(expert_output, handle), handle)
    return owner_sum(rows, handle, words)
