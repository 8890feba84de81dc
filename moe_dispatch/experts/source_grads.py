"""`SourceGrads`: where a `LocalExperts` module puts its per-source weight gradients.

At EP P one backward of the experts mixes the rows of P sources (the ranks of the EP group). A
consumer that needs each source's share of a weight gradient on its own (the layout-invariant
`moe_dispatch.parallel.GradientTree`) hands the experts a store:

    store = SourceGrads()
    experts.collect_source_grads(store)   # on: the weights get no .grad from the layer's backward
    ...                                   # forwards with source blocks, their backwards
    grads = store.take("weight1")         # [E_local, P, ...] per backward, in backward order
    experts.collect_source_grads(None)    # off: .grad as usual

The layer gives the experts source blocks (``ExpertRows.source_blocks``) only while
``experts.source_grads`` is a store; each backward then adds one [E_local, P, ...] tensor per
weight, in the weight's dtype. The store is the one thing the two share: the experts write it,
its consumer takes from it.
"""
from __future__ import annotations

from typing import Dict, List

import torch


class SourceGrads:
    """Per-(local expert, source) weight gradients awaiting their consumer: weight name ->
    [E_local, P, ...] tensors, one per backward since the last `take`, in backward order."""

    def __init__(self) -> None:
        self._by_weight: Dict[str, List[torch.Tensor]] = {}

    def add(self, name: str, grad: torch.Tensor) -> None:
        """Add one backward's gradient [E_local, P, ...] of weight ``name`` (the experts' backward)."""
        self._by_weight.setdefault(name, []).append(grad)

    def take(self, name: str) -> List[torch.Tensor]:
        """The gradients of weight ``name`` added since the last take, in order ([] if none); they
        are the caller's alone from here (it may add into them)."""
        return self._by_weight.pop(name, [])

    def held_bytes(self) -> int:
        """Bytes of the gradients waiting here now (between a backward and their `take`)."""
        return sum(g.numel() * g.element_size() for grads in self._by_weight.values() for g in grads)
