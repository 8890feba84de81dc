"""The contract's rows: a token's output, input gradient and router weight gradient bitwise the same
on every rank, with every dispatcher, at every EP size and whatever the rest of the batch holds;
and the CUDA-graph replay row.

Also the pieces every row is made of: ``Result`` (one row), the comparisons, the check's tokens,
its EP groups, and the gather that makes a FAIL on any rank a FAIL on every rank.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...config import DISPATCHER_KINDS, MoEConfig
from ...distributed.comm import all_gather_rows
from .args import DTYPES


@dataclass
class Result:
    check: str
    max_diff: float
    passed: bool
    # A reference row (stock megatron-core under --megatron): printed, PASS or DIFF, never a FAIL
    # and never part of the exit code.
    informational: bool = False
    skipped: str = ""  # why the row did not run (then it neither passes nor fails)

    @property
    def status(self) -> str:
        if self.skipped:
            return f"SKIP ({self.skipped})"
        return "PASS" if self.passed else ("DIFF" if self.informational else "FAIL")

    @property
    def failed(self) -> bool:
        return not self.passed and not self.informational


def largest_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| elementwise, in float64 (0 for empty tensors)."""
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


_START = time.perf_counter()


def progress(rank: int, text: str) -> None:
    """Rank 0 prints what it starts, with the seconds since the check was imported."""
    if rank == 0:
        print(f"  ... {time.perf_counter() - _START:5.1f} s  {text}", flush=True)


def ep_groups(world: int, sizes: list[int]) -> dict[int, dist.ProcessGroup]:
    """For each EP size, the subgroup of this rank (ranks split into consecutive blocks)."""
    rank = dist.get_rank()
    mine = {}
    for size in sizes:
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine[size] = group
    return mine


def run_layer(layer_fn: Callable[[], torch.nn.Module], x: torch.Tensor, upstream: torch.Tensor):
    """Forward + backward; returns (output, input grad, router weight grad)."""
    layer = layer_fn()
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(upstream)
    return out.detach(), x.grad.detach(), router_weight(layer).grad.detach().clone()


def router_weight(layer: torch.nn.Module) -> torch.nn.Parameter:
    """The router's weight of our MoELayer (the gradient the rows compare beside the input's)."""
    return next(p for n, p in layer.named_parameters() if "router" in n)


def _all_equal_across(group: Optional[dist.ProcessGroup], tensors: tuple[torch.Tensor, ...]) -> tuple[float, bool]:
    """Compare this rank's tensors with every other rank's in the group (gathered)."""
    worst, same = 0.0, True
    for t in tensors:
        flat = t.reshape(-1)
        for row in all_gather_rows(flat[None], group):
            worst = max(worst, largest_diff(row, flat))
            same &= bitwise(row, flat)
    return worst, same


def check_plan(args: argparse.Namespace, world: int) -> tuple[list[int], list[str]]:
    """(EP sizes, dispatchers) to compare, from --ep-sizes and --dispatcher."""
    sizes = [int(s) for s in args.ep_sizes.split(",")] if args.ep_sizes else \
        [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= world and world % s == 0]
    for s in sizes:
        if s < 1 or world % s or args.experts % s:
            raise SystemExit(f"--ep-sizes: {s} must divide the world size {world} and --experts {args.experts}")
    dispatchers = list(DISPATCHER_KINDS) if args.dispatcher == "both" else [args.dispatcher]
    return sizes, dispatchers


def check_tokens(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens shared by every rank [T, H], upstream gradient [T, H], this rank's own tokens [T, H])."""
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed + 1)
    shared_x = torch.randn((args.tokens, args.hidden), generator=gen).to(dtype).to(device)
    upstream = torch.randn((args.tokens, args.hidden), generator=gen).to(dtype).to(device)
    own_gen = torch.Generator().manual_seed(args.seed + 100 + dist.get_rank())
    own_x = torch.randn((args.tokens, args.hidden), generator=own_gen).to(dtype).to(device)
    return shared_x, upstream, own_x


# run(kind, ep, x, upstream) -> (output, input grad, router weight grad) of one forward + backward
# of a freshly zeroed layer with that dispatcher and EP size, on this rank's tokens x [T, H].
RunFn = Callable[[str, int, torch.Tensor, torch.Tensor], tuple]


def contract_checks(args: argparse.Namespace, device: torch.device, sizes: list[int], dispatchers: list[str],
                    run: RunFn, label: str = "", informational: bool = False) -> list[Result]:
    """The contract's rows (every rank, dispatcher, EP size, batch) for one kind of layer
    (``run``), on the check's tokens (the same for every kind of layer); rows prefixed with
    ``label``. Collective: every rank calls it alike."""
    rank = dist.get_rank()
    shared_x, upstream, own_x = check_tokens(args, device)

    # (section, row): rows print by section (every rank, dispatcher, EP size, batch), whatever
    # order they are computed in.
    results: list[tuple[int, Result]] = []

    def add(section: int, check: str, diff: float, same: bool) -> None:
        results.append((section, Result(label + check, diff, same, informational)))

    outs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
    for kind in dispatchers:
        for ep in sizes:
            progress(rank, f"{label}{kind} dispatcher, EP {ep}")
            identical = run(kind, ep, shared_x, upstream)
            diff, same = _all_equal_across(None, identical)
            add(0, f"every rank, same tokens: {kind}, EP {ep}", diff, same)
            outs[(kind, ep)] = run(kind, ep, own_x, upstream)

    first = outs[(dispatchers[0], sizes[0])]
    for kind in dispatchers:
        for ep in sizes:
            if (kind, ep) == (dispatchers[0], sizes[0]):
                continue
            other = outs[(kind, ep)]
            diff = max(largest_diff(a, b) for a, b in zip(first, other))
            same = all(bitwise(a, b) for a, b in zip(first, other))
            if kind == dispatchers[0]:
                add(2, f"EP size: EP {sizes[0]} vs EP {ep}, {kind}", diff, same)
            elif ep == sizes[0]:
                add(1, f"dispatcher: {dispatchers[0]} vs {kind}, EP {ep}", diff, same)
            else:
                add(2, f"EP size and dispatcher: {dispatchers[0]} EP {sizes[0]} vs {kind} EP {ep}", diff, same)

    # Keep fewer tokens than the batch holds, or the truncation would zero nothing.
    keep = args.truncate_at if args.truncate_at < args.tokens else args.tokens // 2
    for kind in dispatchers:
        ep = sizes[-1]
        progress(rank, f"{label}batch: other tokens changed, {kind}, EP {ep}")
        truncated = own_x.clone()
        truncated[keep:] = 0
        out_t, grad_t, _ = run(kind, ep, truncated, upstream)
        full_out, full_grad, _ = outs[(kind, ep)]
        diff = max(largest_diff(out_t[:keep], full_out[:keep]), largest_diff(grad_t[:keep], full_grad[:keep]))
        same = bitwise(out_t[:keep], full_out[:keep]) and bitwise(grad_t[:keep], full_grad[:keep])
        add(3, f"batch: tokens {keep}+ zeroed, tokens 0-{keep - 1} unchanged: {kind}, EP {ep}", diff, same)
        one_out, one_grad, _ = run(kind, ep, own_x[:1], upstream[:1])
        diff = max(largest_diff(one_out, full_out[:1]), largest_diff(one_grad, full_grad[:1]))
        add(3, f"batch: token 0 alone vs in the batch: {kind}, EP {ep}", diff,
            bitwise(one_out, full_out[:1]) and bitwise(one_grad, full_grad[:1]))
    ordered = [r for _, r in sorted(results, key=lambda item: item[0])]  # stable: keeps order in a section
    return gather_results(ordered, device)


def gather_results(results: list[Result], device: torch.device) -> list[Result]:
    """Results on other ranks count too: a FAIL anywhere fails everywhere."""
    flags = torch.tensor([0.0 if r.passed else 1.0 for r in results] + [r.max_diff for r in results],
                         dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    n = len(results)
    return [Result(r.check, float(flags[n + i]), flags[i].item() == 0.0, r.informational)
            for i, r in enumerate(results)]


def captured_check(args: argparse.Namespace, device: torch.device, config: MoEConfig) -> list[Result]:
    """The EP-1 layer's sync-free forward + backward captured in a CUDA graph and replayed on
    new tokens, against the eager step on them: output, input and router gradients bitwise. CUDA
    only (skipped on CPU: there is nothing to capture). Collective: every rank calls it."""
    from ...layer import MoELayer
    from ..capture import capture_step

    check = "CUDA-graph replay vs eager step: EP 1, sync-free"
    if device.type != "cuda":
        return [Result(check, 0.0, True, skipped="CUDA only")]
    rank = dist.get_rank()
    single = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # every rank creates every group
    progress(rank, "CUDA-graph capture, EP 1")
    dtype = DTYPES[args.dtype]
    layer = MoELayer(config, ep_group=single, layer_index=0).to(device)
    gen = torch.Generator().manual_seed(args.seed + 200 + rank)
    first, fresh, upstream = (torch.randn((args.tokens, args.hidden), generator=gen).to(dtype).to(device)
                              for _ in range(3))
    x = first.clone().requires_grad_()

    def step() -> torch.Tensor:
        out = layer(x)
        out.backward(upstream)
        return out

    graph, out = capture_step(layer, x, step, warmup=2)
    with torch.no_grad():
        x.copy_(fresh)
    graph.replay()
    captured = (out.detach().clone(), x.grad.detach().clone(), router_weight(layer).grad.detach().clone())
    layer.zero_grad(set_to_none=True)  # the eager step writes fresh .grad, not into the graph's
    eager = run_layer(lambda: layer, fresh, upstream)
    diff = max(largest_diff(a, b) for a, b in zip(captured, eager))
    same = all(bitwise(a, b) for a, b in zip(captured, eager))
    return gather_results([Result(check, diff, same)], device)
