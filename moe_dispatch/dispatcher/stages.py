"""The staged dispatch: the public stages a framework calls between its own steps.

    prepared = prepare(hidden, routing_map, probs, config, ep_group)  # validate, plan the step
    sent = send(prepared)                                             # the forward data exchange
    expert_input, handle = finish(sent)                               # the experts' layout, frozen handle
    expert_output = experts(to_expert_rows(expert_input, handle))     # [N, H]: the rows and their split

``hidden`` is the payload: the tokens (a tensor), or ``Fp8Rows`` (the tokens quantised per row,
``config.fp8``; tokens given with ``config.fp8`` are quantised in ``prepare``). Every stage runs
alike on either; ``finish`` returns the expert rows as the payload type sent (payload.py).
    returned = return_rows(check_expert_output(expert_output, handle), handle)  # back to the owners
    output = owner_sum(returned, handle)                              # fixed-order fp32 sum, [T, H]

``dispatch`` and ``combine`` (functional.py) are these stages in a row; Megatron's six-method
interface (``moe_dispatch.integrations.megatron``) is these stages one per method. Each stage
returns a frozen record (plan.py) that the next consumes; a framework that changes a tensor
between two stages (Megatron passes its own copies on) swaps it in with ``dataclasses.replace``.
The plan is chosen once, in ``prepare`` (``plan_type``), and every later stage calls it.

Every stage at EP > 1 is collective: every rank of ``ep_group`` runs the same stages in the same
order. An error in the inputs raises the same ValueError on every rank in ``prepare``; one found
later (a wrong expert_output) gives NaN rows and raises on every rank at the next ``prepare``.
``send`` checks that every rank sends the same prepared record (several may wait between prepare
and send) with the x and probs prepare recorded (records.py): the dropless plan in one fixed-size
exchange before its rows move, the sync-free plan in its exchange's check words. Each stage checks
that it got the record of the stage before it (a ValueError naming both, on the rank that erred:
a record of the wrong type names no group to tell).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..config import DispatchConfig, MoEConfig, as_dispatch_config
from ..distributed.agreement import GROUP_LATCHES, ErrorLatch, agree_config
from ..distributed.comm import ProcessGroup
from ..distributed.identity import StepCounter, functional_counter
from ..experts.rows import ExpertRows
from ..ops import RowIdMap
from .dropless.plan import DroplessPlan
from .payload import Fp8Rows
from .plan import DispatchHandle, Plan, Prepared, Returned, Sent
from .records import expect_record, expect_rows, got_name
from .sync_free.plan import SyncFreePlan


def plan_type(cfg: DispatchConfig) -> type[Plan]:
    """The plan of a configuration, chosen here once per dispatch: every later stage calls it."""
    return SyncFreePlan if cfg.sync_free else DroplessPlan


def device_of(hidden: Any) -> torch.device:
    """Where a step's small messages live: the hidden states' device (an Fp8Rows payload's; the
    CPU for anything else)."""
    return hidden.device if isinstance(hidden, (torch.Tensor, Fp8Rows)) else torch.device("cpu")


def prepare(hidden: Any, routing_map: Any, probs: Any, config: MoEConfig | DispatchConfig,
            ep_group: ProcessGroup = None, kind: Optional[str] = None, *, latch: Optional[ErrorLatch] = None,
            agreed: bool = False, steps: Optional[StepCounter] = None,
            experts_grad: Optional[bool] = None) -> Prepared:
    """Validate every rank's input (the same ValueError on every rank) and plan the step.

    Args:
        hidden: [T, H] or [S, B, H] float32/float16/bfloat16, or with ``config.fp8`` an ``Fp8Rows``
            of [T, H] (``Fp8Rows.quantize(tokens)``: its grad_sink the tokens, which the checks,
            shapes and autograd take). routing_map: [T, E] bool.
        probs: [T, E] float; they travel as fp32 (fp64 for an fp64 router).
        config, ep_group, kind: as ``dispatch``.
        latch: the group's ErrorLatch (default ``GROUP_LATCHES.of(ep_group)``).
        agreed: the caller has agreed the configuration with the group already (a dispatcher
            object does, once); otherwise it is agreed here (one small exchange at EP > 1).
        steps: the caller's forward counter (a layer's; default the functional one of the group).
        experts_grad: whether the experts have trainable weights (None: assumed under grad mode).

    Returns a Prepared: x [T, H], probs [T, E] in the wire dtype (autograd to the caller's), the
    step's Plan (the dropless plan: one size exchange; the sync-free plan: none after its first step).
    """
    cfg = as_dispatch_config(config, kind)
    if not agreed:
        agree_config(cfg, ep_group, device_of(hidden))
    latch = GROUP_LATCHES.of(ep_group) if latch is None else latch
    steps = functional_counter(ep_group) if steps is None else steps
    return plan_type(cfg).prepare(hidden, routing_map, probs, cfg, ep_group, latch, steps=steps,
                                  experts_grad=experts_grad)


def send(prepared: Prepared) -> Sent:
    """The forward data exchange of prepared.x and prepared.probs. Returns a Sent whose ``recv``
    holds what arrived: hidden [R, H], probs [R, El] and routing [R, El], by source rank.

    The record is checked first (``Plan.check_record``): every rank must send the same prepared
    record (the same call) with x [T, H] and probs [T, E] of the shapes, dtypes and device prepare
    recorded. The dropless plan at EP > 1 agrees on it in one fixed-size all-gather read on the
    host (the same ValueError on every rank, before any row moves); the sync-free plan in its
    exchange's words (NaN outputs, then the error on every rank)."""
    expect_record(prepared, Prepared, "send")
    plan = prepared.plan
    return plan.send(plan.check_record(prepared))


def send_just_prepared(prepared: Prepared) -> Sent:
    """``send`` of a record its caller has just made with ``prepare`` (``dispatch``): it never
    left the call, so every rank sends the record it prepared, as prepared, and the record
    agreement (the dropless plan's extra exchange and host read) is skipped."""
    return prepared.plan.send(prepared)


def finish(sent: Sent, expert_map: Optional[RowIdMap] = None) -> tuple[torch.Tensor | Fp8Rows, DispatchHandle]:
    """The received rows in the receiver layout: (expert_input, handle), expert_input the payload
    type sent: [N, H], or ``Fp8Rows`` of [N, H] (its data and scales views of the permuted wire rows
    [N, W], ``wire``; its grad_sink takes the rows' gradient). expert_input is expert-major, within
    an expert by (source rank, token) ascending; padding rows are zero. Its backward returns every
    row's gradient to its owner unreduced. ``expert_map``: a previous handle's (the same routing;
    normally None)."""
    expect_record(sent, Sent, "finish")
    return sent.plan.finish(sent, expert_map)


def to_expert_rows(expert_input: torch.Tensor | Fp8Rows, handle: DispatchHandle, *,
                   source_blocks: bool = False) -> ExpertRows:
    """``finish``'s expert_input ([N, H], or ``Fp8Rows`` with ``config.fp8``) as the experts take
    it: one ``ExpertRows`` with the handle's rows per expert (on the device; on the host too where
    the plan has them, never read here), offsets, probs and trailing rows. ``source_blocks``: also
    the (local expert, source rank) blocks, for per-source weight gradients (``handle.source_blocks``:
    a dropless plan's host pairs, a sync-free plan's device rows [El, P], no host read)."""
    expect_record(handle, DispatchHandle, "to_expert_rows")
    fp8 = handle.plan.config.fp8
    if fp8 is None:
        expect_rows(expert_input, "to_expert_rows")
    elif not isinstance(expert_input, Fp8Rows):
        raise ValueError(f"to_expert_rows: an FP8 dispatch (config.fp8={fp8!r}) gives its experts the Fp8Rows "
                         f"that finish() returned; got {got_name(expert_input)}")
    trailing = handle.trailing_rows
    # a sync-free plan's host counts would cost a host read: the experts take the device ones
    host_rows_per_expert = None if trailing else handle.host_rows_per_expert
    # a sync-free plan's blocks are a device tensor (trailing rows in none): no host read either
    blocks = handle.source_blocks if source_blocks else None
    return ExpertRows(expert_input, handle.rows_per_expert, host_rows_per_expert, handle.expert_offsets,
                      handle.permuted_probs, trailing, blocks)


def check_expert_output(expert_output: Any, handle: DispatchHandle) -> torch.Tensor:
    """expert_output if it is [N, H] in the dispatch's dtype and on its device (N: the rows the
    experts were given, ``handle.given_rows`` when fewer). Otherwise: at EP 1 a ValueError; at
    EP > 1 the plan records the error (every rank raises it at the group's next exchange) and NaN
    rows of the right shape come back, so this step's collectives still match on every rank (no
    hang) and its outputs are NaN on the owners of the rows (no silent result).

    Not checkable: which dispatch the rows came from (the experts make new tensors), so rows of
    another dispatch with the same N, dtype and device pass (docs/dispatchers.md)."""
    expect_record(handle, DispatchHandle, "check_expert_output")
    plan = handle.plan
    N, H = handle.expert_map.num_out_tokens, plan.config.hidden_size
    dtype, device = plan.hidden_dtype, plan.routing_map.device
    given = N if handle.given_rows is None else handle.given_rows
    ok = (isinstance(expert_output, torch.Tensor) and expert_output.shape == (given, H)
          and expert_output.dtype == dtype and expert_output.device == device)
    if ok and given < N:  # the rows after the experts' blocks belong to no expert: never read
        return torch.cat([expert_output, expert_output.new_zeros(N - given, H)])
    if ok:
        return expert_output
    is_tensor = isinstance(expert_output, torch.Tensor)
    if plan.ep_size == 1:
        got = f"{list(expert_output.shape)} {expert_output.dtype}" if is_tensor else type(expert_output).__name__
        raise ValueError(f"expert_output must be [N, H] = [{given}, {H}] {dtype} on {device} "
                         f"(N = sum(rows_per_expert)), got {got}")
    plan.flag_expert_output(handle, expert_output)
    nan = torch.full((N, H), float("nan"), dtype=dtype, device=device)
    if is_tensor and expert_output.requires_grad and expert_output.is_floating_point():
        # keep the graph to the experts and the dispatch: their backward collectives must still run
        nan = nan + (expert_output.sum() * 0).to(device=device, dtype=dtype)
    return nan


def return_rows(expert_output: torch.Tensor, handle: DispatchHandle) -> Returned:
    """Checked expert rows [N, H] -> Returned: the owner buffer [M, H] (this rank's rows from
    every expert rank, unreduced; the rows themselves at EP 1), marked with the handle's dispatch."""
    expect_rows(expert_output, "return_rows")
    expect_record(handle, DispatchHandle, "return_rows")
    returned = handle.plan.return_rows(expert_output, handle)
    return dataclasses.replace(returned, dispatch_id=handle.dispatch_id)


def owner_sum(returned: Returned, handle: DispatchHandle) -> torch.Tensor:
    """The owner's weighted sum, hidden_states' shape: out[t] = sum over t's experts e, ascending,
    of probs[t, e] * y[t, e] (probs omitted when the experts applied them) in fp32 (fp64 for fp64
    probs), rounded once to the rows' dtype.

    ``returned`` must come from ``return_rows`` with this handle (a ValueError on this rank
    otherwise: owner_sum runs no collective, so nothing waits on it in the forward)."""
    expect_record(returned, Returned, "owner_sum")
    expect_record(handle, DispatchHandle, "owner_sum")
    if returned.dispatch_id is not None and returned.dispatch_id != handle.dispatch_id:
        raise ValueError("owner_sum was given the Returned of another dispatch than its handle's (return_rows ran "
                         "with another handle): pass the handle the rows were returned with")
    return handle.plan.owner_sum(returned, handle)
