"""``activation_mismatches``: whether an elementwise function gives a row (or an element) the same
bits alone as inside a large batch, forward and backward. tests/experts/test_row_stability.py asserts
none for the hand-built activations; scripts/measure/cpu_row_stability.py counts them for torch's
native ones on this CPU."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["activation_mismatches"]


def activation_mismatches(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                          device: torch.device | str = "cpu") -> int:
    """How many probes of ``fn`` (elementwise: h [n, width] -> [n, width]) differ, in the output or the
    input gradient, between a big batch and the same rows or elements alone: 45 probes (5 rows, 40
    single elements) in each of 4 shapes, 180 in all."""
    g = torch.Generator().manual_seed(1)
    bad = 0
    for n, width in [(1000, 100), (333, 256), (7, 1030), (5000, 7)]:
        h = (torch.randn(n, width, generator=g) * 4).to(device, dtype).requires_grad_()
        out = fn(h)
        dout = torch.randn(out.shape, generator=g).to(device, dtype)
        out.backward(dout)
        probes = [(i, slice(None)) for i in (0, 1, n // 2, n - 2, n - 1)]
        probes += [(i, slice(j, j + 1)) for i, j in zip(torch.randint(n, (40,), generator=g).tolist(),
                                                         torch.randint(width, (40,), generator=g).tolist())]
        for i, cols in probes:
            hi = h.detach()[i : i + 1, cols].clone().requires_grad_()
            oi = fn(hi)
            oi.backward(dout[i : i + 1, cols])
            bad += not (torch.equal(oi[0], out[i, cols]) and torch.equal(hi.grad[0], h.grad[i, cols]))
    return bad
