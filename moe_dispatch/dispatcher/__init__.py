"""Expert-parallel token dispatchers with bitwise rank-, dispatcher-, EP-size- and batch-invariant
results: expert outputs return unreduced to each token's owner, which sums them in a fixed order
in fp32 (fp64 for fp64 probs).

Three faces, one path:
- ``dispatch`` / ``combine`` (functional.py): the frozen ``DispatchHandle`` from one to the other;
- the dispatcher objects (dispatchers.py): the same, with the configuration agreed once;
- the stages (stages.py), for frameworks that call them one by one (Megatron's six methods):
  ``prepare`` -> ``send`` -> ``finish`` -> the experts (``to_expert_rows``) -> ``check_expert_output`` ->
  ``return_rows`` -> ``owner_sum``, each returning a frozen record (``Prepared``, ``Sent``,
  ``DispatchHandle``, ``Returned``).

Inside: ``plan`` (the Plan interface, a step's plan chosen once in prepare, and the records it
passes between the stages); the two plans, a package each: ``dropless`` (``plan``; sizes from
the size exchange, ``layout``; transport, ``exchange``) and ``sync_free`` (``plan``; ``sizes``,
``exchange``, ``words``: its check words); what both use: ``row_format`` (packed rows,
``Received``), ``status_rows`` (words at the end of an exchange's chunks), ``payload`` (what
travels: the tokens, or ``Fp8Rows``, and how each arrives), ``expand`` (the
received rows into the expert layout, and their gradients back). Agreement across ranks and
latched errors: ``moe_dispatch.distributed``; the settings: ``moe_dispatch.config.DispatchConfig``.
"""
from ..config import DispatchConfig
from ..distributed.agreement import InputProblem, hidden_states_problem
from .dispatchers import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from .dropless.exchange import KINDS
from .functional import combine, dispatch, dispatch_rows, with_host_rows_per_expert
from .payload import Fp8Rows, pack_rows, unpack_rows, wire_width
from .plan import DispatchHandle, Plan, Prepared, Returned, Sent
from .stages import (
           check_expert_output,
           device_of,
           finish,
           owner_sum,
           prepare,
           return_rows,
           send,
           to_expert_rows,
)

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DispatchConfig", "DispatchHandle", "Fp8Rows", "InputProblem",
           "KINDS",
           "Plan", "Prepared", "Returned", "Sent", "build_dispatcher", "check_expert_output", "combine", "device_of",
           "dispatch", "dispatch_rows", "finish", "hidden_states_problem", "owner_sum",
           "pack_rows", "prepare", "return_rows", "send", "to_expert_rows", "unpack_rows", "wire_width",
           "with_host_rows_per_expert"]
