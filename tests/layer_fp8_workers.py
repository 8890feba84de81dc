"""Rank bodies of tests/test_layer_fp8.py: the FP8 layer at EP 2 and 4 (gloo) on one world of 4."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_dispatch import MoEConfig, MoELayer

T_GLOBAL, H = 24, 32


def fp8_config(dispatcher: str, **overrides) -> MoEConfig:
    base = dict(hidden_size=H, num_experts=8, topk=2, ffn_hidden_size=32, fp8="e4m3", dispatcher=dispatcher,
                params_dtype=torch.bfloat16, shared_expert_ffn_hidden_size=16, init_seed=11)
    return MoEConfig(**{**base, **overrides})


def global_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's input and upstream gradient, [T_GLOBAL, H] bf16, the same on every rank."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T_GLOBAL, H, generator=gen).to(torch.bfloat16)
    upstream = torch.randn(T_GLOBAL, H, generator=gen).to(torch.bfloat16)
    return x, upstream


def splits(ep: int) -> list[range]:
    """Uneven contiguous token ranges of the EP ranks (one may be empty)."""
    cuts = {1: [0, T_GLOBAL], 2: [0, 9, T_GLOBAL], 4: [0, 3, 3, 14, T_GLOBAL]}[ep]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def run_layer(config: MoEConfig, group, ep_rank: int, ids: range) -> dict:
    """This rank's tokens' output and input gradient, its experts' weight gradients (by global
    expert id) and the router's weight gradient."""
    layer = MoELayer(config, group, layer_index=0)
    x, upstream = global_data()
    mine = x[ids.start:ids.stop].clone().requires_grad_()
    out = layer(mine)
    out.backward(upstream[ids.start:ids.stop])
    first = layer.experts.local_expert_offset
    experts = {first + e: (layer.experts.weight1.grad[e].clone(), layer.experts.weight2.grad[e].clone())
               for e in range(layer.experts.num_local_experts)}
    return dict(ids=list(ids), out=out.detach(), gx=mine.grad.detach(), experts=experts,
                router=layer.router.weight.grad.detach().clone())


def ep_worker(rank: int, world: int) -> dict:
    """EP 4 (the world) and EP 2 (two groups of 2), both dispatchers; and EP 2 sync-free
    (``ep_capacity_factor``: static buffers with trailing rows), half the tokens on each rank; EP 4
    and EP 2 sync-free again with ``fp8_wgrad=False``."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {}
    half = T_GLOBAL // 2
    for kind in ("alltoall", "allgather"):
        results[(kind, 4)] = run_layer(fp8_config(kind), dist.group.WORLD, rank, splits(4)[rank])
        results[(kind, 2)] = run_layer(fp8_config(kind), pairs[rank // 2], rank % 2, splits(2)[rank % 2])
        # capacity 2x the balanced load: a rank can receive every token's topk rows, so nothing drops
        results[(kind, "sync-free")] = run_layer(fp8_config(kind, ep_capacity_factor=2.0), pairs[rank // 2],
                                                 rank % 2, range(half * (rank % 2), half * (rank % 2 + 1)))
        # the weight gradients in the tokens' dtype (fp8_wgrad=False): EP 4, and EP 2 sync-free
        results[(kind, 4, "wide")] = run_layer(fp8_config(kind, fp8_wgrad=False), dist.group.WORLD, rank,
                                               splits(4)[rank])
        results[(kind, "sync-free", "wide")] = run_layer(fp8_config(kind, ep_capacity_factor=2.0, fp8_wgrad=False),
                                                         pairs[rank // 2], rank % 2,
                                                         range(half * (rank % 2), half * (rank % 2 + 1)))
    return results


def settings_differ_worker(rank: int, world: int) -> dict:
    """EP 2 with one setting differing on rank 1 (fp8_wgrad=False; fp8=None; probs_in_experts=True
    with fp8=None): each first forward's error (None if it ran)."""
    from tests.dispatcher.harness import value_error_of

    x, _ = global_data()
    errors = {}
    for name, override in (("fp8_wgrad", dict(fp8_wgrad=rank == 0)),
                           ("fp8", dict(fp8="e4m3" if rank == 0 else None)),
                           ("probs_in_experts", dict(fp8=None, probs_in_experts=rank == 1))):
        layer = MoELayer(fp8_config("alltoall", **override), dist.group.WORLD, layer_index=0)
        errors[name] = value_error_of(lambda: layer(x[rank * 4:(rank + 1) * 4]))
    return errors
