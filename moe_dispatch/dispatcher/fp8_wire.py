"""The FP8 wire row (``DispatchConfig.fp8``): a token's row quantised with its own scale, as it travels.

Each token's row [H] is quantised once, before the dispatch, by ``ops.quantize_rows`` (per row:
scale = amax / fp8_max, so a token's bytes depend on the token alone). The wire row holds the fp8
row (H bytes), its fp32 scale (4 bytes) and 12 zero bytes: H + 16 bytes, so that every row starts
16-byte aligned and the FP8 GEMMs read the received rows in place (``unpack_rows`` returns views,
no copy). It is viewed as (H + 16) / 2 bfloat16 elements so that the exchanges, ``permute`` and its
zero padding move it as plain 16-bit rows: bitwise copies, never arithmetic. The probs travel
beside it in fp32 as ever. Against bf16 rows (2H bytes) that is (H + 16) / 2H of the bytes: 0.502
at H = 4096.

The rows carry no gradient (quantised bytes): the dispatch's autograd links to the unquantised
tokens instead, and the rows' gradient [N, H] reaches it through ``DispatchHandle.row_grad_sink``
(straight-through: the gradient of the dequantised rows).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import FP8_FORMATS, DispatchConfig
from ..ops import quantize_rows

SCALE_BYTES = 4  # the fp32 scale after the fp8 row
ROW_ALIGN = 16  # wire row bytes: a multiple of 16 (the FP8 GEMMs' row alignment), zero-filled after the scale
WIRE_DTYPE = torch.bfloat16  # how the wire row's bytes are viewed: 2 bytes an element


def fp8_dtype(fp8: str) -> torch.dtype:
    """The torch dtype of an ``fp8`` format name ('e4m3' -> torch.float8_e4m3fn)."""
    return FP8_FORMATS[fp8]


def wire_width(hidden_size: int) -> int:
    """W, the wire row's elements: (H + 16) / 2 (the config asks H a multiple of 16)."""
    return (hidden_size + ROW_ALIGN) // WIRE_DTYPE.itemsize


def pack_rows(x: torch.Tensor, fp8: str) -> torch.Tensor:
    """x [T, H] float -> the wire rows [T, W] (WIRE_DTYPE; no autograd): each row's fp8 bytes, then
    its fp32 scale's, then zeros up to W."""
    T, H = x.shape
    q, scales = quantize_rows(x.detach(), fp8_dtype(fp8))
    # One concatenation of 4-byte words (H is a multiple of 16): a byte-wise copy into the rows'
    # strided [:, :H] columns ran one byte a thread, slower than the quantisation itself.
    words = torch.cat([q.view(torch.int32), scales.view(torch.int32).view(T, 1),
                       torch.zeros((T, (ROW_ALIGN - SCALE_BYTES) // 4), dtype=torch.int32, device=x.device)], dim=1)
    return words.view(WIRE_DTYPE)


def wire_rows(x: torch.Tensor, cfg: DispatchConfig) -> Optional[torch.Tensor]:
    """What a plan sends for x [T, H]: the FP8 wire rows [T, W] when ``cfg.fp8``, else None (x)."""
    return pack_rows(x, cfg.fp8) if cfg.fp8 is not None else None


def unpack_rows(rows: torch.Tensor, hidden_size: int, fp8: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire rows [N, W] -> (q [N, H] fp8, a view of the rows' bytes: row-major, row stride 2W
    bytes, 16-byte aligned; scales [N] fp32, contiguous). Zero rows (padding) give zeros and scale 0."""
    N, H = rows.shape[0], hidden_size
    if rows.shape[1] != wire_width(H) or rows.dtype != WIRE_DTYPE:
        raise ValueError(f"fp8 wire rows must be [N, {wire_width(H)}] {WIRE_DTYPE}, got {rows.dtype} "
                         f"{list(rows.shape)}")
    raw = rows.contiguous().view(torch.uint8)
    q = raw[:, :H].view(fp8_dtype(fp8))
    scales = raw[:, H : H + SCALE_BYTES].view(torch.float32).reshape(N).contiguous()
    return q, scales
