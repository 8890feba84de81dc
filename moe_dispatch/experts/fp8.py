"""FP8 expert GEMMs with row-wise scales: forward, dgrad and wgrad, batch-invariant by construction.

Interface (the one public function)::

    fp8_expert_gemm(x, x_scales, w, tokens_per_expert, offsets=None,
                    fp8_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16, *, grad_sink=None) -> out [N, M]

- ``x`` [N, K], rows expert-major (expert 0's rows, then expert 1's, ...), either
  * already quantised: ``fp8_dtype`` rows with ``x_scales`` [N] float32, value = ``x.float() * x_scales[:, None]``
    (the dispatch's rows). float8 cannot carry a gradient (autograd would round it to float8 without a
    scale), so the rows' gradient goes to ``grad_sink``: any float tensor [N, K] on x's device whose
    values are never read (e.g. ``torch.zeros((), dtype=torch.bfloat16).expand(N, K).requires_grad_()``);
    it receives the gradient in its own dtype. Without it only ``w`` gets a gradient.
  * or unquantised bf16/fp16/fp32 with ``x_scales=None`` (fc2, whose input is the activation):
    quantised here per row; its gradient is in x's dtype.
- ``w`` [E, K, M] bf16/fp16/fp32 master weights, the gradient in w's dtype. ``tokens_per_expert`` [E]
  int (CPU or device), summing to N. ``offsets``: optional int32 [E] cumulative row ends on x's device
  (as for `expert_gemm`), saving a host-to-device copy when ``tokens_per_expert`` is on the CPU.
- ``fp8_dtype``: ``torch.float8_e4m3fn`` only (the one float8 ``torch._scaled_grouped_mm`` takes on sm90).
- ``out_dtype``: bf16 (CUDA: the only output of the sm90 kernel); the CPU also takes fp16 and fp32.

Quantisation, all with ``quantize_rows``' arithmetic (its Triton kernel on CUDA, its torch twin on the
CPU, bitwise alike; per row: scale = amax / fp8_max), wgrad's per column by ``ops.quantize_group_columns``
(the same arithmetic, one kernel for all experts). A scale never spans two experts or two rows:

- forward ``out_e = deq(x_e) @ deq(w[e])``: x per row; w per (expert, output column m), its scale over K.
- dgrad ``dx_e = deq(dy_e) @ deq(w[e])^T``: dy per row (own scales); w per (expert, k), over M.
- wgrad ``dw[e] = deq(x_e)^T @ deq(dy_e)``: the dequantised forward rows and dy are quantised again
  per (expert, column), over that expert's rows: the contraction runs over rows, and a scale must be
  constant along it. Both are straight-through: the gradient is the one of the dequantised math.

Every GEMM result is rounded once to ``out_dtype``, then cast to its destination's dtype.

Devices. CUDA: ``torch._scaled_grouped_mm`` (e4m3, fp32 row-wise scales, bf16 out): forward and dgrad
2d x 3d, sync-free; wgrad 2d x 2d with groups along the rows. That kernel needs each group's row
count to be a multiple of 16, so wgrad pads every expert's rows with zeros to the next multiple of
16 (zeros add nothing to the sums, and the padded count depends on the expert's own count only, so a
group's wgrad still depends on its rows alone); it reads the counts on the host (one sync when
``tokens_per_expert`` is on the device). K and M must be multiples of 16 (16-byte fp8 rows).
CPU (the twin): the same quantised operands; each expert's products of the float8 values (exact in
fp32) summed by `ordered_mm`'s fixed tree, then ``(acc * a_scale) * b_scale`` in fp32, then one
rounding. No BLAS call, so a row's bits depend on the row and w[e] only, and wgrad[e] on expert
e's rows only. The twin and CUDA agree closely, not bitwise (the kernel's summation order is its own).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..numerics.autograd import refuse_double_backward
from ..numerics.fixed_order import ordered_mm
from ..numerics.rounding import round_up
from ..ops.quantize import quantize_group_columns as _quantize_group_columns
from ..ops.quantize import quantize_rows
from .activations import activate, scale_rows

# wgrad's group row counts are padded to this for the CUDA kernel (rows multiple of 16).
WGRAD_ROW_MULTIPLE = 16
_OUT_DTYPES = {"cuda": (torch.bfloat16,), "cpu": (torch.bfloat16, torch.float16, torch.float32)}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned (the grouped kernels reject other operands), copied only if not."""
    return x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)


def quantize_group_columns(x: torch.Tensor, counts: Sequence[int], fp8_dtype: torch.dtype,
                           pad_to: int = WGRAD_ROW_MULTIPLE,
                           row_scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [N, C], rows grouped by counts -> (qt [C, P] fp8, scales [E, C] fp32): expert e's rows x_e
    quantised per column, i.e. ``quantize_rows(x_e.T)``, written to qt's columns [p_e, p_e + n_e) with
    zero columns up to p_e + round_up(n_e, pad_to) = p_{e+1} (P = sum of the padded counts). With
    ``row_scales`` [N] fp32 the rows are ``x.float() * row_scales[:, None]`` (float8 x's dequantised
    rows, bitwise, never materialised).

    One ``ops.quantize_group_columns`` call (one kernel on CUDA); the host counts become the op's
    row and padded starts in one small host-to-device copy."""
    counts = [int(n) for n in counts]
    if sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(f"counts {counts} must be >= 0 and sum to the {x.shape[0]} rows of x")
    padded = [round_up(n, pad_to) for n in counts]
    starts = torch.tensor([[0, *counts], [0, *padded]], dtype=torch.int64).cumsum(1).to(x.device)
    return _quantize_group_columns(x, starts[0], starts[1], sum(padded), fp8_dtype, row_scales)


def _host_counts(tokens_per_expert: torch.Tensor, n_rows: int) -> List[int]:
    counts = [int(n) for n in tokens_per_expert.tolist()]
    if sum(counts) != n_rows or min(counts, default=0) < 0:
        raise ValueError(f"tokens_per_expert {counts} must be >= 0 and sum to the {n_rows} rows of x")
    return counts


def _twin_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: List[int],
             out_dtype: torch.dtype) -> torch.Tensor:
    """CPU: a [N, C] fp8 (scales sa [N]) times b[e]^T, b [E, D, C] fp8 (scales sb [E, D]) -> [N, D]."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)
    start = 0
    for e, n in enumerate(counts):
        acc = ordered_mm(a[start : start + n].float(), b[e].float().t())
        out[start : start + n] = (acc * sa[start : start + n, None] * sb[e][None, :]).to(out_dtype)
        start += n
    return out


def _twin_wgrad(xt: torch.Tensor, sx: torch.Tensor, dyt: torch.Tensor, sdy: torch.Tensor, counts: List[int],
                out_dtype: torch.dtype) -> torch.Tensor:
    """CPU: dw[e] [K, M] = xt[:, rows of e] @ dyt[:, rows of e]^T, scales sx [E, K] and sdy [E, M]."""
    dw = torch.empty(len(counts), xt.shape[0], dyt.shape[0], dtype=out_dtype)
    start = 0
    for e, n in enumerate(counts):
        acc = ordered_mm(xt[:, start : start + n].float(), dyt[:, start : start + n].float().t())
        dw[e] = (acc * sx[e][:, None] * sdy[e][None, :]).to(out_dtype)
        start += round_up(n, WGRAD_ROW_MULTIPLE)
    return dw


def _cuda_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
    """CUDA: the same product as `_twin_mm`: b [E, D, C] contiguous is the column-major 3d operand."""
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[1], dtype=torch.bfloat16)
    return torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offsets, out_dtype=torch.bfloat16)


def _cuda_wgrad(xt: torch.Tensor, sx: torch.Tensor, dyt: torch.Tensor, sdy: torch.Tensor,
                counts: List[int]) -> torch.Tensor:
    """CUDA: `_twin_wgrad`'s product, 2d x 2d with groups along the padded rows -> [E, K, M] bf16."""
    e, k, m = len(counts), xt.shape[0], dyt.shape[0]
    if xt.shape[1] == 0:
        return xt.new_zeros(e, k, m, dtype=torch.bfloat16)
    padded = torch.tensor([round_up(n, WGRAD_ROW_MULTIPLE) for n in counts], dtype=torch.int64)
    offs = torch.cumsum(padded, 0).to(device=xt.device, dtype=torch.int32)
    dw = torch._scaled_grouped_mm(xt, dyt.t(), sx.reshape(-1), sdy.reshape(-1), offs=offs, out_dtype=torch.bfloat16)
    empty = [i for i, n in enumerate(counts) if n == 0]
    if empty:  # the kernel's output for a group of no rows is not documented: exact zeros
        dw[torch.tensor(empty, device=dw.device)] = 0
    return dw


class _Fp8ExpertGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_scales, w, grad_sink, tokens_per_expert, offsets, fp8_dtype, out_dtype):  # type: ignore[override]
        cuda = x.device.type == "cuda"
        counts = None if cuda else _host_counts(tokens_per_expert, x.shape[0])
        # Where the rows' gradient goes: x itself (quantised here), or the sink of pre-quantised rows.
        sink_dtype = None if grad_sink is None else grad_sink.dtype
        ctx.rows_index, ctx.rows_grad_dtype = (0, x.dtype) if x_scales is None else (3, sink_dtype)
        if x_scales is None:
            x, x_scales = quantize_rows(x, fp8_dtype)
        x = _dense(x)
        e, k, m = w.shape
        wq, sw = quantize_rows(w.detach().transpose(1, 2).reshape(e * m, k), fp8_dtype)  # per (e, m), over K
        wq, sw = wq.view(e, m, k), sw.view(e, m)
        if cuda:
            out = _cuda_mm(x, x_scales, wq, sw, offsets)
        else:
            out = _twin_mm(x, x_scales, wq, sw, counts, out_dtype)
        ctx.save_for_backward(x, x_scales, w, tokens_per_expert, offsets)
        ctx.args = (counts, fp8_dtype, out_dtype)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        refuse_double_backward("fp8_expert_gemm")
        x, x_scales, w, tokens_per_expert, offsets = ctx.saved_tensors
        counts, fp8_dtype, out_dtype = ctx.args
        cuda = x.device.type == "cuda"
        grad = _dense(grad)
        e, k, m = w.shape
        rows_index = ctx.rows_index
        gx = gw = None
        if ctx.needs_input_grad[rows_index]:
            dyq, sdy = quantize_rows(grad, fp8_dtype)
            wq, sw = quantize_rows(w.detach().reshape(e * k, m), fp8_dtype)  # per (e, k), over M
            wq, sw = wq.view(e, k, m), sw.view(e, k)
            if cuda:
                gx = _cuda_mm(dyq, sdy, wq, sw, offsets)
            else:
                gx = _twin_mm(dyq, sdy, wq, sw, counts, out_dtype)
            gx = gx.to(ctx.rows_grad_dtype)
        if ctx.needs_input_grad[2]:
            counts = counts if counts is not None else _host_counts(tokens_per_expert, x.shape[0])
            xt, sx = quantize_group_columns(x, counts, fp8_dtype, row_scales=x_scales)  # the dequantised rows
            dyt, sdy = quantize_group_columns(grad, counts, fp8_dtype)
            if cuda:
                gw = _cuda_wgrad(xt, sx, dyt, sdy, counts)
            else:
                gw = _twin_wgrad(xt, sx, dyt, sdy, counts, out_dtype)
            gw = gw.to(w.dtype)
        grads = [None] * 8
        grads[rows_index], grads[2] = gx, gw
        return tuple(grads)


def _check(x: torch.Tensor, x_scales: Optional[torch.Tensor], w: torch.Tensor, tokens_per_expert: torch.Tensor,
           offsets: Optional[torch.Tensor], fp8_dtype: torch.dtype, out_dtype: torch.dtype,
           grad_sink: Optional[torch.Tensor]) -> None:
    if fp8_dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn (the float8 torch._scaled_grouped_mm takes on "
                         f"sm90), got {fp8_dtype}")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or w.device != x.device:
        raise ValueError(f"x must be [N, K] and w [E, K, M] on one device, got x {list(x.shape)} on {x.device} "
                         f"and w {list(w.shape)} on {w.device}")
    if w.dtype not in _FLOATS:
        raise ValueError(f"w must be bf16, fp16 or fp32, got {w.dtype}")
    n, (e, k, m) = x.shape[0], w.shape
    if x_scales is None:
        if x.dtype not in _FLOATS or grad_sink is not None:
            raise ValueError(f"x without x_scales must be bf16, fp16 or fp32 (quantised here) and takes no grad_sink, "
                             f"got {x.dtype}{' and a grad_sink' if grad_sink is not None else ''}")
    else:
        if x.dtype != fp8_dtype or x_scales.shape != (n,) or x_scales.dtype != torch.float32:
            raise ValueError(f"x with x_scales must be {fp8_dtype} rows with float32 x_scales [{n}], got x {x.dtype} "
                             f"and x_scales {x_scales.dtype} {list(x_scales.shape)}")
        if x_scales.device != x.device:
            raise ValueError(f"x_scales must be on x's device {x.device}, got {x_scales.device}")
        if grad_sink is not None and (grad_sink.shape != x.shape or grad_sink.dtype not in _FLOATS
                                      or grad_sink.device != x.device):
            raise ValueError(f"grad_sink must be a bf16/fp16/fp32 tensor {list(x.shape)} on {x.device}, got "
                             f"{grad_sink.dtype} {list(grad_sink.shape)} on {grad_sink.device}")
    if tokens_per_expert.shape != (e,) or tokens_per_expert.is_floating_point():
        raise ValueError(f"tokens_per_expert must be an integer tensor [{e}], got {tokens_per_expert.dtype} "
                         f"{list(tokens_per_expert.shape)}")
    kind = x.device.type
    if kind not in _OUT_DTYPES or out_dtype not in _OUT_DTYPES[kind]:
        raise ValueError(f"out_dtype on {kind} must be one of {_OUT_DTYPES.get(kind, ())}, got {out_dtype}")
    if kind == "cuda":
        if k % 16 or m % 16:
            raise ValueError(f"w [E, K, M] needs K and M multiples of 16 on CUDA (16-byte fp8 rows), got {k} and {m}")
        if offsets is not None and (offsets.shape != (e,) or offsets.dtype != torch.int32
                                    or offsets.device != x.device):
            raise ValueError(f"offsets must be int32 [{e}] on {x.device}, got {offsets.dtype} {list(offsets.shape)} "
                             f"on {offsets.device}")


def fp8_expert_gemm(x: torch.Tensor, x_scales: Optional[torch.Tensor], w: torch.Tensor,
                    tokens_per_expert: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                    fp8_dtype: torch.dtype = torch.float8_e4m3fn, out_dtype: torch.dtype = torch.bfloat16, *,
                    grad_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [N, M] out_dtype: ``out[rows of e] = deq(x[rows of e]) @ deq(w[e])`` in FP8, differentiable
    (rows' gradient to x, or to ``grad_sink`` for pre-quantised x; w's to w). The module docstring
    states the shapes, the scales and the devices."""
    _check(x, x_scales, w, tokens_per_expert, offsets, fp8_dtype, out_dtype, grad_sink)
    if x.device.type == "cuda" and offsets is None:
        # A CPU tensor here is a pageable host-to-device copy per call: pass offsets to avoid it.
        offsets = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
    if x.device.type == "cpu":
        offsets = None  # the twin reads the host counts
    return _Fp8ExpertGemm.apply(x, x_scales, w, grad_sink, tokens_per_expert, offsets, fp8_dtype, out_dtype)


def fp8_mlp(rows: torch.Tensor, row_scales: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            tokens_per_expert: torch.Tensor, offsets: Optional[torch.Tensor], fp8_dtype: torch.dtype,
            activation: str, probs: Optional[torch.Tensor], row_grad_sink: torch.Tensor) -> torch.Tensor:
    """The experts' MLP on the dispatch's FP8 rows: rows [N, H] fp8 with row_scales [N] fp32 ->
    [N, H] in row_grad_sink's dtype. fc1 (w1 [E, H, F]) on the rows as they are (their gradient to
    ``row_grad_sink`` [N, H]), the activation in that dtype, times ``probs`` [N] when given, then
    fc2 (w2 [E, F, H]) quantising its input per row."""
    out_dtype = row_grad_sink.dtype
    h = fp8_expert_gemm(rows, row_scales, w1, tokens_per_expert, offsets, fp8_dtype, out_dtype,
                        grad_sink=row_grad_sink)
    act = activate(h, activation)
    if probs is not None:
        act = scale_rows(act, probs)
    return fp8_expert_gemm(act, None, w2, tokens_per_expert, offsets, fp8_dtype, out_dtype)
