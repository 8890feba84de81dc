"""One rank of `moe-dispatch check`: ``main_worker`` joins the process group, runs every row, and
rank 0 prints the report; it raises SystemExit(1) if any row that counts FAILs on any rank.
``launch`` (torch-free, so that a bad flag is refused at once) spawns the ranks that run it.
"""
from __future__ import annotations

import argparse
import importlib
import os

import torch
import torch.distributed as dist

from ...distributed.launch import end_spawned_rank, rank_device, set_rank_env
from .args import DTYPES, base_config
from .contract import Result, RunFn, captured_check, check_plan, contract_checks, ep_groups, progress, run_layer
from .layouts import layout_rows
from .reference import combine_rows
from .report import print_report, throughput


def run_checks(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """Every row on our MoELayer: the contract's, against the references, the CUDA-graph replay,
    and a short training run on two layouts (GradientTree). Collective: every rank calls it."""
    from ...layer import MoELayer

    world = dist.get_world_size()
    sizes, dispatchers = check_plan(args, world)
    groups = ep_groups(world, sizes)
    base = base_config(args)

    def run(kind: str, ep: int, x: torch.Tensor, upstream: torch.Tensor) -> tuple:
        return run_layer(lambda: MoELayer(base.replace(dispatcher=kind), ep_group=groups[ep],
                                          layer_index=0).to(device), x, upstream)

    results = contract_checks(args, device, sizes, dispatchers, run)
    layer = MoELayer(base.replace(dispatcher=dispatchers[0]), ep_group=groups[sizes[-1]],
                     layer_index=0).to(device)
    return (results + combine_rows(args, device, layer, sizes) + captured_check(args, device, base)
            + layout_rows(args, device))


def _megatron_checks(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """--megatron: the contract checks (every rank, dispatcher, EP size, batch) on megatron-core's
    MoELayer (``integrations.megatron.check``), handed this check's EP groups and
    ``contract_checks`` (so that module never imports this package)."""
    from ...integrations.megatron.check import run_megatron_checks

    world = dist.get_world_size()
    sizes, dispatchers = check_plan(args, world)
    groups = ep_groups(world, sizes)

    def contract(run: RunFn, label: str, informational: bool) -> list[Result]:
        return contract_checks(args, device, sizes, dispatchers, run, label=label, informational=informational)

    return run_megatron_checks(args, device, DTYPES[args.dtype], groups, contract)


def _worker(local_rank: int, world: int, port: int, backend: str, args: argparse.Namespace) -> None:
    set_rank_env(local_rank, world, port)
    main_worker(args, backend)  # a failed check raises SystemExit(1) here
    end_spawned_rank()


def main_worker(args: argparse.Namespace, backend: str) -> int:
    """One rank of the check, its rank set in the environment (by torchrun or ``spawn_ranks``)."""
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
                  f"{args.dtype}, router {args.router_dtype}" + (f", fp8 {args.fp8}" if args.fp8 else "")
                  + (", wgrad in the tokens' dtype" if args.no_fp8_wgrad else ""), flush=True)
        # torch's custom ops (our permute/unpermute) import torch._dynamo on their first call: a
        # one-time wait of seconds, said here rather than left silent in the first row.
        progress(rank, "importing torch._dynamo (torch's custom ops need it, once per process)")
        importlib.import_module("torch._dynamo")

        results = run_checks(args, device)
        if args.megatron:
            results += _megatron_checks(args, device)
        line = throughput(args, device)
        if rank == 0:
            print_report(args, results, line)
        ok = not any(r.failed for r in results)
    finally:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)
    return 0
