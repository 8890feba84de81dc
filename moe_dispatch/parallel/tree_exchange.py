"""GradientTree's cross-rank step: one micro-step's nodes summed over the tree's group by recursive
doubling, at once or overlapped with the next micro-batch.

At doubling step k, group rank r adds the prefix of rank r xor 2^k: the two partners hold the two
halves of one tree node, and a + b is the same bits as b + a, so both then hold the node. Overlapped,
the steps run on a worker thread over a process group of the same ranks made for it, so that its
collectives never interleave with those the caller's thread runs meanwhile (the calls'
agreements, the layers' dispatch); the values are the same either way.
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

__all__ = ["DoublingExchange"]

_EXCHANGE_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a group -> its overlapped exchange's group


def _exchange_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A process group of the same ranks as ``group``, in the same order, made once per group
    (every rank of group builds its trees in the same order, so they make it alike)."""
    if group not in _EXCHANGE_GROUPS:
        _EXCHANGE_GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                                                 use_local_synchronization=True)
    return _EXCHANGE_GROUPS[group]


class DoublingExchange:
    """Recursive doubling over ``group`` (``world`` ranks, a power of two; this one ``rank``).

    ``start(flat, prefix, then, at_once)`` sums ``flat`` [n] in place: at step k over its first
    ``prefix[k]`` values (the parameters that have joined by step k come first), then calls
    ``then()``. With ``overlap`` and not ``at_once`` it returns at once and the work runs on the
    worker thread, on the CUDA stream ``flat`` was made on; ``finish()`` waits for it and calls
    the ``then``s in order (an error in the exchange raises there).

    ``busy_seconds`` and ``sent_bytes`` count, since it was made, the wall time of the doubling
    steps (on the worker thread when overlapped; gloo waits for its host copies inside them) and
    the bytes this rank sent: what a benchmark reads to say where a step's time goes."""

    def __init__(self, group: Optional[dist.ProcessGroup], world: int, rank: int, overlap: bool) -> None:
        self.world, self.rank, self.steps = world, rank, int(math.log2(world))
        self._worker: Optional[ThreadPoolExecutor] = None
        self._group = WeakGroup(group)
        if overlap and world > 1:
            self._group = WeakGroup(_exchange_group(group))
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="GradientTree")
        self._pending: List[Tuple[Future, torch.Tensor, Callable[[], None]]] = []
        self.busy_seconds, self.sent_bytes = 0.0, 0

    def start(self, flat: torch.Tensor, prefix: Sequence[int], then: Callable[[], None], at_once: bool) -> None:
        if self._worker is None or at_once:
            self._doubling(flat, prefix, None)
            then()
            return
        stream = torch.cuda.current_stream(flat.device) if flat.is_cuda else None
        self._pending.append((self._worker.submit(self._doubling, flat, prefix, stream), flat, then))

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

    def _doubling(self, flat: torch.Tensor, prefix: Sequence[int], stream: Optional[torch.cuda.Stream]) -> None:
        start = time.perf_counter()
        if stream is None:
            for k in range(self.steps):
                self._step(flat, prefix[k], k)
        else:
            with torch.cuda.stream(stream):  # a new thread would start on the device's default stream
                for k in range(self.steps):
                    self._step(flat, prefix[k], k)
        self.busy_seconds += time.perf_counter() - start

    def _step(self, flat: torch.Tensor, n: int, k: int) -> None:
        """Step k: add the first n values of group rank (rank xor 2^k)."""
        if n == 0:
            return
        peer = self.rank ^ (1 << k)
        splits = [n if r == peer else 0 for r in range(self.world)]
        received = torch.empty(n, dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(received, flat[:n].contiguous(), splits, splits, group=self._group())
        flat[:n].add_(received)  # a + b == b + a: both partners hold the same node
        self.sent_bytes += n * flat.element_size()
