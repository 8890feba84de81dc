"""What this CPU's own kernels do to a row, which is why the CPU default paths use none of them.

Run:  python scripts/measure/cpu_row_stability.py

Two tables, for this machine's BLAS and vector unit only (another CPU may print other numbers;
the tests assert only what holds on every CPU):
- the fast GEMM paths (``"grouped"``: torch's grouped_mm, ``"loop"``: one mm per expert) in fp32:
  for each block size, whether one fixed token's output row equals the row it gets in a block of
  one ("ordered", the default, is listed beside them);
- torch's native silu and gelu (fp32, forward and backward): how many of the probed rows or
  elements give other bits alone than inside a large batch, beside the hand-built activations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_dispatch.experts import expert_gemm
from moe_dispatch.experts.activations import _unary
from moe_dispatch.tools.batch_invariance import activation_mismatches

BLOCKS = [1, 2, 3, 7, 8, 16, 64, 200, 1000]


def gemm_table() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 64, 96, generator=g)
    token = torch.randn(64, generator=g)
    print(f"fp32 GEMM, K=64, N=96, {torch.get_num_threads()} threads: row equal to the 1-row block's?")
    print(f"{'block rows':>10} | " + " | ".join(f"{s:>8}" for s in ("ordered", "grouped", "loop")))
    refs = {}
    for block in BLOCKS:
        x = torch.randn(block, 64, generator=g)
        x[block - 1] = token
        cells = []
        for strategy in ("ordered", "grouped", "loop"):
            row = expert_gemm(x, w, torch.tensor([block]), strategy)[block - 1]
            ref = refs.setdefault(strategy, row)
            cells.append("equal" if torch.equal(row, ref) else "differs")
        print(f"{block:>10} | " + " | ".join(f"{c:>8}" for c in cells))


def activation_table() -> None:
    print("\nfp32 activations: probes (of 180) whose value or gradient alone differs from inside the batch")
    print(f"{'':>8} | {'native':>7} | {'ours':>7}")
    for name, native in (("silu", F.silu), ("gelu", F.gelu)):
        ours = activation_mismatches(lambda h, n=name: _unary(h, n), torch.float32)
        print(f"{name:>8} | {activation_mismatches(native, torch.float32):>7} | {ours:>7}")


if __name__ == "__main__":
    gemm_table()
    activation_table()
