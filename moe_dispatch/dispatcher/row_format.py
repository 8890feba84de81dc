"""How rows travel in both plans' exchanges: ``RowFormat``, the byte layout of a packed row
(probs, hidden, routing at aligned offsets, read back as strided views without unpacking copies),
and ``Received``, what a forward exchange delivered."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..numerics.rounding import round_up


@dataclass(frozen=True)
class RowFormat:
    """Byte layout of one packed row: probs [k] (if probs_dtype), hidden [H], routing [k] bool
    (if routing). Parts start at 16-byte aligned offsets; the row is a multiple of 16 bytes.
    Without probs and routing the buffer is plain [n, H] in hidden_dtype."""

    hidden_size: int
    hidden_dtype: torch.dtype
    num_cols: int
    probs_dtype: Optional[torch.dtype]
    routing: bool

    @property
    def plain(self) -> bool:
        return self.probs_dtype is None and not self.routing

    def _offsets(self) -> tuple[int, int, int]:
        p = self.num_cols * self.probs_dtype.itemsize if self.probs_dtype is not None else 0
        h0 = round_up(p, 16)
        r0 = h0 + self.hidden_size * self.hidden_dtype.itemsize
        width = round_up(r0 + (self.num_cols if self.routing else 0), 16)
        return h0, r0, width

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        if self.plain:
            return torch.empty((rows, self.hidden_size), dtype=self.hidden_dtype, device=device)
        return torch.empty((rows, self._offsets()[2]), dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor, routing_dtype: torch.dtype = torch.bool,
              ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """buf -> (hidden [n, H], probs [n, k] or None, routing [n, k] or None), strided views;
        the routing as ``routing_dtype``: bool, or uint8 (0 / 1)."""
        if self.plain:
            return buf, None, None
        h0, r0, _ = self._offsets()
        hidden = buf[:, h0:r0].view(self.hidden_dtype)
        probs = routing = None
        if self.probs_dtype is not None:
            probs = buf[:, :self.num_cols * self.probs_dtype.itemsize].view(self.probs_dtype)
        if self.routing:
            routing = buf[:, r0:r0 + self.num_cols].view(routing_dtype)
        return hidden, probs, routing

    def pack(self, buf: torch.Tensor, hidden: torch.Tensor, probs: Optional[torch.Tensor],
             routing: Optional[torch.Tensor], index: Optional[torch.Tensor] = None) -> None:
        """buf's rows = the rows ``index`` of hidden [R, H], probs [R, k], routing [R, k] (all rows
        in order without index). The hidden rows are copied straight into the buffer (one pass);
        the small probs and routing parts through an index_select."""
        if index is not None:
            probs = probs.index_select(0, index) if probs is not None else None
            routing = routing.index_select(0, index) if routing is not None else None
        self.write(buf, hidden, probs, routing, index)

    def write(self, buf: torch.Tensor, hidden: torch.Tensor, probs: Optional[torch.Tensor],
              routing: Optional[torch.Tensor], hidden_index: Optional[torch.Tensor] = None) -> None:
        """buf's rows = probs [n, k], routing [n, k] and the rows ``hidden_index`` of hidden [R, H]
        (hidden [n, H] itself without it).

        The byte views are taken here, from ``buf``, and written at once: under torch.compile,
        views of one buffer in different dtypes that reach a graph as separate inputs and are
        written there make AOT autograd rebuild them from one "synthetic base", which cannot
        reinterpret bytes (a PyTorch internal assert). The routing is written as bytes: torch
        2.11's inductor cannot lower a view of uint8 as bool."""
        h, p, r = self.views(buf, torch.uint8)
        _gather_rows_into(h, hidden, hidden_index)
        if p is not None:
            p.copy_(probs)
        if r is not None:
            r.copy_(routing)


def _gather_rows_into(out: torch.Tensor, src: torch.Tensor, index: Optional[torch.Tensor]) -> None:
    """out [n, H] (a strided view) = src[index] (src itself without index). Eager: one pass
    (index_select with out=). torch.compile breaks the graph at an out= that is not contiguous,
    so there a gather and a copy, which the compiler can fuse."""
    if index is None:
        out.copy_(src)
    elif torch.compiler.is_compiling():
        out.copy_(src.index_select(0, index))
    else:
        torch.index_select(src, 0, index, out=out)


@dataclass(frozen=True)
class Received:
    """What the forward exchange delivered: hidden [R, H], probs [R, El] and routing [R, El]
    (None when not sent) as views of one buffer; ``order``: the source rank of each segment;
    ``words``: the sync-free dispatch's check words (sync_free/words.py), None otherwise."""

    hidden: torch.Tensor
    probs: torch.Tensor
    routing: Optional[torch.Tensor]
    order: tuple[int, ...]
    words: Optional[torch.Tensor] = None
