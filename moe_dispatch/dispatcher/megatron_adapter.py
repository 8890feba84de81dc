"""Build a dispatcher from Megatron-core's TransformerConfig and ProcessGroupCollection."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .dispatchers import _Dispatcher, build_dispatcher


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def dispatcher_from_megatron(config: Any, pg_collection: Any) -> _Dispatcher:
    """Our dispatcher on ``pg_collection.ep``, in Megatron's argument order ``(config, pg_collection)``.

    Args:
        config: a Megatron ``TransformerConfig``, converted with
            ``MoEConfig.from_megatron(config, megatron_layer=True)``: the dispatcher serves
            Megatron's own router and experts, which multiply the probs themselves, so it runs in
            ``probs_in_experts`` mode and the probs are applied once. A ``MoEConfig`` is used as is.
            (A TransformerConfig is told apart by its ``num_moe_experts`` field.)
        pg_collection: Megatron's ProcessGroupCollection (``.ep``; ``.expt_tp`` and ``.tp_ep``
            are checked when present).

    Raises:
        ValueError: no EP group, or expert tensor parallelism (``expt_tp`` size != 1, or
            ``tp_ep`` not the EP group): these dispatchers split experts across EP ranks only.
    """
    if hasattr(config, "num_moe_experts"):  # Megatron's TransformerConfig
        from ..config import MoEConfig

        config = MoEConfig.from_megatron(config, megatron_layer=True)
    ep = getattr(pg_collection, "ep", None)
    if ep is None:
        raise ValueError("pg_collection.ep (the expert-parallel group) is required")
    expt_tp = _size(getattr(pg_collection, "expt_tp", None))
    if expt_tp != 1:
        raise ValueError(f"expert tensor parallelism is not supported: pg_collection.expt_tp has size "
                         f"{expt_tp}, expected 1 (set expert_tensor_parallel_size=1)")
    tp_ep = _size(getattr(pg_collection, "tp_ep", None))
    if getattr(pg_collection, "tp_ep", None) is not None and tp_ep != _size(ep):
        raise ValueError(f"pg_collection.tp_ep has size {tp_ep} but ep has size {_size(ep)}; with expert "
                         f"tensor parallel size 1 they must be the same group")
    return build_dispatcher(config, ep)
