"""Top-k router: row-stable gating, deterministic tie-breaks, Megatron-core routing features."""

from .capacity import apply_capacity, expert_capacity
from .gating import gating_linear, row_stable_mm
from .losses import AuxLossScaler, attach_loss, scores_for_aux_loss, seq_aux_loss, switch_aux_loss, z_loss
from .router import INIT_STD, ROUTER_SEED_OFFSET, TopKRouter
from .topk import group_limited_topk_indices, stable_topk_indices, topk_routing

__all__ = [
    "INIT_STD",
    "ROUTER_SEED_OFFSET",
    "TopKRouter",
    "AuxLossScaler",
    "apply_capacity",
    "attach_loss",
    "expert_capacity",
    "gating_linear",
    "group_limited_topk_indices",
    "row_stable_mm",
    "scores_for_aux_loss",
    "seq_aux_loss",
    "stable_topk_indices",
    "switch_aux_loss",
    "topk_routing",
    "z_loss",
]
