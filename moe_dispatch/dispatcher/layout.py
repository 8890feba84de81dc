"""The size exchange: agreement, validation and the host-side sizes (Layout) of one dispatch.

Every rank describes its inputs (shapes, dtypes, a local error code), its routing counts and a
hash of its configuration in one int64 vector; one all-gather gives every rank every rank's
vector and one host synchronisation reads it. Every rank then runs the same validation on the same
gathered data, so bad input on any rank raises the same ValueError on every rank before any data
collective starts (no hang, no half-finished exchange). All split sizes are host ints from then on.

The vector's length depends on E and P, and gloo aborts the process (NCCL hangs) when ranks
gather different lengths. So before its first step a dispatcher agrees on its configuration in
one fixed-size exchange (``agree_config``: [tag, P, fingerprint, settings hash]); a mismatch raises
on every rank naming the field and the ranks. The settings are those of the layer around the
dispatcher (router, experts), whose differences would not upset the exchange but would make a
token's result depend on its rank. Each step's vector carries the fingerprint's hash again, and a
tag, in case ranks pair up different dispatchers.

Errors found after the exchange (``combine`` given the wrong rows, a reused handle whose routing
differs) cannot raise at once without stranding the other ranks in the next collective. They are
latched (``latch_error``) and travel in the next size exchange on the same group, where every rank
raises them; meanwhile the flagged step's results are NaN (see ``functional``).

Notation: P = EP size, E = num_experts, El = E / P local experts; rank r owns global experts
[r * El, (r + 1) * El).
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..ops.torch_twin import round_up
from .comm import ProcessGroup, all_gather_rows, group_size_rank, read_host, to_device
from .config import DispatchConfig

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.bool: 5,
                torch.int64: 6, torch.int32: 7, torch.int16: 8, torch.int8: 9, torch.uint8: 10}
_CODE_NAMES = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}
_CODE_NAMES.update({0: "unsupported dtype", -1: "non-tensor"})
_HIDDEN_DTYPES = (1, 2, 3)
_PROBS_DTYPES = (1, 2, 3, 4)
_HANDSHAKE_TAG = 0x4D6F4548  # marks the fixed-size configuration message
_STEP_TAG = 0x4D6F4553  # marks a step's size message
_SETTINGS_TAG = 0x4D6F4552  # marks agree_settings' message

# Step message: host fields, then device fields, then counts [E] and sent [P].
# err_*: an error the caller found locally (InputProblem); late_*: a latched error of an earlier step.
_HOST_FIELDS = ("tag", "fingerprint", "err_code", "err_expected", "err_got",
                "hidden_T", "hidden_H", "hidden_dtype", "map_T", "map_E", "map_dtype",
                "probs_T", "probs_E", "probs_dtype", "probs_grad", "one_device")
_DEVICE_FIELDS = ("max_k", "probs_nonfinite", "late_code", "late_expected", "late_got")
_FIELDS = _HOST_FIELDS + _DEVICE_FIELDS
_AT = {name: i for i, name in enumerate(_FIELDS)}


# ---- errors found outside the size exchange ---------------------------------------------------
@dataclass(frozen=True)
class InputProblem:
    """A problem one rank found locally, sent in the size exchange so that every rank raises it.
    code: a key of ``_PROBLEMS``; expected / got: ints the message shows."""

    code: int
    expected: int = 0
    got: int = 0


def _dtype_name(code: int) -> str:
    return _CODE_NAMES.get(code, f"dtype code {code}")


# code -> message(expected, got). Codes < 100 come from the caller (err_*), >= 100 are latched.
_PROBLEMS = {
    1: lambda e, g: "hidden_states must be a tensor",
    2: lambda e, g: f"hidden_states must be [T, H] or [S, B, H] (2 or 3 dims), got {g} dims",
    3: lambda e, g: f"hidden_states must have hidden size {e} (its last dim), got {g}",
    4: lambda e, g: f"hidden_states must be float32, float16 or bfloat16, got {_dtype_name(g)}",
    5: lambda e, g: f"hidden_states must be on the layer's device type ({_DEVICE_NAMES.get(e, e)}), got "
                    f"{_DEVICE_NAMES.get(g, g)}",
    100: lambda e, g: f"expert_output given to the previous combine on this group must have N = {e} rows "
                      f"(sum(tokens_per_expert)) of hidden size H, got {g if g >= 0 else 'no [rows, H] tensor'} "
                      f"(that step's outputs were NaN)",
    102: lambda e, g: f"expert_output given to the previous combine on this group must be {_dtype_name(e)} like "
                      f"the dispatched rows, got {_dtype_name(g)} (that step's outputs were NaN)",
    101: lambda e, g: "routing_map given to dispatch(handle=...) differs from the handle's routing "
                      "(that step's outputs were NaN)",
}
_DEVICE_CODES = {"cpu": 1, "cuda": 2}
_DEVICE_NAMES = {v: k for k, v in _DEVICE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 0)


def device_code(device: torch.device) -> int:
    return _DEVICE_CODES.get(device.type, 99)


_LATCHED: dict = {}  # group -> [3] int64 (code, expected, got), on the device or the host


def _group_key(group: ProcessGroup) -> Any:
    """None and the default group are one group."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def latch_error(group: ProcessGroup, code: torch.Tensor | int, expected: torch.Tensor | int = 0,
                got: torch.Tensor | int = 0, device: Optional[torch.device] = None) -> None:
    """Remember an error (code 0 = none; ints or device scalars) for the next size exchange on
    ``group``, where every rank of the group raises it. No host synchronisation."""
    values = (code, expected, got)
    dev = next((v.device for v in values if isinstance(v, torch.Tensor)), device or torch.device("cpu"))
    # host ints become fills on the device (a fill is a kernel, not a host-to-device copy)
    new = torch.stack([v.to(torch.int64).reshape(()) if isinstance(v, torch.Tensor)
                       else torch.full((), v, dtype=torch.int64, device=dev) for v in values])
    old = _LATCHED.get(_group_key(group))
    if old is not None:  # keep the first error
        new = torch.where(old[0] != 0, old, new.to(old.device))
    _LATCHED[_group_key(group)] = new


def _take_latched(group: ProcessGroup, device: torch.device) -> torch.Tensor:
    late = _LATCHED.pop(_group_key(group), None)
    if late is None:
        return torch.zeros(3, dtype=torch.int64, device=device)
    return late.to(device, non_blocking=True)


# ---- the configuration fingerprint --------------------------------------------------------------
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


def _show(name: str, code: int) -> Any:
    """Invert _encode well enough for an error message."""
    if code == -1:
        return None
    if name in ("capacity_factor", "ep_capacity_factor"):
        return struct.unpack("<d", struct.pack("<q", code))[0]
    if name in ("kind", "router_dtype"):
        return {zlib.crc32(k.encode()): k for k in ("alltoall", "allgather", "fp32", "fp64")}.get(code, code)
    return code


def fingerprint(cfg: DispatchConfig) -> list[int]:
    """The configuration fields every rank must agree on, as ints (DispatchConfig order)."""
    return [_encode(v) for _, v in cfg.field_values()]


def fingerprint_hash(cfg: DispatchConfig) -> int:
    return zlib.crc32(repr(fingerprint(cfg)).encode())


def _differ(values: list, shown: Optional[list[str]] = None) -> str:
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
            problems.append(f"{name} differs across the {group_name}: {_differ(values, shown=values)}")
    return problems


def agree_settings(settings: Settings, group: ProcessGroup, device: torch.device, what: str,
                   group_name: str) -> None:
    """One fixed-size all-gather of (tag, hash of ``settings``) over ``group``; if the hashes
    differ, every rank raises the same ValueError "<what> configuration mismatch", naming each
    setting that differs, its values and the ranks. No-op for a single process. For a collective
    outside the dispatcher (the router's loss counts), before its first call."""
    P, _ = group_size_rank(group)
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


def agree_config(cfg: DispatchConfig, group: ProcessGroup, device: torch.device, settings: Settings = ()) -> None:
    """One fixed-size all-gather of (tag, P, fingerprint, hash of ``settings``); raises the same
    ValueError on every rank if any field or setting differs, naming it and the ranks. No-op for
    a single process. ``settings``: (name, value) pairs of the layer around the dispatcher
    (router, experts), agreed as well; only when their hashes differ does a second exchange
    gather them to name the one that differs."""
    P, _ = group_size_rank(group)
    if P == 1:
        return
    mine = [_HANDSHAKE_TAG, P, *fingerprint(cfg), _settings_hash(settings)]
    rows = read_host(all_gather_rows(to_device(mine, device)[None], group).view(P, -1))
    if any(row[0] != _HANDSHAKE_TAG or row[1] != P for row in rows):
        raise ValueError(f"EP ranks {[r for r, row in enumerate(rows) if row[0] != _HANDSHAKE_TAG]} are not in the "
                         f"dispatcher's configuration exchange (ranks calling different collectives?)")
    problems = []
    for i, (name, _) in enumerate(cfg.field_values()):
        values = [row[2 + i] for row in rows]
        if len(set(values)) > 1:
            problems.append(f"{name} differs across the EP group: {_differ([_show(name, v) for v in values])}")
    if problems:
        raise ValueError("dispatcher configuration mismatch: " + "; ".join(problems))
    if len({row[-1] for row in rows}) > 1:
        raise ValueError("layer configuration mismatch: " + "; ".join(_settings_problems(settings, group,
                                                                                       "EP group")))


# ---- the layout -------------------------------------------------------------------------------
IntTable = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Layout:
    """Host-side sizes of one dispatch, identical on every rank of the EP group. Built once by
    ``Layout.build``; every derived table is a field (nothing is computed or cached later).

    Attributes:
        ep_size, rank, num_experts, num_local_experts: P, this rank, E, El.
        num_tokens: [P], T of every source rank.
        counts: [P][E], routed (token, expert) pairs per (source rank, global expert).
        sent: [P][P], deduplicated tokens per (source, destination rank) of the alltoall dispatch.
        capacity: [P] rows of every (expert, source) block in pad-to-capacity mode; None dropless.
        pad_multiple: dropless mode pads each local expert's block to a multiple of this.
        probs_grad: some rank's probs require grad (decided jointly, so that every rank runs the
            same collectives in the backward).
        max_experts_per_token: [P], the most experts one token of each source is routed to.
        local_blocks: [P][El], rows each source contributes to each local expert (capacity incl.).
        local_tail_pad: [El], pad rows after each local expert's blocks (dropless pad_multiple).
        block_starts: [El][P], first row of each (local expert, source) block in the receiver
            layout (expert-major, source ascending, each expert's tail pad after its blocks).
        tokens_per_local_expert: [El], rows of each local expert's block, padding included.
        owner_blocks: [E], rows per global expert in this rank's returned buffer.
        return_send_splits: [P], rows this rank's experts send back to each source rank.
        return_recv_splits: [P], rows this rank receives back from each expert rank.
    """

    ep_size: int
    rank: int
    num_experts: int
    num_local_experts: int
    num_tokens: tuple[int, ...]
    counts: IntTable
    sent: IntTable
    capacity: Optional[tuple[int, ...]]
    pad_multiple: int
    probs_grad: bool
    max_experts_per_token: tuple[int, ...]
    local_blocks: IntTable
    local_tail_pad: tuple[int, ...]
    block_starts: IntTable
    tokens_per_local_expert: tuple[int, ...]
    owner_blocks: tuple[int, ...]
    return_send_splits: tuple[int, ...]
    return_recv_splits: tuple[int, ...]

    @classmethod
    def build(cls, cfg: DispatchConfig, ep_size: int, rank: int, num_tokens: list[int], counts: list[list[int]],
              sent: list[list[int]], probs_grad: bool, max_experts_per_token: list[int]) -> "Layout":
        P, E = ep_size, cfg.num_experts
        El = E // P
        capacity = tuple(cfg.capacity(t) for t in num_tokens) if cfg.pad_to_capacity else None

        def block(source: int, expert: int) -> int:
            return capacity[source] if capacity is not None else counts[source][expert]

        base = rank * El
        local_blocks = tuple(tuple(block(s, base + e) for e in range(El)) for s in range(P))
        totals = [sum(local_blocks[s][e] for s in range(P)) for e in range(El)]
        m = cfg.pad_multiple
        tail = tuple(0 if capacity is not None else round_up(n, m) - n for n in totals)
        starts, at = [], 0
        for e in range(El):
            starts.append([])
            for s in range(P):
                starts[e].append(at)
                at += local_blocks[s][e]
            at += tail[e]
        return cls(
            ep_size=P, rank=rank, num_experts=E, num_local_experts=El, num_tokens=tuple(num_tokens),
            counts=tuple(map(tuple, counts)), sent=tuple(map(tuple, sent)), capacity=capacity, pad_multiple=m,
            probs_grad=probs_grad, max_experts_per_token=tuple(max_experts_per_token),
            local_blocks=local_blocks, local_tail_pad=tail, block_starts=tuple(map(tuple, starts)),
            tokens_per_local_expert=tuple(n + t for n, t in zip(totals, tail)),
            owner_blocks=tuple(block(rank, e) for e in range(E)),
            return_send_splits=tuple(sum(row) for row in local_blocks),
            return_recv_splits=tuple(sum(block(rank, d * El + e) for e in range(El)) for d in range(P)),
        )


def check_ep_size(num_experts: int, ep_size: int) -> int:
    """Local experts per rank; raises before any collective when E is not divisible by P."""
    if num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {ep_size}: "
                         f"experts are split contiguously, num_experts / ep_size per rank")
    return num_experts // ep_size


# ---- validation ---------------------------------------------------------------------------------
def _describe(hidden: Any, routing_map: Any, probs: Any) -> list[int]:
    def shape2(x: Any, flatten: bool) -> tuple:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or (not flatten and x.dim() != 2):
            return -1, -1
        return math.prod(x.shape[:-1]), x.shape[-1]

    def code(x: Any) -> int:
        return _DTYPE_CODES.get(x.dtype, 0) if isinstance(x, torch.Tensor) else -1

    grad = int(isinstance(probs, torch.Tensor) and probs.requires_grad)
    devices = {x.device for x in (hidden, routing_map, probs) if isinstance(x, torch.Tensor)}
    return [*shape2(hidden, True), code(hidden), *shape2(routing_map, False), code(routing_map),
            *shape2(probs, False), code(probs), grad, int(len(devices) <= 1)]


def _input_problems(f: dict, cfg: DispatchConfig) -> list[str]:
    """Problems with one rank's own description (the same function runs on gathered data)."""
    out = []
    if f["err_code"]:
        out.append(_PROBLEMS[f["err_code"]](f["err_expected"], f["err_got"]))
        return out
    E, H = cfg.num_experts, cfg.hidden_size
    if f["hidden_T"] < 0 or f["hidden_dtype"] not in _HIDDEN_DTYPES or f["hidden_H"] != H:
        return [f"hidden_states must be a float32/float16/bfloat16 tensor [T, {H}] or [S, B, {H}], got "
                f"{_dtype_name(f['hidden_dtype'])} [{f['hidden_T']}, {f['hidden_H']}]"]
    T = f["hidden_T"]
    if f["map_dtype"] != _DTYPE_CODES[torch.bool] or (f["map_T"], f["map_E"]) != (T, E):
        out.append(f"routing_map must be a bool tensor [T, num_experts] = [{T}, {E}], got "
                   f"{_dtype_name(f['map_dtype'])} [{f['map_T']}, {f['map_E']}]")
    if f["probs_dtype"] not in _PROBS_DTYPES or (f["probs_T"], f["probs_E"]) != (T, E):
        out.append(f"probs must be a float tensor [T, num_experts] = [{T}, {E}], got "
                   f"{_dtype_name(f['probs_dtype'])} [{f['probs_T']}, {f['probs_E']}]")
    if not f["one_device"]:
        out.append("hidden_states, routing_map and probs must be on one device")
    return out


def _problems(rows: list[list[int]], cfg: DispatchConfig, fp_hash: int) -> list[str]:
    """Human-readable problems with the gathered vectors (the same list on every rank)."""
    fs = [dict(zip(_FIELDS, row)) for row in rows]
    alien = [r for r, f in enumerate(fs) if f["tag"] != _STEP_TAG or f["fingerprint"] != fp_hash]
    if alien:
        return [f"EP ranks {alien} sent a size exchange of another dispatcher configuration (ranks calling "
                f"different dispatchers or collectives in this slot?)"]
    out = []
    for r, f in enumerate(fs):
        if f["late_code"]:
            out.append(f"{_PROBLEMS[f['late_code']](f['late_expected'], f['late_got'])} on EP rank {r}")
    for r, f in enumerate(fs):
        mine = _input_problems(f, cfg)
        if not mine and f["probs_nonfinite"]:
            mine = ["probs contain NaN or inf (are the router's logits finite?)"]
        out += [f"{p} on EP rank {r}" for p in mine]
    if not out:
        for name, what in (("hidden_dtype", "hidden_states dtype"), ("probs_dtype", "probs dtype")):
            values = [f[name] for f in fs]
            if len(set(values)) > 1:
                out.append(f"{what} differs across the EP group: {_differ([_dtype_name(v) for v in values])}; "
                           f"it must be equal")
    return out


def exchange_sizes(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup,
                   problem: Optional[InputProblem] = None, device: Optional[torch.device] = None) -> Layout:
    """Validate every rank's inputs and exchange the routing counts: one all-gather, one host
    synchronisation. Raises the same ValueError on every rank if any rank's input is bad, if
    ``problem`` is set on any rank, or if an error was latched on any rank (``latch_error``).

    Args:
        hidden: [T, H] or [S, B, H]; routing_map: [T, E] bool; probs: [T, E] float (anything on a
            rank that passes ``problem``: only its description travels).
        problem: an error the caller found locally; this rank then takes part with zero counts.
        device: where the message lives (default: the inputs' device); NCCL needs CUDA.
    """
    P, rank = group_size_rank(group)
    E = cfg.num_experts
    El = check_ep_size(E, P)
    if device is None:
        device = next((x.device for x in (hidden, routing_map, probs) if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))
    err = [problem.code, problem.expected, problem.got] if problem is not None else [0, 0, 0]
    host = [_STEP_TAG, fingerprint_hash(cfg), *err, *_describe(hidden, routing_map, probs)]
    local_ok = not _input_problems(dict(zip(_HOST_FIELDS, host)), cfg)
    late = _take_latched(group, device)
    if local_ok:
        T = host[_AT["hidden_T"]]
        counts = routing_map.sum(0, dtype=torch.int64)
        sent = routing_map.reshape(T, P, El).any(-1).sum(0, dtype=torch.int64)
        if T:  # computed on the device: read back with everything else, no extra sync
            stats = torch.stack([routing_map.sum(1, dtype=torch.int64).max(), (~torch.isfinite(probs)).any().long()])
        else:
            stats = torch.zeros(2, dtype=torch.int64, device=device)
    else:  # still take part in the exchange with zeros, so the other ranks do not hang
        counts = torch.zeros(E, dtype=torch.int64, device=device)
        sent = torch.zeros(P, dtype=torch.int64, device=device)
        stats = torch.zeros(2, dtype=torch.int64, device=device)
    tail = torch.cat([stats.to(device), late, counts.to(device), sent.to(device)])
    if P == 1:  # nothing to exchange: only the device part is read back
        rows = [host + read_host(tail)]
    else:
        message = torch.cat([to_device(host, device), tail])
        rows = read_host(all_gather_rows(message[None], group))  # the one host synchronisation
    problems = _problems(rows, cfg, fingerprint_hash(cfg))
    if problems:
        raise ValueError("invalid MoE dispatch input: " + "; ".join(problems))
    nf = len(_FIELDS)
    counts_all = [row[nf:nf + E] for row in rows]
    layout = Layout.build(cfg, P, rank, num_tokens=[row[_AT["hidden_T"]] for row in rows], counts=counts_all,
                          sent=[row[nf + E:] for row in rows],
                          probs_grad=any(row[_AT["probs_grad"]] for row in rows),
                          max_experts_per_token=[row[_AT["max_k"]] for row in rows])
    if layout.capacity is not None:
        caps = layout.capacity
        over = [(s, e, c) for s, row in enumerate(counts_all) for e, c in enumerate(row) if c > caps[s]]
        if over:
            s, e, c = over[0]
            raise ValueError(f"pad_to_capacity: EP rank {s} routes {c} tokens to expert {e}, more than its "
                             f"capacity {caps[s]} (capacity_factor={cfg.capacity_factor}); the router must "
                             f"drop tokens over capacity first ({len(over)} (rank, expert) blocks over)")
    return layout


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
        return InputProblem(4, 0, _DTYPE_CODES.get(hidden_states.dtype, 0))
    if hidden_states.device.type != device.type:
        return InputProblem(5, device_code(device), device_code(hidden_states.device))
    return None
