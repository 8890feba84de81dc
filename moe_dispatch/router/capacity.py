"""Expert capacity: token dropping and padding.

Capacity-based dropping depends on the whole batch by definition (which tokens an expert keeps
depends on the others that chose it), so it is OUTSIDE the package's batch-invariance guarantee.
It is still deterministic: ties are broken towards the lower token index on every device.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Rows each expert may take: ceil(T * K / E * capacity_factor), as in Megatron-core."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def apply_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Drop the (token, expert) pairs beyond each expert's capacity; optionally pad to it.

    Each expert ranks its tokens: routed tokens first, ordered by prob (policy 'probs', highest
    first) or by position ('position', earliest first); then unrouted tokens by position. It keeps
    the first ``capacity`` of them. Without padding, only routed tokens survive; with
    ``pad_to_capacity`` every expert gets exactly ``min(capacity, T)`` rows, the padding rows
    having prob 0.

    Args:
        probs: [T, E] routing probs, zero outside the map, non-negative.
        routing_map: [T, E] bool.
    Returns:
        (probs [T, E] same dtype, routing_map [T, E] bool) after dropping/padding.
    """
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy={drop_policy!r} is not one of ('probs', 'position')")
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            # -1 ranks every unrouted token below every routed one, even a routed prob of 0.
            key = torch.where(routing_map, probs.detach(), probs.new_tensor(-1.0))
        else:
            key = routing_map.to(torch.int8)
        # Sort each expert's column (as a row of the transpose): stable, so ties go to lower t.
        order = torch.sort(key.t(), dim=-1, descending=True, stable=True).indices[:, :capacity]
        keep = torch.zeros_like(routing_map.t()).scatter(1, order, True).t()
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map
