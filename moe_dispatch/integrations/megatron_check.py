"""``moe-dispatch check --megatron``: the contract checks on megatron-core's own MoELayer.

The same checks (a)-(d) as ``moe_dispatch.check`` runs on our MoELayer, on the same tokens, for
megatron-core 0.16.1's MoELayer (SequentialMLP experts, no TransformerEngine) at the check's size:

- ``megatron stock``: with Megatron's own dispatcher. Reference rows (``informational``): shown as
  PASS or DIFF, they never fail the check. On CPU they usually match; on GPUs they show Megatron's
  rank, dispatcher and batch dependence (shared/FACTS.md).
- ``megatron + moe-dispatch``: the same layer with our dispatcher installed
  (``integrations.megatron.install``, default ``row_stable_gemms=True``: the router's gating GEMM
  and the SequentialMLP experts' GEMMs also run row-stably, on Megatron's own parameters). These
  rows count like ours.

Every EP size's layer is built with an explicit ProcessGroupCollection over the check's EP
subgroup, and the weights are seeded per global expert id (the draws of our own MoELayer), so the
layers of every EP size are the same model. Megatron's layers are fed [T, 1, H].
"""
from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist

from ..check import DTYPES, Result, _ep_groups, check_plan, contract_checks

STOCK_LABEL = "megatron stock: "
OURS_LABEL = "megatron + moe-dispatch: "


def _megatron_run(args: argparse.Namespace, device: torch.device, groups: dict, single, ours: bool):
    """A check run function (see ``moe_dispatch.check.RunFn``) over Megatron layers, one per
    (dispatcher, EP size), built on first use and reused (grads zeroed before each step)."""
    from .megatron_build import build_moe_layer, load_seeded_weights, moe_transformer_config, process_groups

    dtype = DTYPES[args.dtype]
    layers: dict = {}

    def layer_for(kind: str, ep: int):
        if (kind, ep) not in layers:
            with warnings.catch_warnings():  # config deprecation notices, "Apex is not installed"
                warnings.simplefilter("ignore")
                config = moe_transformer_config(args.hidden, args.ffn, args.experts, args.topk, kind, dtype, ep,
                                                router_dtype=args.router_dtype)
                layer = build_moe_layer(config, process_groups(groups[ep], single), ours=ours)
                layers[(kind, ep)] = load_seeded_weights(layer, args.seed).to(device)
        return layers[(kind, ep)]

    def run(kind: str, ep: int, x: torch.Tensor, upstream: torch.Tensor) -> tuple:
        layer = layer_for(kind, ep)
        layer.zero_grad(set_to_none=True)
        tokens, hidden = x.shape
        xi = x.reshape(tokens, 1, hidden).clone().requires_grad_()
        out, bias = layer(xi)
        assert bias is None
        out.backward(upstream.reshape(out.shape))
        # clone: Megatron's allgather dispatcher may leave grads in views of its reused global buffer
        return (out.detach().reshape(tokens, hidden).clone(), xi.grad.reshape(tokens, hidden).clone(),
                layer.router.weight.grad.detach().clone())

    return run


def explain(results: list[Result]) -> list[str]:
    """Lines to print under the table: what the two kinds of Megatron rows mean."""
    if any(r.check.startswith(STOCK_LABEL) for r in results):
        return ["note: megatron + moe-dispatch = install(layer): our dispatcher, and Megatron's router gating "
                "and SequentialMLP GEMMs run row-stably on its own weights (row_stable_gemms=True)."]
    return []


def run_megatron_checks(args: argparse.Namespace, device: torch.device) -> list[Result]:
    """Checks (a)-(d) on megatron-core's MoELayer, stock (reference rows) and with our dispatcher
    installed. Collective: call on every rank, after ``moe_dispatch.check.run_checks``."""
    from .megatron_build import prepare_megatron

    rank, world = dist.get_rank(), dist.get_world_size()
    # Megatron's allgather dispatcher calls it; torch 2.13 renamed it
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*deprecated")
    if rank == 0:
        print("  ... megatron-core MoELayer (SequentialMLP, no TE)", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time notices (no TE, no apex, ...)
        prepare_megatron(device)
    sizes, dispatchers = check_plan(args, world)
    groups = _ep_groups(world, sizes)
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates all
    results: list[Result] = []
    for ours, label in ((False, STOCK_LABEL), (True, OURS_LABEL)):
        run = _megatron_run(args, device, groups, singles[rank], ours)
        results += contract_checks(args, device, sizes, dispatchers, run, label=label, informational=not ours)
    return results
