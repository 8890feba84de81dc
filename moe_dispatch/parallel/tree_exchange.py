"""GradientTree's cross-rank step: one micro-step's nodes summed over the tree's group in tree
order, at once or overlapped with the next micro-batch.

The tree pairs group rank r with r xor 2^k at level k: the two partners hold the two halves of one
tree node, and a + b is the same bits as b + a, so it does not matter which of them adds. The sum
is a reduce-scatter by recursive halving followed by an all-gather by recursive doubling: at
halving step k each rank keeps half of the segment it holds (the lower half where bit k of its
rank is 0), sends the other half to its partner and adds the partner's copy of the kept half; after
the last step every value is complete on one rank, and the all-gather steps, in reverse, hand the
finished segments back. Every value is summed by the same pairs in the same order as if both
partners added the whole vector at every level (recursive doubling), so the bits are the same;
each rank sends 2 (W - 1) / W times the vector instead of log2(W) times, in 2 log2(W) collectives
instead of log2(W). A vector of fewer than ``halving_min_bytes`` (default 8 MiB) goes by recursive
doubling itself, where the collectives' latency, not the bytes, bounds the time: on 4 and 8 gloo
ranks on CPU the two break even at 4-8 MiB, halving 1.5-2.2x faster at 64 MiB and up to 2x slower
at 1 MiB (scripts/measure/tree_exchange.py). Both give the same bits, and every rank chooses alike
(the vector's size is the same on every rank).

Values join at their own level (``prefix``: the values of level k come first); a group of values
that joins at level j is halved over levels j.. only. Overlapped, the steps run on a worker thread
over a process group of the same ranks made for it, so that its collectives never interleave with
those the caller's thread runs meanwhile (the calls' agreements, the layers' dispatch); the values
are the same either way.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ..distributed.comm import WeakGroup

__all__ = ["TreeExchange"]

_EXCHANGE_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a group -> its overlapped exchange's group


def _exchange_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A process group of the same ranks as ``group``, in the same order, made once per group
    (every rank of group builds its trees in the same order, so they make it alike)."""
    if group not in _EXCHANGE_GROUPS:
        _EXCHANGE_GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                                                 use_local_synchronization=True)
    return _EXCHANGE_GROUPS[group]


class TreeExchange:
    """The tree's sum over ``group`` (``world`` ranks, a power of two; this one ``rank``).

    ``start(flat, prefix, then, at_once)`` sums ``flat`` [n] in place: at level k over its first
    ``prefix[k]`` values (the parameters that have joined by level k come first), then calls
    ``then()``. With ``overlap`` and not ``at_once`` it returns at once and the work runs on the
    worker thread, on the CUDA stream ``flat`` was made on; ``finish()`` waits for it and calls
    the ``then``s in order (an error in the exchange raises there).

    ``busy_seconds`` and ``sent_bytes`` count, since it was made, the wall time of the exchange's
    steps (on the worker thread when overlapped; gloo waits for its host copies inside them) and
    the bytes this rank sent: what a benchmark reads to say where a step's time goes."""

    def __init__(self, group: Optional[dist.ProcessGroup], world: int, rank: int, overlap: bool,
                 halving_min_bytes: int = 8 << 20) -> None:
        self.world, self.rank, self.steps = world, rank, int(math.log2(world))
        self.halving_min_bytes = halving_min_bytes
        self._worker: Optional[ThreadPoolExecutor] = None
        self._group = WeakGroup(group)
        if overlap and world > 1:
            self._group = WeakGroup(_exchange_group(group))
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="GradientTree")
        self._pending: List[Tuple[Future, torch.Tensor, Callable[[], None]]] = []
        self.busy_seconds, self.sent_bytes = 0.0, 0

    def start(self, flat: torch.Tensor, prefix: Sequence[int], then: Callable[[], None], at_once: bool) -> None:
        if self._worker is None or at_once:
            self._reduce(flat, prefix, None)
            then()
            return
        stream = torch.cuda.current_stream(flat.device) if flat.is_cuda else None
        self._pending.append((self._worker.submit(self._reduce, flat, prefix, stream), flat, then))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for future, _, then in pending:
            future.result()
            then()

    def drop(self) -> None:
        """Wait for the exchanges in flight (every rank started them) and forget their nodes."""
        pending, self._pending = self._pending, []
        for future, *_ in pending:
            future.exception()

    def held_bytes(self) -> int:
        """Bytes of the nodes in flight."""
        return sum(flat.numel() * flat.element_size() for _, flat, _ in self._pending)

    def _reduce(self, flat: torch.Tensor, prefix: Sequence[int], stream: Optional[torch.cuda.Stream]) -> None:
        start = time.perf_counter()
        levels = self._halving_then_gather if flat.numel() * flat.element_size() >= self.halving_min_bytes \
            else self._doubling
        if stream is None:
            levels(flat, prefix)
        else:
            with torch.cuda.stream(stream):  # a new thread would start on the device's default stream
                levels(flat, prefix)
        self.busy_seconds += time.perf_counter() - start

    def _doubling(self, flat: torch.Tensor, prefix: Sequence[int]) -> None:
        """Recursive doubling: at level k both partners add the whole joined prefix."""
        for k in range(self.steps):
            if prefix[k]:
                received = self._swap(flat, [(0, prefix[k])], [(0, prefix[k])], k)
                flat[:prefix[k]].add_(received)  # a + b == b + a: both partners hold the same node

    def _halving_then_gather(self, flat: torch.Tensor, prefix: Sequence[int]) -> None:
        """The module docstring's two phases. ``held[j]``: the segment [lo, hi) of the values
        joining at level j (``prefix[j-1]`` to ``prefix[j]``) that this rank holds now;
        ``given[k][j]``: the half of it that halving step k sent to the partner, which the partner
        finishes and the all-gather's step k hands back."""
        bounds = [0, *prefix]
        held = [(bounds[j], bounds[j + 1]) for j in range(self.steps)]
        given: List[List[Tuple[int, int]]] = []
        for k in range(self.steps):  # reduce-scatter: keep one half, add the partner's copy of it
            if prefix[k] == 0:  # nothing has joined (the same on every rank: the collective is skipped by all)
                given.append([])
                continue
            low_half = not (self.rank >> k) & 1
            give = []
            for j in range(k + 1):  # the values that have joined by level k
                lo, hi = held[j]
                mid = lo + (hi - lo) // 2  # the partner, whose bits below k are ours, splits alike
                held[j], other = ((lo, mid), (mid, hi)) if low_half else ((mid, hi), (lo, mid))
                give.append(other)
            given.append(give)
            keep = held[:k + 1]
            received = self._swap(flat, give, keep, k)
            for (lo, hi), part in zip(keep, received.split([hi - lo for lo, hi in keep])):
                flat[lo:hi].add_(part)  # a + b == b + a: either partner may add
        for k in reversed(range(self.steps)):  # all-gather: hand back the finished segments
            if prefix[k] == 0:
                continue
            mine, theirs = held[:k + 1], given[k]
            received = self._swap(flat, mine, theirs, k)
            for j, ((lo, hi), part) in enumerate(zip(theirs, received.split([hi - lo for lo, hi in theirs]))):
                flat[lo:hi].copy_(part)
                held[j] = (min(lo, held[j][0]), max(hi, held[j][1]))  # the two halves: step k's segment

    def _swap(self, flat: torch.Tensor, send: Sequence[Tuple[int, int]], receive: Sequence[Tuple[int, int]],
              k: int) -> torch.Tensor:
        """Send ``flat``'s segments ``send`` to the partner of level k (rank xor 2^k) and return what
        it sends: as many values as the segments ``receive`` hold (its ``send`` is our ``receive``)."""
        n_send, n_receive = sum(hi - lo for lo, hi in send), sum(hi - lo for lo, hi in receive)
        received = torch.empty(n_receive, dtype=flat.dtype, device=flat.device)
        peer = self.rank ^ (1 << k)
        outgoing = torch.cat([flat[lo:hi] for lo, hi in send])
        dist.all_to_all_single(received, outgoing, [n_receive if r == peer else 0 for r in range(self.world)],
                               [n_send if r == peer else 0 for r in range(self.world)], group=self._group())
        self.sent_bytes += n_send * flat.element_size()
        return received
