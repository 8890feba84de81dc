"""Test data and the row-stable expert stand-in shared by the dispatcher tests.

The stand-in for expert e is y = tanh(x * w_e + b_e), elementwise, with w_e, b_e [H] drawn from a
generator seeded with the global expert id: a row's result never depends on the other rows (with
H = 64 every row starts on a vector boundary, so no row falls in a scalar tail loop).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from moe_dispatch.dispatcher import DispatchConfig

H, E, K = 64, 8, 3
G = 192  # global tokens: 4 chunks of 48


def config(**changes) -> DispatchConfig:
    """The dispatchers' typed config for the test shapes (H, E, K); ``changes`` override fields."""
    base = dict(kind="alltoall", num_experts=E, topk=K, hidden_size=H, router_dtype="fp32", probs_in_experts=False,
                capacity_factor=None, pad_to_capacity=False, pad_multiple=1)
    base.update(changes)
    return DispatchConfig(**base)


def routing(n: int, seed: int, allowed: Optional[Sequence[int]] = None, k: int = K):
    """(routing_map [n, E] bool with k experts per token, probs [n, E] fp32 softmax over them)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand((n, E), generator=g)
    if allowed is not None:
        mask = torch.ones(E, dtype=torch.bool)
        mask[list(allowed)] = False
        scores[:, mask] = -1.0
    idx = scores.topk(k, dim=1).indices
    rmap = torch.zeros((n, E), dtype=torch.bool).scatter_(1, idx, True)
    logits = torch.randn((n, E), generator=g) * 2
    probs = torch.softmax(logits.masked_fill(~rmap, float("-inf")), dim=1)
    return rmap, probs


def batch(dtype: torch.dtype, seed: int = 0, n: int = G, allowed=None, k: int = K) -> dict:
    """x [n, H] in dtype, routing_map [n, E], probs [n, E] fp32, cotangent r [n, H] in dtype."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn((n, H), generator=g).to(dtype)
    r = torch.randn((n, H), generator=g).to(dtype)
    rmap, probs = routing(n, seed, allowed, k)
    return dict(x=x, rmap=rmap, probs=probs, r=r)


def expert_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W, B [E, H]: row e from a generator seeded with e (independent of the EP layout)."""
    ws, bs = [], []
    for e in range(E):
        g = torch.Generator().manual_seed(7919 * (e + 1))
        ws.append(1 + 0.5 * torch.randn(H, generator=g))
        bs.append(0.1 * torch.randn(H, generator=g))
    return torch.stack(ws).to(dtype), torch.stack(bs).to(dtype)


def run_experts(rows: torch.Tensor, tokens_per_expert: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                row_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Local experts on their blocks of rows [N, H]; w, b [El, H]. With row_probs [N] (Megatron
    mode) each row is scaled by its prob in the probs dtype, then rounded to the rows' dtype."""
    outs, start = [], 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        outs.append(torch.tanh(rows[start:start + n] * w[e] + b[e]))
        start += n
    y = torch.cat(outs) if outs else rows[:0]
    if row_probs is not None:
        y = (y.to(row_probs.dtype) * row_probs[:, None]).to(rows.dtype)
    return y
