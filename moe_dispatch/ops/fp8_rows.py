"""``Fp8Rows``: rows quantised per row, the FP8 payload that a dispatch carries instead of a tensor.

A dispatch moves one payload through the same stages: the tokens themselves (a tensor [T, H]), or
``Fp8Rows`` (float8 values [N, H] with one fp32 scale per row, ``quantize_rows``). How FP8 rows
travel is a property of the payload: the wire row packs a row's fp8 bytes (H), its fp32 scale (4
bytes) and 12 zero bytes into H + 16 bytes, so that every row starts 16-byte aligned and the FP8
GEMMs read the received rows in place (``from_wire`` returns views, no copy). The wire rows are
viewed as (H + 16) / 2 bfloat16 elements, so that the exchanges, ``permute`` and its zero padding
move them as plain 16-bit rows: bitwise copies, never arithmetic. Against bf16 rows (2H bytes)
that is (H + 16) / 2H of the bytes: 0.502 at H = 4096.

Quantised bytes carry no gradient: an ``Fp8Rows`` names the tensor their gradient goes to,
``grad_sink`` [N, H] (straight-through: the gradient of the dequantised rows). The tokens' payload
names the tokens themselves (``quantize``); the expert rows' payload a tensor that the dispatch's
autograd links back to the tokens' owners. Its values are never read; its dtype is the rows'
output dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .quantize import quantize_rows

SCALE_BYTES = 4  # the fp32 scale after the fp8 row
ROW_ALIGN = 16  # wire row bytes: a multiple of 16 (the FP8 GEMMs' row alignment), zero-filled after the scale
WIRE_DTYPE = torch.bfloat16  # how the wire row's bytes are viewed: 2 bytes an element


def wire_width(hidden_size: int) -> int:
    """W, the wire row's elements: (H + 16) / 2 (H a multiple of 16)."""
    return (hidden_size + ROW_ALIGN) // WIRE_DTYPE.itemsize


@dataclass(frozen=True)
class Fp8Rows:
    """Rows quantised per row: value of row i = ``data[i].float() * scales[i]``. Immutable.

    Attributes:
        data: [N, H] float8 (a view of ``wire`` when unpacked from it).
        scales: [N] float32, one per row.
        grad_sink: [N, H] float (or the tokens' [S, B, H]), the tensor the rows' gradient goes to
            (the quantised rows carry none); its values are never read. None: no gradient.
        wire: [N, W] WIRE_DTYPE, the packed rows that ``data`` and ``scales`` view, when they came
            from one (``from_wire``); None: ``packed()`` packs them.
    """

    data: torch.Tensor
    scales: torch.Tensor
    grad_sink: Optional[torch.Tensor] = None
    wire: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        data, scales = self.data, self.scales
        if not isinstance(data, torch.Tensor) or data.dim() != 2 or data.element_size() != 1 \
                or not data.is_floating_point():
            got = f"{data.dtype} {list(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
            raise ValueError(f"Fp8Rows.data must be float8 [N, H], got {got}")
        if not isinstance(scales, torch.Tensor) or scales.shape != data.shape[:1] or scales.dtype != torch.float32 \
                or scales.device != data.device:
            got = (f"{scales.dtype} {list(scales.shape)} on {scales.device}" if isinstance(scales, torch.Tensor)
                   else type(scales).__name__)
            raise ValueError(f"Fp8Rows.scales must be float32 [{data.shape[0]}] on {data.device}, got {got}")
        sink = self.grad_sink
        if sink is not None and (not isinstance(sink, torch.Tensor) or not sink.is_floating_point()
                                 or sink.numel() != data.numel() or sink.shape[-1:] != data.shape[1:]):
            got = f"{sink.dtype} {list(sink.shape)}" if isinstance(sink, torch.Tensor) else type(sink).__name__
            raise ValueError(f"Fp8Rows.grad_sink must be a float tensor of {list(data.shape)}'s rows, got {got}")

    @property
    def hidden_size(self) -> int:
        return self.data.shape[1]

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @classmethod
    def quantize(cls, x: torch.Tensor, fp8_dtype: torch.dtype) -> "Fp8Rows":
        """x [T, H] float -> its rows quantised (``quantize_rows``), their gradient to x itself."""
        data, scales = quantize_rows(x.detach(), fp8_dtype)
        return cls(data, scales, x)

    def packed(self) -> torch.Tensor:
        """The wire rows [N, W] (WIRE_DTYPE; no autograd): each row's fp8 bytes, then its fp32
        scale's, then zeros up to W."""
        if self.wire is not None:
            return self.wire
        N = self.data.shape[0]
        # One concatenation of 4-byte words (H is a multiple of 16): a byte-wise copy into the rows'
        # strided [:, :H] columns ran one byte a thread, slower than the quantisation itself.
        words = torch.cat([self.data.contiguous().view(torch.int32), self.scales.view(torch.int32).view(N, 1),
                           torch.zeros((N, (ROW_ALIGN - SCALE_BYTES) // 4), dtype=torch.int32, device=self.device)],
                          dim=1)
        return words.view(WIRE_DTYPE)

    @classmethod
    def from_wire(cls, wire: torch.Tensor, hidden_size: int, fp8_dtype: torch.dtype,
                  grad_sink: Optional[torch.Tensor] = None, *, contiguous_scales: bool = True) -> "Fp8Rows":
        """The wire rows [N, W] -> Fp8Rows: data [N, H] a view of the rows' bytes (row-major, row
        stride 2W bytes, 16-byte aligned); scales [N] fp32, contiguous (a strided view without
        ``contiguous_scales``). Zero rows (padding) give zeros and scale 0."""
        N, H = wire.shape[0], hidden_size
        if wire.dim() != 2 or wire.shape[1] != wire_width(H) or wire.dtype != WIRE_DTYPE:
            raise ValueError(f"fp8 wire rows must be [N, {wire_width(H)}] {WIRE_DTYPE}, got {wire.dtype} "
                             f"{list(wire.shape)}")
        wire = wire.contiguous()
        raw = wire.view(torch.uint8)
        data = raw[:, :H].view(fp8_dtype)
        scales = raw[:, H : H + SCALE_BYTES].view(torch.float32).reshape(N)
        return cls(data, scales.contiguous() if contiguous_scales else scales, grad_sink, wire)
