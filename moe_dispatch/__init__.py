"""moe-dispatch: mixture-of-experts dispatch for expert parallelism whose results are bitwise
identical on every rank, with either dispatcher, at any EP size and whatever else is in the batch.

The names below are imported on first use, so that importing one module (``moe_dispatch.config``)
does not load the others."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the submodule that defines it
_HOMES = {
    "AllGatherDispatcher": "dispatcher", "AllToAllDispatcher": "dispatcher", "DispatchHandle": "dispatcher",
    "build_dispatcher": "dispatcher", "combine": "dispatcher", "dispatch": "dispatcher",
    "GroupedMLP": "experts", "SequentialMLP": "experts", "MoEConfig": "config", "MoELayer": "layer",
    "RowIdMap": "ops", "expert_row_counts": "ops", "permute": "ops", "sort_chunks": "ops", "unpermute": "ops",
    "AuxLossScaler": "router", "TopKRouter": "router",
}
__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "AuxLossScaler", "DispatchHandle", "GroupedMLP", "MoEConfig",
    "MoELayer",
    "RowIdMap", "SequentialMLP", "TopKRouter", "build_dispatcher", "combine", "dispatch", "expert_row_counts",
    "permute", "sort_chunks", "unpermute",
]

if TYPE_CHECKING:
    from .config import MoEConfig
    from .dispatcher import AllGatherDispatcher, AllToAllDispatcher, DispatchHandle, build_dispatcher, combine, dispatch
    from .experts import GroupedMLP, SequentialMLP
    from .layer import MoELayer
    from .ops import RowIdMap, expert_row_counts, permute, sort_chunks, unpermute
    from .router import AuxLossScaler, TopKRouter


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    else:  # a submodule, as ``import moe_dispatch`` used to load them all
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
