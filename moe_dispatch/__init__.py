"""moe-dispatch: mixture-of-experts dispatch for expert parallelism whose results are bitwise
identical on every rank, with either dispatcher, at any EP size and whatever else is in the batch."""
from .config import MoEConfig
from .dispatcher import AllGatherDispatcher, AllToAllDispatcher, DispatchHandle, build_dispatcher, combine, dispatch
from .experts import GroupedMLP, SequentialMLP
from .layer import MoELayer
from .ops import RowIdMap, expert_row_counts, permute, sort_chunks, unpermute
from .router import AuxLossScaler, TopKRouter

__version__ = "0.1.0"

__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "AuxLossScaler", "DispatchHandle", "GroupedMLP", "MoEConfig",
    "MoELayer",
    "RowIdMap", "SequentialMLP", "TopKRouter", "build_dispatcher", "combine", "dispatch", "expert_row_counts",
    "permute", "sort_chunks", "unpermute",
]
