"""Checks of the records that pass between the stages (stages.py): that a stage got the record of
the stage before it, and, in ``send``, that every rank of the group sends the same prepared record
(the same call: a micro-batch's (layer, forward), ``identity.CallId``) with the x and probs that
``prepare`` recorded.

Why ``send`` needs an agreement of its own: a framework may prepare several micro-batches before
sending any, and may swap a tensor into a record (``dataclasses.replace``). A rank that sends
another micro-batch than its peers pairs their rows up silently when the split sizes agree, and
gloo aborts (NCCL hangs) when they differ; a rank whose x has other rows or another dtype fails
alone or aborts the exchange. The dropless plan's forward exchange has variable sizes, so the
record's call and its check travel first, in one fixed-size all-gather (``agree_send``), and every
rank raises the same ValueError before any row moves. The sync-free plan's exchange has fixed
sizes and carries the call in its status words already (sync_free/words.py): a bad record there
takes part with zeros and its check word (no host read).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..distributed.agreement import differ, dtype_code, dtype_name
from ..distributed.comm import all_gather_rows, group_size_rank, read_host, to_device
from ..distributed.identity import CallId
from .plan import DispatchHandle, Prepared, Returned, Sent

# The stage that makes each record, for the error messages.
_MADE_BY = {Prepared: "prepare()", Sent: "send()", DispatchHandle: "finish() or dispatch()",
            Returned: "return_rows()"}
_SEND_TAG = 0x4D6F4553 + 2  # marks send's record agreement (not the size exchange's tag)
_DEVICE_TYPES = ("cpu", "cuda")


def got_name(value: Any) -> str:
    """'a Sent (from send())', 'a Tensor', 'None': what a stage was given, for its message."""
    if value is None:
        return "None"
    name = type(value).__name__
    made_by = _MADE_BY.get(type(value))
    return f"a {name}" + (f" (from {made_by})" if made_by else "")


def expect_record(value: Any, record: type, stage: str) -> None:
    """ValueError unless ``value`` is the ``record`` that ``stage`` takes, naming both records."""
    if not isinstance(value, record):
        raise ValueError(f"{stage} expects the {record.__name__} from {_MADE_BY[record]}; got {got_name(value)}")


def expect_rows(value: Any, stage: str) -> None:
    """ValueError unless ``value`` is a tensor (expert rows), naming the record given instead."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{stage} expects the expert rows (a tensor [N, H], from check_expert_output()); got "
                         f"{got_name(value)}")


# ---- what send checks in a record ---------------------------------------------------------------
def _device_code(device: torch.device) -> int:
    kind = _DEVICE_TYPES.index(device.type) + 1 if device.type in _DEVICE_TYPES else 99
    return kind * 1000 + (device.index if device.index is not None else -1) + 1


def _device_text(code: int) -> str:
    kind, index = divmod(code, 1000)
    name = _DEVICE_TYPES[kind - 1] if 1 <= kind <= len(_DEVICE_TYPES) else "another device type"
    return name if index == 0 else f"{name}:{index - 1}"


def _describe(t: Any) -> list[int]:
    """[rows, cols, dtype code, device code] of a 2-D tensor ([-1, -1, -1, 0] for anything else)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        return [-1, -1, -1, 0]
    return [t.shape[0], t.shape[1], dtype_code(t.dtype), _device_code(t.device)]


_PARTS = ("x", "probs")  # part code 1, 2 (0: the record is as prepared)
_PROBLEM_WIDTH = 9  # part, expected [4], got [4]


def record_problem(prepared: Prepared) -> list[int]:
    """[part, expected [4], got [4]] of the first of x, probs that differs from what ``prepare``
    recorded (rows, width, dtype, device), or zeros: the record may be sent."""
    plan = prepared.plan
    T, E = plan.routing_map.shape
    device = _device_code(plan.routing_map.device)
    expected = ([T, plan.config.hidden_size, dtype_code(plan.hidden_dtype), device],
                [T, E, dtype_code(plan.probs_dtype), device])
    for part, (tensor, want) in enumerate(zip((prepared.x, prepared.probs), expected), start=1):
        got = _describe(tensor)
        if got != want:
            return [part, *want, *got]
    return [0] * _PROBLEM_WIDTH


def _tensor_text(d: list[int]) -> str:
    if d[0] < 0:
        return "no 2-D tensor"
    return f"[{d[0]}, {d[1]}] {dtype_name(d[2])} on {_device_text(d[3])}"


def problem_text(problem: list[int], rank: Optional[int] = None) -> str:
    part, want, got = problem[0], problem[1:5], problem[5:9]
    where = "" if rank is None else f" on EP rank {rank}"
    name = _PARTS[part - 1]
    return (f"send: the Prepared record's {name}{where} must be {_tensor_text(want)}, as prepare() recorded, got "
            f"{_tensor_text(got)} (a copy swapped in with dataclasses.replace must keep prepare()'s shape, dtype "
            f"and device)")


def check_record_here(prepared: Prepared) -> None:
    """One process: the record's problem, raised at once."""
    problem = record_problem(prepared)
    if problem[0]:
        raise ValueError(problem_text(problem))


def agree_send(prepared: Prepared, call: CallId) -> None:
    """Before a variable-size forward exchange: one fixed-size all-gather of (tag, the record's
    call, its problem), read on the host (one synchronisation). Raises the same ValueError on every
    rank when a rank's record differs from what prepare recorded (naming the rank, the expected
    and the given tensor) or when the ranks send different records (naming each rank's call)."""
    plan = prepared.plan
    P, _ = group_size_rank(plan.group)
    mine = [_SEND_TAG, call.tag, *record_problem(prepared)]
    rows = read_host(all_gather_rows(to_device(mine, plan.routing_map.device)[None], plan.group).view(P, -1))
    alien = [r for r, row in enumerate(rows) if row[0] != _SEND_TAG]
    if alien:
        raise ValueError(f"EP ranks {alien} are not in send's record agreement (ranks calling different stages or "
                         f"collectives?)")
    problems = [problem_text(row[2:], r) for r, row in enumerate(rows) if row[2]]
    tags = [row[1] for row in rows]
    if len(set(tags)) > 1:
        calls = [str(CallId.from_tag(t)) for t in tags]
        problems.insert(0, f"send on the EP group pairs different prepared records: {differ(tags, shown=calls)} "
                           f"(micro-batches prepared in one order and sent in another on some rank?)")
    if problems:
        raise ValueError("; ".join(problems) + "; no row was exchanged")
