"""Megatron's experts on our row-stable GEMMs, reading the weights where they live
(``make_row_stable``). Two layouts hold one [out, in] weight per local expert and projection
(``expert_weights``): SequentialMLP (Megatron's own or TransformerEngine's linears,
``local_experts[i].linear_fcX.weight``) and TEGroupedMLP (TE's GroupedLinear,
``linear_fcX.weight0`` .. ``weight{El-1}``).

``stack_expert_weights`` (run by ``make_row_stable``) moves each projection's El expert weights
into one storage [El, out, in] (the Linear layout, expert-major) and makes every one of those
weights a view of its slice: the same Parameter objects, names, shapes, dtypes and state-dict
keys. ``expert_linear`` then reads the stack in place (no copy per
step) and returns each weight's gradient as a contiguous slice of one [El, out, in] tensor, so
AccumulateGrad (or Megatron DDP's hook into ``main_grad``) adds contiguous tensors.

Fast path (no weight copy): the El weights of a projection are consecutive, contiguous slices
of one storage in expert order, with the activations' dtype; checked on the host at every
forward (pointer and stride arithmetic). Otherwise (weights re-pointed elsewhere, e.g. by
Megatron's DistributedDataParallel with the distributed optimizer, which keeps them in its own
buffer in reverse, fc1 / fc2 interleaved; or reloaded with ``assign=True``) the forward stacks
them (one contiguous copy, warned once per experts module): never stale, just slower.
Conversions (``.to``, ``.cuda``, ``.bfloat16``) re-stack afterwards.

Numerics: the same GEMM strategies (``moe_dispatch.experts.expert_gemm``) on the transposed
view of the stack; the weight gradient of expert e is ``dy_e^T @ x_e`` computed directly in the
[out, in] layout (one grouped_mm, or one product per expert: ``ordered_mm`` on CPU, mm elsewhere).
"""
from __future__ import annotations

import types
import warnings
from typing import Any, List, Optional, Sequence

import torch

from ...experts import expert_gemm, select_gemm
from ...numerics import ordered_mm

__all__ = ["expert_linear", "expert_weights", "restack_after_conversion", "stack_expert_weights", "stacked_view",
           "stacked_weights", "warn_copied"]

_PROJECTIONS = ("linear_fc1", "linear_fc2")


def expert_weights(experts: Any, projection: str) -> List[torch.nn.Parameter]:
    """The El weights [out, in] of ``projection`` ('linear_fc1' or 'linear_fc2'), in local expert
    order: ``local_experts[i].<projection>.weight`` of a SequentialMLP, else (TEGroupedMLP)
    ``<projection>.weight{i}`` of TE's GroupedLinear, one Parameter per GEMM
    (``supported.expert_layout`` has checked which)."""
    local = getattr(experts, "local_experts", None)
    if local is not None:
        return [getattr(e, projection).weight for e in local]
    linear = getattr(experts, projection)
    return [getattr(linear, f"weight{i}") for i in range(linear.num_gemms)]


def stacked_view(weights: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """[El, out, in] view over ``weights`` (each [out, in]) when they are consecutive contiguous
    slices of one storage, in order; else None. Host-only checks, no copy."""
    first = weights[0]
    if first.dim() != 2 or not first.is_contiguous():
        return None
    out, inp = first.shape
    step = out * inp * first.element_size()
    base = first.data_ptr()
    for i, w in enumerate(weights):
        if (w.data_ptr() != base + i * step or w.shape != first.shape or w.dtype != first.dtype
                or not w.is_contiguous() or w.device != first.device):
            return None
    # The slices lie inside first's storage only if it extends over all of them.
    storage = first.untyped_storage()
    if storage.nbytes() < first.storage_offset() * first.element_size() + len(weights) * step:
        return None
    return first.detach().as_strided((len(weights), out, inp), (out * inp, inp, 1), first.storage_offset())


@torch.no_grad()
def stack_expert_weights(experts: Any) -> bool:
    """Make each projection's expert weights views of one new [El, out, in] storage (values kept;
    same Parameter objects). Returns True when both projections are stacked.

    Weights that Megatron's DistributedDataParallel already wraps (they have ``main_grad``) are
    left in its buffer: moving them out would leave its optimizer updating a stale copy."""
    stacked = True
    for projection in _PROJECTIONS:
        weights = expert_weights(experts, projection)
        if stacked_view(weights) is not None:
            continue
        if any(hasattr(w, "main_grad") for w in weights) or len({(w.shape, w.dtype, w.device) for w in weights}) != 1:
            stacked = False
            continue
        stack = torch.stack([w.detach() for w in weights])
        for i, w in enumerate(weights):
            w.data = stack[i]
    return stacked


def restack_after_conversion(experts: Any) -> None:
    """Wrap ``experts._apply`` (what ``.to`` / ``.cuda`` / ``.half`` run) so that the converted
    weights, each a new tensor, are stacked again. Idempotent."""
    if getattr(experts, "_moe_dispatch_restacks", False):
        return
    original = type(experts)._apply

    def _apply(self, fn, *args, **kwargs):
        result = original(self, fn, *args, **kwargs)
        stack_expert_weights(self)
        return result

    experts._apply = types.MethodType(_apply, experts)
    experts._moe_dispatch_restacks = True


def warn_copied(owner: Any, stacklevel: int = 2) -> None:
    """Warn once per experts module that its forwards copy the weights."""
    if owner is not None and not getattr(owner, "_moe_dispatch_warned_copy", False):
        owner._moe_dispatch_warned_copy = True
        warnings.warn(f"moe_dispatch: the {type(owner).__name__} expert weights are not views of one stacked storage "
                      "(e.g. Megatron's DistributedDataParallel moved them into its buffer, or they were "
                      "replaced): every forward copies them (correct, slower). Call install() before wrapping "
                      "the model in DistributedDataParallel to avoid it.", stacklevel=stacklevel + 1)


def _known_stacked_view(weights: Sequence[torch.Tensor], owner: Any) -> Optional[torch.Tensor]:
    """``stacked_view``, with the per-weight checks skipped when the weights' addresses are those
    that passed them last time (host time: one pointer read per weight)."""
    first = weights[0]
    key = (tuple(w.data_ptr() for w in weights), first.shape, first.dtype, first.device)
    known = owner.__dict__.setdefault("_moe_dispatch_stacked", {}) if owner is not None else {}
    if known.get(id(first)) == key:
        n = first.numel()
        # The storage check still guards against a reused address range in another storage.
        if first.untyped_storage().nbytes() >= (first.storage_offset() + len(weights) * n) * first.element_size():
            return first.detach().as_strided((len(weights), *first.shape), (n, first.shape[1], 1),
                                             first.storage_offset())
    w = stacked_view(weights)
    known[id(first)] = key if w is not None else None
    return w


def _stack(weights: Sequence[torch.Tensor], dtype: torch.dtype, owner: Any) -> torch.Tensor:
    """The weights as [El, out, in] in ``dtype``: the stack itself where possible, else a copy."""
    w = _known_stacked_view(weights, owner)
    if w is None:
        warn_copied(owner, stacklevel=5)
        w = torch.stack([t.detach() for t in weights])
    return w if w.dtype == dtype else w.to(dtype)


class _ExpertLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ W[e]^T, W[e] [out, in] the weights of local expert e."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens_per_expert: torch.Tensor, offsets: Optional[torch.Tensor],  # type: ignore[override]
                owner: Any, trailing_rows: bool, *weights: torch.Tensor) -> torch.Tensor:
        w = _stack(weights, x.dtype, owner)  # [El, out, in]
        x = x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)
        wt = w.transpose(1, 2)  # [El, in, out]: expert_gemm's [E, K, M], no copy
        strategy = select_gemm(x, wt, True, True)
        if strategy == "grouped" and offsets is None:
            offsets = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
        ctx.save_for_backward(x, w, offsets, *weights)  # the weights: autograd's in-place checks
        ctx.tokens_per_expert, ctx.strategy, ctx.trailing_rows = tokens_per_expert, strategy, trailing_rows
        return expert_gemm(x, wt, tokens_per_expert, strategy, offsets=offsets, trailing_rows=trailing_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, w, offsets, *weights = ctx.saved_tensors
        tokens_per_expert, strategy, trailing = ctx.tokens_per_expert, ctx.strategy, ctx.trailing_rows
        grad = grad if grad.is_contiguous() and grad.data_ptr() % 16 == 0 else \
            grad.clone(memory_format=torch.contiguous_format)
        # dx rows: dy_row @ W[e], the forward's strategy (same padding / tiling: row-stable).
        dx = expert_gemm(grad, w, tokens_per_expert, strategy, offsets=offsets, trailing_rows=trailing) \
            if ctx.needs_input_grad[0] else None
        none = (None, None, None, None)  # tokens_per_expert, offsets, owner, trailing_rows
        if not any(ctx.needs_input_grad[5:]):
            return (dx, *none) + (None,) * len(weights)
        # dW[e] = dy_e^T @ x_e over expert e's rows: directly [El, out, in], the layout of .grad.
        if grad.shape[0] == 0:
            dw = torch.zeros_like(w)
        elif strategy == "grouped":  # groups end at the last offset: trailing rows add nothing
            dw = torch._grouped_mm(grad.t(), x, offs=offsets)
        else:
            # host counts (a device tensor is read here: a sync on CUDA, on these paths only)
            counts = [int(c) for c in tokens_per_expert.tolist()]
            n = sum(counts)  # trailing rows (no expert) add nothing
            # expert_gemm's own weight-gradient product per strategy, operands swapped: each entry
            # is the same products summed in the same order, so the bits are those of its transpose.
            mm = ordered_mm if strategy == "ordered" else torch.mm
            dw = w.new_empty(w.shape)
            for e, (xe, ge) in enumerate(zip(torch.split(x[:n], counts), torch.split(grad[:n], counts))):
                dw[e] = mm(ge.t(), xe)  # an empty expert gives zeros
        if dw.dtype != weights[0].dtype:
            dw = dw.to(weights[0].dtype)
        return (dx, *none) + tuple(dw.unbind(0))


class _StackedWeights(torch.autograd.Function):
    """The El weights [out, in] as one differentiable [El, out, in]: the stack itself (no copy)."""

    @staticmethod
    def forward(ctx, owner: Any, *weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _stack(weights, weights[0].dtype, owner)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return (None, *grad.contiguous().unbind(0))  # each weight's gradient a contiguous [out, in] slice


def stacked_weights(weights: Sequence[torch.Tensor], owner: Any = None) -> torch.Tensor:
    """``weights`` (El tensors [out, in]) as one [El, out, in] tensor with autograd to each of them:
    a view of their stacked storage where they have one (else one copy, warned once per ``owner``).
    For GEMMs that take the stacked weights themselves (the FP8 experts, ``make_row_stable``)."""
    return _StackedWeights.apply(owner, *weights)


def expert_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], tokens_per_expert: torch.Tensor,
                  offsets: Optional[torch.Tensor] = None, owner: Any = None,
                  trailing_rows: bool = False) -> torch.Tensor:
    """x [N, in] expert-major, ``weights`` El tensors [out, in] (Megatron's Linear layout),
    ``tokens_per_expert`` [El] (CPU int, or on the device) -> [N, out] in x's dtype, row-stable
    (``select_gemm``).

    ``offsets``: int32 [El] on x's device, cumsum(tokens_per_expert) (saves a host-to-device copy
    for grouped_mm; with it grouped_mm reads nothing on the host). ``owner``: the module whose one
    warning about copied weights this is. ``trailing_rows``: tokens_per_expert may sum to less
    than N (a sync-free dispatch's buffer; see ``expert_gemm``)."""
    if len(weights) != tokens_per_expert.shape[0]:
        raise ValueError(f"tokens_per_expert must be [{len(weights)}] (one per weight), "
                         f"got {tuple(tokens_per_expert.shape)}")
    return _ExpertLinear.apply(x, tokens_per_expert, offsets, owner, trailing_rows, *weights)
