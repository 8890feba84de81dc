"""Dispatch + combine round trip with identity experts on 2 GPUs (NCCL), side by side:
our AllToAll/AllGather dispatchers, megatron-core 0.16.1's (if importable) and a raw
all_to_all_single of the K-copy rows there and back.

    python -m tests.dispatcher.bench_roundtrip [--tokens 8192 --hidden 4096 --experts 64 --topk 6]

Each figure is the median over iterations of the per-iteration CUDA-event time on rank 0 (ranks
start each iteration together after a barrier), forward only, and forward + backward.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, iters: int = 30, warmup: int = 5) -> float:
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _megatron(kind, P, rank, E, K, H):
    try:
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                                     MoEAlltoAllTokenDispatcher)
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as exc:  # optional peer
        return None, f"megatron-core not importable: {exc}"
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    single = [dist.new_group([r]) for r in range(P)][rank]
    pg = ProcessGroupCollection(ep=dist.group.WORLD, tp_ep=dist.group.WORLD, expt_tp=single)
    tc = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=8, num_moe_experts=E,
                           moe_router_topk=K, moe_token_dispatcher_type=kind, moe_permute_fusion=False,
                           add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                           expert_model_parallel_size=P)
    El = E // P
    cls = MoEAlltoAllTokenDispatcher if kind == "alltoall" else MoEAllGatherTokenDispatcher
    return cls(El, list(range(rank * El, (rank + 1) * El)), tc, pg_collection=pg), ""


def _worker(rank: int, P: int, init: str, args) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=P)
    from moe_dispatch.dispatcher import AllGatherDispatcher, AllToAllDispatcher
    from types import SimpleNamespace

    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    scores = torch.rand(T, E, device="cuda", generator=g)
    rmap = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, scores.topk(K, 1).indices, True)
    probs = (torch.softmax(scores, 1) * rmap).requires_grad_()
    grad = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    cfg = SimpleNamespace(num_experts=E, topk=K, router_dtype="fp32", probs_in_experts=False,
                          pad_multiple=1, pad_to_capacity=False, capacity_factor=None)

    def ours(cls, backward):
        def step():
            d = cls(cfg)
            rows, _, handle = d.dispatch(x, rmap, probs)
            out = d.combine(rows, handle)
            if backward:
                out.backward(grad)
        return step

    def megatron(d, backward):
        def step():
            h, p = d.dispatch_preprocess(x, rmap, probs)
            h, p = d.token_dispatch(h, p)
            rows, _, p = d.dispatch_postprocess(h, p)
            out = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows)))
            if backward:
                out.backward(grad)
        return step

    kcopy = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
    back = torch.empty_like(kcopy)

    def raw():
        dist.all_to_all_single(back, kcopy)
        dist.all_to_all_single(kcopy, back)

    results = [("raw K-copy all_to_all there and back", _time(raw), float("nan"))]
    for name, cls in (("ours alltoall", AllToAllDispatcher), ("ours allgather", AllGatherDispatcher)):
        results.append((name, _time(ours(cls, False)), _time(ours(cls, True))))
    for kind in ("alltoall", "allgather"):
        d, why = _megatron(kind, P, rank, E, K, H)
        if d is None:
            results.append((f"megatron {kind} ({why})", float("nan"), float("nan")))
        else:
            results.append((f"megatron {kind}", _time(megatron(d, False)), _time(megatron(d, True))))
    # bytes: deduplicated dispatch (tokens going to the other rank) + K-copy combine rows back
    El = E // P
    remote = rmap.view(T, P, El).any(-1).clone()
    remote[:, rank] = False
    remote_pairs = rmap.view(T, P, El).clone()
    remote_pairs[:, rank] = False
    nbytes = (int(remote.sum()) + int(remote_pairs.sum())) * H * 2
    if rank == 0:
        print(f"T={T} per rank, H={H}, E={E}, K={K}, bf16, EP={P}; bytes leaving rank 0 "
              f"(dedup dispatch + K-copy combine): {nbytes / 1e6:.1f} MB")
        print(f"{'what':60s} {'fwd ms':>8s} {'fwd+bwd ms':>11s}")
        for name, fwd, both in results:
            print(f"{name:60s} {fwd:8.3f} {both:11.3f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    args = ap.parse_args()
    P = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(P, os.path.join(tmp, "store"), args), nprocs=P)


if __name__ == "__main__":
    main()
