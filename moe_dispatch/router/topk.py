"""Top-k expert selection with a defined tie-break, as pure functions of the logits.

Every operation here is row-local, so a token's probs and map depend on its own logits only.
Ties are broken towards the lower index (expert or group) on every device: selection uses a
stable descending sort, because ``torch.topk`` leaves the order of equal values unspecified (it
differs between CPU and CUDA). Small per-row sums are written as left-to-right additions so their
rounding cannot depend on a reduction kernel's launch configuration (which can vary with the
row count).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for score arithmetic: half types are computed in fp32 (as Megatron does)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, strictly left to right: [..., n] -> [..., 1]."""
    acc = x[..., 0:1]
    for j in range(1, x.shape[-1]):
        acc = acc + x[..., j : j + 1]
    return acc


def stable_topk_indices(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, largest first, ties to the lower index.

    Args:
        key: [..., n] finite values (not differentiated).
        k: how many to keep.
    Returns:
        [..., k] int64 indices.
    """
    # A stable descending sort keeps equal values in index order (its cost: BENCHMARKS.md "Router").
    # "+ 0.0" maps -0.0 to +0.0: a radix sort (CUDA) orders them, a comparison sort (CPU) not.
    return torch.sort(key.detach() + 0.0, dim=-1, descending=True, stable=True).indices[..., :k]


def group_limited_topk_indices(key: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """DeepSeek-V3 group-limited selection.

    Experts are split into ``num_groups`` equal groups; each group is scored by the sum of its best
    ``topk // group_topk`` keys; the best ``group_topk`` groups are kept and the ``topk`` experts
    are chosen among their experts. Ties go to the lower group index, then the lower expert index.

    Args:
        key: [T, E] selection keys.
    Returns:
        [T, topk] expert indices, best first.
    """
    t, e = key.shape
    key = key.detach()
    grouped = key.reshape(t, num_groups, e // num_groups)
    # topk values are the same whichever of equal entries it picks: no tie-break needed here.
    best = torch.topk(grouped, topk // group_topk, dim=-1).values
    group_scores = row_sum(best).squeeze(-1)  # [T, G]
    groups = stable_topk_indices(group_scores, group_topk)
    keep = torch.zeros(t, num_groups, dtype=torch.bool, device=key.device).scatter(1, groups, True)
    keep = keep.repeat_interleave(e // num_groups, dim=1)
    return stable_topk_indices(key.masked_fill(~keep, float("-inf")), topk)


def _select(key: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]) -> torch.Tensor:
    if group_topk:
        return group_limited_topk_indices(key, topk, num_groups, group_topk)
    return stable_topk_indices(key, topk)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routing probs and map from router logits, with Megatron-core's semantics.

    * softmax, post (default): choose the top-k logits, softmax over those k.
    * softmax, ``pre_softmax``: softmax over all E, keep the top-k scores as they are.
    * sigmoid: choose on ``sigmoid(logits) + expert_bias`` (bias for selection only), then
      normalise the chosen sigmoid scores to sum to 1 when ``topk > 1``.
    * ``scaling_factor`` multiplies the final probs.

    Scores are rounded to the logits dtype before selection (so bf16 routing chooses exactly what
    Megatron chooses); arithmetic on half types runs in fp32.

    Args:
        logits: [T, E] in the router dtype.
        expert_bias: [E] fp32 or None; used by the sigmoid score function only.
    Returns:
        probs [T, E] in the logits dtype, zero outside the map; routing_map [T, E] bool.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if score_function not in ("softmax", "sigmoid"):
        raise ValueError(f"score_function={score_function!r} is not one of ('softmax', 'sigmoid')")
    dtype = logits.dtype
    cdt = compute_dtype(dtype)
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits.to(cdt), dim=-1).to(dtype)
            idx = _select(scores, topk, num_groups, group_topk)
            probs = scores.gather(1, idx).to(cdt)
        else:
            idx = _select(logits, topk, num_groups, group_topk)
            probs = torch.softmax(logits.gather(1, idx).to(cdt), dim=-1)
    else:
        scores = torch.sigmoid(logits.to(cdt)).to(dtype)
        key = scores if expert_bias is None else scores + expert_bias
        idx = _select(key, topk, num_groups, group_topk)
        probs = scores.gather(1, idx).to(cdt)
        if topk > 1:
            probs = probs / (row_sum(probs) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(dtype)
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(1, idx, True)
    return routing_probs, routing_map
