"""The registered torch.library ops of moe_dispatch.ops and the entry points callers use.

Each op takes tensors and ints only and has a fake implementation for torch.compile; the ones with
a backward register it here. ``_impl`` picks the backend per call: the Triton kernels
(kernels/) for CUDA tensors, the pure-torch twin (torch_twin.py) for CPU tensors, or one
forced by ``set_backend``. Arguments added after an op's first release come last, with defaults,
so calls written against the older schema keep working.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from ..numerics.autograd import refuse_double_backward
from . import fingerprint, guard, torch_twin

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("MOE_DISPATCH_BACKEND", "auto")


@contextlib.contextmanager
def set_backend(name: str) -> Iterator[None]:
    """Force a backend inside the block: 'auto' (CUDA -> Triton, CPU -> torch), 'torch' or 'triton'."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def _uses_triton(x: torch.Tensor) -> bool:
    return _backend == "triton" or (_backend == "auto" and x.is_cuda)


def _impl(x: torch.Tensor):
    if not _uses_triton(x):
        return torch_twin
    from . import kernels  # imported lazily: CPU-only users need no Triton
    return kernels


# --------------------------------------------------------------------------------------------
# Custom ops (tensors and ints only), with fake implementations for torch.compile.
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("moe_dispatch::make_slots", mutates_args=())
def _make_slots_op(routing_map: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(routing_map).make_slots(routing_map, pad_multiple)


@_make_slots_op.register_fake
def _(routing_map, pad_multiple):
    T, E = routing_map.shape
    return (routing_map.new_empty((T, 2 * E + 1), dtype=torch.int32),
            routing_map.new_empty((E + 1,), dtype=torch.int64))


@torch.library.custom_op("moe_dispatch::make_slots_checked", mutates_args=())
def _make_slots_checked_op(routing_map: torch.Tensor, pad_multiple: int, probs: Optional[torch.Tensor],
                           given_counts: Optional[list[int]],
                           given_max: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(routing_map).make_slots_checked(routing_map, pad_multiple, probs, given_counts, given_max)


@_make_slots_checked_op.register_fake
def _(routing_map, pad_multiple, probs, given_counts, given_max):
    T, E = routing_map.shape
    return (routing_map.new_empty((T, 2 * E + 1), dtype=torch.int32),
            routing_map.new_empty((E + 1 + guard.STATUS_WORDS,), dtype=torch.int64))


@torch.library.custom_op("moe_dispatch::permute_rows", mutates_args=())
def _permute_op(tokens: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor], num_out: int,
                zero_fill: bool,
                row_scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> (rows [num_out, H], their probs [num_out] or [0], their scales [num_out] or [0]).
    return _impl(tokens).permute_rows(tokens, slots, probs, num_out, zero_fill, row_scales=row_scales)


@_permute_op.register_fake
def _(tokens, slots, probs, num_out, zero_fill, row_scales=None):
    out_probs = probs.new_empty((num_out,)) if probs is not None else tokens.new_empty((0,), dtype=torch.float32)
    out_scales = tokens.new_empty((num_out if row_scales is not None else 0,), dtype=torch.float32)
    return tokens.new_empty((num_out, tokens.shape[1])), out_probs, out_scales


@torch.library.custom_op("moe_dispatch::permute_rows_backward", mutates_args=())
def _permute_bwd_op(grad: torch.Tensor, slots: torch.Tensor, grad_probs: Optional[torch.Tensor],
                    probs_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(grad).permute_rows_backward(grad, slots, grad_probs, probs_dtype)


@_permute_bwd_op.register_fake
def _(grad, slots, grad_probs, probs_dtype):
    T, E = slots.shape[0], (slots.shape[1] - 1) // 2
    gp = grad.new_empty((T, E) if grad_probs is not None else (0,), dtype=probs_dtype)
    return grad.new_empty((T, grad.shape[1])), gp


def _permute_setup(ctx, inputs, output):
    tokens, slots, probs, _, _, _ = inputs
    ctx.mark_non_differentiable(output[2])  # row scales are constants of the quantisation
    ctx.save_for_backward(slots)
    ctx.has_probs = probs is not None
    ctx.probs_dtype = probs.dtype if probs is not None else torch.float32


def _permute_backward(ctx, grad_out, grad_out_probs, _grad_out_scales):
    refuse_double_backward("moe_dispatch::permute_rows")
    (slots,) = ctx.saved_tensors
    grad_probs = None
    if ctx.has_probs:
        grad_probs = grad_out_probs if grad_out_probs is not None else torch.zeros(
            grad_out.shape[0], dtype=ctx.probs_dtype, device=grad_out.device)
    grad_tokens, grad_token_probs = _permute_bwd_op(grad_out.contiguous(), slots, grad_probs, ctx.probs_dtype)
    return grad_tokens, None, (grad_token_probs if ctx.has_probs else None), None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("moe_dispatch::unpermute_rows", mutates_args=())
def _unpermute_op(rows: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor], has_pad_rows: bool,
                  max_slots: int, row_scales: Optional[torch.Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    # has_pad_rows and max_slots only matter to the backward: pad rows get an explicit zero
    # gradient; max_slots sizes its buffer of partial probability gradients.
    return _impl(rows).unpermute_rows(rows, slots, probs, row_scales=row_scales, out_dtype=out_dtype)


@_unpermute_op.register_fake
def _(rows, slots, probs, has_pad_rows, max_slots, row_scales=None, out_dtype=None):
    return rows.new_empty((slots.shape[0], rows.shape[1]), dtype=out_dtype or rows.dtype)


@torch.library.custom_op("moe_dispatch::unpermute_rows_backward", mutates_args=())
def _unpermute_bwd_op(grad: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                      probs: Optional[torch.Tensor], zero_fill: bool, max_slots: int,
                      row_scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(rows).unpermute_rows_backward(grad, rows, slots, probs, zero_fill, max_slots, row_scales=row_scales)


@_unpermute_bwd_op.register_fake
def _(grad, rows, slots, probs, zero_fill, max_slots, row_scales=None):
    gp = (probs.new_empty(probs.shape) if probs is not None else rows.new_empty((0,), dtype=torch.float32))
    return rows.new_empty(rows.shape), gp


def _unpermute_setup(ctx, inputs, output):
    rows, slots, probs, has_pad_rows, max_slots, row_scales, _ = inputs
    ctx.save_for_backward(rows, slots, probs, row_scales)
    ctx.has_pad_rows = has_pad_rows
    ctx.max_slots = max_slots


def _unpermute_backward(ctx, grad_out):
    refuse_double_backward("moe_dispatch::unpermute_rows")
    rows, slots, probs, row_scales = ctx.saved_tensors
    grad_rows, grad_probs = _unpermute_bwd_op(grad_out.contiguous(), rows, slots, probs, ctx.has_pad_rows,
                                              ctx.max_slots, row_scales)
    return grad_rows, None, grad_probs if probs is not None else None, None, None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


@torch.library.custom_op("moe_dispatch::gather_rows", mutates_args=())
def _gather_rows_op(x: torch.Tensor, index: torch.Tensor, inverse_index: torch.Tensor) -> torch.Tensor:
    return _impl(x).gather_rows(x, index)


@_gather_rows_op.register_fake
def _(x, index, inverse_index):
    return x.new_empty((index.shape[0], x.shape[1]))


def _gather_setup(ctx, inputs, output):
    _, index, inverse_index = inputs
    ctx.save_for_backward(index, inverse_index)


def _gather_backward(ctx, grad):
    refuse_double_backward("moe_dispatch::gather_rows")
    index, inverse_index = ctx.saved_tensors
    # A permutation: the gradient is the inverse gather, no sums involved.
    return _gather_rows_op(grad.contiguous(), inverse_index, index), None, None


_gather_rows_op.register_autograd(_gather_backward, setup_context=_gather_setup)


@torch.library.custom_op("moe_dispatch::bits_fingerprint", mutates_args=())
def _bits_fingerprint_op(t: torch.Tensor) -> torch.Tensor:
    return _fingerprint_impl(t).bits_fingerprint(t)


@_bits_fingerprint_op.register_fake
def _(t):
    return t.new_empty((2,), dtype=torch.int64)


def _fingerprint_impl(t: torch.Tensor):
    """fingerprint.py (the torch twin) or kernels/fingerprint.py (Triton), as ``_impl`` picks."""
    if not _uses_triton(t):
        return fingerprint
    from .kernels import fingerprint as fingerprint_kernel  # imported lazily: CPU-only users need no Triton
    return fingerprint_kernel


# --------------------------------------------------------------------------------------------
# Callers go through these: the registered op under torch.compile or when autograd needs its
# backward; otherwise the backend function directly (the op wrapper's host time per call is
# measurable, BENCHMARKS.md, and these run several times per dispatch). Same function, same bits.
# --------------------------------------------------------------------------------------------
def _direct(*tensors: Optional[torch.Tensor]) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def make_slots(routing_map: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots int32 [T, 2E+1], stats int64 [E+1]: per-expert counts, then the most experts of a
    token) for a contiguous bool routing_map [T, E]. Never differentiable."""
    if _direct():
        return _impl(routing_map).make_slots(routing_map, pad_multiple)
    return _make_slots_op(routing_map, pad_multiple)


def make_slots_checked(routing_map: torch.Tensor, pad_multiple: int, probs: Optional[torch.Tensor],
                       given_counts: Optional[list[int]],
                       given_max: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """make_slots with permute's device-side checks (guard.py): (slots, stats int64
    [E + 1 + STATUS_WORDS]: make_slots' stats, then the device's status words)."""
    if _direct():
        return _impl(routing_map).make_slots_checked(routing_map, pad_multiple, probs, given_counts, given_max)
    return _make_slots_checked_op(routing_map, pad_multiple, probs, given_counts, given_max)


def permute_rows(tokens: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor], num_out: int,
                 zero_fill: bool, row_scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """The permute_rows op: tokens [T, H] -> ([num_out, H], row probs [num_out] or a placeholder),
    and with row_scales (fp32 [T], contiguous) a third item, the rows' scales [num_out] fp32."""
    if _direct(tokens, probs):
        out = _impl(tokens).permute_rows(tokens, slots, probs, num_out, zero_fill, row_scales=row_scales)
    else:
        out = _permute_op(tokens, slots, probs, num_out, zero_fill, row_scales)
    return out if row_scales is not None else out[:2]


def unpermute_rows(rows: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor], has_pad_rows: bool,
                   max_slots: int, row_scales: Optional[torch.Tensor] = None,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The unpermute_rows op: rows [N, H] (row_scales [N] fp32, contiguous) -> [T, H] in out_dtype
    (default rows.dtype); has_pad_rows and max_slots serve the backward."""
    out_dtype = out_dtype or rows.dtype
    if _direct(rows, probs):
        return _impl(rows).unpermute_rows(rows, slots, probs, row_scales=row_scales, out_dtype=out_dtype)
    return _unpermute_op(rows, slots, probs, has_pad_rows, max_slots, row_scales, out_dtype)


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse_index: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation ``index`` [M] (``inverse_index`` serves the backward)."""
    if _direct(x):
        return _impl(x).gather_rows(x, index)
    return _gather_rows_op(x, index, inverse_index)


def bits_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] on t's device: the fingerprint of t's bits (``moe_dispatch.ops.fingerprint``'s
    definition; equal bits, dtype size and element count give equal values on any device and
    backend). t: any shape, strides and dtype of 1, 2, 4 or 8 bytes; never differentiable."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bits_fingerprint: t must be a torch.Tensor, got {type(t).__name__}")
    if t.element_size() not in (1, 2, 4, 8):
        raise TypeError(f"bits_fingerprint: t's elements must take 1, 2, 4 or 8 bytes, got {t.dtype}")
    t = t.detach()
    if _direct():
        return _fingerprint_impl(t).bits_fingerprint(t)
    return _bits_fingerprint_op(t)
