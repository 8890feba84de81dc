"""Expert-parallel token dispatchers with bitwise rank-, dispatcher-, EP-size- and batch-invariant
results: expert outputs return unreduced to each token's owner, which sums them in a fixed order
in fp32 (fp64 for fp64 probs)."""
from .common import DispatchHandle
from .dispatchers import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from .functional import combine, dispatch
from .megatron_adapter import dispatcher_from_megatron

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DispatchHandle", "build_dispatcher", "combine",
           "dispatch", "dispatcher_from_megatron"]
