"""Input validation and the one per-step size exchange of the dispatchers.

Every rank describes its inputs (shapes, dtypes) and its routing counts in one fixed-size int64
vector; one all-gather gives every rank every rank's vector and one host synchronisation reads it.
From then on all split sizes are host integers, and every rank runs the same validation on the
same gathered data, so bad input on any rank raises the same ValueError on every rank before any
data collective starts (no hang, no half-finished exchange).

Notation: P = EP size, E = num_experts, El = E / P local experts; rank r owns global experts
[r * El, (r + 1) * El).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..ops.torch_twin import round_up
from .comm import ProcessGroup, all_gather_rows, group_size_rank

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.bool: 5,
                torch.int64: 6, torch.int32: 7, torch.int16: 8, torch.int8: 9, torch.uint8: 10}
_CODE_NAMES = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}
_CODE_NAMES.update({0: "unsupported dtype", -1: "non-tensor"})
_HIDDEN_DTYPES = (1, 2, 3)
_PROBS_DTYPES = (1, 2, 3, 4)
# Descriptor fields; shapes -1 = not a tensor or wrong number of dimensions; dtype -1 = not a
# tensor, 0 = a dtype without a code.
_FIELDS = ("hidden_T", "hidden_H", "hidden_dtype", "map_T", "map_E", "map_dtype",
           "probs_T", "probs_E", "probs_dtype", "probs_grad", "one_device", "max_k", "probs_nonfinite")


def check_ep_size(num_experts: int, ep_size: int) -> int:
    """Local experts per rank; raises before any collective when E is not divisible by P."""
    if num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {ep_size}: "
                         f"experts are split contiguously, num_experts / ep_size per rank")
    return num_experts // ep_size


def wire_probs_dtype(config: Any, probs_dtype: torch.dtype) -> torch.dtype:
    """Probabilities travel and are applied in fp32, or fp64 when the router works in fp64.
    bf16/fp16 probs are upcast (exactly) to fp32; they are never sent in 16 bits."""
    if getattr(config, "router_dtype", None) == "fp64" or probs_dtype == torch.float64:
        return torch.float64
    return torch.float32


def capacity_of(num_tokens: int, config: Any) -> int:
    """Megatron's expert capacity ceil(T * topk / E * capacity_factor), rounded up to pad_multiple."""
    cap = math.ceil(num_tokens * config.topk / config.num_experts * config.capacity_factor)
    m = getattr(config, "pad_multiple", 1)
    return round_up(cap, m)


def _memo(method: Callable) -> Callable:
    """Cache a Layout method's result: a step asks for the same derived sizes many times."""
    @functools.wraps(method)
    def cached(self: "Layout"):
        return self.memo(method.__name__, lambda: method(self))
    return cached


@dataclass(frozen=True)
class Layout:
    """Host-side sizes of one dispatch, identical on every rank of the EP group.

    Attributes:
        ep_size, rank, num_experts, num_local_experts: P, this rank, E, El.
        num_tokens: T of every source rank, [P].
        counts: routed (token, expert) pairs per (source rank, global expert), [P][E].
        sent: deduplicated tokens per (source, destination rank) of the alltoall dispatch, [P][P].
        capacity: per source rank, in pad-to-capacity mode (each (expert, source) block then has
            exactly that many rows); None when dropless.
        pad_multiple: dropless mode pads each local expert's block to a multiple of this.
        probs_grad: some rank's probs require grad (decided jointly so that every rank runs the
            same collectives in the backward).
        max_experts_per_token: per source rank, the most experts one of its tokens is routed to.
    """

    ep_size: int
    rank: int
    num_experts: int
    num_local_experts: int
    num_tokens: list[int]
    counts: list[list[int]]
    sent: list[list[int]]
    capacity: Optional[list[int]]
    pad_multiple: int
    probs_grad: bool
    max_experts_per_token: list[int]
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """compute() once per layout under ``key`` (derived host-side tables)."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def block(self, source: int, expert: int) -> int:
        """Rows of global `expert` coming from `source` rank (with capacity padding)."""
        return self.capacity[source] if self.capacity is not None else self.counts[source][expert]

    @_memo
    def local_blocks(self) -> list[list[int]]:
        """[P][El]: rows each source rank contributes to each local expert of this rank."""
        base = self.rank * self.num_local_experts
        return [[self.block(s, base + e) for e in range(self.num_local_experts)] for s in range(self.ep_size)]

    @_memo
    def local_tail_pad(self) -> list[int]:
        """[El]: pad rows at the end of each local expert's block (dropless pad_multiple)."""
        if self.capacity is not None:
            return [0] * self.num_local_experts  # capacities are already multiples of pad_multiple
        m = self.pad_multiple
        totals = [sum(col) for col in zip(*self.local_blocks())]
        return [round_up(n, m) - n for n in totals]

    @_memo
    def tokens_per_local_expert(self) -> list[int]:
        """[El]: rows of each local expert's block, padding included."""
        blocks, tail = self.local_blocks(), self.local_tail_pad()
        return [sum(blocks[s][e] for s in range(self.ep_size)) + tail[e] for e in range(self.num_local_experts)]

    @_memo
    def return_send_splits(self) -> list[int]:
        """[P]: rows this rank's experts send back to each source rank."""
        return [sum(row) for row in self.local_blocks()]

    @_memo
    def return_recv_splits(self) -> list[int]:
        """[P]: rows this rank receives back from each expert rank for its own tokens."""
        El = self.num_local_experts
        return [sum(self.block(self.rank, d * El + e) for e in range(El)) for d in range(self.ep_size)]

    @_memo
    def owner_blocks(self) -> list[int]:
        """[E]: rows per global expert in this rank's returned buffer (global expert-major)."""
        return [self.block(self.rank, e) for e in range(self.num_experts)]


def _describe(hidden: Any, routing_map: Any, probs: Any) -> list[int]:
    def shape2(x: Any, flatten: bool) -> tuple:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or (not flatten and x.dim() != 2):
            return -1, -1
        return math.prod(x.shape[:-1]), x.shape[-1]

    def code(x: Any) -> int:
        return _DTYPE_CODES.get(x.dtype, 0) if isinstance(x, torch.Tensor) else -1

    grad = int(isinstance(probs, torch.Tensor) and probs.requires_grad)
    devices = {x.device for x in (hidden, routing_map, probs) if isinstance(x, torch.Tensor)}
    # max_k and probs_nonfinite are filled in on the device once the input is known to be valid
    return [*shape2(hidden, True), code(hidden), *shape2(routing_map, False), code(routing_map),
            *shape2(probs, False), code(probs), grad, int(len(devices) <= 1), 0, 0]


def _problems(desc: list[list[int]], config: Any) -> list[str]:
    """Human-readable problems with the gathered descriptors (same list on every rank)."""
    E = config.num_experts
    out = []
    for r, d in enumerate(desc):
        f = dict(zip(_FIELDS, d))
        where = f"on EP rank {r}"
        if f["hidden_T"] < 0 or f["hidden_dtype"] not in _HIDDEN_DTYPES:
            out.append(f"hidden_states must be a float32/float16/bfloat16 tensor [T, H] or [S, B, H] {where}, "
                       f"got {_CODE_NAMES[f['hidden_dtype']]} [{f['hidden_T']}, {f['hidden_H']}]")
            continue
        T = f["hidden_T"]
        if f["map_dtype"] != _DTYPE_CODES[torch.bool] or (f["map_T"], f["map_E"]) != (T, E):
            out.append(f"routing_map must be a bool tensor [T, num_experts] = [{T}, {E}] {where}, got "
                       f"{_CODE_NAMES[f['map_dtype']]} [{f['map_T']}, {f['map_E']}]")
        if f["probs_dtype"] not in _PROBS_DTYPES or (f["probs_T"], f["probs_E"]) != (T, E):
            out.append(f"probs must be a float tensor [T, num_experts] = [{T}, {E}] {where}, got "
                       f"{_CODE_NAMES[f['probs_dtype']]} [{f['probs_T']}, {f['probs_E']}]")
        if not f["one_device"]:
            out.append(f"hidden_states, routing_map and probs must be on one device {where}")
        if f["probs_nonfinite"]:
            out.append(f"probs contain NaN or inf {where} (are the router's logits finite?)")
    if not out:
        for field, what in (("hidden_H", "hidden size H"), ("hidden_dtype", "hidden_states dtype"),
                            ("probs_dtype", "probs dtype")):
            values = [dict(zip(_FIELDS, d))[field] for d in desc]
            if len(set(values)) > 1:
                shown = values if field == "hidden_H" else [_CODE_NAMES[v] for v in values]
                out.append(f"{what} differs across the EP group (by rank: {shown}); it must be equal")
    return out


def exchange_layout(hidden: Any, routing_map: Any, probs: Any, config: Any, group: ProcessGroup) -> Layout:
    """Validate the inputs of every rank and exchange the routing counts (one all-gather, one
    host synchronisation). Raises the same ValueError on every rank if any rank's input is bad.

    Args:
        hidden: [T, H] or [S, B, H]; routing_map: [T, E] bool; probs: [T, E] float.
    """
    P, rank = group_size_rank(group)
    El = check_ep_size(config.num_experts, P)
    E = config.num_experts
    desc = _describe(hidden, routing_map, probs)
    local_ok = not _problems([desc], config)
    device = next((x.device for x in (hidden, routing_map, probs) if isinstance(x, torch.Tensor)),
                  torch.device("cpu"))
    # non_blocking: no wait for the GPU's queued work (a plain copy to CUDA synchronises)
    desc_t = torch.tensor(desc, dtype=torch.int64).to(device, non_blocking=True)
    if local_ok:
        T = desc[0]
        counts = routing_map.sum(0, dtype=torch.int64)
        sent = routing_map.reshape(T, P, El).any(-1).sum(0, dtype=torch.int64)
        if T:  # computed on the device: read back with everything else, no extra sync
            desc_t[_FIELDS.index("max_k")] = routing_map.sum(1, dtype=torch.int64).max()
            # NaN/inf probs become a clear error on every rank at no extra synchronisation.
            desc_t[_FIELDS.index("probs_nonfinite")] = (~torch.isfinite(probs)).any()
    else:  # still take part in the exchange with zeros, so the other ranks do not hang
        counts = torch.zeros(E, dtype=torch.int64, device=device)
        sent = torch.zeros(P, dtype=torch.int64, device=device)
    message = torch.cat([desc_t, counts.to(device), sent.to(device)])
    rows = all_gather_rows(message[None], group).tolist()  # the one host synchronisation
    nd = len(_FIELDS)
    descs = [row[:nd] for row in rows]
    problems = _problems(descs, config)
    if problems:
        raise ValueError("invalid MoE dispatch input: " + "; ".join(problems))
    counts_all = [row[nd:nd + E] for row in rows]
    layout = Layout(
        ep_size=P, rank=rank, num_experts=E, num_local_experts=El,
        num_tokens=[d[0] for d in descs], counts=counts_all, sent=[row[nd + E:] for row in rows],
        capacity=None, pad_multiple=getattr(config, "pad_multiple", 1) or 1,
        probs_grad=any(d[_FIELDS.index("probs_grad")] for d in descs),
        max_experts_per_token=[d[_FIELDS.index("max_k")] for d in descs],
    )
    if getattr(config, "pad_to_capacity", False):
        caps = [capacity_of(t, config) for t in layout.num_tokens]
        over = [(s, e, c) for s, row in enumerate(counts_all) for e, c in enumerate(row) if c > caps[s]]
        if over:
            s, e, c = over[0]
            raise ValueError(f"pad_to_capacity: EP rank {s} routes {c} tokens to expert {e}, more than its "
                             f"capacity {caps[s]} (capacity_factor={config.capacity_factor}); the router must "
                             f"drop tokens over capacity first ({len(over)} (rank, expert) blocks over)")
        layout = dataclasses.replace(layout, capacity=caps)
    return layout
