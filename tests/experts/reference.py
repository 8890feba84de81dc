"""Float64 per-expert reference for the expert MLPs, and small builders shared by the tests."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from moe_dispatch.config import MoEConfig


def make_config(activation: str = "swiglu", dtype: torch.dtype = torch.float32, probs_in_experts: bool = False,
                hidden: int = 64, ffn: int = 96, num_experts: int = 4, seed: int = 1234) -> MoEConfig:
    return MoEConfig(hidden_size=hidden, num_experts=num_experts, topk=2, ffn_hidden_size=ffn,
                     activation=activation, params_dtype=dtype, probs_in_experts=probs_in_experts,
                     init_seed=seed)


def reference_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: List[int], activation: str,
                      probs: Optional[torch.Tensor]) -> torch.Tensor:
    """All float64, one expert at a time: act(x_e @ w1[e]) (* p) @ w2[e]."""
    outs = []
    probs_parts = torch.split(probs, counts) if probs is not None else [None] * len(counts)
    for e, (xe, pe) in enumerate(zip(torch.split(x, counts), probs_parts)):
        h = xe @ w1[e]
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(h) if activation == "gelu" else F.relu(h)
        if pe is not None:
            a = a * pe.unsqueeze(-1)
        outs.append(a @ w2[e])
    return torch.cat(outs)


def routed_batch(counts: List[int], hidden: int, dtype: torch.dtype, seed: int = 0):
    """Random expert-major tokens [N, H], tokens_per_expert and probs [N] (float32) for `counts`."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    probs = torch.rand(n, generator=g) * 0.9 + 0.1
    return x, torch.tensor(counts, dtype=torch.int64), probs
