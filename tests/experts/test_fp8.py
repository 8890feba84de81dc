"""fp8_expert_gemm: row and group invariance, FP8 really on, the float64 bound of the dequantised math,
bad arguments, empty experts (CPU twin); on CUDA (marked gpu) the kernel's invariance and its
closeness to the twin."""
from __future__ import annotations

import math

import pytest
import torch

from moe_dispatch.experts.fp8 import fp8_expert_gemm, quantize_rows, wgrad_layout
from moe_dispatch.ops import quantize_group_columns

E4M3 = torch.float8_e4m3fn


def _rows(n: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows of magnitudes spread over 1e-2..1e2, so that any scale shared between rows shows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen) * 10.0 ** (4 * torch.rand(n, 1, generator=gen) - 2)
    return x.to(dtype)


def _weights(e: int, k: int, m: int, seed: int = 7) -> torch.Tensor:
    return (torch.randn(e, k, m, generator=torch.Generator().manual_seed(seed)) / math.sqrt(k)).to(torch.bfloat16)


def _run(x, w, counts, g, prequant: bool, out_dtype=torch.bfloat16, device="cpu", fp8_wgrad=True):
    """(out, rows' gradient, w's gradient) of sum(out * g)."""
    x, w, g = x.to(device), w.detach().to(device).requires_grad_(), g.to(device)
    tokens = torch.tensor(counts, device=device)
    if prequant:
        q, s = quantize_rows(x, E4M3)
        sink = torch.zeros((), dtype=x.dtype, device=device).expand(x.shape).requires_grad_()
        out = fp8_expert_gemm(q, s, w, tokens, out_dtype=out_dtype, grad_sink=sink, fp8_wgrad=fp8_wgrad)
        out.backward(g)
        return out.detach(), sink.grad, w.grad
    x = x.detach().clone().requires_grad_()
    out = fp8_expert_gemm(x, None, w, tokens, out_dtype=out_dtype, fp8_wgrad=fp8_wgrad)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def _batch(block: torch.Tensor, g_block: torch.Tensor, counts, expert: int, seed: int, m: int):
    """x and g with `block` as expert `expert`'s rows and fresh rows for the other experts."""
    before, after = sum(counts[:expert]), sum(counts[expert + 1:])
    k = block.shape[1]
    x = torch.cat([_rows(before, k, seed), block, _rows(after, k, seed + 1)])
    g = torch.cat([_rows(before, m, seed + 2), g_block, _rows(after, m, seed + 3)])
    return x, g, before


@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8_wgrad", "wide_wgrad"])
@pytest.mark.parametrize("prequant", [False, True])
def test_rows_and_groups_invariant(prequant, fp8_wgrad):
    """A row's output and input gradient are bitwise the same whatever rows share the call and
    however the others are grouped; expert 2's wgrad is bitwise the same whatever the others hold."""
    k, m, rows = 48, 32, 13
    w = _weights(4, k, m)
    block, g_block = _rows(rows, k, 1), _rows(rows, m, 2)
    splits = [[7, 0, rows, 20], [0, 0, rows, 0], [3, 30, rows, 1]]
    results = []
    for i, counts in enumerate(splits):
        x, g, start = _batch(block, g_block, counts, 2, 10 * i + 20, m)
        out, gx, gw = _run(x, w, counts, g, prequant, fp8_wgrad=fp8_wgrad)
        results.append((out[start : start + rows], gx[start : start + rows], gw[2]))
    for out, gx, gw in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(gx, results[0][1]) and torch.equal(gw, results[0][2])
    out, gx, _ = _run(block[5:6], w, [0, 0, 1, 0], g_block[5:6], prequant, fp8_wgrad=fp8_wgrad)  # one row alone
    assert torch.equal(out, results[0][0][5:6]) and torch.equal(gx, results[0][1][5:6])


def _median_row_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).median())


def test_fp8_really_on():
    """Median per-row relative error against the unquantised fp32 math lies in [1e-2, 0.2]
    (e4m3's 3-bit mantissa), for the output, the rows' gradient and the weight gradient."""
    counts, k, m = [30, 10, 24], 64, 32
    x, g, w = _rows(64, k, 3), _rows(64, m, 4), _weights(3, k, m)
    out, gx, gw = _run(x, w, counts, g, prequant=False)
    xs, gs = torch.split(x.double(), counts), torch.split(g.double(), counts)
    ref_out = torch.cat([xe @ w[e].double() for e, xe in enumerate(xs)])
    ref_gx = torch.cat([ge @ w[e].double().t() for e, ge in enumerate(gs)])
    ref_gw = torch.stack([xe.t() @ ge for xe, ge in zip(xs, gs)])
    for got, ref in [(out, ref_out), (gx, ref_gx), (gw, ref_gw)]:
        assert 1e-2 <= _median_row_error(got, ref) <= 0.2


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.double() * s.double()[:, None]


def _within_bound(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """got ~ a @ b (float64 dequantised operands, [n, C] and [C, D]). fp32 products of float8 values
    are exact; the tree sum over C adds ceil(log2 C) roundings and the two scale multiplies two more,
    each <= 2^-24 of the absolute sum S = |a| @ |b|, and one more where an fp32 result is cast on to
    bf16; the final rounding <= u (of got's dtype) of the value:
    |got - ref| <= u * |ref| + (1 + u) * (ceil(log2 C) + 3) * 2^-24 * S."""
    ref, s = a @ b, a.abs() @ b.abs()
    u = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[got.dtype]
    bound = u * ref.abs() + (1 + u) * (math.ceil(math.log2(max(a.shape[1], 2))) + 3) * 2.0 ** -24 * s
    assert bool(((got.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_float64_bound(out_dtype):
    """Forward, dgrad and wgrad against float64 of the same dequantised operands, built here by
    quantize_rows alone (wgrad's per-(expert, column) operands one expert at a time)."""
    counts, k, m = [40, 1, 0, 3], 48, 32
    n = sum(counts)
    x, g, w = _rows(n, k, 5), _rows(n, m, 6).to(out_dtype), _weights(4, k, m)
    out, gx, gw = _run(x, w, counts, g, prequant=False, out_dtype=out_dtype)
    xq, xs = quantize_rows(x, E4M3)
    gq, gs = quantize_rows(g, E4M3)
    start = 0
    for e, rows in enumerate(counts):
        sl = slice(start, start + rows)
        wq, ws = quantize_rows(w[e].t(), E4M3)  # per output column, over K
        _within_bound(out[sl], _deq(xq[sl], xs[sl]), _deq(wq, ws).t())
        wq, ws = quantize_rows(w[e], E4M3)  # per k, over M
        _within_bound(gx[sl], _deq(gq[sl], gs[sl]), _deq(wq, ws).t())
        xcq, xcs = quantize_rows((_deq(xq[sl], xs[sl]).float()).t(), E4M3)
        gcq, gcs = quantize_rows(g[sl].t(), E4M3)
        _within_bound(gw[e], _deq(xcq, xcs), _deq(gcq, gcs).t())
        start += rows


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_wide_wgrad(out_dtype):
    """fp8_wgrad=False: the forward and the input gradient are bitwise those of fp8_wgrad=True; the
    weight gradient is within the float64 bound of deq(x_e)^T @ g_e, with deq(x) the saved rows
    widened to the gradient's dtype (one fp32 multiply, one rounding); and it is closer to the
    unquantised product than the FP8 weight gradient (one FP8 rounding of x instead of three
    quantisations: x per row, then x and g per column)."""
    counts, k, m = [40, 1, 0, 23], 48, 32
    n = sum(counts)
    x, g, w = _rows(n, k, 5), _rows(n, m, 6).to(out_dtype), _weights(4, k, m)
    fp8 = _run(x, w, counts, g, prequant=False, out_dtype=out_dtype)
    wide = _run(x, w, counts, g, prequant=False, out_dtype=out_dtype, fp8_wgrad=False)
    assert torch.equal(wide[0], fp8[0]) and torch.equal(wide[1], fp8[1])
    xq, xs = quantize_rows(x, E4M3)
    xd = (xq.float() * xs[:, None]).to(out_dtype).double()
    start, errors = 0, {"fp8": [], "wide": []}
    for e, rows in enumerate(counts):
        sl = slice(start, start + rows)
        _within_bound(wide[2][e], xd[sl].t(), g[sl].double())
        if rows > 1:
            ref = x[sl].double().t() @ g[sl].double()
            for name, got in (("fp8", fp8[2]), ("wide", wide[2])):
                errors[name].append(((got[e].double() - ref).norm() / ref.norm()).item())
        start += rows
    assert max(errors["wide"]) < min(errors["fp8"])


@pytest.mark.parametrize("fp8_wgrad", [False, True])
def test_per_source_weight_gradients(fp8_wgrad):
    """source_blocks (GradientTree): each (expert, source) block's weight gradient is bitwise the
    gradient of that source's rows alone (fp8_wgrad=True, issue 50 item 3: the column scales per
    block); the output and input gradient are unchanged; w gets no gradient. The sync-free plan's
    device blocks ([E, P] rows) with trailing junk rows give the same bits. No sink: refused."""
    k, m = 32, 16
    w = _weights(2, k, m)
    # two sources (a micro-batch each), expert-major: expert 0 gets 3 + 5 rows, expert 1 gets 0 + 4
    per_source = [[3, 0], [5, 4]]
    x_src = [_rows(sum(c), k, 40 + i) for i, c in enumerate(per_source)]
    g_src = [_rows(sum(c), m, 50 + i) for i, c in enumerate(per_source)]
    split = [torch.split(t, c) for t, c in zip(x_src, per_source)]
    split_g = [torch.split(t, c) for t, c in zip(g_src, per_source)]
    x = torch.cat([split[s][e] for e in range(2) for s in range(2)])
    g = torch.cat([split_g[s][e] for e in range(2) for s in range(2)])
    blocks = [[(0, 3), (3, 5)], [(8, 0), (8, 4)]]
    q, scales = quantize_rows(x, E4M3)
    got = []
    sink = torch.zeros((), dtype=x.dtype).expand(x.shape).requires_grad_()
    wl = w.detach().clone().requires_grad_()
    out = fp8_expert_gemm(q, scales, wl, torch.tensor([8, 4]), grad_sink=sink, fp8_wgrad=fp8_wgrad,
                          source_blocks=blocks, sink=got.append)
    out.backward(g)
    assert wl.grad is None and len(got) == 1 and got[0].shape == (2, 2, k, m)
    ref = _run(x, w, [8, 4], g, prequant=True, fp8_wgrad=fp8_wgrad)
    assert torch.equal(out, ref[0]) and torch.equal(sink.grad, ref[1])
    for s in range(2):  # each source alone
        alone = _run(x_src[s], w, per_source[s], g_src[s], prequant=True, fp8_wgrad=fp8_wgrad)
        for e in range(2):
            assert torch.equal(got[0][e, s], alone[2][e]), (e, s)
    # device blocks and 3 trailing rows of junk (a sync-free buffer)
    qt, st = torch.cat([q, q[:3]]), torch.cat([scales, torch.full((3,), 1e6)])
    gt = torch.cat([g, torch.full((3, m), 1e4)])
    sink_t = torch.zeros((), dtype=x.dtype).expand(qt.shape).requires_grad_()
    device_blocks = torch.tensor([[3, 5], [0, 4]])
    fp8_expert_gemm(qt, st, wl, torch.tensor([8, 4]), grad_sink=sink_t, trailing_rows=True, fp8_wgrad=fp8_wgrad,
                    source_blocks=device_blocks, sink=got.append).backward(gt)
    assert torch.equal(got[1], got[0])
    with pytest.raises(ValueError, match="a sink"):
        fp8_expert_gemm(q, scales, wl, torch.tensor([8, 4]), grad_sink=sink, fp8_wgrad=False, source_blocks=blocks)


def test_group_columns_match_one_call_per_expert():
    """The wgrad operands (wgrad_layout's padding) equal quantize_rows(x_e.T) per expert, zeros in
    the padding; an expert of no rows gets 16 zero columns."""
    counts = [40, 1, 0, 3, 17]
    x = _rows(sum(counts), 24, 8)
    row_starts, padded_starts, P = wgrad_layout(torch.tensor(counts).cumsum(0), x.shape[0])
    qt, scales = quantize_group_columns(x, row_starts, padded_starts, P, E4M3)
    assert qt.shape == (24, 48 + 16 + 16 + 16 + 32 + 16)  # the experts, then the slack (none here)
    start = pstart = 0
    for e, rows in enumerate(counts):
        q, s = quantize_rows(x[start : start + rows].t(), E4M3)
        padded = -(-max(rows, 1) // 16) * 16
        assert torch.equal(qt[:, pstart : pstart + rows].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales[e], s)
        assert not qt[:, pstart + rows : pstart + padded].view(torch.uint8).any()
        start, pstart = start + rows, pstart + padded


@pytest.mark.parametrize("layout", ["D contiguous", "C contiguous", "strided"])
def test_weight_operand_is_quantize_rows_per_expert(layout):
    """weight_operand of w [E, D, C] gives quantize_rows(w[e])'s bits for every expert, C contiguous
    with 16-byte rows, whichever way w is laid out (in place by quantize_rows or by the op's
    transposing quantisation, or after a copy)."""
    from moe_dispatch.experts.fp8 import weight_operand

    base = _weights(3, 48, 32)  # [E, D=48, C=32]
    w = {"C contiguous": base, "D contiguous": base.transpose(1, 2).contiguous().transpose(1, 2),
         "strided": torch.stack([base, base], dim=3)[..., 0]}[layout]
    assert torch.equal(w, base)
    q, s = weight_operand(w, E4M3)
    assert q.shape == (3, 48, 32) and q.stride(2) == 1 and q.stride(1) % 16 == 0 and s.shape == (3, 48)
    for e in range(3):
        ref_q, ref_s = quantize_rows(base[e], E4M3)
        assert torch.equal(q[e].contiguous().view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s[e], ref_s)


@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8_wgrad", "wide_wgrad"])
@pytest.mark.parametrize("prequant", [False, True])
def test_trailing_rows_change_nothing(prequant, fp8_wgrad):
    """trailing_rows: rows after sum(counts) (a sync-free buffer, here holding large values and a
    NaN) change no real row's output or gradient nor w's gradient, bitwise, and give zero output
    rows on the CPU; without trailing_rows the same counts are refused."""
    counts, k, m = [9, 0, 21], 32, 16
    w = _weights(3, k, m)
    x, g = _rows(30, k, 11), _rows(30, m, 12)
    junk_x, junk_g = 1e4 * _rows(7, k, 13), _rows(7, m, 14)
    junk_x[2, 3] = float("nan")
    ref = _run(x, w, counts, g, prequant, fp8_wgrad=fp8_wgrad)
    xb, gb = torch.cat([x, junk_x]), torch.cat([g, junk_g])
    wb = w.detach().clone().requires_grad_()
    tokens = torch.tensor(counts)
    if prequant:
        q, s = quantize_rows(xb, E4M3)
        sink = torch.zeros((), dtype=xb.dtype).expand(xb.shape).requires_grad_()
        out = fp8_expert_gemm(q, s, wb, tokens, grad_sink=sink, trailing_rows=True, fp8_wgrad=fp8_wgrad)
        out.backward(gb)
        gx = sink.grad
    else:
        xr = xb.detach().clone().requires_grad_()
        out = fp8_expert_gemm(xr, None, wb, tokens, trailing_rows=True, fp8_wgrad=fp8_wgrad)
        out.backward(gb)
        gx = xr.grad
    assert torch.equal(out[:30], ref[0]) and torch.equal(gx[:30], ref[1]) and torch.equal(wb.grad, ref[2])
    assert not out[30:].any()
    with pytest.raises(ValueError, match="tokens_per_expert"):
        fp8_expert_gemm(xb, None, w, tokens)



@pytest.mark.parametrize("bad", [torch.float8_e5m2, torch.float16, torch.int8])
def test_bad_fp8_dtype_names_it(bad):
    x, w = _rows(4, 16, 0), _weights(2, 16, 16)
    with pytest.raises(ValueError, match="fp8_dtype"):
        fp8_expert_gemm(x, None, w, torch.tensor([1, 3]), fp8_dtype=bad)


def test_bad_arguments_name_them():
    x, w = _rows(4, 16, 0), _weights(2, 16, 16)
    q, s = quantize_rows(x, E4M3)
    with pytest.raises(ValueError, match="x_scales"):
        fp8_expert_gemm(q, s[:3], w, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        fp8_expert_gemm(x, None, w, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_expert_gemm(x, None, w, torch.tensor([1, 3]), out_dtype=torch.float64)
    with pytest.raises(ValueError, match="grad_sink"):
        fp8_expert_gemm(x, None, w, torch.tensor([1, 3]), grad_sink=torch.zeros(4, 16))
    with pytest.raises(ValueError, match="fp8_wgrad"):
        fp8_expert_gemm(x, None, w, torch.tensor([1, 3]), fp8_wgrad="no")


@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8_wgrad", "wide_wgrad"])
@pytest.mark.parametrize("counts", [[0, 9, 0], [0, 0, 0]])
def test_empty_experts_give_zeros(counts, fp8_wgrad):
    n, k, m = sum(counts), 16, 16
    out, gx, gw = _run(_rows(n, k, 1), _weights(3, k, m), counts, _rows(n, m, 2), prequant=False,
                       fp8_wgrad=fp8_wgrad)
    assert out.shape == (n, m) and gx.shape == (n, k)
    for e, rows in enumerate(counts):
        if rows == 0:
            assert torch.equal(gw[e], torch.zeros(k, m, dtype=gw.dtype))
        else:
            assert gw[e].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8_wgrad", "wide_wgrad"])
@pytest.mark.parametrize("prequant", [False, True])
def test_cuda_invariant_and_close_to_twin(prequant, fp8_wgrad):
    """CUDA: 128 rows alone and inside a batch of unaligned groups (1068 rows included, which FP8
    wgrad cannot take unpadded) give bitwise the same output, input gradient and their expert's
    wgrad; the batch is close to the CPU twin (per expert, in the Frobenius norm)."""
    k, m, rows = 512, 256, 128
    w = _weights(6, k, m)
    block, g_block = _rows(rows, k, 1), _rows(rows, m, 2)
    counts = [1068, 13, 0, rows, 301, 7]
    x, g, start = _batch(block, g_block, counts, 3, 30, m)
    got = _run(x, w, counts, g, prequant, device="cuda", fp8_wgrad=fp8_wgrad)
    alone = _run(block, w, [0, 0, 0, rows, 0, 0], g_block, prequant, device="cuda", fp8_wgrad=fp8_wgrad)
    sl = slice(start, start + rows)
    assert torch.equal(got[0][sl], alone[0]) and torch.equal(got[1][sl], alone[1])
    assert torch.equal(got[2][3], alone[2][3])
    twin = _run(x, w, counts, g, prequant, fp8_wgrad=fp8_wgrad)
    # The H200's FP8 MMA accumulates with fewer bits than fp32 (DeepSeek-V3's report, section
    # 3.3.2): out and dx with its fast accumulation (FAST_ACCUM_ROWS), dw between its promotions to
    # fp32 (there an elementwise bound with an fp32 summation term failed: 1.09x it, and 1.05x with
    # that term 1.5x larger). So each result is held per expert in the Frobenius norm: within 2^-7
    # of the twin (both round to bf16, about 2^-9 each; a wrong scale, row or padding is off by
    # e4m3's 2^-4 or more), and exact zeros where an expert has no rows (dw).
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    for name, gpu, cpu in zip(("out", "dx", "dw"), got, twin):
        gpu, cpu = gpu.cpu().double(), cpu.double()
        for e, (n, a, b) in enumerate(zip(counts, starts, starts[1:])):
            gpu_e, cpu_e = (gpu[e], cpu[e]) if name == "dw" else (gpu[a:b], cpu[a:b])
            if n == 0:
                assert not gpu_e.any() and not cpu_e.any(), (name, e)
                continue
            rel = ((gpu_e - cpu_e).norm() / cpu_e.norm()).item()
            assert rel <= 2.0 ** -7, f"{name}, expert {e} ({n} rows): {rel:.3g} of its norm away from the twin"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8_wgrad", "wide_wgrad"])
def test_cuda_sync_free_with_trailing_rows(fp8_wgrad):
    """CUDA, device counts and trailing rows (a sync-free buffer, holding junk): forward and
    backward run with CUDA's sync debug mode set to 'error' (no host read), and every real row's
    output and gradient and w's gradient are bitwise those of the call without the trailing rows."""
    counts, k, m = [1068, 0, 13, 128], 256, 128
    n = sum(counts)
    w = _weights(4, k, m)
    x, g = _rows(n, k, 21), _rows(n, m, 22)
    ref = _run(x, w, counts, g, True, device="cuda", fp8_wgrad=fp8_wgrad)
    dev = torch.device("cuda")
    xb = torch.cat([x, 1e4 * _rows(37, k, 23)]).to(dev)
    gb = torch.cat([g, _rows(37, m, 24)]).to(dev)
    wb = w.to(dev).requires_grad_()
    tokens = torch.tensor(counts, device=dev)
    offsets = torch.cumsum(tokens, 0).to(torch.int32)
    q, s = quantize_rows(xb, E4M3)
    sink = torch.zeros((), dtype=xb.dtype, device=dev).expand(xb.shape).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fp8_expert_gemm(q, s, wb, tokens, offsets, grad_sink=sink, trailing_rows=True, fp8_wgrad=fp8_wgrad)
        out.backward(gb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out[:n], ref[0]) and torch.equal(sink.grad[:n], ref[1]) and torch.equal(wb.grad, ref[2])
