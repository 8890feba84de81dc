"""The unpermute forward with fused multiply-adds (torch_twin.NUMERICS["unpermute_fma"]): the twin's
exact fp32 fma emulation against exact rational arithmetic, and the kernel against the twin."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from moe_dispatch.ops import permute, set_backend, unpermute
from moe_dispatch.ops import torch_twin as TW
from tests.ops.oracle import random_routing


def _round_to_fp32(value: Fraction) -> np.float32:
    """value rounded to the nearest fp32, ties to even (exact comparisons, no double rounding)."""
    x = np.float32(float(value))
    candidates = [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - value), int(np.float32(v).view(np.int32)) & 1))


def test_fma32_is_the_correctly_rounded_fused_multiply_add():
    gen = torch.Generator().manual_seed(0)
    n = 3000
    a, b, c = (torch.randn(n, generator=gen) for _ in range(3))
    c[:1000] = -(a[:1000].double() * b[:1000].double()).float() * (1 + 1e-6 * torch.randn(1000, generator=gen))
    c[1000:1500] *= 2.0 ** -30
    b[1500:2000] = b[1500:2000].to(torch.bfloat16).float()
    a[2000:2100] *= 2.0 ** -70  # products and sums in fp32's subnormal range
    b[2000:2100] *= 2.0 ** -70
    c[2000:2100] *= 2.0 ** -140
    # Sums that land exactly on an fp32 midpoint in fp64 while inexact: the double-rounding cases.
    mid = 1 + 2.0 ** -12
    a[2100:2104], b[2100:2104] = mid, mid
    c[2100:2104] = torch.tensor([2.0 ** -80, -2.0 ** -80, 2.0 ** -60, -2.0 ** -70])
    a[2104], b[2104], c[2104] = -mid, mid, -(2.0 ** -80)
    ours = TW.fma32(a, b, c)
    naive = (a.double() * b.double() + c.double()).float()
    assert not torch.equal(ours[2100:2105], naive[2100:2105])  # the cases do round twice naively
    for i in range(2105):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert np.float32(ours[i].item()) == _round_to_fp32(exact), i


def _exact_interpreter_fma(self, x, y, z):
    """The interpreter's fma is a * b + c in numpy (two roundings); the GPU's is fused."""
    from triton.runtime.interpreter import TensorHandle

    out = TW.fma32(torch.from_numpy(np.asarray(x.data)), torch.from_numpy(np.asarray(y.data)),
                   torch.from_numpy(np.asarray(z.data)))
    return TensorHandle(out.numpy(), z.dtype.scalar)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fma_kernel_matches_twin(monkeypatch, dtype):
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_fma", _exact_interpreter_fma)
    monkeypatch.setitem(TW.NUMERICS, "unpermute_fma", True)
    gen = torch.Generator().manual_seed(4)
    T, E, K, H = 23, 8, 4, 40
    routing_map = random_routing(T, E, K, gen)
    probs = torch.rand((T, E), generator=gen) * routing_map
    _, _, rmap = permute(torch.zeros(T, 4), routing_map)
    y = torch.randn((T * K, H), generator=gen).to(dtype)
    outs = []
    for backend in ("torch", "triton"):
        with set_backend(backend):
            outs.append(unpermute(y, rmap, probs))
    if dtype == torch.float32:
        assert torch.equal(outs[0], outs[1])
    else:  # the interpreter truncates fp32 -> bf16
        diff = (outs[0].double() - outs[1].double()).abs()
        assert bool((diff <= outs[0].double().abs() * 2.0 ** -7).all())
    monkeypatch.setitem(TW.NUMERICS, "unpermute_fma", False)
    with set_backend("torch"):
        unfused = unpermute(y, rmap, probs)
    assert not torch.equal(unfused, outs[0]) or dtype != torch.float32  # the knob changes some bits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_fma_kernel_matches_twin_bitwise(monkeypatch, dtype):
    """With the knob on, tl.fma on the GPU equals the twin's emulation bit for bit."""
    monkeypatch.setitem(TW.NUMERICS, "unpermute_fma", True)
    gen = torch.Generator().manual_seed(21)
    T, E, K, H = 4096, 64, 8, 1000
    routing_map = random_routing(T, E, K, gen)
    probs = torch.softmax(torch.rand((T, E), generator=gen), 1) * routing_map
    _, _, rmap = permute(torch.zeros(T, 4), routing_map)
    y = torch.randn((T * K, H), generator=gen).to(dtype)
    cpu = unpermute(y, rmap, probs)
    _, _, rmap_gpu = permute(torch.zeros(T, 4, device="cuda"), routing_map.cuda())
    assert torch.equal(cpu, unpermute(y.cuda(), rmap_gpu, probs.cuda()).cpu())
