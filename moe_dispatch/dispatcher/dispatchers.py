"""AllToAllDispatcher and AllGatherDispatcher: the functional dispatch/combine as objects, plus
Megatron-core's six-method token-dispatcher interface on the same code.

Megatron's MoELayer calls, in order:
    dispatch_preprocess(hidden_states, routing_map, probs) -> (hidden [T, H], probs [T, E])
    token_dispatch(hidden, probs)                           -> (received tokens, received probs)
    dispatch_postprocess(tokens, probs)                     -> (permuted_tokens [N, H],
                                                               tokens_per_expert [El], permuted_probs [N])
    combine_preprocess(expert_output [N, H])                -> rows grouped by owner rank
    token_combine(rows)                                     -> the owner's rows
    combine_postprocess(rows)                               -> output, shaped like hidden_states
The object keeps the step's handle between the calls, so one dispatcher serves one layer.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..ops import unpermute
from . import functional
from .comm import ProcessGroup, group_size_rank
from .common import DispatchHandle, expand, send_to_owners, to_source_major
from .layout import check_ep_size


class _Dispatcher:
    kind = ""

    def __init__(self, config: Any, ep_group: ProcessGroup = None) -> None:
        """config: MoEConfig (num_experts, probs_in_experts, router_dtype, pad_multiple, ...);
        ep_group: the expert-parallel ProcessGroup (None: the default group, or one process).
        Raises ValueError if num_experts is not divisible by the EP size."""
        self.config = config
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = group_size_rank(ep_group)
        self.num_local_experts = check_ep_size(config.num_experts, self.ep_size)
        first = self.ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.handle: Optional[DispatchHandle] = None
        self._owner: Optional[tuple] = None  # (x [T, H], probs [T, E]) between the Megatron steps
        self._recv_map: Optional[torch.Tensor] = None

    # ---- functional form -----------------------------------------------------------------
    def dispatch(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """(expert_input [N, H], tokens_per_expert CPU int64 [El], handle); see functional.dispatch."""
        return functional.dispatch(hidden_states, routing_map, probs, self.config, self.ep_group, self.kind)

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_output [N, H] -> hidden_states' shape; see functional.combine."""
        return functional.combine(expert_output, handle)

    # ---- Megatron-core interface -----------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Validate (all ranks), exchange sizes; returns (hidden [T, H], probs [T, E] fp32/fp64)."""
        x, self.handle = functional.prepare(hidden_states, routing_map, probs, self.config, self.ep_group, self.kind)
        self._owner = (x, self.handle.probs)
        return x, self.handle.probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Exchange; returns (received tokens [R, H], received probs [R, El]), grouped by source."""
        recv_x, self._recv_map, recv_probs = functional.exchange(hidden_states, self._require_handle())
        return recv_x, recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Returns (permuted_tokens [N, H], tokens_per_expert CPU int64 [El], permuted_probs [N]).

        With config.probs_in_experts=False (default) the combine applies the probs, so experts
        must ignore permuted_probs (returned detached, for inspection). Megatron's own experts
        always multiply by them: use probs_in_experts=True with those experts."""
        handle = self._require_handle()
        x, owner_probs = self._owner
        rows, handle.permuted_probs = expand(x, owner_probs, hidden_states, self._recv_map, probs, handle)
        self._owner, self._recv_map = None, None
        return rows, handle.tokens_per_expert, handle.permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert output [N, H] -> rows grouped by owner rank (padding dropped)."""
        return to_source_major(hidden_states, self._require_handle().layout)[0]

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Rows grouped by owner -> this rank's own rows, global expert-major (unreduced)."""
        handle = self._require_handle()
        return send_to_owners(hidden_states, handle.layout, handle.group, autograd=True)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The owner's fixed-order fp32 weighted sum; returns hidden_states' original shape."""
        handle, self.handle = self._require_handle(), None
        return unpermute(hidden_states, handle.owner_map, handle.combine_weights(),
                         restore_shape=handle.hidden_shape)

    def _require_handle(self) -> DispatchHandle:
        if self.handle is None:
            raise RuntimeError(f"{type(self).__name__}: call dispatch_preprocess first")
        return self.handle

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
    """The dispatcher named by config.dispatcher ('alltoall' or 'allgather')."""
    kind = getattr(config, "dispatcher", "alltoall")
    classes = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
    if kind not in classes:
        raise ValueError(f"config.dispatcher must be one of {tuple(classes)}, got {kind!r}")
    return classes[kind](config, ep_group)
