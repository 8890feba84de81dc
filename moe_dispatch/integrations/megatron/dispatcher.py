"""Megatron-core's six-method token-dispatcher interface as a thin wrapper around our dispatcher.

Megatron's MoELayer calls, in order:
    dispatch_preprocess(hidden_states, routing_map, probs) -> (hidden [T, H], probs [T, E])
    token_dispatch(hidden, probs)                           -> (received tokens, received probs)
    dispatch_postprocess(tokens, probs)                     -> (permuted_tokens [N, H],
                                                               tokens_per_expert [El], permuted_probs [N])
    combine_preprocess(expert_output [N, H])                -> the checked expert output
    token_combine(rows)                                     -> the owner's rows (unreduced)
    combine_postprocess(rows)                               -> output, shaped like hidden_states
The interface keeps state between the calls; here it is the frozen record of the stage just run
(``moe_dispatch.dispatcher``'s staged API: prepare, send, finish, return_rows, owner_sum), which the
next call checks and replaces. One wrapper serves one layer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ...config import as_dispatch_config
from ...dispatcher import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    DispatchHandle,
    Fp8Rows,
    Prepared,
    Returned,
    Sent,
    build_dispatcher,
    check_expert_output,
    device_of,
    finish,
    owner_sum,
    prepare,
    return_rows,
    send,
)
from .config import moe_config_from_megatron
from .supported import check_groups, megatron_field

Dispatcher = Union[AllGatherDispatcher, AllToAllDispatcher]


@dataclass(frozen=True)
class _Dispatched:  # after dispatch_postprocess, combine_preprocess
    handle: DispatchHandle
    fp8_rows: Optional[Fp8Rows] = None  # FP8: the expert rows whose wire rows Megatron was handed


@dataclass(frozen=True)
class _Combined:  # after token_combine
    handle: DispatchHandle
    returned: Returned


# The record of the step so far: the stages' own records, and the handle with them.
_Step = Union[None, Prepared, Sent, _Dispatched, _Combined]

class MegatronTokenDispatcher:
    """One of our dispatchers (``dispatcher``) behind Megatron's MoETokenDispatcher interface.

    Exposes what Megatron's MoELayer and the plug-in read: ``config`` (our DispatchConfig),
    ``ep_group``, ``ep_size``, ``ep_rank``, ``num_local_experts``, ``local_expert_indices``."""

    # What Megatron's MoELayer reads besides the six methods. Self-contained: megatron-core
    # 0.16.1 .. 0.19.2 and HEAD (0.20). Megatron's MoETokenDispatcher sets these in its __init__
    # (``ep_size`` and ``ep_rank``, this rank's index in the EP group, are set below with the same
    # meaning). Each value is the one Megatron's own allgather / alltoall dispatchers have in the
    # modes we support.
    tp_size = 1  # expert tensor-parallel size: always 1 here (install() rejects more)
    tp_rank = 0
    use_nccl_stream = False  # Megatron: A2A on a side stream to overlap shared experts; ours: current stream
    shared_experts = None  # shared experts run by the layer, never inside the dispatcher
    cudagraph_attrs: tuple = ()  # nothing for a CUDA graph of moe_preprocess to capture (not supported)
    valid_cudagraph_attrs = None

    def __init__(self, dispatcher: Dispatcher) -> None:
        """dispatcher: ours (``build_dispatcher``), on the layer's EP group."""
        self.dispatcher = dispatcher
        self.config = dispatcher.config
        self.ep_size, self.ep_rank = dispatcher.ep_size, dispatcher.ep_rank
        self.num_local_experts = dispatcher.num_local_experts
        self.local_expert_indices = list(dispatcher.local_expert_indices)
        self._step: _Step = None

    @property
    def ep_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The dispatcher's EP group (held weakly there: a model kept to the end of a script keeps
        no destroyed group alive)."""
        return self.dispatcher.ep_group

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate (all ranks), plan the step; returns (hidden [T, H], probs [T, E] fp32/fp64)."""
        self.dispatcher.agree(device_of(hidden_states))
        prepared = prepare(hidden_states, routing_map, probs, self.config, self.ep_group, latch=self.dispatcher.latch,
                           agreed=True, steps=self.dispatcher.steps)
        self._step = prepared
        return prepared.x, prepared.probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send hidden_states [T, H] and probs [T, E] (the step's own, as dispatch_preprocess
        returned them); returns (received tokens [R, H], received probs [R, El]), by source."""
        prepared = self._expect(Prepared, "dispatch_preprocess")
        sent = send(dataclasses.replace(prepared, x=hidden_states, probs=probs))
        self._step = sent
        return sent.recv.hidden, sent.recv.probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor,
                             probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (permuted_tokens [N, H], tokens_per_expert int64 [El], permuted_probs [N]).

        tokens_per_expert is on the CPU (the dropless plan's), or, sync-free (``config.sync_free``:
        install() at EP 1), the handle's device counts, read by nobody on the host: N = T * topk,
        the rows after the last expert's block belong to no expert (``handle.trailing_rows``), and
        ``make_row_stable``'s experts take the device offsets (Megatron's MoELayer only hands
        tokens_per_expert to its experts).
        With probs_in_experts=False the combine applies the probs, so experts must ignore
        permuted_probs (returned detached, for inspection): ``make_row_stable``'s experts do.
        Megatron's own experts always multiply by them: they need probs_in_experts=True (the
        default of ``dispatcher_from_megatron``)."""
        sent = self._expect(Sent, "token_dispatch")
        recv = dataclasses.replace(sent.recv, hidden=hidden_states, probs=probs)
        rows, handle = finish(dataclasses.replace(sent, recv=recv))
        # Megatron moves tensors: FP8 rows go to it as their wire rows [N, W] (no copy)
        fp8_rows = rows if isinstance(rows, Fp8Rows) else None
        rows = rows.packed() if fp8_rows is not None else rows
        self._step = _Dispatched(handle, fp8_rows)
        rows_per_expert = handle.rows_per_expert if handle.trailing_rows else handle.host_rows_per_expert
        return rows, rows_per_expert, handle.permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert output [N, H] -> the same rows, checked (see ``check_expert_output``)."""
        return check_expert_output(hidden_states, self._expect(_Dispatched, "dispatch_postprocess").handle)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert rows -> this rank's own rows, from every expert rank (unreduced)."""
        handle = self._expect(_Dispatched, "dispatch_postprocess").handle
        returned = return_rows(hidden_states, handle)
        self._step = _Combined(handle, returned)
        return returned.rows

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The owner's fixed-order fp32 weighted sum; returns hidden_states' original shape."""
        step = self._expect(_Combined, "token_combine")
        self._step = None
        return owner_sum(dataclasses.replace(step.returned, rows=hidden_states), step.handle)

    @property
    def handle(self) -> Optional[DispatchHandle]:
        """The current step's handle (after dispatch_postprocess), else None."""
        return self._step.handle if isinstance(self._step, (_Dispatched, _Combined)) else None

    def fp8_rows(self, rows: torch.Tensor) -> Optional[Fp8Rows]:
        """FP8 (``config.fp8``): the step's expert rows as ``Fp8Rows``, for Megatron's copy ``rows``
        [N, W] of their wire rows (its own tensor: the values are the ones it was handed, the
        gradient goes to the dispatch's grad_sink). None before dispatch_postprocess or in bf16."""
        step = self._step
        kept = step.fp8_rows if isinstance(step, _Dispatched) else None
        if kept is None or rows is kept.wire:
            return kept
        return Fp8Rows.from_wire(rows, kept.hidden_size, kept.fp8_dtype, kept.grad_sink)

    def _expect(self, record: type, previous: str) -> Any:
        if not isinstance(self._step, record):
            raise RuntimeError(f"{type(self).__name__}: call {previous} first")
        return self._step

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


def dispatcher_from_megatron(config: Any, pg_collection: Any, *, probs_in_experts: bool = True,
                             sync_free: bool = False, fp8: Optional[str] = None) -> MegatronTokenDispatcher:
    """Our dispatcher on ``pg_collection.ep`` behind Megatron's interface, in Megatron's argument
    order ``(config, pg_collection)``.

    Args:
        config: a Megatron ``TransformerConfig``, converted with
            ``moe_config_from_megatron(config, megatron_layer=True)``. A ``MoEConfig`` is used as
            is. (A TransformerConfig is told apart by its ``num_moe_experts`` field.)
        probs_in_experts: for a TransformerConfig: True (default) for Megatron's own experts,
            which multiply ``permuted_probs`` themselves (the combine then sums unweighted: probs
            applied once); False for experts that ignore them (``make_row_stable``'s, which
            ``install`` sets up), so the combine weights the rows in its fp32 sum.
        pg_collection: Megatron's ProcessGroupCollection (``.ep``; ``.expt_tp`` and ``.tp_ep``
            are checked when present, see ``check_groups``).
        sync_free: the sync-free dispatch (dispatcher/sync_free/: no host read per step), for
            experts that take device counts (``make_row_stable``'s; install() decides, see
            ``sync_free_obstacle``): EP size 1, no capacity padding, at most topk experts per token.

        fp8: for a TransformerConfig: the FP8 wire (``MoEConfig.fp8``; None: the tokens' dtype),
            for experts that take FP8 rows (``make_row_stable``'s; install() checks, ``check_fp8``).

    Raises:
        ValueError: no EP group, or expert tensor parallelism: these dispatchers split experts
            across EP ranks only; sync_free at EP > 1; a bad ``fp8`` (MoEConfig's error).
    """
    if hasattr(config, "num_moe_experts"):  # Megatron's TransformerConfig
        config = moe_config_from_megatron(config, megatron_layer=True, probs_in_experts=probs_in_experts, fp8=fp8)
    dispatch_config = as_dispatch_config(config)
    if sync_free:
        dispatch_config = dispatch_config.replace(sync_free=True)
    return MegatronTokenDispatcher(build_dispatcher(dispatch_config, check_groups(pg_collection)))


def is_installed(moe_layer: Any) -> bool:
    """True when moe_layer.token_dispatcher is one of ours (``install``, or ``dispatcher_from_megatron``)."""
    return isinstance(megatron_field(moe_layer, "token_dispatcher"), MegatronTokenDispatcher)
