"""Call identity: which layer, and which of its forwards, a collective belongs to.

Every rank of an EP group must run the same layers' collectives in the same order. A program-order
bug (two layers called in swapped order on one rank, micro-batches combined in another order)
pairs up collectives of different calls: their data is then exchanged without any error. So
every call carries a ``CallId`` (layer, step), equal on every rank for the same call:

- ``layer``: each dispatcher object (one per layer) takes the next number of a per-process counter
  of the dispatchers built on its EP group (``registry.LAYER_IDS``). ASSUMPTION: every rank of the group builds its
  dispatchers (its MoE layers) on that group in the same order, as a model built by the same
  code on every rank does. The id is agreed at the first forward (``agree_config``), so a
  different build or call order is caught there; it is sent again in every size exchange.
  ``FUNCTIONAL_LAYER`` (-1) marks the functional ``dispatch``, which has no layer.
- ``step``: the forward count of that layer (of the functional API, per group): its size
  exchanges that succeeded. A failed one raises the same error on every rank, so the counts stay
  equal, and a layer works again after an error.

The size exchange compares both (``dispatcher.dropless.layout``); the return exchanges (combine, and the
backward's) carry the handle's tag in their status rows, and every receiver compares the
senders' tags with its own (``agreement.latch_call_mismatch``; ``agreement.check_call`` first,
on the host, under ``strict_call_order``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .comm import ProcessGroup
from .registry import FUNCTIONAL_STEPS, LAYER_IDS

FUNCTIONAL_LAYER = -1
_STEP_BITS = 32


@dataclass(frozen=True)
class CallId:
    """One call of one layer: ``layer`` (its id on the EP group, FUNCTIONAL_LAYER for the
    functional API) and ``step`` (that layer's forward count, from 0)."""

    layer: int
    step: int

    @property
    def tag(self) -> int:
        """(layer, step) as one int64 (equal exactly when both are, for steps below 2**32)."""
        return ((self.layer + 1) << _STEP_BITS) | (self.step & ((1 << _STEP_BITS) - 1))

    @classmethod
    def from_tag(cls, tag: int) -> "CallId":
        return cls((tag >> _STEP_BITS) - 1, tag & ((1 << _STEP_BITS) - 1))

    def __str__(self) -> str:
        return f"{layer_name(self.layer)} forward {self.step}"


def layer_name(layer: int) -> str:
    if layer == FUNCTIONAL_LAYER:
        return "the functional dispatch"
    return f"MoE layer #{layer}"


class StepCounter:
    """The forward count of one layer (or of the functional API on one group)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.steps = 0

    def call(self) -> CallId:
        """The CallId of the next forward (``advance`` once its size exchange succeeded)."""
        return CallId(self.layer, self.steps)

    def advance(self) -> None:
        self.steps += 1


def new_layer_id(group: ProcessGroup) -> int:
    """The next layer id on ``group`` (0, 1, ... in construction order; see the assumption above)."""
    layer = LAYER_IDS.get(group) or 0
    LAYER_IDS.set(group, layer + 1)
    return layer


def functional_counter(group: ProcessGroup) -> StepCounter:
    """The step counter of the functional dispatches on ``group``."""
    return FUNCTIONAL_STEPS.setdefault(group, lambda: StepCounter(FUNCTIONAL_LAYER))
