"""AllToAllDispatcher and AllGatherDispatcher: dispatch/combine as objects, and Megatron-core's
six-method token-dispatcher interface as a thin adapter over the same handle.

Megatron's MoELayer calls, in order:
    dispatch_preprocess(hidden_states, routing_map, probs) -> (hidden [T, H], probs [T, E])
    token_dispatch(hidden, probs)                           -> (received tokens, received probs)
    dispatch_postprocess(tokens, probs)                     -> (permuted_tokens [N, H],
                                                               tokens_per_expert [El], permuted_probs [N])
    combine_preprocess(expert_output [N, H])                -> the checked expert output
    token_combine(rows)                                     -> the owner's rows (unreduced)
    combine_postprocess(rows)                               -> output, shaped like hidden_states
The interface keeps state between the calls; here it is one frozen record per step (``_step``),
which the next call checks and replaces. One dispatcher serves one layer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from . import functional, static
from .comm import ProcessGroup, group_size_rank
from .config import DispatchConfig, as_dispatch_config
from .exchange import Received
from .functional import DispatchHandle, Plan
from .layout import InputProblem, agree_config, check_ep_size, exchange_sizes, hidden_states_problem


@dataclass(frozen=True)
class _Prepared:  # after dispatch_preprocess
    plan: Plan
    hidden_shape: torch.Size


@dataclass(frozen=True)
class _Sent:  # after token_dispatch: the owner's tensors (autograd) and what arrived
    plan: Plan
    hidden_shape: torch.Size
    x: torch.Tensor
    probs: torch.Tensor
    recv: Received


@dataclass(frozen=True)
class _Dispatched:  # after dispatch_postprocess, combine_preprocess
    handle: DispatchHandle


@dataclass(frozen=True)
class _Returned:  # after token_combine
    handle: DispatchHandle
    words: Optional[torch.Tensor] = None  # the sync-free step's check words


_Step = Union[None, _Prepared, _Sent, _Dispatched, _Returned]


class _Dispatcher:
    kind = ""

    def __init__(self, config: Any, ep_group: ProcessGroup = None) -> None:
        """config: a MoEConfig or DispatchConfig (its kind must be this class's, if it has one);
        ep_group: the expert-parallel ProcessGroup (None: the default group, or one process).
        Raises ValueError if num_experts is not divisible by the EP size."""
        self.config: DispatchConfig = as_dispatch_config(config, self.kind or None)
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = group_size_rank(ep_group)
        self.num_local_experts = check_ep_size(self.config.num_experts, self.ep_size)
        first = self.ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        if self.config.sync_free and self.ep_size > 1 and self.config.ep_capacity_factor is None:
            raise ValueError(f"sync_free=True at EP size {self.ep_size} needs ep_capacity_factor (the static-capacity "
                             f"exchange), got None")
        self._agreed = self.ep_size == 1  # configuration agreed with the group (once, lazily)
        self._step: _Step = None

    @property
    def agreed(self) -> bool:
        """True once the configuration is agreed with the group (always, for one process)."""
        return self._agreed

    def agree(self, device: torch.device, settings: Sequence[tuple[str, Any]] = ()) -> None:
        """Agree on the configuration with the group (one fixed-size exchange), the first time
        only; dispatch does it too. A layer calls it before its own first collective, passing its
        own settings (router, experts) as (name, value) pairs to be agreed in the same exchange."""
        if not self._agreed:
            agree_config(self.config, self.ep_group, device, settings)
            self._agreed = True

    # ---- functional form -----------------------------------------------------------------
    def dispatch(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                 handle: Optional[DispatchHandle] = None) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """(expert_input [N, H], tokens_per_expert CPU int64 [El], handle); see functional.dispatch
        (``handle``: reuse a previous step's, for activation recomputation). Sync-free
        (``config.sync_free``): tokens_per_expert is read from the device (use
        ``handle.expert_counts`` / ``handle.expert_offsets`` to stay sync-free: ``dispatch_static``)."""
        rows, handle = self.dispatch_static(hidden_states, routing_map, probs, handle)
        return rows, handle.tokens_per_expert, handle

    def dispatch_static(self, hidden_states: Any, routing_map: torch.Tensor, probs: torch.Tensor,
                        handle: Optional[DispatchHandle] = None) -> tuple[torch.Tensor, DispatchHandle]:
        """dispatch without tokens_per_expert: (expert_input [N, H], handle). No host read in the
        sync-free mode (hidden_states None: this rank's input was bad; see MoELayer.forward)."""
        if hidden_states is None:
            hidden_states = static.BAD_INPUT
        if handle is None:
            self.agree(hidden_states.device if isinstance(hidden_states, torch.Tensor) else probs.device)
            x, wire, plan = functional.prepare(hidden_states, routing_map, probs, self.config, self.ep_group)
            replaced = isinstance(plan, static.StaticPlan) and plan.replaced  # then zeros of the agreed [T, H]
            rows, new = functional.finish(x, wire, functional.send_tokens(x, wire, plan), plan,
                                          x.shape if replaced else hidden_states.shape)
            return rows, new
        rows, _, new = functional.dispatch(hidden_states, routing_map, probs, self.config, self.ep_group, handle=handle)
        return rows, new

    @property
    def sync_free(self) -> bool:
        """The sync-free dispatch (static.py): no host read per step."""
        return self.config.sync_free

    def static_agreed_input(self) -> Optional[tuple[torch.Size, torch.dtype]]:
        """Sync-free at EP > 1 after the first step: the agreed hidden_states (shape, dtype)."""
        if not (self.config.sync_free and self.ep_size > 1):
            return None
        return static.agreed_hidden(self.ep_group, self.config)

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_output [N, H] -> hidden_states' shape; see functional.combine."""
        return functional.combine(expert_output, handle)

    def raise_together(self, problem: InputProblem, device: torch.device) -> None:
        """Take part in this step's size exchange with a locally found problem: every rank of the
        group (those in dispatch, and this one) raises the same ValueError. Always raises."""
        self.agree(device)
        exchange_sizes(None, None, None, self.config, self.ep_group, problem=problem, device=device)
        raise AssertionError("exchange_sizes returned despite a problem")  # unreachable: it raises

    def check_layer_input(self, hidden_states: Any, device: torch.device) -> None:
        """For a layer's forward, before its router: if hidden_states is not a float tensor
        [T, H] / [S, B, H] with H = config.hidden_size on ``device``'s type, every rank of the group
        raises the same ValueError (this rank through ``raise_together``, the others in their
        dispatch). No collective and no sync when the input is fine. A wrapper around an install()'d
        Megatron layer's forward can call it on ``moe_layer.token_dispatcher``."""
        problem = hidden_states_problem(hidden_states, self.config.hidden_size, device)
        if problem is not None:
            self.raise_together(problem, device)

    # ---- Megatron-core interface -----------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Validate (all ranks), exchange sizes; returns (hidden [T, H], probs [T, E] fp32/fp64)."""
        self.agree(hidden_states.device if isinstance(hidden_states, torch.Tensor) else torch.device("cpu"))
        x, wire, plan = functional.prepare(hidden_states, routing_map, probs, self.config, self.ep_group)
        replaced = isinstance(plan, static.StaticPlan) and plan.replaced
        self._step = _Prepared(plan, x.shape if replaced else hidden_states.shape)
        return x, wire

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send hidden_states [T, H] and probs [T, E] (the step's own, as dispatch_preprocess
        returned them); returns (received tokens [R, H], received probs [R, El]), by source."""
        step = self._expect(_Prepared, "dispatch_preprocess")
        recv = functional.send_tokens(hidden_states, probs, step.plan)
        self._step = _Sent(step.plan, step.hidden_shape, hidden_states, probs, recv)
        return recv.hidden, recv.probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Returns (permuted_tokens [N, H], tokens_per_expert CPU int64 [El], permuted_probs [N]).

        With probs_in_experts=False (default) the combine applies the probs, so experts must ignore
        permuted_probs (returned detached, for inspection). Megatron's own experts always multiply
        by them: use probs_in_experts=True with those experts."""
        step = self._expect(_Sent, "token_dispatch")
        recv = dataclasses.replace(step.recv, hidden=hidden_states, probs=probs)
        rows, handle = functional.finish(step.x, step.probs, recv, step.plan, step.hidden_shape)
        self._step = _Dispatched(handle)
        return rows, handle.tokens_per_expert, handle.permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert output [N, H] -> the same rows, checked (see functional.check_expert_output)."""
        return functional.check_expert_output(hidden_states, self._expect(_Dispatched, "dispatch_postprocess").handle)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert rows -> this rank's own rows, from every expert rank (unreduced)."""
        handle = self._expect(_Dispatched, "dispatch_postprocess").handle
        rows, words = functional.return_with_words(hidden_states, handle)
        self._step = _Returned(handle, words)
        return rows

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The owner's fixed-order fp32 weighted sum; returns hidden_states' original shape."""
        step = self._expect(_Returned, "token_combine")
        self._step = None
        return functional.owner_sum(hidden_states, step.handle, step.words)

    @property
    def handle(self) -> Optional[DispatchHandle]:
        """The current step's handle (after dispatch_postprocess), else None."""
        return self._step.handle if isinstance(self._step, (_Dispatched, _Returned)) else None

    def _expect(self, record: type, previous: str) -> Any:
        if not isinstance(self._step, record):
            raise RuntimeError(f"{type(self).__name__}: call {previous} first")
        return self._step

    # ---- Megatron-core: what its MoELayer reads besides the six methods ----------------------
    # Self-contained: megatron-core 0.16.1 .. 0.19.2 and HEAD (0.20). Megatron's MoETokenDispatcher
    # sets these in its __init__ (``ep_size`` and ``ep_rank``, this rank's index in the EP group,
    # are set in ours above with the same meaning). Each value is the one Megatron's own
    # allgather / alltoall dispatchers have in the modes we support.
    tp_size = 1  # expert tensor-parallel size: always 1 here (install() rejects more)
    tp_rank = 0
    use_nccl_stream = False  # Megatron: A2A on a side stream to overlap shared experts; ours: current stream
    shared_experts = None  # shared experts run by the layer, never inside the dispatcher
    cudagraph_attrs: tuple = ()  # nothing for a CUDA graph of moe_preprocess to capture (not supported)
    valid_cudagraph_attrs = None

    def get_expert_zero_copy_buffers(self) -> tuple[None, None]:
        """(output_buffer, grad_input_buffer) that the experts should write their output / input
        gradient into (megatron-core >= 0.19). (None, None), as for Megatron's own allgather and
        alltoall dispatchers: the experts allocate their own, which combine_preprocess reads."""
        return None, None

    def set_shared_experts(self, shared_experts: Any) -> None:
        """Megatron's moe_shared_expert_overlap hook: not supported (the shared experts would run
        inside the dispatcher's communication)."""
        raise ValueError("moe_shared_expert_overlap=True is not supported by moe_dispatch's dispatchers: "
                         "expected False (the layer then runs the shared experts itself)")


class AllToAllDispatcher(_Dispatcher):
    """Deduplicated uneven all-to-all: a token crosses the wire once per rank that owns any of its
    experts; expert outputs come back unreduced to the owner (all-to-all)."""

    kind = "alltoall"


class AllGatherDispatcher(_Dispatcher):
    """All-gather of tokens, routing and probs; expert outputs come back unreduced to the owner
    through an all-to-all (never a reduce-scatter)."""

    kind = "allgather"


def build_dispatcher(config: Any, ep_group: ProcessGroup = None) -> _Dispatcher:
    """The dispatcher of config's kind (a MoEConfig's ``dispatcher``, a DispatchConfig's ``kind``)."""
    cfg = as_dispatch_config(config)
    named = {cls.kind: cls for cls in _Dispatcher.__subclasses__()}
    return named.get(cfg.kind, _Dispatcher)(cfg, ep_group)
