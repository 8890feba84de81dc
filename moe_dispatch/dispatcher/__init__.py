"""Expert-parallel token dispatchers with bitwise rank-, dispatcher-, EP-size- and batch-invariant
results: expert outputs return unreduced to each token's owner, which sums them in a fixed order
in fp32 (fp64 for fp64 probs).

Modules: ``layout`` (the size exchange: validation, sizes), ``exchange`` (the kinds' transport,
forward and back), ``expand`` (the received rows into the expert layout, and their gradients
back), ``functional`` (dispatch / combine and the frozen handle), ``static`` (the sync-free
plan), ``dispatchers`` (the objects). Agreement across ranks and latched errors:
``moe_dispatch.distributed.agreement``; which layer and step a collective belongs to:
``moe_dispatch.distributed.identity``; the settings: ``moe_dispatch.config.DispatchConfig``; Megatron's
six-method interface: ``moe_dispatch.integrations.megatron``.
"""
from ..config import DispatchConfig
from ..distributed.agreement import InputProblem, hidden_states_problem
from .dispatchers import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from .exchange import KINDS
from .functional import DispatchHandle, combine, dispatch

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DispatchConfig", "DispatchHandle", "InputProblem", "KINDS",
           "build_dispatcher", "combine", "dispatch", "hidden_states_problem"]
