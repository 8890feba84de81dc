"""The sizes of one sync-free step (``SyncFreeSizes``), from the config and T alone: what the plan
(plan.py), its exchanges (exchange.py) and its check words (words.py) share."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ...config import DispatchConfig


@dataclass(frozen=True)
class SyncFreeSizes:
    """The sizes of one sync-free step, host ints from the config and T alone (equal on every
    rank). Field names shared with ``layout.Layout`` mean the same.

    Attributes:
        num_tokens: [P], the plan's T on every rank (a rank with fewer tokens pads: see prepare).
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
    def build(cls, cfg: DispatchConfig, ep_size: int, rank: int, num_tokens: int) -> "SyncFreeSizes":
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
                   num_tokens=(T,) * P, factor=None if f is None else float(f),  # the same text on every rank
                   send_capacity=send, recv_rows=recv, return_capacity=ret, probs_grad=cfg.probs_in_experts)

    @property
    def T(self) -> int:
        return self.num_tokens[0]
