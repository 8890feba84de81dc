"""The Plan interface: what one step's routing decides, and how that step's rows move.

A dispatch chooses its plan once (``stages.plan_type``: the config's ``sync_free``), in ``prepare``;
every later stage calls the plan it was given and never asks which plan it is:

    prepare      validate, size the step          -> Prepared (x [T, H], wire probs, plan)
    send         the forward data exchange          -> Sent (what arrived, by source rank)
    finish       expand into the experts' layout     -> (expert_input [N, H], DispatchHandle)
    return_rows  expert rows back to their owners    -> Returned (owner buffer [M, H], check words)
    owner_sum    the owner's fixed-order fp32 sum    -> output, hidden_states' shape

Two plans implement it:
- ``DroplessPlan`` (dropless.py): sizes from a size exchange (one all-gather, one host read);
- ``StaticPlan`` (static.py): sizes from the config and T alone, no host read (``sync_free``).
A new plan (an FP8 wire format, a node-level dedup) is a third class with these methods.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from ..config import DispatchConfig
    from ..distributed.agreement import DeviceProblem, ErrorLatch
    from ..distributed.comm import ProcessGroup
    from ..distributed.identity import CallId, StepCounter
    from ..ops import RowIdMap
    from .handle import DispatchHandle, Prepared, Returned, Sent

# (first row, rows) of each (local expert, source EP rank) block of the receiver layout: [El][P]
SourceBlocks = tuple[tuple[tuple[int, int], ...], ...]


class Plan(ABC):
    """One step's plan. Implementations are frozen dataclasses with at least these fields:

    config (DispatchConfig), group (the EP ProcessGroup), latch (its ErrorLatch), layout (the
    step's sizes: at least ep_size and rank; layout.Layout or static.StaticSizes), routing_map
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
    def finish(self, sent: "Sent", expert_map: Optional["RowIdMap"] = None) -> tuple[torch.Tensor, "DispatchHandle"]:
        """The received rows in the receiver layout, with autograd to the owner's x and probs."""

    @abstractmethod
    def reuse(self, handle: "DispatchHandle", hidden: Any, routing_map: Any,
              probs: Any) -> tuple[torch.Tensor, "DispatchHandle"]:
        """dispatch(handle=...): the same routing again, its check on the device (no host sync)."""

    @abstractmethod
    def host_counts(self, handle: "DispatchHandle") -> torch.Tensor:
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
        """Host (first row, rows) of each (local expert, source) block; None if not on the host."""
        return None

