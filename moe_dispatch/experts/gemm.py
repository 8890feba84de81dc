"""Expert GEMMs: ``out[rows of e] = x[rows of e] @ w[e]`` for every local expert e.

``x`` is [N, K] with rows expert-major (expert 0's rows, then expert 1's, ...), ``w`` is
[E, K, M] and ``tokens_per_expert`` is [E] (int, CPU or device; it must sum to N). Result [N, M].

Three strategies, picked by `select_gemm`:

- ``"grouped"``: one ``torch._grouped_mm`` call. No host sync. Row-stable where
  `grouped_mm_row_stable` says so (CPU bf16/fp16, CUDA bf16 on sm90+: one CUTLASS kernel whose
  tile shape does not depend on the group sizes). On CPU fp32 it is a loop of plain mm inside and
  NOT row-stable (rows of groups with fewer than 4 rows differ).
- ``"padded"``: a per-expert loop of plain mm in which each expert's row block is zero-padded to a
  multiple of `row_tile` rows. BLAS picks its kernel from M, and on CPU (MKL fp32) only M < 4 takes a
  different path (also when several threads split M), so padding to a multiple of 8 puts every
  row through the same kernel. The row-stable fallback; it syncs with the host.
- ``"loop"``: plain per-expert mm, as Megatron's SequentialMLP does. Fastest loop, NOT row-stable
  (CPU fp32 below M=4; cuBLAS changes rows between M<=64 and M>=128). Opt-in only.

Row stability covers autograd too: the input gradient of a row is ``dy_row @ w[e]^T`` computed by
the same strategy (grouped_mm's backward is a grouped_mm; the padded loop's backward multiplies
padded blocks). Weight gradients are ``x_e^T @ dy_e`` per expert: a sum over that expert's rows
only, so they are deterministic and equal at any EP size for the same rows in the same order.
"""

from __future__ import annotations

from typing import List, Literal

import torch

GemmStrategy = Literal["grouped", "padded", "loop"]

# CPU: MKL fp32 sgemm has one kernel class for M >= 4 (any thread count we tried); 8 leaves margin.
# CUDA: cuBLAS keeps one kernel family only for large M (rows from M<=64 differ from M>=128).
_ROW_TILE = {"cpu": 8, "cuda": 128}


def default_row_tile(device: torch.device) -> int:
    """Rows each expert block is padded to a multiple of on the ``"padded"`` path."""
    return _ROW_TILE.get(device.type, 128)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` accepts these operands here (dtype, device, 16-byte strides)."""
    if not hasattr(torch, "_grouped_mm") or x.device != w.device or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        ok_dtype = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif x.device.type == "cuda":
        # Only bf16 runs the CUTLASS grouped kernel (sm90+); other dtypes fall back to an mm loop.
        ok_dtype = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        ok_dtype = False
    # Operands (and their transposes in backward) need row strides that are multiples of 16 bytes.
    item = x.element_size()
    return ok_dtype and (x.shape[1] * item) % 16 == 0 and (w.shape[2] * item) % 16 == 0


def grouped_mm_row_stable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` is known row-stable (tests/experts prove each entry).

    CPU bf16/fp16 (oneDNN kernel per group, row-stable at every M tried); CUDA bf16 (CUTLASS,
    FACTS.md and tests/experts/test_gpu.py). CPU fp32 is not: it loops plain MKL sgemm.
    """
    if device.type == "cpu":
        return dtype in (torch.bfloat16, torch.float16)
    return device.type == "cuda" and dtype == torch.bfloat16


def select_gemm(x: torch.Tensor, w: torch.Tensor, prefer_grouped: bool, row_stable: bool) -> GemmStrategy:
    """The strategy `expert_gemm` uses for these operands (see the module docstring)."""
    grouped_ok = prefer_grouped and grouped_mm_supported(x, w)
    if row_stable:
        if grouped_ok and grouped_mm_row_stable(x.device, x.dtype):
            return "grouped"
        return "padded"
    return "grouped" if grouped_ok else "loop"


def _counts(tokens_per_expert: torch.Tensor, n_rows: int) -> List[int]:
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if sum(counts) != n_rows or min(counts, default=0) < 0:
        raise ValueError(f"tokens_per_expert {counts} must be >= 0 and sum to the {n_rows} input rows")
    return counts


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm with an explicit backward: the built-in one rejects the stride-0
    gradients that e.g. ``out.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        if grad.shape[0] == 0:  # no rows: an empty tensor may carry strides grouped_mm rejects
            return torch.zeros_like(x), torch.zeros_like(w), None
        grad = grad.contiguous()
        # dx rows: dy_row @ w[e]^T, one grouped GEMM again (row-stable like the forward).
        gx = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        # dw[e] = x_e^T @ dy_e: groups now split the reduction dim; empty groups give zeros.
        gw = torch._grouped_mm(x.t(), grad, offs=offs) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def _grouped(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    if tokens_per_expert.device.type == "cpu":
        _counts(tokens_per_expert, x.shape[0])  # cheap check; a device tensor would need a sync
    offs = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
    return _GroupedMM.apply(x, w, offs)


def _loop(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor, row_tile: int) -> torch.Tensor:
    counts = _counts(tokens_per_expert, x.shape[0])
    outs = []
    for e, block in enumerate(torch.split(x, counts)):
        # Empty experts still multiply (a [0, K] block) so w gets a zero gradient, never None.
        pad = -block.shape[0] % row_tile
        if pad:
            block = torch.cat([block, block.new_zeros(pad, block.shape[1])])
        outs.append((block @ w[e])[: counts[e]])
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[2])


def expert_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    strategy: GemmStrategy,
    row_tile: int = 0,
) -> torch.Tensor:
    """``x`` [N, K] expert-major, ``w`` [E, K, M], ``tokens_per_expert`` [E] -> [N, M].

    ``row_tile`` (``"padded"`` only): 0 means `default_row_tile` for the device.
    """
    if strategy == "grouped":
        return _grouped(x, w, tokens_per_expert)
    if strategy == "padded":
        return _loop(x, w, tokens_per_expert, row_tile or default_row_tile(x.device))
    if strategy == "loop":
        return _loop(x, w, tokens_per_expert, 1)
    raise ValueError(f"unknown GEMM strategy {strategy!r}")
