"""The size exchange: validation and the host-side sizes (Layout) of one dispatch.

Every rank describes its inputs (shapes, dtypes, a local error code), its routing counts and a
hash of its configuration in one int64 vector; one all-gather gives every rank every rank's
vector and one host synchronisation reads it. Every rank then runs the same validation on the same
gathered data, so bad input on any rank raises the same ValueError on every rank before any data
collective starts (no hang, no half-finished exchange). All split sizes are host ints from then on.
The vector also carries an error latched by an earlier step (``agreement.ErrorLatch``), the
configuration's fingerprint hash with a tag, in case ranks pair up different dispatchers, and the
call's identity (layer id, forward count: ``identity.CallId``), in case ranks pair up different
layers or calls. And whether each rank's hidden states, probs and experts need gradients, so that
every rank runs the backward's collectives when any rank needs them (``Layout.dispatch_backward``
/ ``combine_backward``).

Notation: P = EP size, E = num_experts, El = E / P local experts; rank r owns global experts
[r * El, (r + 1) * El).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...config import DispatchConfig
from ...distributed.agreement import (
    ErrorLatch,
    InputProblem,
    differ,
    dtype_code,
    dtype_name,
    fingerprint_hash,
    order_problem,
    problem_message,
)
from ...distributed.comm import ProcessGroup, all_gather_rows, group_size_rank, read_host, to_device
from ...distributed.identity import CallId
from ...numerics.rounding import round_up

_HIDDEN_DTYPES = tuple(dtype_code(d) for d in (torch.float32, torch.float16, torch.bfloat16))
_PROBS_DTYPES = (*_HIDDEN_DTYPES, dtype_code(torch.float64))
_STEP_TAG = 0x4D6F4553  # marks a step's size message

# Step message: host fields, then device fields, then counts [E] and sent [P].
# err_*: an error the caller found locally (InputProblem); late_*: a latched error of an earlier step.
# layer_id, step: the call (identity.CallId); grad_mode: torch.is_grad_enabled(); *_grad: this
# rank's hidden states / probs require grad, its experts have trainable weights (all under grad_mode).
_HOST_FIELDS = ("tag", "fingerprint", "layer_id", "step", "err_code", "err_expected", "err_got",
                "hidden_T", "hidden_H", "hidden_dtype", "map_T", "map_E", "map_dtype",
                "probs_T", "probs_E", "probs_dtype", "probs_grad", "one_device",
                "grad_mode", "hidden_grad", "experts_grad")
_DESCRIBED_FIELDS = _HOST_FIELDS[_HOST_FIELDS.index("hidden_T"):]  # what _describe returns, in order
_DEVICE_FIELDS = ("max_k", "probs_nonfinite", "late_code", "late_expected", "late_got")
_FIELDS = _HOST_FIELDS + _DEVICE_FIELDS
_AT = {name: i for i, name in enumerate(_FIELDS)}


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
        call: the call's identity (layer, forward count), the same on every rank.
        probs_grad: some rank's probs require grad (decided jointly, so that every rank runs the
            same collectives in the backward).
        dispatch_backward: some rank's hidden states (or probs, with probs_in_experts) need
            gradients: every rank's dispatch output then requires grad, so that every rank's
            backward runs the dispatch's backward exchange.
        combine_backward: dispatch_backward, or some rank's experts have trainable weights:
            every rank's combine output requires grad (its backward exchange runs everywhere).
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
    call: CallId
    probs_grad: bool
    dispatch_backward: bool
    combine_backward: bool
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
              sent: list[list[int]], probs_grad: bool, max_experts_per_token: list[int], *, call: CallId,
              dispatch_backward: bool, combine_backward: bool) -> "Layout":
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
            call=call, probs_grad=probs_grad, dispatch_backward=dispatch_backward, combine_backward=combine_backward,
            max_experts_per_token=tuple(max_experts_per_token),
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
def _describe(hidden: Any, routing_map: Any, probs: Any, experts_grad: bool) -> list[int]:
    def shape2(x: Any, flatten: bool) -> tuple:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or (not flatten and x.dim() != 2):
            return -1, -1
        return math.prod(x.shape[:-1]), x.shape[-1]

    def code(x: Any) -> int:
        return dtype_code(x.dtype) if isinstance(x, torch.Tensor) else -1

    mode = torch.is_grad_enabled()  # without it no graph is built: nothing needs a gradient

    def grad(x: Any) -> int:
        return int(mode and isinstance(x, torch.Tensor) and x.requires_grad)

    devices = {x.device for x in (hidden, routing_map, probs) if isinstance(x, torch.Tensor)}
    return [*shape2(hidden, True), code(hidden), *shape2(routing_map, False), code(routing_map),
            *shape2(probs, False), code(probs), grad(probs), int(len(devices) <= 1),
            int(mode), grad(hidden), int(mode and experts_grad)]


def _input_problems(f: dict, cfg: DispatchConfig) -> list[str]:
    """Problems with one rank's own description (the same function runs on gathered data)."""
    out = []
    if f["err_code"]:
        out.append(problem_message(f["err_code"], f["err_expected"], f["err_got"]))
        return out
    E, H = cfg.num_experts, cfg.hidden_size
    if f["hidden_T"] < 0 or f["hidden_dtype"] not in _HIDDEN_DTYPES or f["hidden_H"] != H:
        return [f"hidden_states must be a float32/float16/bfloat16 tensor [T, {H}] or [S, B, {H}], got "
                f"{dtype_name(f['hidden_dtype'])} [{f['hidden_T']}, {f['hidden_H']}]"]
    T = f["hidden_T"]
    if f["map_dtype"] != dtype_code(torch.bool) or (f["map_T"], f["map_E"]) != (T, E):
        out.append(f"routing_map must be a bool tensor [T, num_experts] = [{T}, {E}], got "
                   f"{dtype_name(f['map_dtype'])} [{f['map_T']}, {f['map_E']}]")
    if f["probs_dtype"] not in _PROBS_DTYPES or (f["probs_T"], f["probs_E"]) != (T, E):
        out.append(f"probs must be a float tensor [T, num_experts] = [{T}, {E}], got "
                   f"{dtype_name(f['probs_dtype'])} [{f['probs_T']}, {f['probs_E']}]")
    if not f["one_device"]:
        out.append("hidden_states, routing_map and probs must be on one device")
    return out


def own_input_problems(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig) -> list[str]:
    """Problems with this rank's own hidden_states, routing_map and probs, found on the host alone
    (no collective): the checks the size exchange runs on every rank's description."""
    described = _describe(hidden, routing_map, probs, experts_grad=True)
    return _input_problems({"err_code": 0, **dict(zip(_DESCRIBED_FIELDS, described))}, cfg)


def _on_ranks(found: list[tuple[str, int]]) -> list[str]:
    """(problem, rank) pairs -> "problem on EP rank r" / "on EP ranks r, s" (one line per text,
    naming every rank that has it), in order of first appearance."""
    ranks: dict[str, list[int]] = {}
    for text, r in found:
        ranks.setdefault(text, []).append(r)
    return [f"{text} on EP rank {rs[0]}" if len(rs) == 1 else f"{text} on EP ranks {', '.join(map(str, rs))}"
            for text, rs in ranks.items()]


def _problems(rows: list[list[int]], cfg: DispatchConfig, fp_hash: int) -> list[str]:
    """Human-readable problems with the gathered vectors (the same list on every rank)."""
    fs = [dict(zip(_FIELDS, row)) for row in rows]
    alien = [r for r, f in enumerate(fs) if f["tag"] != _STEP_TAG or f["fingerprint"] != fp_hash]
    if alien:
        return [f"EP ranks {alien} sent a size exchange of another dispatcher configuration (ranks calling "
                f"different dispatchers or collectives in this slot?)"]
    out = _on_ranks([(problem_message(f["late_code"], f["late_expected"], f["late_got"]), r)
                     for r, f in enumerate(fs) if f["late_code"]])
    order = order_problem([f["layer_id"] for f in fs], [f["step"] for f in fs])
    if order:  # the ranks are in different calls: their inputs are not comparable
        return [order] + out
    modes = [f["grad_mode"] for f in fs]
    if len(set(modes)) > 1:
        out.append(f"torch.is_grad_enabled() differs across the EP group: {differ([bool(m) for m in modes])} (every "
                   f"rank must run the layer in the same grad mode: a rank under no_grad would skip the backward "
                   f"exchanges the others wait in)")
    found = []
    for r, f in enumerate(fs):
        mine = _input_problems(f, cfg)
        if not mine and f["probs_nonfinite"]:
            mine = ["probs contain NaN or inf (are the router's logits finite?)"]
        found += [(p, r) for p in mine]
    out += _on_ranks(found)
    if not out:
        for name, what in (("hidden_dtype", "hidden_states dtype"), ("probs_dtype", "probs dtype")):
            values = [f[name] for f in fs]
            if len(set(values)) > 1:
                out.append(f"{what} differs across the EP group: {differ([dtype_name(v) for v in values])}; "
                           f"it must be equal")
    return out


def exchange_sizes(hidden: Any, routing_map: Any, probs: Any, cfg: DispatchConfig, group: ProcessGroup,
                   latch: ErrorLatch, problem: Optional[InputProblem] = None,
                   device: Optional[torch.device] = None, *, call: CallId,
                   experts_grad: Optional[bool] = None) -> Layout:
    """Validate every rank's inputs and exchange the routing counts: one all-gather, one host
    synchronisation. Raises the same ValueError on every rank if any rank's input is bad, if
    ``problem`` is set on any rank, or if an error was latched on any rank's ``latch`` (the
    group's; taken, so it raises once).

    Args:
        hidden: [T, H] or [S, B, H]; routing_map: [T, E] bool; probs: [T, E] float (anything on a
            rank that passes ``problem``: only its description travels).
        problem: an error the caller found locally; this rank then takes part with zero counts.
        device: where the message lives (default: the inputs' device); NCCL needs CUDA.
        call: this call's identity (every rank must send the same; see ``identity``).
        experts_grad: whether this rank's experts have trainable weights (None: unknown, taken
            as True under grad mode, so that the combine's backward exchange runs everywhere).
    """
    P, rank = group_size_rank(group)
    E = cfg.num_experts
    El = check_ep_size(E, P)
    if device is None:
        device = next((x.device for x in (hidden, routing_map, probs) if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))
    err = [problem.code, problem.expected, problem.got] if problem is not None else [0, 0, 0]
    experts_grad = True if experts_grad is None else experts_grad
    host = [_STEP_TAG, fingerprint_hash(cfg), call.layer, call.step, *err,
            *_describe(hidden, routing_map, probs, experts_grad)]
    local_ok = not _input_problems(dict(zip(_HOST_FIELDS, host)), cfg)
    late = latch.take(device)
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
    probs_backward = cfg.probs_in_experts and any(row[_AT["probs_grad"]] for row in rows)
    dispatch_backward = probs_backward or any(row[_AT["hidden_grad"]] for row in rows)
    counts_all = [row[nf:nf + E] for row in rows]
    layout = Layout.build(cfg, P, rank, num_tokens=[row[_AT["hidden_T"]] for row in rows], counts=counts_all,
                          sent=[row[nf + E:] for row in rows],
                          probs_grad=any(row[_AT["probs_grad"]] for row in rows),
                          max_experts_per_token=[row[_AT["max_k"]] for row in rows], call=call,
                          dispatch_backward=dispatch_backward,
                          combine_backward=dispatch_backward or any(row[_AT["experts_grad"]] for row in rows))
    if layout.capacity is not None:
        caps = layout.capacity
        over = [(s, e, c) for s, row in enumerate(counts_all) for e, c in enumerate(row) if c > caps[s]]
        if over:
            s, e, c = over[0]
            raise ValueError(f"pad_to_capacity: EP rank {s} routes {c} tokens to expert {e}, more than its "
                             f"capacity {caps[s]} (capacity_factor={cfg.capacity_factor}); the router must "
                             f"drop tokens over capacity first ({len(over)} (rank, expert) blocks over)")
    return layout
