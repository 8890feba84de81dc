"""Build a dispatcher from Megatron-core's ProcessGroupCollection (``.ep``, ``.tp_ep``, ``.expt_tp``)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .dispatchers import _Dispatcher, build_dispatcher


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def dispatcher_from_megatron(pg_collection: Any, config: Any) -> _Dispatcher:
    """The dispatcher for config (a MoEConfig, or a Megatron TransformerConfig, converted with
    MoEConfig.from_megatron) on pg_collection.ep.

    Raises ValueError when expert tensor parallelism is used (pg_collection.expt_tp size != 1, or
    tp_ep larger than ep): these dispatchers split experts across EP ranks only.
    """
    if hasattr(config, "num_moe_experts"):
        from ..config import MoEConfig

        config = MoEConfig.from_megatron(config)
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
