"""GradientTree's cross-rank exchange alone (moe_dispatch.parallel.tree_exchange.TreeExchange): the
reduce-scatter by recursive halving + all-gather against recursive doubling, by vector size, on
this group. Both give the same bits (checked here on every size); the table says which is faster
where, with the bytes each rank sends beside the time (the floor any transport pays):

    torchrun --nproc-per-node 4 scripts/measure/tree_exchange.py            # gloo, CPU
    torchrun --nproc-per-node 4 scripts/measure/tree_exchange.py --cuda     # gloo, one shared GPU
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from moe_dispatch.parallel.tree_exchange import TreeExchange


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", action="store_true",
                        help="the vectors on the GPU (gloo stages them through the host)")
    parser.add_argument("--mib", default="0.25,0.65,1,4,16,64", help="vector sizes, MiB of fp32")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda" if args.cuda else "cpu")
    if args.cuda:
        torch.cuda.set_device(0)
    steps = world.bit_length() - 1
    if rank == 0:
        print(f"TreeExchange on {world} gloo ranks, {device.type}, fp32, every value joining at level 0; median of "
              f"{args.iters}")
        print(f"{'MiB':>6} {'doubling ms':>12} {'sent MiB':>9} {'halving ms':>11} {'sent MiB':>9} {'same bits':>10}")
    for mib in (float(m) for m in args.mib.split(",")):
        n = int(mib * 2**20 / 4)
        gen = torch.Generator().manual_seed(rank)
        scale = torch.exp2(torch.randint(-20, 20, (n,), generator=gen).float())  # a sum's bits depend on its order
        base = (torch.randn(n, generator=gen) * scale).to(device)
        row = []
        results = []
        for min_bytes in (1 << 62, 0):  # doubling, then halving
            exchange = TreeExchange(dist.group.WORLD, world, rank, overlap=False, halving_min_bytes=min_bytes)
            times = []
            for _ in range(args.iters + 1):
                flat = base.clone()
                dist.barrier()
                t0 = time.perf_counter()
                exchange.start(flat, [n] * steps, lambda: None, at_once=True)
                if args.cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            results.append(flat)
            row += [statistics.median(times[1:]) * 1e3, exchange.sent_bytes / (args.iters + 1) / 2**20]
        same = torch.equal(results[0], results[1])
        if rank == 0:
            print(f"{mib:6.2f} {row[0]:12.2f} {row[1]:9.2f} {row[2]:11.2f} {row[3]:9.2f} {str(same):>10}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
