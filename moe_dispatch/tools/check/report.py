"""What rank 0 prints after the checks: the table of rows with its legends, the throughput line (a
timing of the small layer, never checked) and the verdict (ALL PASS, or how many rows FAIL).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from .args import DTYPES, base_config
from .contract import Result, progress
from .layouts import LABEL as LAYOUTS_LABEL
from .layouts import LEGEND as LAYOUTS_LEGEND
from .reference import FLOAT64_LABEL, FLOAT64_LEGEND, FLOAT64_LEGEND_FP32, REFERENCE_LABEL


def throughput(args: argparse.Namespace, device: torch.device) -> str:
    """The throughput line: tokens/s of forward + backward of the layer at EP = world size,
    timed over 5 steps after one warm-up. Collective: every rank calls it."""
    from ...layer import MoELayer

    world = dist.get_world_size()
    config = base_config(args, dispatcher="alltoall" if args.dispatcher == "both" else args.dispatcher)
    progress(dist.get_rank(), f"throughput: 5 timed steps of the layer at EP {world}, {config.dispatcher}")
    layer = MoELayer(config, layer_index=0).to(device)
    x = torch.randn((args.tokens, args.hidden), device=device).to(DTYPES[args.dtype]).requires_grad_()
    steps = 5
    for i in range(steps + 1):
        if i == 1:  # the first step warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
        layer(x).float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    where = (f"{world} CPU ranks on gloo, one thread each" if device.type == "cpu"
             else f"{world} ranks on {torch.cuda.get_device_name(device)}")
    return (f"throughput (timing of this small layer, not checked and not a benchmark): "
            f"{args.tokens * world / seconds:,.0f} tokens/s forward+backward; {where}, EP {world}, "
            f"{config.dispatcher}, {args.tokens} tokens per rank, {args.dtype}")


LEGEND = """\
Each row runs forward + backward and compares output, input gradient and router weight gradient
bitwise; the second column is the largest elementwise difference (0: bitwise equal)."""

REFERENCE_LEGEND = """\
Reference rows (not ours, informational: DIFF is expected and never fails the check): the same
expert outputs combined as a reduce-scatter combine does (each EP rank rounds its experts' partial
sum to {dtype}, then the ranks' partials are added). A token whose experts sit on different ranks
is rounded twice, so its output changes with the EP size; our combine sums a token's expert
outputs in one fixed order in fp32 and rounds once, at every EP size.{same}"""


def _print_table(args: argparse.Namespace, results: list[Result]) -> None:
    """The rows, with a legend above and, under the float64 row and reference rows, what they
    compute. A skipped row shows no number: it measured nothing."""
    dtype = args.dtype
    print(LEGEND)
    width = max(len(r.check) for r in results)
    print(f"{'check':<{width}} | {'max |diff|':>10} | result")
    print("-" * (width + 22))
    for r in results:
        shown = "-" if r.skipped else f"{r.max_diff:.3e}"
        print(f"{r.check:<{width}} | {shown:>10} | {r.status}")
    if any(r.check.startswith(FLOAT64_LABEL) for r in results):
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        legend = FLOAT64_LEGEND_FP32 if dtype == "fp32" else FLOAT64_LEGEND
        print(legend.format(dtype=dtype, router=args.router_dtype, tokens=args.tokens, hidden=args.hidden,
                            ranks=ranks, outputs=args.tokens * args.hidden * ranks))
    layouts = [r for r in results if r.check.startswith(LAYOUTS_LABEL)]
    if layouts and not all(r.skipped for r in layouts):
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        print(LAYOUTS_LEGEND.format(ranks=ranks, tokens=args.tokens, dtype=args.dtype))
    reference = [r for r in results if r.check.startswith(REFERENCE_LABEL)]
    if reference:
        same = ("\n(Here the partials need no rounding, probs and activations sharing a dtype, so these rows "
                "match.)" if all(r.passed for r in reference) else "")
        print(REFERENCE_LEGEND.format(dtype=dtype, same=same))


def print_report(args: argparse.Namespace, results: list[Result], throughput_line: str) -> None:
    """The table, the --megatron notes, the throughput line and the verdict (rank 0 calls it)."""
    _print_table(args, results)
    if args.megatron:
        from ...integrations.megatron.check import explain
        for note in explain(results):
            print(note)
    print(throughput_line)
    failed = [r for r in results if r.failed]
    differ = sum(1 for r in results if r.informational and not r.passed)
    note = f" ({differ} reference row{'s' * (differ > 1)} DIFF)" if differ else ""
    print(("ALL PASS" if not failed else f"{len(failed)} FAIL") + note, flush=True)
