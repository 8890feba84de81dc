"""Expert-parallel token dispatchers with bitwise rank-, dispatcher-, EP-size- and batch-invariant
results: expert outputs return unreduced to each token's owner, which sums them in a fixed order
in fp32 (fp64 for fp64 probs).

Modules: ``config`` (DispatchConfig), ``layout`` (the size exchange: agreement, validation, sizes),
``exchange`` (the kinds' transport, forward and back), ``functional`` (dispatch / combine and the
frozen handle), ``dispatchers`` (the objects and Megatron's six-method adapter), ``identity``
(which layer and step a collective belongs to), ``comm``.
"""
from .config import DispatchConfig
from .dispatchers import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from .exchange import KINDS
from .functional import DispatchHandle, combine, dispatch
from .layout import InputProblem, hidden_states_problem
from .megatron_adapter import dispatcher_from_megatron

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DispatchConfig", "DispatchHandle", "InputProblem", "KINDS",
           "build_dispatcher", "combine", "dispatch", "dispatcher_from_megatron", "hidden_states_problem"]
