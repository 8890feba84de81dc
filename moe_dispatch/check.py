"""`moe-dispatch check`: prove the contract on this machine.

Builds a small MoE layer on N ranks and checks, bitwise, that a token's output and gradients are
(a) identical on every rank holding it, (b) identical with the allgather and the alltoall
dispatcher, (c) identical at every EP size, and (d) unchanged when the other tokens of the batch
change (the report's truncation test: zero tokens 90 onwards). Prints a table and a throughput
line; exits nonzero on any FAIL. With --megatron, megatron-core's MoELayer is checked too: with its
stock dispatcher (reference rows, shown as PASS or DIFF) and with ours installed (rows that count).

Launch plainly (it spawns the ranks itself: 4 CPU ranks on gloo by default, one rank per GPU on
NCCL where CUDA is present) or under torchrun, which sets the ranks:

    moe-dispatch check
    python -m moe_dispatch.check --ranks 2 --dtype fp32
    torchrun --nproc-per-node 8 -m moe_dispatch.check --ep-sizes 1,2,4,8
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .comm import all_gather_rows
from .config import DISPATCHER_KINDS, MoEConfig
from .launch import end_spawned_rank, rank_device, set_rank_env, spawn_ranks

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


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"  ... {text}", flush=True)


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


# run(kind, ep, x, upstream) -> (output, input grad, router weight grad) of one forward + backward
# of a freshly zeroed layer with that dispatcher and EP size, on this rank's tokens x [T, H].
RunFn = Callable[[str, int, torch.Tensor, torch.Tensor], tuple]


def contract_checks(args: argparse.Namespace, device: torch.device, sizes: list[int], dispatchers: list[str],
                    run: RunFn, label: str = "", informational: bool = False) -> list[Result]:
    """Checks (a)-(d) of one kind of layer (``run``), on the check's tokens (the same for every
    kind of layer); rows prefixed with ``label``. Collective: every rank calls it alike."""
    rank = dist.get_rank()
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed + 1)
    shared_x = torch.randn((args.tokens, args.hidden), generator=gen).to(dtype).to(device)
    upstream = torch.randn((args.tokens, args.hidden), generator=gen).to(dtype).to(device)
    own_gen = torch.Generator().manual_seed(args.seed + 100 + rank)
    own_x = torch.randn((args.tokens, args.hidden), generator=own_gen).to(dtype).to(device)

    results: list[Result] = []

    def add(check: str, diff: float, same: bool) -> None:
        results.append(Result(label + check, diff, same, informational))

    outs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
    for kind in dispatchers:
        for ep in sizes:
            _progress(rank, f"{label}{kind} dispatcher, EP {ep}")
            identical = run(kind, ep, shared_x, upstream)
            diff, same = _all_equal_across(None, identical)
            add(f"(a) identical tokens, every rank: {kind}, EP {ep}", diff, same)
            outs[(kind, ep)] = run(kind, ep, own_x, upstream)

    first = outs[(dispatchers[0], sizes[0])]
    for kind in dispatchers:
        for ep in sizes:
            if (kind, ep) == (dispatchers[0], sizes[0]):
                continue
            other = outs[(kind, ep)]
            diff = max(_max_diff(a, b) for a, b in zip(first, other))
            same = all(_bitwise(a, b) for a, b in zip(first, other))
            check = "(b) allgather vs alltoall" if kind != dispatchers[0] and ep == sizes[0] else "(c) EP size"
            add(f"{check}: {dispatchers[0]} EP {sizes[0]} vs {kind} EP {ep}", diff, same)

    # Keep fewer tokens than the batch holds, or the truncation would zero nothing.
    keep = args.truncate_at if args.truncate_at < args.tokens else args.tokens // 2
    for kind in dispatchers:
        ep = sizes[-1]
        _progress(rank, f"{label}truncation test, {kind}, EP {ep}")
        truncated = own_x.clone()
        truncated[keep:] = 0
        out_t, grad_t, _ = run(kind, ep, truncated, upstream)
        full_out, full_grad, _ = outs[(kind, ep)]
        diff = max(_max_diff(out_t[:keep], full_out[:keep]), _max_diff(grad_t[:keep], full_grad[:keep]))
        same = _bitwise(out_t[:keep], full_out[:keep]) and _bitwise(grad_t[:keep], full_grad[:keep])
        add(f"(d) truncation (tokens {keep}+ zeroed): {kind}, EP {ep}", diff, same)
        one_out, one_grad, _ = run(kind, ep, own_x[:1], upstream[:1])
        diff = max(_max_diff(one_out, full_out[:1]), _max_diff(one_grad, full_grad[:1]))
        add(f"(d) one token alone vs in the batch: {kind}, EP {ep}", diff,
            _bitwise(one_out, full_out[:1]) and _bitwise(one_grad, full_grad[:1]))
    return _gather_results(results, device)


def _gather_results(results: list[Result], device: torch.device) -> list[Result]:
    """Results on other ranks count too: a FAIL anywhere fails everywhere."""
    flags = torch.tensor([0.0 if r.passed else 1.0 for r in results] + [r.max_diff for r in results],
                         dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    n = len(results)
    return [Result(r.check, float(flags[n + i]), flags[i].item() == 0.0, r.informational)
            for i, r in enumerate(results)]


def run_checks(args: argparse.Namespace, device: torch.device) -> list[Result]:
    from .config import MoEConfig
    from .layer import MoELayer

    world = dist.get_world_size()
    sizes, dispatchers = check_plan(args, world)
    groups = _ep_groups(world, sizes)
    base = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                     router_dtype=args.router_dtype, init_seed=args.seed)

    def run(kind: str, ep: int, x: torch.Tensor, upstream: torch.Tensor) -> tuple:
        return _run_layer(lambda: MoELayer(base.replace(dispatcher=kind), ep_group=groups[ep],
                                           layer_index=0).to(device), x, upstream)

    return contract_checks(args, device, sizes, dispatchers, run) + captured_check(args, device, base)


def captured_check(args: argparse.Namespace, device: torch.device, config: MoEConfig) -> list[Result]:
    """(e) The EP-1 layer's sync-free forward + backward captured in a CUDA graph and replayed on
    new tokens, against the eager step on them: output, input and router gradients bitwise. CUDA
    only (skipped on CPU: there is nothing to capture). Collective: every rank calls it."""
    from .layer import MoELayer

    check = "(e) CUDA-graph replay vs eager step: EP 1, sync-free"
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

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(upstream)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
        out.backward(upstream)
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
    """--megatron: checks (a)-(d) on megatron-core's MoELayer (``integrations.megatron.check``),
    handed this check's EP groups and ``contract_checks`` (so that module never imports this one)."""
    from .integrations.megatron.check import run_megatron_checks

    world = dist.get_world_size()
    sizes, dispatchers = check_plan(args, world)
    groups = _ep_groups(world, sizes)

    def contract(run: RunFn, label: str, informational: bool) -> list[Result]:
        return contract_checks(args, device, sizes, dispatchers, run, label=label, informational=informational)

    return run_megatron_checks(args, device, DTYPES[args.dtype], groups, contract)


def throughput(args: argparse.Namespace, device: torch.device) -> str:
    from .config import MoEConfig
    from .layer import MoELayer

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
    return (f"throughput: {args.tokens * world / seconds:,.0f} tokens/s forward+backward "
            f"({world} ranks, EP {world}, {config.dispatcher}, {args.tokens} tokens per rank, {args.dtype})")


def _print_table(results: list[Result]) -> None:
    width = max(len(r.check) for r in results)
    print(f"{'check':<{width}} | {'max |diff|':>10} | result")
    print("-" * (width + 22))
    for r in results:
        print(f"{r.check:<{width}} | {r.max_diff:>10.3e} | {r.status}")
    if any(r.informational for r in results):
        print("(reference rows: stock megatron-core, shown beside ours; DIFF there does not fail the check)")


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
        results = run_checks(args, device)
        if args.megatron:
            results += _megatron_checks(args, device)
        line = throughput(args, device)
        if rank == 0:
            _print_table(results)
            if args.megatron:
                from .integrations.megatron.check import explain
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
    from .config import MoEConfig

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
        from .integrations.megatron.check import megatron_unavailable

        if why := megatron_unavailable():
            parser.error(why)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        return main_worker(args, backend)
    world = args.ranks or (torch.cuda.device_count() if backend == "nccl" else 4)
    return spawn_ranks(_worker, world, backend, args)


if __name__ == "__main__":
    raise SystemExit(main())
