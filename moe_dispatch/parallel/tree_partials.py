"""The GradientTree's per-parameter state: a stack of partial sums over the micro-steps (a binary
counter), the store that pairs the experts' per-source gradients as they arrive, and the small
helpers the tree and its agreement share."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..experts import SourceGrads


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """[2^k, ...] -> [...]: ((x0 + x1) + (x2 + x3)) + ..., adjacent pairs level by level."""
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def first_differences(descriptions: List[List[str]]) -> str:
    """Each rank's first trained parameter that differs from the most common list's (on a tie, the
    lowest rank's), as text: descriptions[r] is group rank r's list."""
    common = max(descriptions, key=lambda d: (descriptions.count(d), -descriptions.index(d)))
    ref = descriptions.index(common)
    out = []
    for r, mine in enumerate(descriptions):
        if mine == common:
            continue
        i = next((i for i, (a, b) in enumerate(zip(mine, common)) if a != b), min(len(mine), len(common)))
        here = mine[i] if i < len(mine) else "(none)"
        there = common[i] if i < len(common) else "(none)"
        out.append(f"group rank {r}'s trained parameter #{i} is {here}, group rank {ref}'s is {there} "
                   f"({len(mine)} and {len(common)} trained parameters)")
    return ("the trained parameters (name, shape, dtype, in model order) differ: " + "; ".join(out))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def pair_sources(grad: torch.Tensor) -> torch.Tensor:
    """[E_local, P, ...] (one backward's per-source weight gradients, in the weight's dtype) ->
    [E_local, ...] in the accumulation dtype: the P blocks paired in source order,
    ((s0 + s1) + (s2 + s3)) + ..., by a binary counter, each block converted on its own (exact),
    so at most log2(P) + 1 converted blocks live at once."""
    acc = accumulation_dtype(grad.dtype)
    stack: List[Tuple[int, torch.Tensor]] = []
    for s in range(grad.shape[1]):
        block = grad[:, s].to(acc)
        level = 0
        while stack and stack[-1][0] == level:
            block = stack.pop()[1].add_(block)
            level += 1
        stack.append((level, block))
    (_, node), = stack
    return node


class PairedSourceGrads(SourceGrads):
    """The tree's store for a sharded `LocalExperts`: each backward's [E_local, P, ...] is paired
    over its sources as it arrives (`pair_sources`), so from the backward to `add_micro_batch` a
    weight holds one [E_local, ...] partial in the accumulation dtype, whatever P, instead of P
    blocks. A further backward in the same micro-batch (the experts run twice) adds its pair into
    it, in backward order. `take` gives [that partial] ([] if none). ``largest_handed``: the bytes
    of the largest [E_local, P, ...] a backward handed over since the store was made, which lives
    inside that backward until paired (P times the local experts' weight, in its dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_handed = 0

    def add(self, name: str, grad: torch.Tensor) -> None:
        self.largest_handed = max(self.largest_handed, grad.numel() * grad.element_size())
        node = pair_sources(grad)
        held = self.take(name)
        super().add(name, held[0].add_(node) if held else node)


class ParameterPartials:
    """One trained parameter: its partials (a stack of (level, tensor)) and where it joins the
    cross-rank tree (``start``: the first doubling step; log2(P) for experts sharded over P ranks).
    ``source_grads``: a sharded expert weight's per-source gradients (its module's store), else None.
    ``name``: its name in its module (the store's key); ``qualname``: in the model."""

    def __init__(self, param: nn.Parameter, source_grads: Optional[SourceGrads], name: str, qualname: str,
                 start: int) -> None:
        self.param, self.source_grads, self.name, self.qualname = param, source_grads, name, qualname
        self.start = start
        self.dtype, self.shape = param.dtype, param.shape  # as built: the agreed layout
        self.stack: List[Tuple[int, torch.Tensor]] = []

    def describe(self) -> str:
        """'moe.0.experts.weight1 [2, 16, 32] float32 (EP 2)': what the ranks agree on, as text."""
        ep = f" (EP {1 << self.start})" if self.start else ""
        return f"{self.qualname} {list(self.shape)} {str(self.dtype).replace('torch.', '')}{ep}"

    def changed(self) -> Optional[str]:
        """How the parameter differs from the one the tree was built with (None: it does not)."""
        p = self.param
        if not p.requires_grad:
            return f"{self.qualname} was frozen (requires_grad=False) after the GradientTree was built"
        if p.dtype != self.dtype or p.shape != self.shape:
            return (f"{self.qualname} is {list(p.shape)} {str(p.dtype).replace('torch.', '')} now, "
                    f"{list(self.shape)} {str(self.dtype).replace('torch.', '')} when the GradientTree was built")
        return None

    def push(self, leaf: torch.Tensor, acc: torch.dtype) -> None:
        """Add a micro-batch's gradient (any float dtype; ours to keep or modify) to the stack. A
        leaf that completes a pair is added into its left partner in ``acc`` directly: the same
        bits as converting it first (the conversion is exact), without an ``acc`` copy of it."""
        if self.stack and self.stack[-1][0] == 0:
            _, left = self.stack.pop()
            self.stack.append((1, left.add_(leaf)))
        else:
            self.stack.append((0, leaf.to(acc)))
        while len(self.stack) >= 2 and self.stack[-1][0] == self.stack[-2][0]:
            level, right = self.stack.pop()
            _, left = self.stack.pop()
            self.stack.append((level + 1, left.add_(right)))


def push_views(flat: torch.Tensor, entries: Sequence[ParameterPartials], acc: torch.dtype) -> None:
    """Push each entry's node, a view of ``flat`` (the entries' nodes in order), on its stack."""
    offset = 0
    for e in entries:  # views of flat: it lives as long as a node of this micro-step does
        n = e.shape.numel()
        e.push(flat[offset:offset + n].view(e.shape), acc)
        offset += n
