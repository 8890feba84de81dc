"""`moe-dispatch check`: prove the contract on this machine.

Builds a small MoE layer on N ranks, runs forward + backward and checks, bitwise, that a token's
output, input gradient and router weight gradient are the same:
  every rank     on every rank that holds the same tokens;
  dispatcher     with the allgather and the alltoall dispatcher;
  EP size        at every expert-parallel size;
  batch          when the other tokens of the batch change: tokens 90 onwards zeroed (the first 90
                 must not change), and one token run alone against the same token in the batch.
It then compares our output with the float64 sum of the same expert outputs (within one final
rounding), and prints reference rows that are not ours and are expected to differ: the same expert
outputs combined as a reduce-scatter combine does (each EP rank rounds its partial sum to the
activation dtype before the ranks' partials are added), at EP 1 and at larger EP sizes.
Exits nonzero on any FAIL of our rows; reference rows (DIFF) never fail the check. With --megatron,
megatron-core's MoELayer is checked too: with its stock dispatcher (reference rows, PASS or DIFF)
and with ours installed (rows that count).

Launch plainly (it spawns the ranks itself: 4 CPU ranks on gloo by default, one rank per GPU on
NCCL where CUDA is present) or under torchrun, which sets the ranks:

    moe-dispatch check
    python -m moe_dispatch.tools.check --ranks 2 --dtype fp32
    torchrun --nproc-per-node 8 -m moe_dispatch.tools.check --ep-sizes 1,2,4,8
"""
from __future__ import annotations

import argparse
import importlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config import DISPATCHER_KINDS, MoEConfig
from ..distributed.comm import all_gather_rows
from ..distributed.launch import end_spawned_rank, rank_device, set_rank_env, spawn_ranks
from .check_sizes import SIZE_FLAGS, memory_per_rank, size_problem

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors print once under torchrun: every rank parses and exits 2,
    only rank 0 says why."""

    def error(self, message: str):  # type: ignore[override]
        if os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ:
            self.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moe-dispatch check", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks to spawn when not under torchrun (default: GPUs if any, else 4)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl with CUDA, else gloo")
    parser.add_argument("--ep-sizes", default=None,
                        help="comma-separated EP sizes to compare (default: powers of two up to --ranks)")
    parser.add_argument("--dispatcher", choices=["both", *DISPATCHER_KINDS], default="both")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype")
    parser.add_argument("--router-dtype", choices=["fp32", "fp64"], default="fp32")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank (at least 2)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--truncate-at", type=int, default=90,
                        help="tokens kept in the truncation test, below --tokens (default 90, or half of "
                             "--tokens when that is 90 or fewer)")
    parser.add_argument("--megatron", action="store_true",
                        help="also run the checks on megatron-core's own MoELayer (SequentialMLP, no TE), beside "
                             "ours on the same tokens: with its stock dispatcher (reference rows: PASS or DIFF, "
                             "never a FAIL) and with our dispatcher installed (counted like ours); needs "
                             "megatron-core (0.16.1 through 0.19.2) and CUDA")
    parser.add_argument("--seed", type=int, default=1234)
    return parser


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


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


_START = time.perf_counter()


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"  ... {time.perf_counter() - _START:5.1f} s  {text}", flush=True)


def _ep_groups(world: int, sizes: list[int]) -> dict[int, dist.ProcessGroup]:
    """For each EP size, the subgroup of this rank (ranks split into consecutive blocks)."""
    rank = dist.get_rank()
    mine = {}
    for size in sizes:
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine[size] = group
    return mine


def _run_layer(layer_fn: Callable[[], torch.nn.Module], x: torch.Tensor, upstream: torch.Tensor):
    """Forward + backward; returns (output, input grad, router weight grad)."""
    layer = layer_fn()
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(upstream)
    router_weight = next(p for n, p in layer.named_parameters() if "router" in n)
    return out.detach(), x.grad.detach(), router_weight.grad.detach().clone()


def _all_equal_across(group: Optional[dist.ProcessGroup], tensors: tuple[torch.Tensor, ...]) -> tuple[float, bool]:
    """Compare this rank's tensors with every other rank's in the group (gathered)."""
    worst, same = 0.0, True
    for t in tensors:
        flat = t.reshape(-1)
        for row in all_gather_rows(flat[None], group):
            worst = max(worst, _max_diff(row, flat))
            same &= _bitwise(row, flat)
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
            _progress(rank, f"{label}{kind} dispatcher, EP {ep}")
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
            diff = max(_max_diff(a, b) for a, b in zip(first, other))
            same = all(_bitwise(a, b) for a, b in zip(first, other))
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
        _progress(rank, f"{label}batch: other tokens changed, {kind}, EP {ep}")
        truncated = own_x.clone()
        truncated[keep:] = 0
        out_t, grad_t, _ = run(kind, ep, truncated, upstream)
        full_out, full_grad, _ = outs[(kind, ep)]
        diff = max(_max_diff(out_t[:keep], full_out[:keep]), _max_diff(grad_t[:keep], full_grad[:keep]))
        same = _bitwise(out_t[:keep], full_out[:keep]) and _bitwise(grad_t[:keep], full_grad[:keep])
        add(3, f"batch: tokens {keep}+ zeroed, tokens 0-{keep - 1} unchanged: {kind}, EP {ep}", diff, same)
        one_out, one_grad, _ = run(kind, ep, own_x[:1], upstream[:1])
        diff = max(_max_diff(one_out, full_out[:1]), _max_diff(one_grad, full_grad[:1]))
        add(3, f"batch: token 0 alone vs in the batch: {kind}, EP {ep}", diff,
            _bitwise(one_out, full_out[:1]) and _bitwise(one_grad, full_grad[:1]))
    ordered = [r for _, r in sorted(results, key=lambda item: item[0])]  # stable: keeps order in a section
    return _gather_results(ordered, device)


def _gather_results(results: list[Result], device: torch.device) -> list[Result]:
    """Results on other ranks count too: a FAIL anywhere fails everywhere."""
    flags = torch.tensor([0.0 if r.passed else 1.0 for r in results] + [r.max_diff for r in results],
                         dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    n = len(results)
    return [Result(r.check, float(flags[n + i]), flags[i].item() == 0.0, r.informational)
            for i, r in enumerate(results)]


def run_checks(args: argparse.Namespace, device: torch.device) -> list[Result]:
    from ..config import MoEConfig
    from ..layer import MoELayer

    world = dist.get_world_size()
    sizes, dispatchers = check_plan(args, world)
    groups = _ep_groups(world, sizes)
    base = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                     router_dtype=args.router_dtype, init_seed=args.seed)

    def run(kind: str, ep: int, x: torch.Tensor, upstream: torch.Tensor) -> tuple:
        return _run_layer(lambda: MoELayer(base.replace(dispatcher=kind), ep_group=groups[ep],
                                           layer_index=0).to(device), x, upstream)

    results = contract_checks(args, device, sizes, dispatchers, run)
    layer = MoELayer(base.replace(dispatcher=dispatchers[0]), ep_group=groups[sizes[-1]],
                     layer_index=0).to(device)
    return results + combine_rows(args, device, layer, sizes) + captured_check(args, device, base)


def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers in the binade of each float64 value (subnormals: the
    smallest spacing)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(values.abs().clamp_min(info.tiny))
    return torch.ldexp(torch.full_like(values, info.eps), exponent - 1)


REFERENCE_LABEL = "reference, not ours: "


@torch.no_grad()
def expert_outputs(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] fp32/fp64, zero where not routed; y [T, E, H] every expert's output for every
    token routed to it, zero elsewhere) for our MoELayer ``layer`` on x [T, H]: its router, and
    all E experts rebuilt on this rank from the same seed (row-stable, so a row's output does not
    depend on which other rows its expert gets)."""
    config = layer.config
    probs, routing_map = layer.router(x)
    experts = type(layer.experts)(config, config.num_experts, 0).to(x.device)
    rows = [routing_map[:, e].nonzero().flatten() for e in range(config.num_experts)]
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    out = experts(x[torch.cat(rows)], counts)
    y = torch.zeros((x.shape[0], config.num_experts, x.shape[1]), dtype=out.dtype, device=x.device)
    for e, (r, block) in enumerate(zip(rows, out.split(counts.tolist()))):
        y[r, e] = block
    return probs, y


def reduce_scatter_combine(probs: torch.Tensor, y: torch.Tensor, ep: int) -> torch.Tensor:
    """probs [T, E], y [T, E, H] -> [T, H] in y's dtype, combined as a reduce-scatter combine does
    at EP size ``ep``: each EP rank sums p * y over its own experts (ascending, in probs' dtype)
    and rounds that partial sum to y's dtype; the ranks' partials are then added in fp32 (in rank
    order) and rounded again. A token whose experts sit on different ranks is rounded twice, so
    its output depends on the EP size. Not ours: a reference that shows what the contract buys."""
    num_experts = probs.shape[1]
    products = probs[:, :, None] * y.to(probs.dtype)
    total = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for block in products.split(num_experts // ep, dim=1):
        partial = torch.zeros_like(block[:, 0])
        for e in range(block.shape[1]):  # one term at a time: the fixed ascending order
            partial = partial + block[:, e]
        total = total + partial.to(y.dtype).float()
    return total.to(y.dtype)


def combine_rows(args: argparse.Namespace, device: torch.device, layer: torch.nn.Module,
                 sizes: list[int]) -> list[Result]:
    """Our layer's output against the float64 combine of the same expert outputs (a row that
    counts: within one final rounding), and reference rows (informational, not ours): the same
    expert outputs combined by ``reduce_scatter_combine``, EP 1 against each larger EP size.
    Collective: every rank calls it alike."""
    rank = dist.get_rank()
    _progress(rank, "ours vs float64, and the reference combine")
    _, _, own_x = check_tokens(args, device)
    dtype = DTYPES[args.dtype]
    with torch.no_grad():
        ours = layer(own_x).double()
        probs, y = expert_outputs(layer, own_x)
    products = probs.double()[:, :, None] * y.double()
    exact = products.sum(1)
    err = (ours - exact).abs()
    # One final rounding (half a ulp) plus the error of the sum in probs' dtype: K products and
    # K - 1 additions, each within half an ulp of that dtype of sum |p * y|; counted twice, since
    # the final rounding is to the number nearest the computed sum, not the exact one.
    accumulation = torch.finfo(probs.dtype).eps / 2 * (2 * args.topk - 1) * products.abs().sum(1)
    bound = 0.5 * _ulp(exact, dtype) + 2 * accumulation
    within = bool((err <= bound).all())
    # bf16/fp16: the worst error past the fp32 sum's share of the bound, in ulps of the output
    # dtype (at most 1/2: one final rounding). Not the whole error in ulps: where a token's terms
    # cancel to near 0 the ulp is tiny and the fp32 sum's error dominates. fp32: the worst error
    # as a fraction of the bound.
    if dtype == torch.float32:
        worst_of, unit = err / bound, "of the fp32 sum's error bound (bound 1)"
    else:
        worst_of = (err - 2 * accumulation).clamp_min(0) / _ulp(exact, dtype)
        unit = f"ulp of {args.dtype} past the fp32 sum's error (bound 0.50)"
    worst = torch.tensor([float(worst_of.max())], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    measured = f"{float(worst):.2f} {unit}"
    rows = [Result(f"ours vs float64 sum of the same expert outputs: {measured}", float(err.max()), within)]
    single = reduce_scatter_combine(probs, y, 1)
    for ep in [s for s in sizes if s > 1] or [2]:
        if args.experts % ep:
            continue
        other = reduce_scatter_combine(probs, y, ep)
        rows.append(Result(f"{REFERENCE_LABEL}reduce-scatter combine, EP 1 vs EP {ep}", _max_diff(single, other),
                           _bitwise(single, other), informational=True))
    return _gather_results(rows, device)


def captured_check(args: argparse.Namespace, device: torch.device, config: MoEConfig) -> list[Result]:
    """The EP-1 layer's sync-free forward + backward captured in a CUDA graph and replayed on
    new tokens, against the eager step on them: output, input and router gradients bitwise. CUDA
    only (skipped on CPU: there is nothing to capture). Collective: every rank calls it."""
    from ..layer import MoELayer
    from .capture import capture_step

    check = "CUDA-graph replay vs eager step: EP 1, sync-free"
    if device.type != "cuda":
        return [Result(check, 0.0, True, skipped="CUDA only")]
    rank = dist.get_rank()
    single = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # every rank creates every group
    _progress(rank, "CUDA-graph capture, EP 1")
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
    router = next(p for n, p in layer.named_parameters() if "router" in n)
    captured = (out.detach().clone(), x.grad.detach().clone(), router.grad.detach().clone())
    layer.zero_grad(set_to_none=True)  # the eager step writes fresh .grad, not into the graph's
    eager = _run_layer(lambda: layer, fresh, upstream)
    diff = max(_max_diff(a, b) for a, b in zip(captured, eager))
    same = all(_bitwise(a, b) for a, b in zip(captured, eager))
    return _gather_results([Result(check, diff, same)], device)


def _megatron_checks(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """--megatron: the contract checks (every rank, dispatcher, EP size, batch) on megatron-core's
    MoELayer (``integrations.megatron.check``), handed this check's EP groups and
    ``contract_checks`` (so that module never imports this one)."""
    from ..integrations.megatron.check import run_megatron_checks

    world = dist.get_world_size()
    sizes, dispatchers = check_plan(args, world)
    groups = _ep_groups(world, sizes)

    def contract(run: RunFn, label: str, informational: bool) -> list[Result]:
        return contract_checks(args, device, sizes, dispatchers, run, label=label, informational=informational)

    return run_megatron_checks(args, device, DTYPES[args.dtype], groups, contract)


def throughput(args: argparse.Namespace, device: torch.device) -> str:
    from ..config import MoEConfig
    from ..layer import MoELayer

    world = dist.get_world_size()
    config = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                       router_dtype=args.router_dtype, init_seed=args.seed,
                       dispatcher="alltoall" if args.dispatcher == "both" else args.dispatcher)
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


def _print_table(results: list[Result], dtype: str) -> None:
    """The rows, with a legend above and, under reference rows, what they compute."""
    print(LEGEND)
    width = max(len(r.check) for r in results)
    print(f"{'check':<{width}} | {'max |diff|':>10} | result")
    print("-" * (width + 22))
    for r in results:
        print(f"{r.check:<{width}} | {r.max_diff:>10.3e} | {r.status}")
    reference = [r for r in results if r.check.startswith(REFERENCE_LABEL)]
    if reference:
        same = ("\n(Here the partials need no rounding, probs and activations sharing a dtype, so these rows "
                "match.)" if all(r.passed for r in reference) else "")
        print(REFERENCE_LEGEND.format(dtype=dtype, same=same))


def _worker(local_rank: int, world: int, port: int, backend: str, args: argparse.Namespace) -> None:
    set_rank_env(local_rank, world, port)
    main_worker(args, backend)  # a failed check raises SystemExit(1) here
    end_spawned_rank()


def main_worker(args: argparse.Namespace, backend: str) -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = rank_device(backend, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the cores; one thread each avoids oversubscription
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    rank = dist.get_rank()
    try:
        if rank == 0:
            print(f"moe-dispatch check: {dist.get_world_size()} ranks on {backend} ({device.type}), "
                  f"{args.tokens} tokens per rank, H={args.hidden}, E={args.experts}, K={args.topk}, "
                  f"{args.dtype}, router {args.router_dtype}", flush=True)
        # torch's custom ops (our permute/unpermute) import torch._dynamo on their first call: a
        # one-time wait of seconds, said here rather than left silent in the first row.
        _progress(rank, "importing torch._dynamo (torch's custom ops need it, once per process)")
        importlib.import_module("torch._dynamo")

        results = run_checks(args, device)
        if args.megatron:
            results += _megatron_checks(args, device)
        line = throughput(args, device)
        if rank == 0:
            _print_table(results, args.dtype)
            if args.megatron:
                from ..integrations.megatron.check import explain
                for note in explain(results):
                    print(note)
            print(line)
            failed = [r for r in results if r.failed]
            differ = sum(1 for r in results if r.informational and not r.passed)
            note = f" ({differ} reference row{'s' * (differ > 1)} DIFF)" if differ else ""
            print(("ALL PASS" if not failed else f"{len(failed)} FAIL") + note, flush=True)
        ok = not any(r.failed for r in results)
    finally:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
    return 0


# The check's flags by the MoEConfig field they set: a config error names the flag.
_FLAG_OF_FIELD = {"hidden_size": "--hidden", "ffn_hidden_size": "--ffn", "num_experts": "--experts",
                  "topk": "--topk", "router_dtype": "--router-dtype", "init_seed": "--seed",
                  "dispatcher": "--dispatcher"}


def _config_error_as_flags(message: str) -> str:
    """A MoEConfig error with its field names written as the check's flags, led by the first one."""
    import re

    fields = re.compile(r"\b(" + "|".join(_FLAG_OF_FIELD) + r")\b")
    first = fields.search(message)
    text = fields.sub(lambda m: _FLAG_OF_FIELD[m.group(1)], message)
    if not first:
        return f"invalid flags: {text}"
    flag = _FLAG_OF_FIELD[first.group(1)]
    return f"argument {flag}: {text[len(flag) + 1:] if text.startswith(flag + ' ') else text}"


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    """Check every flag before any process or process group starts; returns the world size.

    A bad flag is one ``parser.error`` (exit status 2) naming the flag, never a traceback per
    rank; a check that would compare nothing is refused the same way."""
    fail = parser.error
    if args.ranks is not None and args.ranks < 1:
        fail(f"argument --ranks: must be >= 1, got {args.ranks}")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        fail("argument --backend: nccl needs CUDA, which is not available here (use --backend gloo)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun, which sets the ranks
        world = int(os.environ["WORLD_SIZE"])
        if args.ranks is not None and args.ranks != world:
            fail(f"argument --ranks: {args.ranks} differs from torchrun's WORLD_SIZE={world}; leave --ranks out")
    else:
        world = args.ranks or (torch.cuda.device_count() if backend == "nccl" else 4)
        if backend == "nccl" and world > torch.cuda.device_count():
            fail(f"argument --ranks: {world} ranks on nccl need {world} GPUs, this machine has "
                 f"{torch.cuda.device_count()} (use --backend gloo for more ranks than GPUs)")
    defaults = {name: parser.get_default(name) for name in SIZE_FLAGS}
    if problem := size_problem(args, defaults, world, DTYPES[args.dtype].itemsize, memory_per_rank(backend, world)):
        fail(problem)  # before any rank starts: not an allocator error in each rank's traceback
    # The truncation test zeroes tokens keep.. and compares tokens 0..keep-1, and one token alone
    # against the first: it needs a token on each side of the cut.
    if args.tokens < 2:
        fail(f"argument --tokens: must be >= 2 (the truncation test keeps some tokens and zeroes the rest), "
             f"got {args.tokens}")
    if args.truncate_at < 1:
        fail(f"argument --truncate-at: must be >= 1 (tokens kept and compared), got {args.truncate_at}")
    given = parser.parse_args(argv, argparse.Namespace(truncate_at=None)).truncate_at is not None
    if given and args.truncate_at >= args.tokens:
        fail(f"argument --truncate-at: {args.truncate_at} must be below --tokens {args.tokens}, "
             "or the truncation test zeroes nothing")
    if args.topk == 1:  # MoEConfig would ask for pre_softmax, which the check has no flag for
        fail("argument --topk: must be >= 2 (the check's softmax router over one chosen expert gets no gradient)")
    from ..config import MoEConfig

    try:
        base = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                         router_dtype=args.router_dtype, init_seed=args.seed)
        for kind in DISPATCHER_KINDS if args.dispatcher == "both" else (args.dispatcher,):
            base.replace(dispatcher=kind)
    except ValueError as exc:
        fail(_config_error_as_flags(str(exc)))
    if args.experts % world:
        fail(f"argument --experts: {args.experts} experts do not split over the {world} ranks "
             f"(the throughput line runs at EP {world})")
    if args.ep_sizes is not None:
        try:
            sizes = [int(s) for s in args.ep_sizes.split(",")]
        except ValueError:
            fail(f"argument --ep-sizes: expected comma-separated ints such as 1,2,4, got {args.ep_sizes!r}")
        for s in sizes:  # a divisor of the world divides --experts too (checked above)
            if s < 1 or world % s:
                fail(f"argument --ep-sizes: {s} does not divide the {world} ranks")
        if len(set(sizes)) < len(sizes):
            fail(f"argument --ep-sizes: {args.ep_sizes!r} lists a size twice (it would compare a run with itself)")
    return world


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args, argv)
    if args.megatron:
        from ..integrations.megatron.check import megatron_unavailable

        if why := megatron_unavailable():
            parser.error(why)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        return main_worker(args, backend)
    world = args.ranks or (torch.cuda.device_count() if backend == "nccl" else 4)
    return spawn_ranks(_worker, world, backend, args)


if __name__ == "__main__":
    raise SystemExit(main())
