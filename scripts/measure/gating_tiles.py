"""The row-stable gating GEMM's tile configurations (``_config_for`` in
moe_dispatch/router/_triton_gemm.py) beside alternatives, at the router benchmark's shapes.

Run on a CUDA machine:  python scripts/measure/gating_tiles.py [--tokens T]

For each case (the forward's logits [T, E] = hidden [T, H] @ weight.T per operand kind, and the
input gradient [T, H] = grad [T, E] @ weight, whose N is H) it prints the ``do_bench`` median of
every candidate (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), the shipped one marked, and
cuBLAS fp32 ``mm`` (not row-stable) for scale; a candidate that does not fit the GPU's shared
memory prints "n/a". Timings only: other tiles may round the logits otherwise.
"""
from __future__ import annotations

import argparse

import torch

from moe_dispatch.router._triton_gemm import _config_for, triton_row_stable_mm

SHAPES = ((4096, 128), (7168, 256))  # (H, E), scripts/bench_router.py's cases
CANDIDATES = {
    "half": [(64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 4, 4)],
    "split": [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 128, 32, 8, 3)],
    "fp32": [(128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (64, 64, 32, 4, 4)],
}


def cases(tokens: int, hidden: int, experts: int) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """(label, kind, a [M, K], b_t [N, K]) of the forward per operand kind and of the input gradient."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x16 = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    w32 = torch.randn(experts, hidden, device="cuda", generator=g) * hidden**-0.5
    grad = torch.randn(tokens, experts, device="cuda", generator=g)
    return [
        ("forward, bf16 x, bf16 weight", "half", x16, w32.bfloat16()),
        ("forward, bf16 x, fp32 weight", "split", x16, w32),
        ("forward, fp32 x, fp32 weight", "fp32", x16.float(), w32),
        ("input gradient, fp32", "fp32", grad, w32.t()),
        ("input gradient, bf16", "half", grad.bfloat16(), w32.bfloat16().t()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    import triton.testing

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    print(f"{torch.cuda.get_device_name()}, T={args.tokens}, fp32 result; ms, * = shipped")
    for hidden, experts in SHAPES:
        for label, kind, a, b_t in cases(args.tokens, hidden, experts):
            shipped = _config_for(kind, b_t.shape[0])
            cells = [f"cuBLAS {bench(lambda: a.float() @ b_t.float().t()):.3f}"]
            for tiles in dict.fromkeys([shipped, *CANDIDATES[kind]]):
                try:
                    ms = f"{bench(lambda: triton_row_stable_mm(a, b_t, torch.float32, _config=tiles)):.3f}"
                except Exception as e:  # triton's OutOfResources and kin: the tiles do not fit
                    cells.append(f"{tiles} n/a ({type(e).__name__})")
                    continue
                cells.append(f"{tiles}{'*' if tiles == shipped else ''} {ms}")
            print(f"H={hidden} E={experts} {label}:\n  " + "\n  ".join(cells))


if __name__ == "__main__":
    main()
