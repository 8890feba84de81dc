"""Agreement across ranks, and errors that every rank raises together.

A bad input or configuration on one rank must raise the same ValueError on every rank, never
leave the others waiting in a collective. Four ways, each one fixed-size exchange or a part of one:
- ``agree_config`` / ``agree_settings``: before a dispatcher's (or the router's loss) first
  collective, every rank sends a fingerprint of its configuration; a mismatch names the field,
  its values and the ranks.
- ``InputProblem`` (e.g. from ``hidden_states_problem``): a problem one rank finds in its input
  travels in the dispatcher's size exchange instead of the data (``_Dispatcher.raise_together``).
  A ``DeviceProblem`` is one found on the device (a stale FP8 weights handle's bits): it travels
  in the step's own exchanges, read with them (``_Dispatcher.dispatch_rows(device_problem=...)``).
- ``ErrorLatch``: an error found after the size exchange (``combine`` given the wrong rows, a
  reused handle whose routing differs, another call's rows in a return exchange:
  ``latch_call_mismatch``) cannot raise at once without stranding the other ranks in the step's
  next collective. It is latched, and travels in the next size exchange on the same group, where
  every rank raises it; meanwhile the flagged step's results are NaN.
- ``agree_problems``: refusals found locally (GradientTree's checks) go through one fixed-size
  exchange, so that every rank raises the same ValueError naming the rank that found them.
Ranks in different calls (layers called in another order: ``identity``) are named as such
(``order_problem``), before any field that differs between the two layers.
"""
from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import DispatchConfig
from .comm import ProcessGroup, all_gather_rows, group_size_rank, read_host, to_device
from .identity import FUNCTIONAL_LAYER, CallId, layer_name
from .registry import LATCHES

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.bool: 5,
                torch.int64: 6, torch.int32: 7, torch.int16: 8, torch.int8: 9, torch.uint8: 10}
_CODE_NAMES = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}
_CODE_NAMES.update({0: "unsupported dtype", -1: "non-tensor"})
_DEVICE_CODES = {"cpu": 1, "cuda": 2}
_DEVICE_NAMES = {v: k for k, v in _DEVICE_CODES.items()}
_HANDSHAKE_TAG = 0x4D6F4548  # marks the dispatcher's configuration message
_SETTINGS_TAG = 0x4D6F4552  # marks agree_settings' message
_PROBLEMS_TAG = 0x4D6F4550  # marks agree_problems' message


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as an int for an exchange message (0: not one we know)."""
    return _DTYPE_CODES.get(dtype, 0)


def dtype_name(code: int) -> str:
    return _CODE_NAMES.get(code, f"dtype code {code}")


def device_code(device: torch.device) -> int:
    return _DEVICE_CODES.get(device.type, 99)


# ---- problems that travel in the size exchange --------------------------------------------------
@dataclass(frozen=True)
class InputProblem:
    """A problem one rank found locally, sent in the size exchange so that every rank raises it.
    code: a key of ``_PROBLEMS``; expected / got: ints the message shows."""

    code: int
    expected: int = 0
    got: int = 0


@dataclass(frozen=True)
class DeviceProblem:
    """An InputProblem found on the device, so that finding it reads nothing on the host: 0-dim
    int64 tensors on the layer's device; code 0: no problem. The dispatcher carries it in the
    step's exchanges (``_Dispatcher.dispatch_rows``), so every rank raises it without a host sync."""

    code: torch.Tensor
    expected: torch.Tensor
    got: torch.Tensor


# The return exchanges that compare their handle's call (``check_call``): latched code -> which.
COMBINE_CALL, COMBINE_BACKWARD_CALL, DISPATCH_BACKWARD_CALL = 103, 104, 105
RETURN_CHECKS = {COMBINE_CALL: "combine", COMBINE_BACKWARD_CALL: "combine's backward",
                 DISPATCH_BACKWARD_CALL: "dispatch's backward"}


def _call_mismatch(what: str, mine: int, other: int) -> str:
    return (f"the previous {what} on this group paired rows of different calls: this rank's handle is "
            f"{CallId.from_tag(mine)}, another rank's is {CallId.from_tag(other)} (micro-batches combined or "
            f"backpropagated in another order on some rank?); the rows it received were NaN "
            f"(strict_call_order=True raises before they move)")


# A caller's fp8_weights (moe_dispatch.experts.fp8_weights) that cannot serve the forward.
FP8_WEIGHTS_NOT_FP8, FP8_WEIGHTS_NOT_A_HANDLE, FP8_WEIGHTS_OTHER_EXPERTS = 6, 7, 8
FP8_WEIGHTS_STEPPED, FP8_WEIGHTS_CHANGED, FP8_WEIGHTS_BITS_CHANGED = 9, 10, 11
_QUANTISE_AGAIN = "quantise the weights again after each optimizer step (quantize_fp8_weights)"


# code -> message(expected, got). Codes < 100 are a caller's InputProblem, >= 100 are latched.
_PROBLEMS = {
    1: lambda e, g: "hidden_states must be a tensor",
    2: lambda e, g: f"hidden_states must be [T, H] or [S, B, H] (2 or 3 dims), got {g} dims",
    3: lambda e, g: f"hidden_states must have hidden size {e} (its last dim), got {g}",
    4: lambda e, g: f"hidden_states must be float32, float16 or bfloat16, got {dtype_name(g)}",
    5: lambda e, g: f"hidden_states must be on the layer's device type ({_DEVICE_NAMES.get(e, e)}), got "
                    f"{_DEVICE_NAMES.get(g, g)}",
    FP8_WEIGHTS_NOT_FP8: lambda e, g: "fp8_weights was given, but the layer is not FP8 (its config's fp8 is None)",
    FP8_WEIGHTS_NOT_A_HANDLE: lambda e, g: "fp8_weights must be the Fp8ExpertWeights quantize_fp8_weights returns",
    FP8_WEIGHTS_OTHER_EXPERTS: lambda e, g: ("fp8_weights was quantised from other experts' weights (another "
                                             "layer's, a copy's, or parameters replaced since)"),
    FP8_WEIGHTS_STEPPED: lambda e, g: (f"fp8_weights may be stale: {g - e} optimizer step(s) since it was quantised; "
                                       f"{_QUANTISE_AGAIN}"),
    FP8_WEIGHTS_CHANGED: lambda e, g: (f"fp8_weights is stale: weight{e} changed in place or moved since it was "
                                       f"quantised (copy_, load_state_dict, .data =); {_QUANTISE_AGAIN}"),
    FP8_WEIGHTS_BITS_CHANGED: lambda e, g: (f"fp8_weights is stale: weight{e}'s bits differ from those it was "
                                            f"quantised from (a write autograd does not count: dist.broadcast, "
                                            f".data.copy_, a custom kernel); {_QUANTISE_AGAIN}"),
    100: lambda e, g: f"expert_output given to the previous combine on this group must have N = {e} rows "
                      f"(sum(tokens_per_expert)) of hidden size H, got {g if g >= 0 else 'no [rows, H] tensor'} "
                      f"(that step's outputs were NaN)",
    102: lambda e, g: f"expert_output given to the previous combine on this group must be {dtype_name(e)} like "
                      f"the dispatched rows, got {dtype_name(g)} (that step's outputs were NaN)",
    101: lambda e, g: "routing_map given to dispatch(handle=...) differs from the handle's routing "
                      "(that step's outputs were NaN)",
    **{code: functools.partial(_call_mismatch, what) for code, what in RETURN_CHECKS.items()},
}
EXPERT_ROWS, REUSED_ROUTING, EXPERT_DTYPE = 100, 101, 102  # the latched codes


def problem_message(code: int, expected: int, got: int) -> str:
    return _PROBLEMS[code](expected, got)


def hidden_states_problem(hidden_states: Any, hidden_size: int, device: torch.device) -> Optional[InputProblem]:
    """What is wrong with a layer's input, found locally (None: nothing), for the size exchange
    to carry (``_Dispatcher.raise_together``) instead of failing on one rank while others wait.

    Args:
        hidden_states: should be [T, H] or [S, B, H] float32/float16/bfloat16 with H = hidden_size.
        device: the layer's device (its parameters'); hidden_states must have its device type.
    """
    if not isinstance(hidden_states, torch.Tensor):
        return InputProblem(1)
    if hidden_states.dim() not in (2, 3):
        return InputProblem(2, 0, hidden_states.dim())
    if hidden_states.shape[-1] != hidden_size:
        return InputProblem(3, hidden_size, hidden_states.shape[-1])
    if hidden_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return InputProblem(4, 0, dtype_code(hidden_states.dtype))
    if hidden_states.device.type != device.type:
        return InputProblem(5, device_code(device), device_code(hidden_states.device))
    return None


class ErrorLatch:
    """The first error latched on one group since its last size exchange: [3] int64 (code,
    expected, got; code 0 = none), on the device or the host. Setting it never synchronises."""

    def __init__(self) -> None:
        self._error: Optional[torch.Tensor] = None

    def set(self, code: torch.Tensor | int, expected: torch.Tensor | int = 0, got: torch.Tensor | int = 0,
            device: Optional[torch.device] = None) -> None:
        """Latch an error (ints or device scalars; a code of 0 latches nothing); the first one stays."""
        values = (code, expected, got)
        dev = next((v.device for v in values if isinstance(v, torch.Tensor)), device or torch.device("cpu"))
        # host ints become fills on the device (a fill is a kernel, not a host-to-device copy)
        new = torch.stack([v.to(torch.int64).reshape(()) if isinstance(v, torch.Tensor)
                           else torch.full((), v, dtype=torch.int64, device=dev) for v in values])
        if self._error is not None:
            new = torch.where(self._error[0] != 0, self._error, new.to(self._error.device))
        self._error = new

    def take(self, device: torch.device) -> torch.Tensor:
        """The latched error on ``device`` (zeros if none), clearing the latch."""
        error, self._error = self._error, None
        if error is None:
            return torch.zeros(3, dtype=torch.int64, device=device)
        return error.to(device, non_blocking=True)


class GroupLatches:
    """One ErrorLatch per process group (``registry.LATCHES``), shared by every dispatcher and
    functional dispatch on it: an error latched by one step raises at the next size exchange on
    the group, whoever runs it."""

    def of(self, group: ProcessGroup) -> ErrorLatch:
        return LATCHES.setdefault(group, ErrorLatch)


GROUP_LATCHES = GroupLatches()


# ---- configuration agreement --------------------------------------------------------------------
def _encode(value: Any) -> int:
    """A field value as an int64 that is equal exactly when the values are."""
    if value is None:
        return -1
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(str(value).encode())


def fingerprint(cfg: DispatchConfig) -> list[int]:
    """The configuration fields every rank must agree on, as ints (DispatchConfig order)."""
    return [_encode(v) for _, v in cfg.field_values()]


def fingerprint_hash(cfg: DispatchConfig) -> int:
    return zlib.crc32(repr(fingerprint(cfg)).encode())


def differ(values: list, shown: Optional[list[str]] = None) -> str:
    """'[8, 4, 8, 8] by rank; ranks [1] differ from the others' (the others: the most common
    value; on a tie, the lowest rank's). ``shown``: the values' text, if not their repr."""
    common = max(values, key=lambda v: (values.count(v), -values.index(v)))
    odd = [r for r, v in enumerate(values) if v != common]
    listed = values if shown is None else "[" + ", ".join(shown) + "]"
    return f"{listed} by rank; ranks {odd} differ from the others"


Settings = Sequence[tuple[str, Any]]


def _settings_text(settings: Settings) -> list[tuple[str, str]]:
    """(name, repr(value)) of each setting, so that equal text means equal settings on any rank.
    Only plain values (None, bool, int, float, str, torch.dtype, tuples and lists of them): a
    repr of anything else (a function, an object) can name a memory address."""
    def plain(v: Any) -> bool:
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str, torch.dtype))

    return [(name, repr(value)) for name, value in settings if plain(value)]


def _settings_hash(settings: Settings) -> int:
    return zlib.crc32(repr(_settings_text(settings)).encode())


def _settings_problems(settings: Settings, group: ProcessGroup, group_name: str) -> list[str]:
    """Only when the settings' hashes differ (every rank sees the same hashes, so every rank
    comes here): gather every rank's settings as text and name each one that differs."""
    P, _ = group_size_rank(group)
    gathered: list = [None] * P
    dist.all_gather_object(gathered, dict(_settings_text(settings)), group=group)
    problems = []
    for name in sorted(set().union(*gathered)):
        values = [g.get(name, "(not set)") for g in gathered]
        if len(set(values)) > 1:
            problems.append(f"{name} differs across the {group_name}: {differ(values, shown=values)}")
    return problems


def agree_settings(settings: Settings, group: ProcessGroup, device: torch.device, what: str,
                   group_name: str) -> None:
    """One fixed-size all-gather of (tag, hash of ``settings``) over ``group``; if the hashes
    differ, every rank raises the same ValueError "<what> configuration mismatch", naming each
    setting that differs, its values and the ranks. No-op for a single process. For a collective
    outside the dispatcher (the router's loss counts), before its first call."""
    P, _ = group_size_rank(group, group_name)
    if P == 1:
        return
    rows = read_host(all_gather_rows(to_device([_SETTINGS_TAG, _settings_hash(settings)], device)[None], group)
                     .view(P, -1))
    if any(row[0] != _SETTINGS_TAG for row in rows):
        raise ValueError(f"ranks {[r for r, row in enumerate(rows) if row[0] != _SETTINGS_TAG]} of the {group_name} "
                         f"are not in the {what}'s configuration exchange (ranks calling different collectives?)")
    if len({row[1] for row in rows}) > 1:
        raise ValueError(f"{what} configuration mismatch: " + "; ".join(_settings_problems(settings, group,
                                                                                         group_name)))


def agree_problems(problems: Sequence[str], group: ProcessGroup, device: torch.device, what: str,
                   group_name: str = "group", values: Sequence[int] = ()) -> list[list[int]]:
    """Refusals each rank found locally, raised on every rank alike: one fixed-size all-gather of
    (tag, number of ``problems``, *``values``) over ``group``, before any exchange whose size could
    differ. If a rank found a problem, a second exchange gathers every rank's problems as text and
    every rank raises the same ValueError: the problems themselves when every rank found the same,
    else each one prefixed by the rank that found it ("<what> refused on <group_name> rank 1: ...").
    Returns every rank's ``values`` (rank-major) for the caller to compare; every rank passes as
    many. A single process raises its problems, if any, and returns [values]."""
    P, _ = group_size_rank(group, group_name)
    if P == 1:
        if problems:
            raise ValueError("; ".join(problems))
        return [list(values)]
    rows = read_host(all_gather_rows(to_device([_PROBLEMS_TAG, len(problems), *values], device)[None], group)
                     .view(P, -1))
    if any(row[0] != _PROBLEMS_TAG for row in rows):
        raise ValueError(f"ranks {[r for r, row in enumerate(rows) if row[0] != _PROBLEMS_TAG]} of the {group_name} "
                         f"are not in the {what}'s agreement (ranks calling different collectives?)")
    if any(row[1] for row in rows):
        gathered: list = [None] * P
        dist.all_gather_object(gathered, list(problems), group=group)
        if all(g == gathered[0] for g in gathered):
            raise ValueError("; ".join(gathered[0]))
        bad = [r for r, g in enumerate(gathered) if g]
        ranks = f"rank {bad[0]}" if len(bad) == 1 else f"ranks {bad}"
        raise ValueError(f"{what} refused on {group_name} {ranks} (of {P}; every rank raises this): "
                         + "; ".join(f"{group_name} rank {r}: {p}" for r in bad for p in gathered[r]))
    return [row[2:] for row in rows]


def order_problem(layers: list[int], steps: Optional[list[int]] = None) -> Optional[str]:
    """The message when the ranks are in different calls (None when they agree): every rank's
    layer id (and forward count, if given)."""
    if len(set(layers)) > 1:
        shown = [layer_name(v) if steps is None else str(CallId(v, s)) for v, s in zip(layers, steps or layers)]
        return (f"MoE layers called in a different order across the EP group: this exchange pairs "
                f"{differ(layers, shown=shown)} (every rank must build its MoE layers on an EP group in "
                f"the same order, which numbers them, and call them in the same order)")
    if steps is not None and len(set(steps)) > 1:
        return (f"{layer_name(layers[0])} is at different forwards across the EP group: {differ(steps)} (a rank "
                f"skipped or repeated a forward of this layer)")
    return None


def agree_config(cfg: DispatchConfig, group: ProcessGroup, device: torch.device, settings: Settings = (),
                 layer_id: int = FUNCTIONAL_LAYER) -> None:
    """One fixed-size all-gather of (tag, P, layer id, fingerprint, hash of ``settings``); raises
    the same ValueError on every rank if the layer ids differ (the ranks are in different layers:
    named), else if any field or setting differs, naming it and the ranks. No-op for a single
    process. ``settings``: (name, value) pairs of the layer around the dispatcher (router,
    experts), agreed as well; only when their hashes differ does a second exchange gather them to
    name the one that differs. ``layer_id``: the dispatcher's (``identity``).

    The size exchange's length depends on E and P, and gloo aborts the process (NCCL hangs) when
    ranks gather different lengths: hence this fixed-size exchange first."""
    P, _ = group_size_rank(group)
    if P == 1:
        return
    mine = [_HANDSHAKE_TAG, P, layer_id, *fingerprint(cfg), _settings_hash(settings)]
    rows = read_host(all_gather_rows(to_device(mine, device)[None], group).view(P, -1))
    if any(row[0] != _HANDSHAKE_TAG or row[1] != P for row in rows):
        raise ValueError(f"EP ranks {[r for r, row in enumerate(rows) if row[0] != _HANDSHAKE_TAG]} are not in the "
                         f"dispatcher's configuration exchange (ranks calling different collectives?)")
    order = order_problem([row[2] for row in rows])
    if order:  # explains any field that differs too: the ranks compare different layers
        raise ValueError(order)
    fields = cfg.field_values()
    if any(len({row[3 + i] for row in rows}) > 1 for i in range(len(fields))):
        # every rank sees the same rows, so every rank gathers: the values as each rank wrote them
        # (a fingerprint holds a str as its crc32, which no message should show)
        gathered: list = [None] * P
        dist.all_gather_object(gathered, fields, group=group)
        problems = []
        for i, (name, _) in enumerate(fields):
            values = [dict(g)[name] for g in gathered]
            if len({row[3 + i] for row in rows}) > 1:
                problems.append(f"{name} differs across the EP group: {differ(values)}")
        raise ValueError("dispatcher configuration mismatch: " + "; ".join(problems))
    if len({row[-1] for row in rows}) > 1:
        raise ValueError("layer configuration mismatch: " + "; ".join(_settings_problems(settings, group,
                                                                                       "EP group")))


# ---- the call of a return exchange --------------------------------------------------------------
def check_call(group: ProcessGroup, call: CallId, code: int, device: torch.device) -> None:
    """``strict_call_order``, before a return exchange (``code``: a key of RETURN_CHECKS) of the
    handle of ``call``: one all-gather of every rank's call tag (8 bytes each), read on the host (a
    synchronisation); raises the same ValueError on every rank, naming each rank's call, before any
    row moves. Without it the return exchanges carry the tag in their status rows
    (``latch_call_mismatch``), and rows of another call become NaN."""
    seen = read_host(all_gather_rows(torch.full((1,), call.tag, dtype=torch.int64, device=device), group))
    if len(set(seen)) > 1:
        calls = [str(CallId.from_tag(t)) for t in seen]
        raise ValueError(f"the {RETURN_CHECKS[code]} on the EP group pairs rows of different calls: "
                         f"{differ(seen, shown=calls)} (micro-batches combined or backpropagated in another "
                         f"order on some rank?); no row was exchanged")


def latch_call_mismatch(latch: ErrorLatch, call: CallId, code: int, tags: torch.Tensor) -> torch.Tensor:
    """After a return exchange (``code``: a key of RETURN_CHECKS) of the handle of ``call``: the
    other ranks' call tags it carried (int64 [P - 1] on the device, one per sender) -> a device
    bool (no synchronisation), True when one differs from ``call``: the caller makes the rows it
    received NaN. Every rank receives every other rank's tag, so every rank finds a difference.
    The error is latched on ``latch`` and raised on every rank by the next size exchange on the
    group. If the calls' split sizes differ too, the exchange itself fails first (gloo aborts the
    process; NCCL hangs): only strict mode (``check_call`` first) is safe then (README)."""
    differs = tags != call.tag
    bad = differs.any()
    latch.set(bad.long() * code, call.tag, tags[differs.long().argmax()])
    return bad
