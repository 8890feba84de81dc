"""FP8 expert GEMMs with row-wise scales: forward, dgrad and wgrad, batch-invariant by construction.

Interface (the one public function)::

    fp8_expert_gemm(x, x_scales, w, rows_per_expert, offsets=None,
                    fp8_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16, *, grad_sink=None,
                    trailing_rows=False, weight_operands=None, fp8_wgrad=True, source_blocks=None,
                    sink=None) -> out [N, M]

- ``x`` [N, K], rows expert-major (expert 0's rows, then expert 1's, ...), either
  * already quantised: ``fp8_dtype`` rows with ``x_scales`` [N] float32, value = ``x.float() * x_scales[:, None]``
    (the dispatch's rows). float8 cannot carry a gradient (autograd would round it to float8 without a
    scale), so the rows' gradient goes to ``grad_sink``: any float tensor [N, K] on x's device whose
    values are never read (e.g. ``torch.zeros((), dtype=torch.bfloat16).expand(N, K).requires_grad_()``);
    it receives the gradient in its own dtype. Without it only ``w`` gets a gradient.
  * or unquantised bf16/fp16/fp32 with ``x_scales=None`` (fc2, whose input is the activation):
    quantised here per row; its gradient is in x's dtype.
- ``w`` [E, K, M] bf16/fp16/fp32 master weights, the gradient in w's dtype. ``rows_per_expert`` [E]
  int (CPU or device), summing to N. ``offsets``: optional int32 [E] cumulative row ends on x's device
  (as for `expert_gemm`), saving a host-to-device copy when ``rows_per_expert`` is on the CPU.
  ``trailing_rows`` (a sync-free dispatch's buffer): the counts may sum to n <= N; rows [n, N) belong
  to no expert, their outputs and gradients are unspecified on CUDA (zeros on the CPU) and they add
  nothing to w's gradient.
- ``weight_operands``: w already quantised, ``quantize_weight(w, fp8_dtype)``'s four tensors, so that
  several micro-batches between two optimizer steps quantise w once (its gradient still goes to w);
  None: w is quantised at each call (the forward's operand) and each backward (the dgrad's).
- ``fp8_wgrad`` (Megatron's ``fp8_wgrad``): True runs the weight gradient in FP8 (below); False runs it
  in the gradient's dtype, as TransformerEngine's ``override_linear_precision`` wgrad does: the forward's
  saved FP8 rows widened by their row scales (``ops.dequantize_rows``), then ``dw[e] = deq(x_e)^T @ dy_e``
  with fp32 accumulation and one rounding. No column quantisation of x or dy, so no second FP8
  rounding in the weight gradient.
- ``source_blocks`` with ``sink`` (GradientTree's per-source gradients): the weight gradient is
  computed per (expert, source) block of rows and handed to ``sink`` as [E, P, K, M]; w gets no
  gradient. ``fp8_wgrad=False``: as `expert_gemm`'s (`source_weight_grads` on the widened rows; fp32
  accumulation, one rounding to the gradient's dtype). ``fp8_wgrad=True``: FP8 wgrad with a group
  per block instead of per expert, so the column scales span that block's rows alone (one source's:
  finer than per expert, hence not the bits of the call without blocks) and a block's gradient is
  a function of its rows alone.
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

Devices. CUDA: ``torch._scaled_grouped_mm`` (e4m3, fp32 row-wise scales, bf16 out): forward, dgrad
(2d x 3d, fast accumulation: ``FAST_ACCUM_ROWS``) and wgrad (2d x 2d with groups along the rows,
fast accumulation: ``FAST_ACCUM_WGRAD``), all sync-free: no count is read on the host,
so the step captures in a CUDA graph. The wgrad kernel needs each group's row count to be a multiple
of 16, so its operands are laid out on the device (`wgrad_layout`): expert e's rows padded with zero
columns to round_up(max(n_e, 1), 16) (zeros add nothing to the sums; the width depends on the
expert's own count only, so a group's wgrad still depends on its rows alone, and an expert of no
rows gets 16 zero columns, hence exact zeros), then one slack group that takes the trailing rows and
the rest of a width fixed by the shapes (P = round_up(N, 16) + 16 E), whose result is dropped. K and
M must be multiples of 16 (16-byte fp8 rows).
CPU (the twin): the same quantised operands; each expert's products of the float8 values (exact in
fp32) summed by `ordered_mm`'s fixed tree, then ``(acc * a_scale) * b_scale`` in fp32, then one
rounding. No BLAS call, so a row's bits depend on the row and w[e] only, and wgrad[e] on expert
e's rows only. The twin and CUDA agree closely, not bitwise (the kernel's summation order is its own).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..numerics.autograd import refuse_double_backward
from ..numerics.fixed_order import ordered_mm
from ..numerics.rounding import round_up
from ..ops.fp8_rows import Fp8Rows
from ..ops.quantize import dequantize_rows, quantize_group_columns, quantize_rows
from .activations import activate, scale_rows
from .gemm import SourceBlocks, _check_blocks, _host_rows, source_weight_grads
from .rows import ExpertRows

# wgrad's group row counts are padded to this for the CUDA kernel (rows multiple of 16).
WGRAD_ROW_MULTIPLE = 16
# CUDA: the FP8 MMA's fast accumulation, for the forward and dgrad (contractions over H or F: 3x
# faster at the layer's shapes on an H200 for a 2.4e-3 relative change, against e4m3's 5e-2) and for
# wgrad (a contraction over an expert's rows: 2.4x faster; error against float64 of the same operands
# 1.7e-3 at 1193 rows an expert, 3.3e-3 at 24576, against 1.7e-3 for the fp32-promoted default;
# BENCHMARKS.md, FP8). Either way a result depends on its own row and column (wgrad: its expert's
# rows) only.
FAST_ACCUM_ROWS = True
FAST_ACCUM_WGRAD = True
_OUT_DTYPES = {"cuda": (torch.bfloat16,), "cpu": (torch.bfloat16, torch.float16, torch.float32)}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x [N, C] row-major with 16-byte aligned rows (the grouped kernels reject other operands; a row
    stride above C is fine, e.g. the FP8 wire's rows read in place), copied only if not."""
    row_bytes = x.stride(0) * x.element_size()
    if x.stride(1) == 1 and x.stride(0) >= x.shape[1] and row_bytes % 16 == 0 and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def weight_operand(w: torch.Tensor, fp8_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [E, D, C] (bf16/fp16/fp32, any strides) -> (q [E, D, C] fp8_dtype with C contiguous and
    16-byte aligned rows, scales [E, D] fp32): each (e, d) quantised over C, ``quantize_rows(w[e])``'s
    bits. The GEMMs contract over C, so q must hold C contiguous: where w does (the forward's view of
    Megatron's [E, out, in] stacks, the dgrad's of our [E, K, M] weights) one ``quantize_rows`` reads
    it in place; where w holds D contiguous, ``quantize_group_columns`` (groups of C rows, no padding)
    reads it in place and writes the transpose, instead of a transposing copy of the bf16 weight
    before quantising (which cost 1.7-1.8 ms per [64, 4096, 1024] weight on an H200)."""
    e, d, c = w.shape
    if w.stride(2) == 1 and w.stride(1) == c and w.stride(0) == d * c:
        q, scales = quantize_rows(w.reshape(e * d, c), fp8_dtype)
        return q.view(e, d, c), scales.view(e, d)
    if w.stride(1) == 1 and w.stride(2) == d and w.stride(0) == d * c:
        starts = torch.arange(e + 1, dtype=torch.int64, device=w.device) * c
        qt, scales = quantize_group_columns(w.transpose(1, 2).reshape(e * c, d), starts, starts, e * c, fp8_dtype)
        return qt.view(d, e, c).permute(1, 0, 2), scales  # [E, D, C], strides (C, E * C, 1)
    return weight_operand(w.contiguous(), fp8_dtype)


def quantize_weight(w: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, K, M] -> its operands in the two GEMMs that read it, the bits `fp8_expert_gemm` computes
    per call: (forward q [E, M, K] fp8, its scales [E, M] fp32: per (expert, output column), over K;
    dgrad q [E, K, M] fp8, its scales [E, K]: per (expert, k), over M)."""
    w = w.detach()
    return (*weight_operand(w.transpose(1, 2), fp8_dtype), *weight_operand(w, fp8_dtype))


def wgrad_layout(row_ends: torch.Tensor, n_rows: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The weight gradient's operand layout, computed on row_ends' device without a host read.

    row_ends: [E] int, the experts' cumulative row ends (``offsets``; the last <= n_rows, the rest
    of the N = n_rows rows trailing). Returns (row_starts [E + 2] int64, padded_starts [E + 2] int64,
    P): groups 0..E-1 the experts, expert e's rows [s_e, s_{e+1}) in columns [p_e, p_{e+1}) of
    width round_up(max(n_e, 1), WGRAD_ROW_MULTIPLE); group E the slack, rows [s_E, N) in columns
    [p_E, P), with P = round_up(N, 16) + 16 E fixed by the shapes (every width a multiple of 16:
    each expert's is at most n_e + 16, so the slack's is >= N - s_E)."""
    e = row_ends.shape[0]
    zero = row_ends.new_zeros(1, dtype=torch.int64)
    ends = row_ends.to(torch.int64)
    counts = torch.diff(ends, prepend=zero)
    widths = round_up(counts.clamp(min=1), WGRAD_ROW_MULTIPLE)
    padded_rows = round_up(n_rows, WGRAD_ROW_MULTIPLE) + WGRAD_ROW_MULTIPLE * e
    row_starts = torch.cat([zero, ends, torch.full_like(zero, n_rows)])
    padded_starts = torch.cat([zero, torch.cumsum(widths, 0), torch.full_like(zero, padded_rows)])
    return row_starts, padded_starts, padded_rows


def _twin_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: List[int],
             out_dtype: torch.dtype) -> torch.Tensor:
    """CPU: a [N, C] fp8 (scales sa [N]) times b[e]^T, b [E, D, C] fp8 (scales sb [E, D]) -> [N, D]."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)
    out[sum(counts):] = 0  # trailing rows
    start = 0
    for e, n in enumerate(counts):
        acc = ordered_mm(a[start : start + n].float(), b[e].float().t())
        out[start : start + n] = (acc * sa[start : start + n, None] * sb[e][None, :]).to(out_dtype)
        start += n
    return out


def _twin_wgrad(xt: torch.Tensor, sx: torch.Tensor, dyt: torch.Tensor, sdy: torch.Tensor, counts: List[int],
                padded_starts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """CPU: dw[e] [K, M] = xt[:, rows of e] @ dyt[:, rows of e]^T (`wgrad_layout`'s columns), scales
    sx [E + 1, K] and sdy [E + 1, M] (the slack group's unused)."""
    dw = torch.empty(len(counts), xt.shape[0], dyt.shape[0], dtype=out_dtype)
    for e, (n, start) in enumerate(zip(counts, padded_starts.tolist())):
        acc = ordered_mm(xt[:, start : start + n].float(), dyt[:, start : start + n].float().t())
        dw[e] = (acc * sx[e][:, None] * sdy[e][None, :]).to(out_dtype)
    return dw


def _cuda_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
    """CUDA: the same product as `_twin_mm`: b [E, D, C] with C contiguous is the column-major 3d
    operand. Fast accumulation (``FAST_ACCUM_ROWS``): the contraction is H or F long, fixed by the
    shapes."""
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[1], dtype=torch.bfloat16)
    return torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offsets, out_dtype=torch.bfloat16,
                                    use_fast_accum=FAST_ACCUM_ROWS)


def _rows_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
             counts: Optional[List[int]], out_dtype: torch.dtype) -> torch.Tensor:
    """a [N, C] fp8 (scales sa [N]) times b[e]^T per expert -> [N, D]: `_cuda_mm` (device
    ``offsets``) on CUDA, `_twin_mm` (host ``counts``) elsewhere."""
    if a.device.type == "cuda":
        return _cuda_mm(a, sa, b, sb, offsets)
    return _twin_mm(a, sa, b, sb, counts, out_dtype)


def _cuda_wgrad(xt: torch.Tensor, sx: torch.Tensor, dyt: torch.Tensor, sdy: torch.Tensor,
                padded_starts: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """CUDA: `_twin_wgrad`'s product, 2d x 2d with groups along `wgrad_layout`'s columns (every
    group at least 16 wide, the slack group last) -> [E, K, M] bf16 (the slack's result dropped).
    ``fast_accum``: the FP8 MMA's fast accumulation (the layer passes ``FAST_ACCUM_WGRAD``; the
    benchmark measures both)."""
    offs = padded_starts[1:].to(torch.int32)
    dw = torch._scaled_grouped_mm(xt, dyt.t(), sx.reshape(-1), sdy.reshape(-1), offs=offs, out_dtype=torch.bfloat16,
                                  use_fast_accum=fast_accum)
    return dw[:-1]


def _wide_source_wgrad(x: torch.Tensor, x_scales: torch.Tensor, grad: torch.Tensor, blocks: SourceBlocks,
                       w_shape: torch.Size) -> torch.Tensor:
    """The weight gradient in grad's dtype (``fp8_wgrad=False``) per (expert, source) block: x [N, K]
    fp8 with x_scales [N] widened to grad's dtype (`dequantize_rows`), grad [N, M] dense -> [E, P, K,
    M] in grad's dtype, block (e, s) = ``deq(x_b)^T @ grad_b`` over its rows only (`source_weight_grads`:
    one bf16 grouped GEMM with a group per block on CUDA; `ordered_mm` per block in fp32 on the CPU,
    rounded once)."""
    xd = dequantize_rows(x, x_scales, grad.dtype)
    if x.device.type == "cuda":
        return source_weight_grads(xd, grad, blocks, w_shape, "grouped")
    return source_weight_grads(xd.float(), grad.float(), blocks, w_shape, None).to(grad.dtype)


def _source_groups(blocks: SourceBlocks, device: torch.device
                   ) -> Tuple[torch.Tensor, Optional[List[int]], Optional[torch.Tensor]]:
    """The (expert, source) blocks as wgrad groups: (row ends [G] on ``device``, each group's rows on
    the host for the CPU twin (None on CUDA), the index [E * P] of the blocks among the groups, or
    None when the groups are the blocks). Device blocks tile the rows from row 0: their ends are
    the groups' (no host read on CUDA). Host blocks with padding rows between them (an expert's
    tail padding) get a group of their own for those rows, whose result is dropped."""
    cuda = device.type == "cuda"
    if isinstance(blocks, torch.Tensor):
        flat = blocks.reshape(-1).to(torch.int64)
        return torch.cumsum(flat, 0), None if cuda else flat.tolist(), None
    ends, pick, cursor = [], [], 0
    for row in blocks:
        for first, rows in row:
            if first > cursor:
                ends.append(first)
            pick.append(len(ends))
            ends.append(first + rows)
            cursor = first + rows
    counts = torch.diff(torch.tensor([0, *ends])).tolist()
    index = None if len(ends) == len(pick) else torch.tensor(pick, dtype=torch.int64, device=device)
    return torch.tensor(ends, dtype=torch.int64).to(device), None if cuda else counts, index


def _fp8_source_wgrad(x: torch.Tensor, x_scales: torch.Tensor, grad: torch.Tensor, blocks: SourceBlocks,
                      w_shape: torch.Size, fp8_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 weight gradient (``fp8_wgrad=True``) per (expert, source) block -> [E, P, K, M] in
    out_dtype: FP8 wgrad's arithmetic with a group per block instead of per expert, so each
    block's columns are quantised over that block's rows alone (finer scales than one expert's
    rows of every source) and block (e, s) = ``deq(xt_b) @ deq(dyt_b)^T`` is a function of its
    rows alone, whatever other rows the call holds."""
    E, K, M = w_shape
    P = blocks.shape[1] if isinstance(blocks, torch.Tensor) else len(blocks[0])
    row_ends, counts, index = _source_groups(blocks, x.device)
    row_starts, padded_starts, padded_rows = wgrad_layout(row_ends, x.shape[0])
    xt, sx = quantize_group_columns(x, row_starts, padded_starts, padded_rows, fp8_dtype, x_scales)
    dyt, sdy = quantize_group_columns(grad, row_starts, padded_starts, padded_rows, fp8_dtype)
    if x.device.type == "cuda":
        groups = _cuda_wgrad(xt, sx, dyt, sdy, padded_starts, fast_accum=FAST_ACCUM_WGRAD)
    else:
        groups = _twin_wgrad(xt, sx, dyt, sdy, counts, padded_starts, out_dtype)
    if index is not None:
        groups = groups.index_select(0, index)
    return groups.reshape(E, P, K, M)


def _wide_wgrad(x: torch.Tensor, x_scales: torch.Tensor, grad: torch.Tensor, w_shape: torch.Size,
                offsets: Optional[torch.Tensor], counts: Optional[List[int]]) -> torch.Tensor:
    """`_wide_source_wgrad` with one block an expert -> dw [E, K, M] in grad's dtype, ``dw[e] =
    deq(x_e)^T @ grad_e`` over expert e's rows only (rows past the last expert add nothing). CUDA:
    one bf16 ``torch._grouped_mm`` with groups along the rows at the device ``offsets`` (no host
    read, as the sync-free step needs; empty groups give zeros). CPU: the host ``counts``."""
    if x.device.type == "cuda":
        if x.shape[0] == 0:
            return grad.new_zeros(w_shape)
        return torch._grouped_mm(dequantize_rows(x, x_scales, grad.dtype).t(), grad, offs=offsets)
    starts = torch.tensor([0, *counts[:-1]], dtype=torch.int64).cumsum(0).tolist()
    blocks = [[(start, n)] for start, n in zip(starts, counts)]
    return _wide_source_wgrad(x, x_scales, grad, blocks, w_shape)[:, 0]


class _Fp8ExpertGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_scales, w, grad_sink, rows_per_expert, offsets, fp8_dtype, out_dtype,  # type: ignore[override]
                trailing_rows, fp8_wgrad, per_source, wq_forward, sw_forward, wq_dgrad, sw_dgrad):
        cuda = x.device.type == "cuda"
        counts = None if cuda else _host_rows(rows_per_expert, x.shape[0], trailing_rows)  # a CPU tensor
        # Where the rows' gradient goes: x itself (quantised here), or the sink of pre-quantised rows.
        sink_dtype = None if grad_sink is None else grad_sink.dtype
        ctx.rows_index, ctx.rows_grad_dtype = (0, x.dtype) if x_scales is None else (3, sink_dtype)
        if x_scales is None:
            x, x_scales = quantize_rows(x, fp8_dtype)
        x = _dense(x)
        if wq_forward is None:
            wq, sw = weight_operand(w.detach().transpose(1, 2), fp8_dtype)  # [E, M, K]: per (e, m), over K
        else:
            wq, sw = wq_forward, sw_forward
        out = _rows_mm(x, x_scales, wq, sw, offsets, counts, out_dtype)
        ctx.save_for_backward(x, x_scales, w, rows_per_expert, offsets, wq_dgrad, sw_dgrad)
        ctx.args = (counts, fp8_dtype, out_dtype, fp8_wgrad)
        ctx.per_source = per_source  # (blocks, sink) or None
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        refuse_double_backward("fp8_expert_gemm")
        x, x_scales, w, rows_per_expert, offsets, wq_dgrad, sw_dgrad = ctx.saved_tensors
        counts, fp8_dtype, out_dtype, fp8_wgrad = ctx.args
        cuda = x.device.type == "cuda"
        grad = _dense(grad)
        rows_index = ctx.rows_index
        gx = gw = None
        if ctx.needs_input_grad[rows_index]:
            dyq, sdy = quantize_rows(grad, fp8_dtype)
            if wq_dgrad is None:
                wq, sw = weight_operand(w.detach(), fp8_dtype)  # [E, K, M]: per (e, k), over M
            else:
                wq, sw = wq_dgrad, sw_dgrad
            gx = _rows_mm(dyq, sdy, wq, sw, offsets, counts, out_dtype).to(ctx.rows_grad_dtype)
        if ctx.needs_input_grad[2] and ctx.per_source is not None:
            blocks, sink = ctx.per_source
            if fp8_wgrad:
                sink(_fp8_source_wgrad(x, x_scales, grad, blocks, w.shape, fp8_dtype, out_dtype))
            else:
                sink(_wide_source_wgrad(x, x_scales, grad, blocks, w.shape))
        elif ctx.needs_input_grad[2] and not fp8_wgrad:
            gw = _wide_wgrad(x, x_scales, grad, w.shape, offsets, counts).to(w.dtype)
        elif ctx.needs_input_grad[2]:
            row_ends = offsets if cuda else torch.tensor(counts, dtype=torch.int64).cumsum(0)
            row_starts, padded_starts, padded_rows = wgrad_layout(row_ends, x.shape[0])
            # the forward's rows dequantised by their scales inside the kernel, and dy, per (expert, column)
            xt, sx = quantize_group_columns(x, row_starts, padded_starts, padded_rows, fp8_dtype, x_scales)
            dyt, sdy = quantize_group_columns(grad, row_starts, padded_starts, padded_rows, fp8_dtype)
            if cuda:
                gw = _cuda_wgrad(xt, sx, dyt, sdy, padded_starts, fast_accum=FAST_ACCUM_WGRAD)
            else:
                gw = _twin_wgrad(xt, sx, dyt, sdy, counts, padded_starts, out_dtype)
            gw = gw.to(w.dtype)
        grads = [None] * 15
        grads[rows_index], grads[2] = gx, gw
        return tuple(grads)


def _check_weight_operands(operands: Optional[Tuple[torch.Tensor, ...]], w: torch.Tensor,
                           fp8_dtype: torch.dtype) -> None:
    if operands is None:
        return
    e, k, m = w.shape
    expected = [((e, m, k), fp8_dtype), ((e, m), torch.float32), ((e, k, m), fp8_dtype), ((e, k), torch.float32)]
    got = [(tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t).__name__
           for t in (operands if isinstance(operands, (tuple, list)) else ())]
    if got != [(shape, dtype, w.device) for shape, dtype in expected] or any(q.stride(-1) != 1 for q in operands[::2]):
        raise ValueError(f"weight_operands must be quantize_weight(w)'s four tensors on {w.device}: "
                         f"{[(list(shape), dtype) for shape, dtype in expected]}, got {got or type(operands).__name__}")


def _check(x: torch.Tensor, x_scales: Optional[torch.Tensor], w: torch.Tensor, rows_per_expert: torch.Tensor,
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
    if rows_per_expert.shape != (e,) or rows_per_expert.is_floating_point():
        raise ValueError(f"rows_per_expert must be an integer tensor [{e}], got {rows_per_expert.dtype} "
                         f"{list(rows_per_expert.shape)}")
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
                    rows_per_expert: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                    fp8_dtype: torch.dtype = torch.float8_e4m3fn, out_dtype: torch.dtype = torch.bfloat16, *,
                    grad_sink: Optional[torch.Tensor] = None, trailing_rows: bool = False,
                    weight_operands: Optional[Tuple[torch.Tensor, ...]] = None, fp8_wgrad: bool = True,
                    source_blocks: Optional[SourceBlocks] = None,
                    sink: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
    """out [N, M] out_dtype: ``out[rows of e] = deq(x[rows of e]) @ deq(w[e])`` in FP8, differentiable
    (rows' gradient to x, or to ``grad_sink`` for pre-quantised x; w's to w). The module docstring
    states the shapes, the scales, ``trailing_rows``, ``weight_operands``, ``fp8_wgrad``, ``source_blocks``
    and the devices."""
    if not isinstance(fp8_wgrad, bool):
        raise ValueError(f"fp8_wgrad must be a bool (True or False), got {fp8_wgrad!r}")
    per_source = None
    if source_blocks is not None:
        if sink is None:
            raise ValueError("source_blocks (per-source weight gradients) need a sink (where they go)")
        per_source = (_check_blocks(source_blocks, rows_per_expert, w.shape[0], x), sink)
    _check(x, x_scales, w, rows_per_expert, offsets, fp8_dtype, out_dtype, grad_sink)
    _check_weight_operands(weight_operands, w, fp8_dtype)
    if x.device.type == "cuda" and offsets is None:
        # A CPU tensor here is a pageable host-to-device copy per call: pass offsets to avoid it.
        offsets = torch.cumsum(rows_per_expert.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
    if x.device.type == "cpu":
        offsets = None  # the twin reads the host counts
    return _Fp8ExpertGemm.apply(x, x_scales, w, grad_sink, rows_per_expert, offsets, fp8_dtype, out_dtype,
                                trailing_rows, fp8_wgrad, per_source, *(weight_operands or (None,) * 4))


def fp8_rows_problem(rows: ExpertRows) -> Optional[str]:
    """Why ``rows`` cannot be FP8 experts' input (None: they can): not Fp8Rows, or without grad_sink."""
    if not isinstance(rows.rows, Fp8Rows) or rows.rows.grad_sink is None:
        got = "Fp8Rows without grad_sink" if isinstance(rows.rows, Fp8Rows) else f"a {type(rows.rows).__name__}"
        return ("fp8 experts need Fp8Rows rows with a grad_sink [N, H] (the dispatcher's FP8 rows, "
                f"to_expert_rows(expert_input, handle)), got {got}")
    return None


def fp8_mlp(rows: ExpertRows, w1: torch.Tensor, w2: torch.Tensor, activation: str, *, apply_probs: bool,
            fp8_dtype: torch.dtype = torch.float8_e4m3fn,
            weight_operands: Optional[Tuple[Tuple[torch.Tensor, ...], ...]] = None, fp8_wgrad: bool = True,
            sinks: Tuple[Optional[Callable[[torch.Tensor], None]], ...] = (None, None)) -> torch.Tensor:
    """The experts' MLP on the dispatch's FP8 rows: ``rows`` (an ``ExpertRows`` whose rows are
    ``Fp8Rows``: fp8 values [N, H], scales [N] fp32, grad_sink [N, H]) -> [N, H] in grad_sink's dtype.
    fc1 (w1 [E, H, F]) on the rows as they are (their gradient to the grad_sink), the activation
    in that dtype, times ``rows.probs`` [N] with ``apply_probs`` (when given), then fc2 (w2 [E, F, H])
    quantising its input per row. The rows' counts, offsets and trailing rows (a sync-free dispatch's
    device counts and buffer) as `fp8_expert_gemm` takes them. ``weight_operands``:
    (``quantize_weight(w1)``, ``quantize_weight(w2)``), or None to quantise them per call.
    ``fp8_wgrad``: both GEMMs' weight gradients in FP8 (True) or in the rows' dtype (False;
    `fp8_expert_gemm`). ``rows.source_blocks`` with ``sinks`` (one a weight): the weight gradients
    per (expert, source) block (with ``fp8_wgrad``, column scales per block)."""
    problem = fp8_rows_problem(rows)
    if problem is not None:
        raise ValueError(problem)
    fp8_rows = rows.rows
    out_dtype = fp8_rows.grad_sink.dtype
    ops1, ops2 = weight_operands or (None, None)
    counts, offsets, trailing, blocks = rows.gemm_counts, rows.offsets, rows.trailing_rows, rows.source_blocks
    h = fp8_expert_gemm(fp8_rows.data, fp8_rows.scales, w1, counts, offsets, fp8_dtype, out_dtype,
                        grad_sink=fp8_rows.grad_sink, trailing_rows=trailing, weight_operands=ops1,
                        fp8_wgrad=fp8_wgrad, source_blocks=blocks, sink=sinks[0])
    act = activate(h, activation)
    if apply_probs and rows.probs is not None:
        act = scale_rows(act, rows.probs)
    return fp8_expert_gemm(act, None, w2, counts, offsets, fp8_dtype, out_dtype,
                           trailing_rows=trailing, weight_operands=ops2, fp8_wgrad=fp8_wgrad,
                           source_blocks=blocks, sink=sinks[1])
