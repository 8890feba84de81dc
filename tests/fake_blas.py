"""A deliberately row-unstable BLAS: inside `FakeBlas`, every aten matrix product (whoever calls
it: torch.mm, @, F.linear, bmm, autograd's C++ code) sums over K in parts whose number depends on
the call's row count M and on the row's position in the call, as a real BLAS may do on some CPU.
A row-stable construction must give the same rows under it; `calls` counts the products taken.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "addmv", "dot", "vdot", "_grouped_mm",
             "linear", "einsum", "tensordot", "addbmm", "_addmm_activation", "_int_mm", "_scaled_mm"}


def fake_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], row i summing K in 1 + (M + i) % 4 sequential parts (each a real mm)."""
    m, k = a.shape
    out = torch.zeros(m, b.shape[1], dtype=a.dtype, device=a.device)
    for parts in range(1, 5):
        rows = [i for i in range(m) if 1 + (m + i) % 4 == parts]
        if not rows or k == 0:
            continue
        idx = torch.tensor(rows, device=a.device)
        acc = None
        for chunk in torch.arange(k).tensor_split(parts):
            if len(chunk):
                part = aten.mm.default(a[idx][:, chunk[0] : chunk[-1] + 1], b[chunk[0] : chunk[-1] + 1])
                acc = part if acc is None else acc + part
        out[idx] = acc
    return out


class FakeBlas(TorchDispatchMode):
    """Replaces aten mm / addmm / bmm / baddbmm by `fake_mm`; any other product op raises."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in _PRODUCTS:
            return func(*args, **kwargs)
        self.calls += 1
        if func is aten.mm.default:
            return fake_mm(*args)
        if func is aten.bmm.default:
            return torch.stack([fake_mm(x, y) for x, y in zip(*args)])
        if func in (aten.addmm.default, aten.baddbmm.default):
            bias, x, y = args
            prod = fake_mm(x, y) if x.dim() == 2 else torch.stack([fake_mm(p, q) for p, q in zip(x, y)])
            return kwargs.get("beta", 1) * bias + kwargs.get("alpha", 1) * prod
        if func is aten.mm.out:
            return kwargs["out"].copy_(fake_mm(*args))
        raise AssertionError(f"FakeBlas: unexpected product op {func}")
