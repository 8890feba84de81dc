"""Status rows, shared by both plans' exchanges: rows at the end of each chunk of an exchange that
carry a few words (a call tag, check words) instead of token rows, so that every receiver hears
from every sender, chunks without token rows too. Chunks of one size (the sync-free exchanges):
``write_status`` / ``read_status``; chunks of uneven sizes (the dropless return exchange):
``write_status_at`` / ``read_status_at`` at given row positions."""
from __future__ import annotations

import torch


def status_rows(row_bytes: int, status_bytes: int) -> int:
    """Rows that hold ``status_bytes`` in a buffer of ``row_bytes``-byte rows."""
    return -(-status_bytes // row_bytes)


def write_status(buf: torch.Tensor, chunks: int, chunk_rows: int, valid_rows: int, words: torch.Tensor) -> None:
    """Write words (int32 [W]) into the status rows (after ``valid_rows``) of each of buf's
    ``chunks`` chunks of ``chunk_rows`` rows."""
    raw = buf.view(torch.uint8).view(chunks, chunk_rows, -1)[:, valid_rows:].reshape(chunks, -1)
    raw[:, :words.numel() * 4].copy_(words.to(torch.int32).view(torch.uint8).expand(chunks, -1))


def read_status(buf: torch.Tensor, chunks: int, chunk_rows: int, valid_rows: int, count: int) -> torch.Tensor:
    """The max over the chunks of their ``count`` status words: int32 [count]."""
    raw = buf.view(torch.uint8).view(chunks, chunk_rows, -1)[:, valid_rows:].reshape(chunks, -1)
    return raw[:, :count * 4].contiguous().view(torch.int32).amax(0)


def _byte_rows(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.uint8).view(buf.shape[0], -1)


def write_status_at(buf: torch.Tensor, rows: torch.Tensor, chunks: int, words: torch.Tensor) -> None:
    """Chunks of uneven sizes: words (any dtype, [W]) at the start of each chunk's status rows,
    zeros after them. rows: int64 [chunks * S], each chunk's S consecutive status rows of
    buf [n, ...], chunk after chunk."""
    raw = _byte_rows(buf)
    content = raw.new_zeros((chunks, rows.shape[0] // chunks * raw.shape[1]))
    content[:, :words.numel() * words.element_size()] = words.reshape(-1).view(torch.uint8)
    raw.index_copy_(0, rows, content.view(rows.shape[0], raw.shape[1]))


def read_status_at(buf: torch.Tensor, rows: torch.Tensor, chunks: int, words: int, dtype: torch.dtype) -> torch.Tensor:
    """What write_status_at wrote: each chunk's first ``words`` words of ``dtype``, [chunks, words]."""
    raw = _byte_rows(buf).index_select(0, rows).view(chunks, -1)
    return raw[:, :words * dtype.itemsize].contiguous().view(dtype)
