"""Workers of test_gradient_tree.py: the issue's model trained on six layouts with L = 4 micro-batches
(moe_dispatch/tools/gradient_tree_layouts.py, which scripts/bench_gradient_tree.py runs too), beside
each layout's gradients with today's reducers, and GradientTree's refusals.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_dispatch import MoEConfig
from moe_dispatch.experts import LocalExperts
from moe_dispatch.parallel import GradientTree, allreduce_expert_grads
from moe_dispatch.router import AuxLossScaler
from moe_dispatch.tools import gradient_tree_layouts as layouts
from moe_dispatch.tools.gradient_tree_layouts import CONFIG, Groups, Net, by_global_id, micro_batch, rank_layouts
from tests.dispatcher.harness import value_error_of

LAYOUTS, assemble = layouts.LAYOUTS, layouts.assemble  # what test_gradient_tree.py imports from here


def today(config: MoEConfig, groups: Groups, rank: int, layout: Tuple[int, int, int], device: str) -> dict:
    """One step's gradients with today's reducers: micro-batches accumulated into .grad (loss / A),
    the experts by allreduce_expert_grads, the rest by an all-reduce over the data group (then / W)."""
    world, ep, A = layout
    data, ep_group, expert_dp = groups.of(rank, world, ep)
    r = dist.get_rank(data)
    model = Net(config, ep_group, device)
    AuxLossScaler.set_loss_scale(1.0 / A)  # the router losses' gradients scaled like the main loss's
    try:
        for a in range(A):
            x, y = micro_batch(0, a * world + r, config, device)
            (F.cross_entropy(model(x).float(), y) / A).backward()
    finally:
        AuxLossScaler.set_loss_scale(1.0)
    allreduce_expert_grads(model, expert_dp, dp_size=world)
    sharded = {id(p) for m in model.modules() if isinstance(m, LocalExperts) and m.ep_group is not None
               for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in sharded:
            dist.all_reduce(p.grad, group=data)
            p.grad.div_(world)
    return by_global_id(model, grads=True)


def _refusals(rank: int, groups: Groups, device: str) -> Dict[str, Optional[str]]:
    """ValueErrors that every rank of the group raises alike, before any collective."""
    out: Dict[str, Optional[str]] = {}
    out["strided EP groups"] = value_error_of(lambda: GradientTree(Net(CONFIG, groups.strided, device), 1,
                                                                   groups.world))
    out["global_aux_loss"] = value_error_of(lambda: GradientTree(
        Net(CONFIG.replace(load_balancing_type="global_aux_loss"), groups.pair, device), 1, groups.world))
    out["micro_batches"] = value_error_of(lambda: GradientTree(Net(CONFIG, groups.pair, device), 3, groups.world))
    out["micro_batches differ"] = value_error_of(lambda: GradientTree(Net(CONFIG, groups.pair, device),
                                                                      2 if rank == 0 else 1, groups.world))
    three = dist.new_group([0, 1, 2])
    if rank < 3:
        out["group of 3"] = value_error_of(lambda: GradientTree(Net(CONFIG, groups.single, device), 1, three))
    return out


# Runs of the six layouts, by name: the layout_config fields each sets.
VARIANTS = {"tree": {}, "sync-free tree": dict(sync_free=True), "fp8 wgrad tree": dict(fp8_wgrad=True),
            "fp8 wgrad sync-free tree": dict(fp8_wgrad=True, sync_free=True)}


def layouts_worker(rank: int, world_size: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   with_today: bool = True, fp8: bool = False, variants: Tuple[str, ...] = ("tree",)) -> dict:
    """The package's layouts_worker for each of ``variants`` (VARIANTS' names: out[name], in one
    spawn; ``fp8``: the MoE layers in FP8, their expert weight gradients in the tokens' dtype unless
    the variant says fp8 wgrad; "initial" is the first variant's), and with ``with_today`` each
    layout's gradients with today's reducers; on CPU, the refusals."""
    groups = Groups(rank)
    out: dict = {}
    for name in variants:
        run = layouts.layouts_worker(rank, world_size, device, dtype, fp8, groups, **VARIANTS[name])
        out[name] = run["tree"]
        out.setdefault("initial", run["initial"])
    config = layouts.layout_config(dtype, fp8)
    out["today"] = {layout: today(config, groups, rank, layout, device)
                    for layout in rank_layouts(rank)} if with_today else {}
    out["refusals"] = _refusals(rank, groups, device) if device == "cpu" else {}
    return out


def held_bytes_worker(rank: int, world_size: int) -> Dict:
    """The issue's model at (2, 2, 4): the bytes the tree holds after each of the 4 micro-batches,
    in units of this rank's trained parameters in fp32 (its expert shard, the replicated rest), by
    ``overlap``; and whether both trees' gradients are bitwise the same. Beside them, from the
    overlapped tree: held_bytes_by_part() after each backward and each add_micro_batch, the units'
    split, and exchange_totals() after the step."""
    out: Dict = {}
    grads = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = Net(CONFIG, dist.group.WORLD, "cpu")
        tree = GradientTree(model, micro_batches=4, overlap=overlap)
        unit = sum(p.numel() * 4 for p in model.parameters())
        held, parts = [], []
        for a in range(4):
            x, y = micro_batch(0, tree.micro_batch_index(a), CONFIG, "cpu")
            F.cross_entropy(model(x).float(), y).backward()
            parts.append(tree.held_bytes_by_part())
            tree.add_micro_batch()
            held.append(tree.held_bytes() / unit)
            parts.append(tree.held_bytes_by_part())
        tree.reduce()
        out[overlap] = held
        grads[overlap] = [p.grad.clone() for p in model.parameters()]
        if overlap:
            experts = [m for m in model.modules() if isinstance(m, LocalExperts) and m.ep_group is not None]
            out["parts"], out["unit"] = parts, unit
            out["expert bytes"] = sum(w.numel() * 4 for m in experts for w in (m.weight1, m.weight2))
            out["largest expert weight"] = max(w.numel() * 4 for m in experts for w in (m.weight1, m.weight2))
            out["transient"] = tree.source_grads_transient_bytes()
            out["exchange"] = tree.exchange_totals()
    out["same grads"] = all(torch.equal(u, v) for u, v in zip(grads[False], grads[True]))
    return out


def halving_worker(rank: int, world_size: int) -> dict:
    """The six layouts (fp32, CPU) trained twice: with the exchange's default (recursive doubling at
    this model's size) and with its halving form on every vector; and how many exchanges took the
    halving form in each run."""
    from moe_dispatch.parallel import tree_exchange

    groups = Groups(rank)
    exchange = tree_exchange.TreeExchange
    halved = {"calls": 0}
    halving = exchange._halving_then_gather

    def counted(self, flat, prefix):
        halved["calls"] += 1
        return halving(self, flat, prefix)

    exchange._halving_then_gather = counted  # this spawned rank's class only
    out = {"default": layouts.layouts_worker(rank, world_size, "cpu", torch.float32, False, groups)["tree"]}
    out["default calls"] = halved["calls"]
    init = exchange.__init__
    exchange.__init__ = lambda self, *args, **kwargs: init(self, *args, **{**kwargs, "halving_min_bytes": 0})
    out["halving"] = layouts.layouts_worker(rank, world_size, "cpu", torch.float32, False, groups)["tree"]
    out["halving calls"] = halved["calls"] - out["default calls"]
    return out
