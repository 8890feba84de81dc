"""``moe-dispatch check --megatron``: the contract checks on megatron-core's own MoELayer.

The same contract checks (every rank, dispatcher, EP size, batch) as ``moe_dispatch.tools.check`` runs
on our MoELayer, on the same tokens, for megatron-core's MoELayer (0.16.1 through 0.19.2;
SequentialMLP experts, no TransformerEngine) at the check's size:

- ``megatron stock``: with Megatron's own dispatcher. Reference rows (``informational``): shown as
  PASS or DIFF, they never fail the check. On CPU they usually match; on GPUs they show Megatron's
  rank, dispatcher and batch dependence (BENCHMARKS.md).
- ``megatron + moe-dispatch``: the same layer with our dispatcher installed
  (``integrations.megatron.install``, default ``row_stable_gemms=True``: the router's gating GEMM
  and the SequentialMLP experts' GEMMs also run row-stably, on Megatron's own parameters). These
  rows count like ours.

Every EP size's layer is built with an explicit ProcessGroupCollection over the check's EP
subgroup, and the weights are seeded per global expert id (the draws of our own MoELayer), so the
layers of every EP size are the same model. Megatron's layers are fed [T, 1, H].

Megatron's MoE code needs CUDA (it asks for CUDA devices and streams even for CPU tensors), so the
command runs it on GPUs; on CPU ranks only the test suite runs it, with its test-only shims.

This module does not import ``moe_dispatch.tools.check``: the check hands it the EP groups and its
``contract`` function (the contract checks of one kind of layer), so the two never import each
other.
"""
from __future__ import annotations

import argparse
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

STOCK_LABEL = "megatron stock: "
OURS_LABEL = "megatron + moe-dispatch: "


# contract(run, label, informational) -> results: the contract checks on one kind of layer, whose
# run(kind, ep, x, upstream) does one forward + backward (moe_dispatch.tools.check.contract.contract_checks).
ContractFn = Callable[[Callable, str, bool], list]


def _megatron_run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, groups: dict, single: Any,
                  ours: bool) -> Callable:
    """A check run function (see ``moe_dispatch.tools.check.contract.RunFn``) over Megatron layers, one per
    (dispatcher, EP size), built on first use and reused (grads zeroed before each step)."""
    from .build import build_moe_layer, load_seeded_weights, moe_transformer_config, process_groups

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


def explain(results: list) -> list[str]:
    """Lines to print under the table: what the two kinds of Megatron rows mean."""
    if any(r.check.startswith(STOCK_LABEL) for r in results):
        return ["note: megatron + moe-dispatch = install(layer): our dispatcher, and Megatron's router gating "
                "and SequentialMLP GEMMs run row-stably on its own weights (row_stable_gemms=True)."]
    return []


def megatron_unavailable() -> str | None:
    """Why ``--megatron`` cannot run in this process, or None (checked before any rank starts)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        import sys

        return ("--megatron needs megatron-core, which is not installed in this environment "
                f"({sys.executable}): pip install megatron-core (0.16.1 through 0.19.2; TransformerEngine not needed)")
    if not torch.cuda.is_available():
        return ("--megatron needs CUDA: megatron-core's MoE code asks for CUDA devices and streams even for CPU "
                "tensors. On CPU ranks the test suite runs it with test-only shims "
                "(pytest tests/integrations/test_megatron_check.py)")
    return None


def run_megatron_checks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, groups: dict,
                        contract: ContractFn) -> list:
    """Checks (a)-(d) on megatron-core's MoELayer, stock (reference rows) and with our dispatcher
    installed. ``groups``: this rank's EP group per EP size (the check's). Collective: call on
    every rank, after ``moe_dispatch.tools.check.launch.run_checks``."""
    from .build import prepare_megatron
    from .supported import warn_if_untested

    rank, world = dist.get_rank(), dist.get_world_size()
    # Megatron's allgather dispatcher calls it; torch 2.13 renamed it
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*deprecated")
    if rank == 0:
        print("  ... megatron-core MoELayer (SequentialMLP, no TE)", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time notices (no TE, no apex, ...)
        prepare_megatron(device)
    if rank == 0:
        warn_if_untested()
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates all
    results: list = []
    for ours, label in ((False, STOCK_LABEL), (True, OURS_LABEL)):
        run = _megatron_run(args, device, dtype, groups, singles[rank], ours)
        results += contract(run, label, not ours)
    return results
