"""GradientTree (moe_dispatch.parallel) on one GPU with the ranks sharing it (gloo), or on CPU:

    torchrun --nproc-per-node 4 scripts/bench_gradient_tree.py          # CUDA: check + table
    torchrun --nproc-per-node 4 scripts/bench_gradient_tree.py --cpu    # CPU (gloo), small sizes
    torchrun --nproc-per-node 4 scripts/bench_gradient_tree.py --backend nccl   # one GPU per rank

(a) The promise on this device: the issue's model (moe_dispatch/tools/gradient_tree_layouts.py) for
3 steps on the six L = 4 layouts (world, EP, A), bf16 on CUDA (fp32 on CPU); every parameter by
global expert id, each step's loss and norm must be bitwise equal (needs 4 ranks).
(b) Step time and memory, GradientTree against today's reducers at the same layout (world, EP, A)
with A = --micro-batches: DDP (no_sync for all but the last micro-batch, the experts ignored at
EP > 1) + allreduce_expert_grads + torch's clip_grad_norm_ (a local norm: not the global one) +
AdamW. Both runs start from the same weights and see the same data; after the timed steps the
tree's parameters are compared across the table's layouts (bitwise expected), DDP's as well
(differences expected).

Columns: ms per step (median over --iters; wall clock between barriers, so every rank's work and
the gloo host copies count; phases: the A micro-batches' forward + backward + accumulation, the
reduction, clipping + optimizer); peak MiB (max_memory_allocated over a step, CUDA only: with
the activations and the transients of the backward); grad MiB (the most held for gradients after
a micro-batch's backward, after its add_micro_batch or after the reduction: every .grad, the
experts' per-source gradients, the tree's partial sums and nodes in flight, DDP's buckets).
``--breakdown`` adds (c): those parts, the largest per-source weight gradient a backward handed
the tree (alive inside that backward until paired; in neither point above), and where the
tree's time goes (its exchange's time and bytes; on CUDA the host<->device copies of one
profiled step). The goal beside them: <= 10% slower, <= 1.5x the gradient memory. ``--serial``
adds GradientTree with overlap=False (each micro-step's exchange in its add_micro_batch, not
beside the next micro-batch).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.parallel import GradientTree, allreduce_expert_grads, ignore_experts_in_ddp
from moe_dispatch.router import AuxLossScaler
from moe_dispatch.tools.gradient_tree_layouts import LAYOUTS, assemble, by_global_id, layouts_worker

# Issue 50's goals: time, and gradient memory by parameter dtype (DDP's bf16 .grad is 2 bytes a value, so
# one fp32 value per parameter is 2x by itself).
GOAL_TIME, GOAL_MEMORY = 1.10, {torch.float32: 1.5, torch.bfloat16: 2.0}


class Model(nn.Module):
    """Embedding-like dense layer, --layers MoE layers (shared expert, aux loss) with residuals, a head."""

    def __init__(self, config: MoEConfig, layers: int, classes: int, ep_group, device: torch.device) -> None:
        super().__init__()
        H = config.hidden_size
        gen = torch.Generator().manual_seed(3)
        self.embed = nn.Linear(H, H, dtype=config.params_dtype)
        self.moe = nn.ModuleList([MoELayer(config, ep_group, layer_index=i) for i in range(layers)])
        self.head = nn.Linear(H, classes, dtype=config.params_dtype)
        with torch.no_grad():
            for p in (*self.embed.parameters(), *self.head.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * H ** -0.5)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.moe:
            h = h + layer(h)
        return self.head(h)


def batch(step: int, index: int, args, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``index`` of ``step``, the same on every rank that runs it."""
    gen = torch.Generator(device=device).manual_seed(100_000 * step + index)
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=device).to(args.dtype)
    return x, torch.randint(0, args.classes, (args.tokens,), generator=gen, device=device)


class Groups:
    """The data group (the world), EP groups of consecutive ranks and the expert-data-parallel
    groups (equal EP rank) for every EP size in ``eps``; built in one order on every rank."""

    def __init__(self, world: int, rank: int, eps: List[int]) -> None:
        self.ep: Dict[int, dist.ProcessGroup] = {}
        self.expert_dp: Dict[int, dist.ProcessGroup] = {}
        for ep in eps:
            blocks = [dist.new_group(list(range(g, g + ep))) for g in range(0, world, ep)]
            strided = [dist.new_group(list(range(s, world, ep))) for s in range(ep)]
            self.ep[ep], self.expert_dp[ep] = blocks[rank // ep], strided[rank % ep]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def grad_bytes(model: nn.Module, tree: "GradientTree | None") -> int:
    """Bytes held for gradients now: every .grad, and the tree's partial sums, its nodes in flight and
    the experts' per-source gradients waiting for add_micro_batch."""
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return grads + (sum(tree.held_bytes_by_part().values()) if tree is not None else 0)


def run(method: str, ep: int, args, groups: Groups, device: torch.device) -> dict:
    """Warm-up + timed steps of one method at layout (world, ep, A); phase times, memory, final params."""
    world, rank, A = dist.get_world_size(), dist.get_rank(), args.micro_batches
    config = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk,
                       ffn_hidden_size=args.ffn, shared_expert_ffn_hidden_size=args.ffn, aux_loss_coeff=1e-2,
                       params_dtype=args.dtype)
    model = Model(config, args.layers, args.classes, groups.ep[ep], device)  # EP 1: a group of one (None: the world)
    tree = ddp = None
    bucket_bytes = 0
    if method in ("tree", "tree-serial"):
        tree = GradientTree(model, micro_batches=A, overlap=method == "tree")
        forward = model
    else:
        ignored = set(ignore_experts_in_ddp(model))
        ddp = DistributedDataParallel(model)
        forward = ddp
        bucket_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in ignored)
        AuxLossScaler.set_loss_scale(1.0 / A)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    cost: Dict[str, float] = {}  # the breakdown's measures: seconds and bytes summed over the timed steps
    most: Dict[str, Dict[str, int]] = {}  # at each checkpoint, the parts when their total was the most

    def snapshot(where: str) -> None:
        parts = {".grad": grad_bytes(model, None), **tree.held_bytes_by_part()}
        if sum(parts.values()) > sum(most.get(where, {}).values()):
            most[where] = parts

    def one_step(step: int, timed: bool) -> Tuple[Tuple[float, float, float], int]:
        """One optimizer step: (micro-batches, reduce, clip + optimizer) seconds, gradient bytes held.
        The byte counting (host-side sums over the parameters) is timed apart and left out."""
        held = 0
        counting = 0.0

        def count(where: str = "") -> None:
            nonlocal held, counting
            started = time.perf_counter()
            held = max(held, grad_bytes(model, tree))
            if where and timed:
                snapshot(where)
            counting += time.perf_counter() - started

        t0 = time.perf_counter()
        for a in range(A):
            x, y = batch(step, a * world + rank, args, device)  # GradientTree.micro_batch_index(a)
            if tree is not None:
                F.cross_entropy(forward(x).float(), y).backward()
                count("after backward")  # .grad, and the experts' per-source blocks the backward left
                t_add = time.perf_counter()
                tree.add_micro_batch()
                if timed:
                    cost["add_micro_batch s"] = cost.get("add_micro_batch s", 0) + time.perf_counter() - t_add
                count("after add_micro_batch")
            else:  # DDP reduces in the last micro-batch's backward
                with ddp.no_sync() if a < A - 1 else contextlib.nullcontext():
                    (F.cross_entropy(forward(x).float(), y) / A).backward()
                count()
        sync(device)
        t1 = time.perf_counter()
        if tree is not None:
            tree.reduce()
        elif ep > 1:
            allreduce_expert_grads(model, groups.expert_dp[ep], dp_size=world)
        held = max(held, grad_bytes(model, tree))
        sync(device)
        t2 = time.perf_counter()
        if tree is not None:
            tree.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sync(device)
        return (t1 - t0 - counting, t2 - t1, time.perf_counter() - t2), held

    times: List[Tuple[float, float, float]] = []
    peaks, grads = [], []
    try:
        exchanged = (0.0, 0)
        for step in range(args.warmup + args.iters):
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if step == args.warmup and tree is not None:
                exchanged = tree.exchange_totals()
            phases, held = one_step(step, timed=step >= args.warmup)
            if step >= args.warmup:
                times.append(phases)
                peaks.append(torch.cuda.max_memory_allocated() if device.type == "cuda" else 0)
                grads.append(held + bucket_bytes)
        if tree is not None:
            seconds, sent = tree.exchange_totals()
            cost["exchange s"], cost["exchange bytes"] = seconds - exchanged[0], sent - exchanged[1]
            cost["transient bytes"] = tree.source_grads_transient_bytes()
        if args.breakdown and device.type == "cuda":  # one more step under the profiler: host<->device copies
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                one_step(args.warmup + args.iters, timed=False)
            copies = [e for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" in e.name]
            cost["copies"] = len(copies)
            cost["copy s"] = sum(e.device_time for e in copies) * 1e-6
    finally:
        AuxLossScaler.set_loss_scale(1.0)
    params = by_global_id(model)
    model = tree = ddp = forward = opt = None  # freed before the next run (one_step holds the names)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    phases = [statistics.median(t[i] for t in times) * 1e3 for i in range(3)]
    cost = {k: v / args.iters if k in ("add_micro_batch s", "exchange s", "exchange bytes") else v
            for k, v in cost.items()}  # per step
    return {"ms": sum(phases), "phases": phases, "peak": max(peaks) / 2**20, "grad": max(grads) / 2**20,
            "params": params, "cost": cost, "most": most, "buckets": bucket_bytes}


def gather_params(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The union over ranks of ``params`` (keys by global expert id), on every rank."""
    every: List[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every, params)
    merged: Dict[str, torch.Tensor] = {}
    for got in every:
        merged.update(got)
    return merged


def check_layouts(device: torch.device, dtype: torch.dtype) -> None:
    """(a): the six layouts of the test, bitwise (4 ranks)."""
    out = layouts_worker(dist.get_rank(), dist.get_world_size(), device.type, dtype)
    every: List[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every, out)
    if dist.get_rank() != 0:
        return
    merged = assemble(every, "tree")
    ref = merged[LAYOUTS[0]]
    for layout in LAYOUTS[1:]:
        differ = [k for k in ref if not torch.equal(merged[layout][k], ref[k])]
        print(f"  {layout} vs {LAYOUTS[0]}: {'bitwise' if not differ else f'DIFFERS in {len(differ)}: {differ[:4]}'}")
    ok = all(torch.equal(merged[lay][k], ref[k]) for lay in LAYOUTS[1:] for k in ref)
    print(f"layouts (world, EP, A) with L = 4, {dtype}: {'PASS: bitwise' if ok else 'FAIL'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, small default sizes")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (CUDA 1024, CPU 64)")
    parser.add_argument("--ffn", type=int, default=0, help="expert ffn size (CUDA 512, CPU 64)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per micro-batch (CUDA 2048, CPU 128)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--classes", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4, help="A")
    parser.add_argument("--eps", default="", help="EP sizes of the table (default: every power of two <= world)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-check", action="store_true", help="no (a)")
    parser.add_argument("--serial", action="store_true",
                        help="also GradientTree(overlap=False): each micro-step's exchange in its call")
    parser.add_argument("--breakdown", action="store_true",
                        help="also (c): where the memory and the time go (CUDA: one more step under torch.profiler)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameters' dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: one GPU per rank (LOCAL_RANK), the route a multi-GPU run takes")
    args = parser.parse_args()
    if args.backend == "nccl":
        if args.cpu:
            parser.error("--backend nccl needs CUDA: drop --cpu")
        local_rank, world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if not torch.cuda.is_available() or torch.cuda.device_count() < world:
            # NCCL refuses two ranks on one GPU; say so before any collective, on every rank alike.
            parser.error(f"--backend nccl needs one GPU per rank: {world} ranks, "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs; use gloo to share one")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu" if args.cpu else "cuda")
    args.dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if args.cpu else torch.bfloat16
    args.hidden = args.hidden or (64 if args.cpu else 1024)
    args.ffn = args.ffn or (64 if args.cpu else 512)
    args.tokens = args.tokens or (128 if args.cpu else 2048)
    if args.cpu:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        if not args.skip_check:
            if world == 4:
                check_layouts(device, args.dtype)
            elif rank == 0:
                print("(a) needs 4 ranks: skipped")
        eps = [int(e) for e in args.eps.split(",")] if args.eps else [e for e in (1, 2, 4, 8, 16) if e <= world]
        groups = Groups(world, rank, eps)
        methods = ("ddp", "tree", "tree-serial") if args.serial else ("ddp", "tree")
        rows, finals = [], {m: [] for m in methods}
        for ep in eps:
            got = {m: run(m, ep, args, groups, device) for m in methods}
            for m in got:
                finals[m].append(gather_params(got[m].pop("params")))
            rows.append((ep, got))
        if rank == 0:
            report(rows, finals, args, world)
    finally:
        dist.destroy_process_group()


def report(rows, finals, args, world: int) -> None:
    goal_memory = GOAL_MEMORY[args.dtype]
    where = "CPU" if args.cpu else "one GPU per rank (nccl)" if args.backend == "nccl" else "one GPU shared"
    print(f"\n(b) {args.layers} MoE layers, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts top-"
          f"{args.topk}, {args.tokens} tokens per micro-batch, A = {args.micro_batches}, {world} ranks, "
          f"{args.dtype}, {where}; median of {args.iters} steps")
    print(f"{'(W, EP, A)':12} {'method':22} {'ms/step':>8} {'micro':>8} {'reduce':>8} {'opt':>7} "
          f"{'peak MiB':>9} {'grad MiB':>9} {'time x':>7} {'grad x':>7}  goal <= {GOAL_TIME:.2f}x, <= {goal_memory}x")
    for ep, got in rows:
        base = got["ddp"]
        for m, name in (("ddp", "DDP + allreduce_expert"), ("tree", "GradientTree"),
                        ("tree-serial", "GradientTree serial")):
            if m not in got:
                continue
            r = got[m]
            tx, gx = r["ms"] / base["ms"], r["grad"] / base["grad"] if base["grad"] else float("nan")
            verdict = "" if m == "ddp" else ("  ok" if tx <= GOAL_TIME and gx <= goal_memory else "  over goal")
            print(f"{str((world, ep, args.micro_batches)):12} {name:22} {r['ms']:8.1f} {r['phases'][0]:8.1f} "
                  f"{r['phases'][1]:8.1f} {r['phases'][2]:7.1f} {r['peak']:9.1f} {r['grad']:9.2f} {tx:7.2f} "
                  f"{gx:7.2f}{verdict}")
    if args.breakdown:
        breakdown(rows, world, args.micro_batches)
    if "tree-serial" in finals:
        same = all(torch.equal(f[k], g[k]) for f, g in zip(finals["tree"], finals["tree-serial"]) for k in f)
        print(f"GradientTree overlapped vs serial exchange: parameters {'bitwise' if same else 'DIFFER'}")
    for m, name in (("tree", "GradientTree"), ("ddp", "DDP + allreduce_expert_grads")):
        ref = finals[m][0]
        same = all(torch.equal(f[k], ref[k]) for f in finals[m][1:] for k in ref)
        steps = args.warmup + args.iters + (1 if args.breakdown and not args.cpu else 0)  # (c)'s profiled step
        print(f"{name}: parameters after {steps} steps across the table's layouts: "
              f"{'bitwise' if same else 'differ'}")


def breakdown(rows, world: int, A: int) -> None:
    """(c): rank 0's measures behind (b)'s memory and time columns."""
    mib = 2.0 ** -20
    print("\n(c) breakdown, rank 0. Memory (MiB), at the two points of a micro-step, each when its total was the "
          "most: .grad, the experts' per-source blocks, the tree's partials, its nodes in flight. Time, per "
          "step: in add_micro_batch (host), the exchange's steps (on its thread when overlapped), bytes "
          "sent; CUDA: host<->device copies in one profiled step (all ranks' copies share the GPU).")
    print("Beside them, inside each backward and counted in neither point: the largest per-source weight "
          "gradient [E_local, P, ...] a backward handed over (\"in backward\", MiB), alive until paired.")
    print(f"{'(W, EP, A)':12} {'method':20} {'point':22} {'.grad':>7} {'source':>7} {'partials':>8} "
          f"{'flight':>7} {'total':>7} | {'in add ms':>9} {'exch ms':>8} {'sent MiB':>9} {'copies':>7} {'copy ms':>8} "
          f"{'in backward':>11}")
    for ep, got in rows:
        for m, name in (("tree", "GradientTree"), ("tree-serial", "GradientTree serial")):
            if m not in got:
                continue
            c, most = got[m]["cost"], got[m]["most"]
            copies = f"{c['copies']:7.0f} {c['copy s'] * 1e3:8.1f}" if "copies" in c else f"{'-':>7} {'-':>8}"
            for i, (where, parts) in enumerate(most.items()):
                times = (f"{c.get('add_micro_batch s', 0) * 1e3:9.1f} {c.get('exchange s', 0) * 1e3:8.1f} "
                         f"{c.get('exchange bytes', 0) * mib:9.2f} {copies} "
                         f"{c.get('transient bytes', 0) * mib:11.2f}") if i == 0 else ""
                print(f"{str((world, ep, A)):12} {name:20} {where:22} {parts['.grad'] * mib:7.2f} "
                      f"{parts['source blocks'] * mib:7.2f} {parts['partials'] * mib:8.2f} "
                      f"{parts['in flight'] * mib:7.2f} {sum(parts.values()) * mib:7.2f} | {times}")
        base = got["ddp"]
        c = base["cost"]
        copies = f"; {c['copies']:.0f} copies, {c['copy s'] * 1e3:.1f} ms" if "copies" in c else ""
        print(f"{str((world, ep, A)):12} {'DDP':20} {'the most':22} {base['grad'] - base['buckets'] * mib:7.2f} "
              f"{'':7} {'':8} {'':7} {base['grad']:7.2f} | buckets {base['buckets'] * mib:.2f} MiB{copies}")

if __name__ == "__main__":
    main()
