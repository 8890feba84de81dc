"""The payload a dispatch carries: the tokens themselves (a tensor [T, H]) or ``Fp8Rows`` (the
tokens quantised per row, ``moe_dispatch.ops.fp8_rows``: how they pack into wire rows [T, W] and
unpack). Every stage runs alike on either; what travels is ``wire`` of the payload, and what
arrives is made the payload of the same type again (``received``).

A caller that passes tokens with ``DispatchConfig.fp8`` set has them quantised here, once, in
``prepare`` (``token_payload``): the same bits as an ``Fp8Rows.quantize`` of its own.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..config import FP8_FORMATS, DispatchConfig
from ..ops.fp8_rows import Fp8Rows, wire_width

Payload = Union[torch.Tensor, Fp8Rows]

__all__ = ["Fp8Rows", "Payload", "fp8_dtype", "pack_rows", "received", "split_payload", "token_payload",
           "unpack_rows", "wire_width"]


def fp8_dtype(fp8: str) -> torch.dtype:
    """The torch dtype of an ``fp8`` format name ('e4m3' -> torch.float8_e4m3fn)."""
    return FP8_FORMATS[fp8]


def pack_rows(x: torch.Tensor, fp8: str) -> torch.Tensor:
    """x [T, H] float -> the wire rows [T, W] of its rows quantised (no autograd)."""
    return Fp8Rows.quantize(x, fp8_dtype(fp8)).packed()


def unpack_rows(rows: torch.Tensor, hidden_size: int, fp8: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire rows [N, W] -> (q [N, H] fp8, a view of the rows' bytes; scales [N] fp32, contiguous)."""
    payload = Fp8Rows.from_wire(rows, hidden_size, fp8_dtype(fp8))
    return payload.data, payload.scales


def split_payload(hidden: Any, cfg: DispatchConfig) -> tuple[Any, Optional[Fp8Rows]]:
    """A caller's payload -> (the tokens that the plan checks, shapes and links autograd to; the
    FP8 rows given, or None). An ``Fp8Rows`` gives its ``grad_sink`` (the tokens) when it fits
    ``cfg.fp8``; one that does not is passed on as it is, for the input checks to refuse on every
    rank ("not a tensor"), before any collective could wait."""
    if not isinstance(hidden, Fp8Rows):
        return hidden, None
    fits = (cfg.fp8 is not None and hidden.fp8_dtype == fp8_dtype(cfg.fp8) and hidden.grad_sink is not None
            and hidden.grad_sink.reshape(-1, hidden.hidden_size).shape == hidden.data.shape)
    return (hidden.grad_sink, hidden) if fits else (hidden, None)


def token_payload(x: torch.Tensor, cfg: DispatchConfig, given: Optional[Fp8Rows]) -> Optional[Fp8Rows]:
    """What travels for the plan's tokens x [T, H] when it is not x itself: with ``cfg.fp8`` the
    rows given (when x is still their tokens) or x quantised (tokens given, or replaced or padded
    by the plan: quantised alike, row by row), else None."""
    if cfg.fp8 is None:
        return None
    if given is not None and given.grad_sink is not None and x.shape == given.data.shape and (
            x.data_ptr() == given.grad_sink.data_ptr()):
        return given
    return Fp8Rows.quantize(x, fp8_dtype(cfg.fp8))


def received(rows: torch.Tensor, sent: Optional[Fp8Rows]) -> Payload:
    """Rows that arrived ([R, H], or the wire rows [R, W] of FP8 rows) as the payload type sent:
    ``sent`` the token payload (None: the tokens themselves)."""
    if sent is None:
        return rows
    return Fp8Rows.from_wire(rows, sent.hidden_size, sent.fp8_dtype, contiguous_scales=False)
