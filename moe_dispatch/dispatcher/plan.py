"""The Plan interface, what one step's routing decides and how that step's rows move, and the
records that pass between the stages of one dispatch: ``Prepared`` and ``Sent`` on the way to the
experts, the frozen ``DispatchHandle`` that the combine (and a reused dispatch) consumes, and
``Returned`` on the way back. A plan takes and returns these records, and each record holds its
plan: one module, so that neither imports the other.

A dispatch chooses its plan once (``stages.plan_type``: the config's ``sync_free``), in ``prepare``;
every later stage calls the plan it was given and never asks which plan it is:

    prepare      validate, size the step          -> Prepared (x [T, H], wire probs, plan)
    send         the forward data exchange          -> Sent (what arrived, by source rank)
    finish       expand into the experts' layout     -> (expert_input [N, H] or Fp8Rows, DispatchHandle)
    return_rows  expert rows back to their owners    -> Returned (owner buffer [M, H], check words)
    owner_sum    the owner's fixed-order fp32 sum    -> output, hidden_states' shape

Two plans implement it:
- ``DroplessPlan`` (dropless/plan.py): sizes from a size exchange (one all-gather, one host read);
- ``SyncFreePlan`` (sync_free/plan.py): sizes from the config and T alone, no host read (``sync_free``).
A new plan (a node-level dedup) is a third class with these methods.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from ..config import DispatchConfig
from ..distributed.agreement import DeviceProblem, ErrorLatch
from ..distributed.comm import ProcessGroup
from ..distributed.identity import CallId, StepCounter
from ..ops import RowIdMap
from ..ops.fp8_rows import Fp8Rows
from .row_format import Received

# The (local expert, source EP rank) blocks of the receiver layout: host [El][P] (first row, rows)
# (the dropless plan's), or a device int tensor [El, P] of each block's rows, the blocks tiling the
# rows from row 0 (the sync-free plan's: never read on the host). experts.gemm takes either.
SourceBlocks = Union[tuple[tuple[tuple[int, int], ...], ...], torch.Tensor]


class Plan(ABC):
    """One step's plan. Implementations are frozen dataclasses with at least these fields:

    config (DispatchConfig), group (the EP ProcessGroup), latch (its ErrorLatch), layout (the
    step's sizes: at least ep_size and rank; dropless.layout.Layout or sync_free.sizes.SyncFreeSizes), routing_map
    ([T, E] bool, this rank's), hidden_dtype, probs_dtype (the wire dtype), owner_map (RowIdMap of
    this rank's (token, expert) pairs in the owner buffer; None at EP 1, where the expert map
    serves), call (the step's ``identity.CallId``: which record of which layer), ep_size, rank,
    and ``replaced`` (this rank's bad input took part as zeros)."""

    call: "CallId"
    config: "DispatchConfig"
    group: "ProcessGroup"
    latch: "ErrorLatch"
    routing_map: torch.Tensor
    hidden_dtype: torch.dtype
    probs_dtype: torch.dtype
    layout: Any
    owner_map: Optional["RowIdMap"]
    replaced: bool
    # The receiver layout has rows after the last expert's block that belong to no expert (the
    # experts then take device counts; host counts cost a read).
    trailing_rows: bool = False

    @property
    def ep_size(self) -> int:
        return self.layout.ep_size

    @property
    def rank(self) -> int:
        """This rank's index in the EP group."""
        return self.layout.rank

    @classmethod
    @abstractmethod
    def prepare(cls, hidden: Any, routing_map: Any, probs: Any, cfg: "DispatchConfig", group: "ProcessGroup",
                latch: "ErrorLatch", *, steps: "StepCounter", experts_grad: Optional[bool] = None) -> "Prepared":
        """Check every rank's input (the same error on every rank) and plan the step. ``steps``: the
        caller's forward counter (``identity``), advanced once the step is planned; ``experts_grad``:
        whether the experts have trainable weights (None: assumed under grad mode)."""

    @abstractmethod
    def check_record(self, prepared: "Prepared") -> "Prepared":
        """The public ``send``'s check of a record that left ``prepare`` (records.py): that every
        rank sends the same call, with the x and probs prepare recorded. Returns the record to
        send; raises the same ValueError on every rank, or (a fixed-size exchange) lets a bad
        record take part as zeros and carry its error."""

    @abstractmethod
    def send(self, prepared: "Prepared", with_routing: bool = True) -> "Sent":
        """The forward exchange of prepared.x [T, H] and prepared.probs [T, E] (no autograd).
        ``with_routing=False``: the receiver's row map is known (a reused handle)."""

    @abstractmethod
    def finish(self, sent: "Sent", expert_map: Optional["RowIdMap"] = None) -> tuple[Any, "DispatchHandle"]:
        """The received rows in the receiver layout, the payload type sent (a tensor [N, H] or
        ``Fp8Rows``: ``expand``), with autograd to the owner's x and probs."""

    @abstractmethod
    def reuse(self, handle: "DispatchHandle", hidden: Any, routing_map: Any,
              probs: Any) -> tuple[torch.Tensor, "DispatchHandle"]:
        """dispatch(handle=...): the same routing again, its check on the device (no host sync)."""

    @abstractmethod
    def read_host_rows_per_expert(self, handle: "DispatchHandle") -> torch.Tensor:
        """CPU int64 [El]: rows per local expert block, padding included."""

    @abstractmethod
    def flag_expert_output(self, handle: "DispatchHandle", expert_output: Any) -> None:
        """EP > 1: record a wrong expert_output, so that every rank raises it later (no hang)."""

    def flag_input(self, handle: "DispatchHandle", problem: "DeviceProblem") -> None:
        """After the dispatch: a problem with this rank's input found on the device (code 0: none),
        for a plan whose step runs no size exchange to carry it (``_Dispatcher.dispatch_rows``)."""
        raise NotImplementedError(f"{type(self).__name__} carries input problems in its size exchange")

    @abstractmethod
    def return_rows(self, expert_output: torch.Tensor, handle: "DispatchHandle") -> "Returned":
        """Checked expert rows [N, H] -> the owner buffer [M, H] (the rows themselves at EP 1)."""

    @abstractmethod
    def owner_sum(self, returned: "Returned", handle: "DispatchHandle") -> torch.Tensor:
        """The owner's fixed-order weighted sum of its rows -> hidden_states' shape."""

    def source_blocks(self, handle: "DispatchHandle") -> Optional[SourceBlocks]:
        """The (local expert, source) blocks of the receiver layout (``SourceBlocks``); None: none."""
        return None


# ---- the records that pass between the stages --------------------------------------------------
_DISPATCH_IDS = itertools.count(1)  # this process's dispatches, numbered (compared only here)


@torch.compiler.disable
def new_dispatch_id() -> int:
    # Run outside torch.compile: traced, the counter's state becomes a guard, and every new
    # dispatch would recompile the frame that makes the handle.
    return next(_DISPATCH_IDS)


@dataclass(frozen=True)
class Prepared:
    """After ``prepare``: x [T, H] and probs [T, E] in the wire dtype (fp32, fp64 for an fp64
    router; autograd to the caller's), the step's plan, the caller's hidden shape ([T, H] or
    [S, B, H]), and the caller's own (hidden, routing_map, probs) and experts_grad (a sync-free
    send re-plans from them when a rank had more tokens than the plan). ``payload``: what travels
    when it is not x itself: x's rows quantised, ``Fp8Rows`` (payload.py; with ``config.fp8``)."""

    x: torch.Tensor
    probs: torch.Tensor
    plan: "Plan"
    hidden_shape: torch.Size
    inputs: tuple[Any, Any, Any]
    experts_grad: Optional[bool] = None
    payload: Optional[Fp8Rows] = None

    @property
    def rows(self) -> torch.Tensor:
        """What ``send`` moves: x [T, H], or the payload's wire rows [T, W], detached."""
        return self.x.detach() if self.payload is None else self.payload.packed()


@dataclass(frozen=True)
class Sent:
    """After ``send``: the owner's x [T, H] and probs [T, E] (autograd), the plan that sent them
    (a sync-free send can re-plan), what arrived (rows by source rank), the hidden shape, and the
    payload sent when it was not x itself (``Prepared.payload``: what the rows that arrived are)."""

    x: torch.Tensor
    probs: torch.Tensor
    plan: "Plan"
    recv: Received
    hidden_shape: torch.Size
    payload: Optional[Fp8Rows] = None


@dataclass(frozen=True)
class DispatchHandle:
    """What the combine (and the dispatch's backward) needs; returned by ``dispatch``. Immutable.

    Attributes:
        plan: the step's Plan.
        expert_map: RowIdMap of the receiver layout (the rows given to the experts).
        owner_map: RowIdMap of this rank's (token, expert) pairs in the rows that return to it
            (at EP 1 the expert map: nothing moves).
        probs: [T, E] fp32/fp64 (the wire dtype), with autograd to the caller's probs.
        permuted_probs: [N] probs of the rows given to the experts (differentiable only with
            probs_in_experts; otherwise the combine applies the probs).
        hidden_shape: shape of the caller's hidden states ([T, H] or [S, B, H]).
        expert_offsets: int32 [El] on the device, cumulative rows per local expert (the offsets
            torch._grouped_mm takes: no host-to-device copy of the counts).
        route: the plan's return route (None at EP 1: nothing moves).
        given_rows: how many rows the experts were given, when fewer than N (``dispatch`` cuts a
            sync-free plan's rows after the experts' blocks, which belong to no expert); the combine
            takes those. None: all N.
        dispatch_id: this dispatch's number in this process (kept by ``dataclasses.replace``): the
            ``Returned`` of ``return_rows`` carries it, and ``owner_sum`` refuses another's.

    ``copy.copy`` and ``copy.deepcopy`` return the handle itself: it is immutable, its group
    cannot be copied, and its probs carry the step's autograd graph, which a copy would cut.
    """

    plan: "Plan"
    expert_map: RowIdMap
    owner_map: RowIdMap
    probs: torch.Tensor
    permuted_probs: torch.Tensor
    hidden_shape: torch.Size
    expert_offsets: torch.Tensor
    route: Any = None
    given_rows: Optional[int] = None
    dispatch_id: int = field(default_factory=new_dispatch_id)

    def __copy__(self) -> "DispatchHandle":
        return self

    def __deepcopy__(self, memo: dict) -> "DispatchHandle":
        return self

    @property
    def rows_per_expert(self) -> torch.Tensor:
        """int64 [El] on the device, rows per local expert block (padding included): no host read."""
        return self.expert_map.padded_expert_rows

    @property
    def host_rows_per_expert(self) -> torch.Tensor:
        """CPU int64 [El], rows per local expert block (padding included): the dropless plan's, or
        for a sync-free plan read from the device now (a host sync on CUDA: only whoever asks pays)."""
        return self.plan.read_host_rows_per_expert(self)

    @property
    def source_blocks(self) -> Optional["SourceBlocks"]:
        """The (local expert, source EP rank) blocks of the receiver layout: the dropless plan's host
        ints [El][P], (first row, rows) of each block (capacity padding included; an expert's tail
        padding after its blocks is in none); the sync-free plan's a device int64 [El, P], each
        block's rows, the blocks tiling the rows from row 0 (its trailing rows in none; no host
        read). A block holds that source's tokens alone, in token order."""
        return self.plan.source_blocks(self)

    @property
    def trailing_rows(self) -> bool:
        """Rows after the last expert's block (up to N) belong to no expert (the sync-free plan)."""
        return self.plan.trailing_rows

    @property
    def input_replaced(self) -> bool:
        """Sync-free at EP > 1: this rank's inputs were bad and it took part with zeros (NaN results)."""
        return self.plan.replaced


@dataclass(frozen=True)
class Returned:
    """After ``return_rows``: the owner buffer [M, H] (this rank's rows from every expert rank,
    unreduced), the exchange's check words (int32, the max over every rank's) or None, and the
    ``dispatch_id`` of the handle they were returned with (``owner_sum`` compares it)."""

    rows: torch.Tensor
    words: Optional[torch.Tensor] = None
    dispatch_id: Optional[int] = None
