"""Our experts' weights under Megatron-core's state dict names (0.16 layouts, TP=1): the tensor
converters, and ``megatron_state_dict`` / ``load_megatron_state_dict`` for a
``moe_dispatch.experts`` GroupedMLP or SequentialMLP.

Ours: ``weight1`` [E, H, fc1_out], ``weight2`` [E, ffn, H], y = x @ weight[e].

- SequentialMLP: ``local_experts.{i}.linear_fc1.weight`` [fc1_out, H] and
  ``local_experts.{i}.linear_fc2.weight`` [H, ffn]: torch Linear layout (y = x @ W^T), so each is
  the transpose of our expert slice. For swiglu both sides put the gate in the first ffn rows
  (Megatron's glu applies the activation to the first chunk).
- GroupedMLP: ``weight1`` [H, E * fc1_out] and ``weight2`` [E * ffn, H]. Megatron reads them with
  ``.view(E, H, -1)`` and ``.view(E, -1, H)``: the same memory as ours, only the nominal shape
  differs (weight1 is not a transpose or concatenation along dim 1). The flat layout does not
  record E: 4 experts of ffn 48 and 2 of ffn 96 have the same shapes, so pass the right count.

Megatron's SequentialMLP also has ``..._extra_state`` entries (None without TransformerEngine);
load into it with ``strict=False`` or add them. Local indices are used: a rank's dict holds its
own experts 0..E_local-1 as Megatron's does.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

Weights = Tuple[torch.Tensor, torch.Tensor]
LAYOUTS = ("sequential", "grouped")


def to_megatron_sequential(weight1: torch.Tensor, weight2: torch.Tensor, prefix: str = "") -> Dict[str, torch.Tensor]:
    """weight1 [E, H, fc1_out], weight2 [E, ffn, H] -> SequentialMLP state dict entries."""
    out = {}
    for i in range(weight1.shape[0]):
        out[f"{prefix}local_experts.{i}.linear_fc1.weight"] = weight1[i].t().contiguous()
        out[f"{prefix}local_experts.{i}.linear_fc2.weight"] = weight2[i].t().contiguous()
    return out


def from_megatron_sequential(state_dict: Dict[str, torch.Tensor], num_local_experts: int, prefix: str = "") -> Weights:
    """SequentialMLP entries -> (weight1 [E, H, fc1_out], weight2 [E, ffn, H])."""
    fc1 = [state_dict[f"{prefix}local_experts.{i}.linear_fc1.weight"].t() for i in range(num_local_experts)]
    fc2 = [state_dict[f"{prefix}local_experts.{i}.linear_fc2.weight"].t() for i in range(num_local_experts)]
    return torch.stack(fc1), torch.stack(fc2)


def to_megatron_grouped(weight1: torch.Tensor, weight2: torch.Tensor, prefix: str = "") -> Dict[str, torch.Tensor]:
    """weight1 [E, H, fc1_out], weight2 [E, ffn, H] -> GroupedMLP ``weight1`` [H, E*fc1_out],
    ``weight2`` [E*ffn, H] (same memory order)."""
    e, h, fc1_out = weight1.shape
    return {
        f"{prefix}weight1": weight1.contiguous().view(h, e * fc1_out).clone(),
        f"{prefix}weight2": weight2.contiguous().view(e * weight2.shape[1], h).clone(),
    }


def from_megatron_grouped(state_dict: Dict[str, torch.Tensor], num_local_experts: int, hidden_size: int,
                          prefix: str = "") -> Weights:
    """GroupedMLP ``weight1``/``weight2`` -> (weight1 [E, H, fc1_out], weight2 [E, ffn, H])."""
    w1 = state_dict[f"{prefix}weight1"].contiguous()
    w2 = state_dict[f"{prefix}weight2"].contiguous()
    return w1.view(num_local_experts, hidden_size, -1).clone(), w2.view(num_local_experts, -1, hidden_size).clone()


def megatron_state_dict(experts: Any, layout: str = "sequential", prefix: str = "") -> Dict[str, torch.Tensor]:
    """``experts`` (our GroupedMLP / SequentialMLP) under Megatron-core's names: ``layout``
    'sequential' (SequentialMLP, ``local_experts.{i}.linear_fc{1,2}.weight``) or 'grouped'
    (GroupedMLP ``weight1/2``)."""
    _check_layout(layout)
    convert = to_megatron_sequential if layout == "sequential" else to_megatron_grouped
    return convert(experts.weight1.detach(), experts.weight2.detach(), prefix)


@torch.no_grad()
def load_megatron_state_dict(experts: Any, state_dict: Dict[str, torch.Tensor], layout: str = "sequential",
                             prefix: str = "") -> None:
    """Inverse of `megatron_state_dict`: set ``experts``' weights; shapes must match them exactly."""
    _check_layout(layout)
    if layout == "sequential":
        w1, w2 = from_megatron_sequential(state_dict, experts.num_local_experts, prefix)
    else:
        w1, w2 = from_megatron_grouped(state_dict, experts.num_local_experts, experts.hidden_size, prefix)
    for param, w, name in ((experts.weight1, w1, "weight1"), (experts.weight2, w2, "weight2")):
        if w.shape != param.shape:
            raise ValueError(f"{name}: Megatron tensor maps to {tuple(w.shape)}, expected {tuple(param.shape)}")
        param.copy_(w)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'sequential' or 'grouped', got {layout!r}")
