"""Row-stable gating GEMM: bitwise independence from the other rows, backward determinism. The
CPU checks run under `tests.fake_blas.FakeBlas`, a BLAS whose rows change with the row count
and position, so they hold whatever the CPU's BLAS does."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_dispatch.router import gating_linear, row_stable_mm
from tests.fake_blas import FakeBlas, fake_mm

H, E = 96, 24
# (input dtype, router dtype)
CASES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float64, torch.float64),
    (torch.float32, torch.float64),
    (torch.bfloat16, torch.bfloat16),
]
IDS = ["fp32", "bf16-in-fp32", "fp64", "fp32-in-fp64", "bf16"]


def data(in_dtype, t=1000, device="cpu", h=H, e=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device=device, dtype=in_dtype)
    w = (torch.randn(e, h, generator=g) * 0.1).to(device=device)
    return x, w


def test_fake_blas_is_row_unstable():
    """The fake BLAS changes rows with the row count, so the tests below can fail."""
    x, w = data(torch.float32, t=8)
    full = fake_mm(x, w.t())
    assert any(not torch.equal(fake_mm(x[:t], w.t()), full[:t]) for t in (1, 2, 3))


@pytest.mark.parametrize("in_dtype,dtype", CASES, ids=IDS)
def test_rows_bitwise_independent_of_batch(in_dtype, dtype):
    x, w = data(in_dtype)
    with FakeBlas() as blas:
        full = gating_linear(x, w, dtype)
        assert full.dtype == dtype
        for t in list(range(1, 71)) + [128, 129, 200, 999]:
            assert torch.equal(gating_linear(x[:t], w, dtype), full[:t]), t
        for t in (0, 5, 517, 998):  # single tokens, anywhere in the batch
            assert torch.equal(gating_linear(x[t : t + 1], w, dtype), full[t : t + 1]), t
        perm = torch.randperm(1000, generator=torch.Generator().manual_seed(1))
        assert torch.equal(gating_linear(x[perm], w, dtype), full[perm])
        truncated = x.clone()
        truncated[90:] = 0
        assert torch.equal(gating_linear(truncated, w, dtype)[:90], full[:90])
    assert blas.calls == 0
    ref = x.double() @ w.double().t()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("in_dtype,dtype", CASES, ids=IDS)
def test_backward_deterministic_and_row_stable(in_dtype, dtype):
    x, w = data(in_dtype, t=300)
    g = torch.randn(300, E, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def grads(rows, start=0):
        xi = x[start : start + rows].clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        (gating_linear(xi, wi, dtype) * g[start : start + rows].to(dtype)).sum().backward()
        return xi.grad, wi.grad

    gx, gw = grads(300)
    with FakeBlas() as blas:
        gx2, gw2 = grads(300)
        assert torch.equal(gx, gx2) and torch.equal(gw, gw2)  # the weight grad too: a fixed tree over T
        assert gx.dtype == in_dtype and gw.dtype == w.dtype
        for t in (1, 2, 3, 7, 8, 64, 65, 130, 200):  # a token's input grad depends on its grad row only
            assert torch.equal(grads(t)[0], gx[:t]), t
            assert torch.equal(grads(t, 300 - t)[0], gx[300 - t :]), t
    assert blas.calls == 0
    ref_x = g.to(dtype).double() @ w.double()
    ref_w = g.to(dtype).double().t() @ x.double()
    # Each grad is rounded to its tensor's dtype at the end (bf16 input grads, fp32 weight grads);
    # a bf16 router dtype rounds the weight to bf16 first.
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}
    if dtype == torch.bfloat16:
        tol = {torch.float32: 5e-2, torch.float64: 5e-2, torch.bfloat16: 5e-2}
    torch.testing.assert_close(gx.double(), ref_x, rtol=tol[in_dtype], atol=tol[in_dtype])
    torch.testing.assert_close(gw.double(), ref_w, rtol=tol[w.dtype], atol=tol[w.dtype])


def test_row_stable_mm_general_shapes():
    a = torch.randn(257, 33, dtype=torch.float64)
    b_t = torch.randn(5, 33, dtype=torch.float64)
    torch.testing.assert_close(row_stable_mm(a, b_t, torch.float64), a @ b_t.t())
    assert row_stable_mm(a[:0], b_t, torch.float64).shape == (0, 5)


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from moe_dispatch.router._triton_gemm import triton_row_stable_mm
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(70, 40, generator=g).to(dtype)
        w = torch.randn(20, 40, generator=g)          # fp32 weight, cast in the kernel
        full = triton_row_stable_mm(a, w, dtype)
        torch.testing.assert_close(full, (a.double() @ w.double().t()).to(dtype), rtol=1e-5, atol=1e-5)
        for t in (1, 3, 33):
            assert torch.equal(triton_row_stable_mm(a[:t], w, dtype), full[:t]), t
        # transposed right operand through strides, as the backward uses it
        gt = triton_row_stable_mm(full, w.t(), dtype)
        torch.testing.assert_close(gt, (full.double() @ w.double()).to(dtype), rtol=1e-5, atol=1e-5)
    a = torch.randn(70, 40, generator=g).bfloat16()  # half input, fp64 router: upcast via fp32
    out = triton_row_stable_mm(a, w, torch.float64)
    torch.testing.assert_close(out, a.double() @ w.double().t(), rtol=1e-12, atol=1e-12)
    print("OK")
    """
)


def _run_interpreted(script: str, timeout: int) -> None:
    """Run ``script`` in a fresh process under Triton's CPU interpreter; it must print OK."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_triton_kernel_indexing_under_interpreter():
    """Masks, strides and dtype handling of the CUDA kernel, run by Triton's CPU interpreter."""
    _run_interpreted(_INTERPRETER_SCRIPT, timeout=120)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("e", [128, 256])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w-fp32", "w-bf16"])
@pytest.mark.parametrize("in_dtype,dtype", CASES, ids=IDS)
def test_gpu_rows_bitwise_independent_of_batch(in_dtype, dtype, w_dtype, e):
    # Kernel paths: fp32 FMA, half x half MMA, half x (fp32 split in three) MMA, fp64; the tile
    # width depends on E.
    x, w = data(in_dtype, t=4096, device="cuda", h=1024, e=e)
    w = w.to(w_dtype)
    full = gating_linear(x, w, dtype)
    for t in (1, 3, 8, 64, 65, 128, 1000, 4095):
        assert torch.equal(gating_linear(x[:t], w, dtype), full[:t]), t
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(gating_linear(x[perm], w, dtype), full[perm])
    ref = x.double() @ w.double().t()
    tol = {torch.float32: 1e-4, torch.float64: 1e-12, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol)
    xg = x[:1000].clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    gout = torch.randn(1000, e, device="cuda", dtype=dtype)
    gating_linear(xg, wg, dtype).backward(gout)
    gx, gw = xg.grad.clone(), wg.grad.clone()
    xg.grad = None
    wg.grad = None
    gating_linear(xg, wg, dtype).backward(gout)
    assert torch.equal(xg.grad, gx) and torch.equal(wg.grad, gw)


_BACKWARD_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from moe_dispatch.router._triton_gemm import triton_row_stable_mm
    g = torch.Generator().manual_seed(0)
    # The CUDA input gradient: grad_logits [T, E] @ weight [E, H], weight.t() as the right
    # operand; T, E, H not multiples of any tile. (grad dtype, weight dtype, router dtype, tol)
    # Prefixes only: the interpreter's dot is numpy's matmul, whose rows may depend on their
    # place in the tile; and no half operands, which the interpreter's dot gets wrong (the GPU
    # test checks both).
    for gd, wd, dtype, tol in [(torch.float32, torch.float32, torch.float32, 1e-5),
                               (torch.float32, torch.bfloat16, torch.float32, 1e-5),
                               (torch.float64, torch.float32, torch.float64, 1e-12)]:
        grad = torch.randn(70, 6, generator=g).to(gd)
        w = torch.randn(6, 40, generator=g).to(wd)
        full = triton_row_stable_mm(grad, w.t(), dtype)
        ref = grad.double() @ w.to(dtype).double()
        torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol)
        for t in (1, 2, 3, 33, 64, 65, 69):
            assert torch.equal(triton_row_stable_mm(grad[:t], w.t(), dtype), full[:t]), (dtype, t)
    print("OK")
    """
)


def test_triton_input_grad_kernel_row_stable_under_interpreter():
    """The CUDA router input gradient's kernel (the forward's, with weight.t() as the right
    operand), run by Triton's CPU interpreter: correct, and each row independent of the others."""
    _run_interpreted(_BACKWARD_INTERPRETER_SCRIPT, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("store", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["fp32", "split", "half"])
def test_gpu_store_dtype_is_the_cast_of_the_result(kind, store):
    """triton_row_stable_mm(..., store_dtype=...) (the router's input gradient, stored in the
    tokens' dtype) is bitwise ``.to(store_dtype)`` of the result in the compute dtype."""
    from moe_dispatch.router._triton_gemm import triton_row_stable_mm

    gen = torch.Generator().manual_seed(4)
    a = torch.randn(1000, 64, generator=gen)
    b_t = torch.randn(4096, 64, generator=gen)
    if kind != "fp32":  # half activations: "split" with an fp32 weight, "half" with a half one
        a = a.to(store)
        b_t = b_t.to(store) if kind == "half" else b_t
    a, b_t = a.cuda(), b_t.cuda()
    want = triton_row_stable_mm(a, b_t, torch.float32).to(store)
    got = triton_row_stable_mm(a, b_t, torch.float32, store_dtype=store)
    assert got.dtype == store and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("e", [128, 256])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w-fp32", "w-bf16"])
@pytest.mark.parametrize("in_dtype,dtype", CASES, ids=IDS)
def test_gpu_input_grad_rows_bitwise_independent_of_batch(in_dtype, dtype, w_dtype, e):
    """The router's input gradient on CUDA is row-stable by construction: under FakeBlas (which
    makes any BLAS product's rows depend on the row count) a token's input gradient is bitwise
    the same at every batch size 1..4096 and position, and no BLAS product is taken."""
    x, w = data(in_dtype, t=4096, device="cuda", h=1024, e=e)
    w = w.to(w_dtype)  # not a leaf that requires grad: only the input gradient is computed
    gout = torch.randn(4096, e, generator=torch.Generator().manual_seed(3)).to(device="cuda", dtype=dtype)

    def input_grad(start: int, rows: int) -> torch.Tensor:
        xi = x[start : start + rows].clone().requires_grad_(True)
        gating_linear(xi, w, dtype).backward(gout[start : start + rows])
        return xi.grad

    with FakeBlas() as blas:
        full = input_grad(0, 4096)
        for t in (1, 2, 3, 5, 8, 16, 31, 64, 65, 127, 128, 129, 256, 1000, 2048, 4095):
            assert torch.equal(input_grad(0, t), full[:t]), t
            assert torch.equal(input_grad(4096 - t, t), full[4096 - t :]), t
        for i in (0, 1, 777, 4095):  # single tokens anywhere
            assert torch.equal(input_grad(i, 1), full[i : i + 1]), i
    assert blas.calls == 0
    assert full.dtype == in_dtype
    ref = gout.double() @ w.to(dtype).double()
    tol = {torch.float32: 1e-4, torch.float64: 1e-12, torch.bfloat16: 5e-2}[in_dtype]  # rounded to x's dtype
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol * 10)
