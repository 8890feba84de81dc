"""dispatch / combine: one frozen handle from the first to the second (DeepEP style).

    dispatch: prepare (validate, plan: plan.py), send (the forward exchange), finish (expand to one
              row per (token, local expert)); with handle=previous the plan is reused
    combine:  check the rows, return them to their owners unreduced, the owner's fixed-order sum
The stages are public (stages.py) for frameworks that call them one by one. An error found after
the size exchange (a wrong expert_output, a reused handle whose routing differs) is latched on the
group's ErrorLatch (agreement.py) and raises at the next exchange.

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
layer's output, runs the exchanges too (``expand.grad_anchor``). Every rank calls backward, or none does.

Receiver layout (rows given to the local experts, [N, H]): for each local expert e, for each
source rank s ascending, a block of rows (s's tokens ascending, then capacity padding), then the
expert's tail padding (pad_multiple). Owner buffer (rows returned to the owner, [M, H]): for each
expert rank (own rank first, then the others ascending) its experts' blocks, each the owner's
tokens ascending (then capacity padding). At EP size 1 both are the same buffer and nothing moves.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..config import DispatchConfig, MoEConfig
from ..distributed.agreement import ErrorLatch
from ..distributed.comm import ProcessGroup
from ..distributed.identity import StepCounter
from .plan import DispatchHandle
from .stages import check_expert_output, finish, owner_sum, prepare, return_rows, send_just_prepared


def with_host_rows_per_expert(rows: torch.Tensor, handle: DispatchHandle,
                              ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """dispatch's return from dispatch_rows': (rows, host_rows_per_expert, handle). With trailing
    rows (sync-free) the experts get rows [sum(host_rows_per_expert), H], whose counts sum to their
    rows as every expert implementation checks (``handle.given_rows``)."""
    host_rows_per_expert = handle.host_rows_per_expert
    if not handle.trailing_rows:
        return rows, host_rows_per_expert, handle
    n = int(host_rows_per_expert.sum())
    return rows[:n], host_rows_per_expert, dataclasses.replace(handle, given_rows=n)


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
            moves. The routing is compared on the device, without a host sync (``Plan.reuse``).
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
    return with_host_rows_per_expert(rows, new)


def dispatch_rows(hidden: Any, routing_map: torch.Tensor, probs: torch.Tensor, config: MoEConfig | DispatchConfig,
                  ep_group: ProcessGroup = None, kind: Optional[str] = None, handle: Optional[DispatchHandle] = None,
                  *, latch: Optional[ErrorLatch] = None, agreed: bool = False,
                  steps: Optional[StepCounter] = None, experts_grad: Optional[bool] = None,
                  ) -> tuple[torch.Tensor, DispatchHandle]:
    """``dispatch`` without the host counts: (expert_input [N, H], handle). Sync-free configs make
    no host read here (the experts take ``to_expert_rows(expert_input, handle)``: its device counts
    and offsets)."""
    if handle is not None:
        return handle.plan.reuse(handle, hidden, routing_map, probs)
    prepared = prepare(hidden, routing_map, probs, config, ep_group, kind, latch=latch, agreed=agreed,
                       steps=steps, experts_grad=experts_grad)
    return finish(send_just_prepared(prepared))


def combine(expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """expert_output [N, H] (rows as given by dispatch) -> [T, H] or [S, B, H] like the input.

    out[t] = sum over t's experts e, ascending, of probs[t, e] * y[t, e] (probs omitted when the
    experts applied them), in fp32 (fp64 for fp64 probs), rounded once to expert_output.dtype.
    A wrong expert_output: see ``stages.check_expert_output`` (no hang; NaN, then the same error on
    every rank at the next dispatch on the group).
    """
    rows = check_expert_output(expert_output, handle)
    return owner_sum(return_rows(rows, handle), handle)
