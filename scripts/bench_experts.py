"""Benchmark the local-expert MLP paths on one GPU (bf16, triton.testing.do_bench median).

Default shape: hidden 4096, ffn 1024, swiglu, 64 experts of which 32 are local (EP=2), and the
8192 * 6 routed rows of one rank spread over the local experts. Rows:

- GroupedMLP            default: torch._grouped_mm (row-stable on CUDA bf16)
- SequentialMLP         default: cuBLAS mm in fixed calls of 256 rows ("tiled", row-stable);
                        also with 128-row tiles
- SequentialMLP fast    row_stable=False: plain per-expert mm as Megatron does (NOT row-stable)

Usage: python scripts/bench_experts.py [--rows 49152] [--hidden 4096] [--ffn 1024] ...
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe_dispatch.config import MoEConfig
from moe_dispatch.experts import GroupedMLP, SequentialMLP


def _counts(rows: int, experts: int, seed: int) -> torch.Tensor:
    """Row counts per local expert: multinomial, as top-k routing with a balanced router gives."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(experts, (rows,), generator=g)
    return torch.bincount(picks, minlength=experts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192 * 6, help="routed rows on this rank")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64, help="global experts")
    p.add_argument("--local", type=int, default=32, help="local experts (experts / EP size)")
    p.add_argument("--activation", default="swiglu", choices=["gelu", "relu", "swiglu"])
    p.add_argument("--probs-in-experts", action="store_true")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_experts.py needs a CUDA device")
    import triton.testing

    cfg = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=6, ffn_hidden_size=args.ffn,
                    activation=args.activation, params_dtype=torch.bfloat16,
                    probs_in_experts=args.probs_in_experts)
    counts = _counts(args.rows, args.local, seed=0)
    x = torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(args.rows, device="cuda")
    dy = torch.randn_like(x)
    fc1_out = 2 * args.ffn if args.activation == "swiglu" else args.ffn
    flop_fwd = 2 * args.rows * args.hidden * (fc1_out + args.ffn)

    variants = [
        ("GroupedMLP (default)", GroupedMLP(cfg, args.local, device="cuda")),
        ("SequentialMLP (default, tiled 256)", SequentialMLP(cfg, args.local, device="cuda")),
        ("SequentialMLP tiled 128", SequentialMLP(cfg, args.local, row_tile=128, device="cuda")),
        ("SequentialMLP row_stable=False", SequentialMLP(cfg, args.local, row_stable=False, device="cuda")),
    ]
    print(f"rows={args.rows} hidden={args.hidden} ffn={args.ffn} {args.activation} local experts="
          f"{args.local}/{args.experts} bf16, rows per expert {int(counts.min())}..{int(counts.max())}")
    print(f"{'path':34} {'GEMMs':18} {'fwd ms':>8} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8} row-stable")
    for name, experts in variants:
        xg = x.clone().requires_grad_()

        def fwd() -> None:
            with torch.no_grad():
                experts(x, counts, probs)

        def fwd_bwd() -> None:
            experts(xg, counts, probs).backward(dy)

        t_fwd = triton.testing.do_bench(fwd, warmup=args.warmup, rep=args.rep, return_mode="median")
        t_all = triton.testing.do_bench(fwd_bwd, warmup=args.warmup, rep=args.rep, return_mode="median",
                                        grad_to_none=[xg, experts.weight1, experts.weight2])
        strategies = "/".join(experts.gemm_strategies(x))
        print(f"{name:34} {strategies:18} {t_fwd:8.3f} {flop_fwd / t_fwd / 1e9:8.1f} {t_all:11.3f} "
              f"{3 * flop_fwd / t_all / 1e9:8.1f} {'yes' if experts.row_stable else 'no'}")


if __name__ == "__main__":
    main()
