"""The records that pass between the stages of one dispatch (plan.py): ``Prepared`` and ``Sent``
on the way to the experts, the frozen ``DispatchHandle`` that the combine (and a reused dispatch)
consumes, and ``Returned`` on the way back."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..ops import RowIdMap
from .exchange import Received

if TYPE_CHECKING:
    from .plan import Plan, SourceBlocks


_DISPATCH_IDS = itertools.count(1)  # this process's dispatches, numbered (compared only here)


def new_dispatch_id() -> int:
    return next(_DISPATCH_IDS)


@dataclass(frozen=True)
class Prepared:
    """After ``prepare``: x [T, H] and probs [T, E] in the wire dtype (fp32, fp64 for an fp64
    router; autograd to the caller's), the step's plan, the caller's hidden shape ([T, H] or
    [S, B, H]), and the caller's own (hidden, routing_map, probs) and experts_grad (a sync-free
    send re-plans from them when a rank had more tokens than the plan). ``wire``: the rows as
    they travel when they are not x itself: [T, W], the FP8 wire rows (fp8_wire.py)."""

    x: torch.Tensor
    probs: torch.Tensor
    plan: "Plan"
    hidden_shape: torch.Size
    inputs: tuple[Any, Any, Any]
    experts_grad: Optional[bool] = None
    wire: Optional[torch.Tensor] = None

    @property
    def rows(self) -> torch.Tensor:
        """What ``send`` moves: [T, H] (or the wire rows [T, W]), detached."""
        return (self.x if self.wire is None else self.wire).detach()


@dataclass(frozen=True)
class Sent:
    """After ``send``: the owner's x [T, H] and probs [T, E] (autograd), the plan that sent them
    (a sync-free send can re-plan), what arrived (rows by source rank) and the hidden shape."""

    x: torch.Tensor
    probs: torch.Tensor
    plan: "Plan"
    recv: Received
    hidden_shape: torch.Size


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
        row_grad_sink: with the FP8 wire (``config.fp8``), [N, H] zeros in the tokens' dtype whose
            gradient is the expert rows' gradient (the rows are quantised bytes and carry none):
            the experts' first GEMM takes it as its ``grad_sink``. None otherwise.
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
    row_grad_sink: Optional[torch.Tensor] = None
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
        return self.plan.host_counts(self)

    @property
    def source_blocks(self) -> Optional["SourceBlocks"]:
        """Host ints [El][P]: (first row, rows) of each (local expert, source EP rank) block of the
        receiver layout (capacity padding included; an expert's tail padding after its blocks is in
        none). A block holds that source's tokens alone, in token order. None for the sync-free plan."""
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
