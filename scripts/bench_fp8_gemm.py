"""Times the expert GEMMs in bf16 (torch._grouped_mm) against moe_dispatch.experts.fp8 (CUDA only).

For forward (X @ W), dgrad (dY @ W^T) and wgrad (X^T @ dY per expert) it prints, in ms (median of
CUDA-event timings): the bf16 grouped GEMM; the FP8 GEMM alone on operands quantised beforehand; the
FP8 GEMM with its quantisation, as `fp8_expert_gemm` runs it (x per row for the forward: fc2's case;
the weights by ``weight_operand``; wgrad's per-(expert, column) operands, zero-padded to 16 rows per
expert). "fwd, B dense" is the forward on the same weight bytes with each expert's block contiguous
(the line after the table says whether the two forwards are bitwise equal); "fwd, exact acc" the
forward with ``use_fast_accum=False`` (fp32-promoted accumulation; its fp8+quant column: on the
dense copy), where fp8_expert_gemm's forward and dgrad use fast accumulation (FAST_ACCUM_ROWS), with
the relative change between the two after the table; and the FLOP floors at the
H200 SXM's dense peaks (989 TFLOP/s bf16, 1979 TFLOP/s fp8: NVIDIA's H200 datasheet). A last row
times the whole autograd step (forward + backward) of each. Then wgrad with the FP8 MMA's fast
accumulation against the default (the layer's), whose contraction is an expert's rows: the time
of each, each one's error against the float64 product of the same quantised operands, and whether
an expert's result stays bitwise when another expert's rows change (the batch invariance the
layer relies on), at the counts given and with one expert holding half the rows.

    python scripts/bench_fp8_gemm.py [--rows 49152 --hidden 4096 --ffn 2048 --experts 64 --counts even]

``--counts ragged`` draws uneven counts (most not multiples of 16), which wgrad pads; ``skewed``
gives expert 0 half the rows, the rest even.
"""
from __future__ import annotations

import argparse
import sys

import torch

from moe_dispatch.experts.fp8 import _cuda_mm, _cuda_wgrad, fp8_expert_gemm, quantize_rows, weight_operand, wgrad_layout
from moe_dispatch.ops import quantize_group_columns
from moe_dispatch.tools.profiling import median_ms

PEAK = {"bf16": 989.4e12, "fp8": 1978.9e12}  # dense FLOP/s, H200 SXM datasheet
E4M3 = torch.float8_e4m3fn


def _counts(rows: int, experts: int, kind: str) -> list:
    if kind == "even":
        base = [rows // experts] * experts
        base[-1] += rows - sum(base)
        return base
    if kind == "skewed":
        return [rows // 2] + _counts(rows - rows // 2, experts - 1, "even")
    gen = torch.Generator().manual_seed(0)
    picks = torch.multinomial(torch.rand(experts, generator=gen) + 0.5, rows, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--counts", choices=["even", "ragged", "skewed"], default="even")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_gemm needs a CUDA device")
    n, k, m, e = args.rows, args.hidden, args.ffn, args.experts
    counts = _counts(n, e, args.counts)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(e, k, m, device=dev) / k ** 0.5).to(torch.bfloat16)
    dy = torch.randn(n, m, device=dev, dtype=torch.bfloat16)
    tokens = torch.tensor(counts, device=dev)
    offs = torch.cumsum(tokens, 0).to(torch.int32)

    # Operands quantised once, for the GEMM-only column.
    xq, sx = quantize_rows(x, E4M3)
    wf, swf = weight_operand(w.transpose(1, 2), E4M3)  # [E, M, K], as fp8_expert_gemm's forward
    wf_dense = wf.contiguous()  # the same bytes, each expert's [M, K] block contiguous
    wd, swd = weight_operand(w, E4M3)  # [E, K, M], as its dgrad
    dyq, sdy = quantize_rows(dy, E4M3)
    layout = wgrad_layout(offs, n)  # (row starts, padded starts, P), on the device
    xt, sxc = quantize_group_columns(xq, *layout, E4M3, sx)
    dyt, sdyc = quantize_group_columns(dy, *layout, E4M3)

    def fwd_quant():
        q, s = quantize_rows(x, E4M3)
        return _cuda_mm(q, s, *weight_operand(w.transpose(1, 2), E4M3), offs)

    def dgrad_quant():
        q, s = quantize_rows(dy, E4M3)
        return _cuda_mm(q, s, *weight_operand(w, E4M3), offs)

    def wgrad_quant():
        a, sa = quantize_group_columns(xq, *layout, E4M3, sx)
        b, sb = quantize_group_columns(dy, *layout, E4M3)
        return _cuda_wgrad(a, sa, b, sb, layout[1])

    def forward_accum(b, fast: bool):
        """The forward with use_fast_accum=fast (fp8_expert_gemm's forward and dgrad: FAST_ACCUM_ROWS)."""
        return torch._scaled_grouped_mm(xq, b.transpose(1, 2), sx, swf, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def step_bf16():
        xg.grad = wg.grad = None
        torch._grouped_mm(xg, wg, offs=offs).backward(dy)

    def step_fp8():
        xg.grad = wg.grad = None
        fp8_expert_gemm(xg, None, wg, tokens, offs).backward(dy)

    rows = [
        ("forward", lambda: torch._grouped_mm(x, w, offs=offs), lambda: _cuda_mm(xq, sx, wf, swf, offs), fwd_quant),
        ("fwd, B dense", lambda: torch._grouped_mm(x, w, offs=offs), lambda: _cuda_mm(xq, sx, wf_dense, swf, offs),
         lambda: _cuda_mm(xq, sx, wf_dense, swf, offs)),
        ("fwd, exact acc", lambda: torch._grouped_mm(x, w, offs=offs), lambda: forward_accum(wf, False),
         lambda: forward_accum(wf_dense, False)),
        ("dgrad", lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offs),
         lambda: _cuda_mm(dyq, sdy, wd, swd, offs), dgrad_quant),
        ("wgrad", lambda: torch._grouped_mm(x.t(), dy, offs=offs),
         lambda: _cuda_wgrad(xt, sxc, dyt, sdyc, layout[1]), wgrad_quant),
    ]
    flops = 2.0 * n * k * m
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {n} rows, K {k}, M {m}, {e} experts, "
          f"counts {args.counts} ({sum(c % 16 != 0 for c in counts)} not multiples of 16)")
    print(f"{'GEMM':<10}{'bf16':>10}{'fp8 GEMM':>10}{'fp8+quant':>11}{'bf16 floor':>12}{'fp8 floor':>11}   (ms)")
    for name, bf16, fp8, fp8_quant in rows:
        t = [median_ms(f, args.iters) for f in (bf16, fp8, fp8_quant)]
        print(f"{name:<10}{t[0]:>10.3f}{t[1]:>10.3f}{t[2]:>11.3f}"
              f"{flops / PEAK['bf16'] * 1e3:>12.3f}{flops / PEAK['fp8'] * 1e3:>11.3f}")
    t_bf16, t_fp8 = median_ms(step_bf16, args.iters), median_ms(step_fp8, args.iters)
    print(f"{'step':<10}{t_bf16:>10.3f}{'':>10}{t_fp8:>11.3f}"
          f"{3 * flops / PEAK['bf16'] * 1e3:>12.3f}{3 * flops / PEAK['fp8'] * 1e3:>11.3f}"
          "   (autograd forward + backward, fp8 quantising x per row)")
    same = torch.equal(_cuda_mm(xq, sx, wf_dense, swf, offs), _cuda_mm(xq, sx, wf, swf, offs))
    print(f"forward with weight_operand's strided [E, M, K] bitwise the dense copy's: {same}")
    exact, fast = forward_accum(wf, False).double(), forward_accum(wf, True).double()
    rel = ((fast - exact).norm() / exact.norm()).item()
    print(f"forward, use_fast_accum=True against False: relative change {rel:.3g}")
    for kind in dict.fromkeys([args.counts, "skewed"]):
        wgrad_accumulation(x, dy, _counts(n, e, kind), kind, args.iters)


def wgrad_accumulation(x: torch.Tensor, dy: torch.Tensor, counts: list, kind: str, iters: int) -> None:
    """wgrad with fast accumulation against the default, at these counts: ms, error against float64,
    batch invariance."""
    offs = torch.cumsum(torch.tensor(counts, device=x.device), 0).to(torch.int32)
    n = x.shape[0]
    layout = wgrad_layout(offs, n)
    xq, sx = quantize_rows(x, E4M3)
    xt, sxc = quantize_group_columns(xq, *layout, E4M3, sx)
    dyt, sdyc = quantize_group_columns(dy, *layout, E4M3)
    starts = layout[1].tolist()
    # float64 of the same quantised operands: per expert, (xt * sx) @ (dyt * sdy)^T over its columns
    ref = torch.stack([
        (xt[:, starts[g]:starts[g + 1]].double() * sxc[g, :, None].double())
        @ (dyt[:, starts[g]:starts[g + 1]].double() * sdyc[g, :, None].double()).t()
        for g in range(len(counts))])
    # another expert's rows changed (the last expert's dy negated): expert 0's result must not move
    dy2 = dy.clone()
    dy2[int(offs[-2]):int(offs[-1])] *= -1
    dyt2, sdyc2 = quantize_group_columns(dy2, *layout, E4M3)
    print(f"\nwgrad accumulation, counts {kind} (largest expert {max(counts)} rows):")
    for fast in (False, True):
        try:
            dw = _cuda_wgrad(xt, sxc, dyt, sdyc, layout[1], fast_accum=fast)
        except RuntimeError as exc:  # a torch whose 2d x 2d kernel refuses fast accumulation
            print(f"  use_fast_accum={fast}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ms = median_ms(lambda f=fast: _cuda_wgrad(xt, sxc, dyt, sdyc, layout[1], fast_accum=f), iters)
        err = ((dw.double() - ref).norm() / ref.norm()).item()
        worst = max(((dw[g].double() - ref[g]).norm() / ref[g].norm()).item() for g in range(len(counts)))
        other = _cuda_wgrad(xt, sxc, dyt2, sdyc2, layout[1], fast_accum=fast)
        same = torch.equal(dw[0], other[0])
        print(f"  use_fast_accum={fast}: {ms:.3f} ms; relative error against float64 {err:.3g} (worst expert "
              f"{worst:.3g}; bf16 output's rounding alone ~2e-3); expert 0 bitwise when another's rows change: {same}")


if __name__ == "__main__":
    main()
