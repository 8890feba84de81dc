"""Load-balancing and z losses, and the autograd trick that attaches them to activations.

The losses are batch statistics: they are not part of the per-token invariance guarantee (they
do not change any forward value; they only add gradient).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..numerics.autograd import refuse_double_backward
from .topk import compute_dtype, stable_topk_indices


class AuxLossScaler(torch.autograd.Function):
    """Return ``activation`` unchanged; on backward, also send ``loss_scale`` into ``loss``.

    This is how a loss that is not part of the model output still gets its gradient: the
    backward of the activation seeds d(loss) = loss_scale, exactly like Megatron-core's
    MoEAuxLossAutoScaler. Set ``loss_scale`` to the main loss's scale (e.g. 1 / num_microbatches
    or the fp16 loss scale) with `set_loss_scale`.
    """

    loss_scale: Union[float, torch.Tensor] = 1.0

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        refuse_double_backward("AuxLossScaler")
        (loss,) = ctx.saved_tensors
        scale = AuxLossScaler.loss_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(device=loss.device, dtype=loss.dtype)
        return grad, torch.ones_like(loss) * scale

    @staticmethod
    def set_loss_scale(scale: Union[float, torch.Tensor]) -> None:
        """Scale of every attached loss's gradient from now on (shared by all routers)."""
        AuxLossScaler.loss_scale = scale


def attach_loss(activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``activation`` unchanged, with ``loss`` backpropagated whenever it is (see AuxLossScaler)."""
    return AuxLossScaler.apply(activation, loss)


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scores and top-k map that the aux losses use, over ALL experts (no groups, bias, capacity).

    softmax: softmax over E; sigmoid: sigmoid normalised to sum 1 over E. As in Megatron-core.

    Args:
        logits: [T, E].
    Returns:
        (routing_map [T, E] bool, scores [T, E] in fp32 for half logits, else the logits dtype).
    """
    x = logits.to(compute_dtype(logits.dtype))
    if score_function == "softmax":
        scores = torch.softmax(x, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(x)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function={score_function!r} is not one of ('softmax', 'sigmoid')")
    idx = stable_topk_indices(scores, topk)
    routing_map = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(1, idx, True)
    return routing_map, scores


def switch_aux_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Switch-Transformer balance loss: ``E * coeff * sum_i f_i * P_i``.

    With f_i = tokens_per_expert[i] / (K * T) and P_i = sum_t scores[t, i] / T, T = total_tokens.
    ``scores`` may be a local shard of the tokens counted in ``tokens_per_expert``.

    Args:
        scores: [T_local, E]; tokens_per_expert: [E].
    Returns:
        scalar tensor.
    """
    num_experts = scores.shape[-1]
    per_expert = scores.sum(dim=0)
    return torch.sum(per_expert * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens)
    )


def seq_aux_loss(
    scores: torch.Tensor,
    tokens_per_seq_expert: torch.Tensor,
    seq_length: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Sequence-level balance loss (DeepSeek-V2/V3): the switch loss of each sequence, averaged.

    Args:
        scores: [S_local, B, E] aux scores; tokens_per_seq_expert: [B, E] counts per sequence
            (summed over every shard of the sequence); seq_length: the full S.
    Returns:
        scalar tensor.
    """
    batch, num_experts = scores.shape[1], scores.shape[2]
    per_seq_expert = scores.sum(dim=0)  # [B, E]
    total = torch.sum(per_seq_expert * tokens_per_seq_expert)
    return total * (num_experts * coeff / (topk * seq_length * seq_length)) / batch


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss: ``coeff * mean_t logsumexp(logits[t])^2``. logits: [T, E] -> scalar."""
    lse = torch.logsumexp(logits.to(compute_dtype(logits.dtype)), dim=-1)
    return torch.mean(torch.square(lse)) * coeff


def all_reduce_counts(counts: torch.Tensor,
                      group: Optional["torch.distributed.ProcessGroup"]) -> Tuple[torch.Tensor, int]:
    """Sum integer-valued counts over ``group`` (exact in fp32 below 2**24); returns (sum, group size)."""
    if group is None:
        return counts, 1
    counts = counts.to(torch.float32)
    torch.distributed.all_reduce(counts, group=group)
    return counts, torch.distributed.get_world_size(group)
