"""Workers of test_gradient_tree.py's refusal tests: misuse on 2 gloo ranks, one spawn.

Each case runs on its own 2-rank group with a short timeout, so a rank left waiting in a
collective fails the case in seconds instead of hanging the spawn; every case records, per rank,
what it raised ("ValueError: ..." or another exception's type and text) or None.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_dispatch.parallel import GradientTree

from .gradient_tree_workers import CONFIG, Net

GROUP_TIMEOUT = timedelta(seconds=10)


class Tiny(nn.Module):
    """Two same-shaped layers (registered in ``order``) and a head; the same weights on every rank."""

    def __init__(self, order: tuple = ("first", "second")) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = {name: nn.Linear(4, 4) for name in ("first", "second")}
        for name in order:
            setattr(self, name, layers[name])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


def step(model: nn.Module, tree: GradientTree, opt: torch.optim.Optimizer, rank: int, micro_batches: int = 1) -> None:
    """One optimizer step; each rank its own micro-batches."""
    for a in range(micro_batches):
        gen = torch.Generator().manual_seed(rank * micro_batches + a)
        x, y = torch.randn(6, 4, generator=gen), torch.randint(0, 2, (6,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        tree.add_micro_batch()
    tree.reduce()
    tree.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def outcome(fn: Callable[[], object]) -> Optional[str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        return f"{type(e).__name__}: {e}"
    return None


def _frozen(rank: int, group: dist.ProcessGroup, everywhere: bool) -> Dict[str, object]:
    """head.bias frozen after the tree was built (on every rank, or on rank 1 only): the step is
    refused; a tree built again leaves it still, with no .grad."""
    model = Tiny()
    tree = GradientTree(model, micro_batches=1, group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if everywhere or rank == 1:
        model.head.bias.requires_grad_(False)
    before = model.head.bias.detach().clone()
    out: Dict[str, object] = {"refused": outcome(lambda: step(model, tree, opt, rank))}
    if not everywhere:
        return out
    tree = GradientTree(model, micro_batches=1, group=group)
    out["rebuilt"] = outcome(lambda: step(model, tree, opt, rank))
    out["still"] = torch.equal(model.head.bias.detach(), before)
    out["grad"] = model.head.bias.grad
    out["moved"] = not torch.equal(model.head.weight.detach(), Tiny().head.weight.detach())
    return out


def _unfrozen(rank: int, group: dist.ProcessGroup) -> Dict[str, object]:
    """head.bias frozen when the tree was built, trained since: the step is refused; a tree built
    again reduces it, and the replicas stay bitwise equal."""
    model = Tiny()
    model.head.bias.requires_grad_(False)
    tree = GradientTree(model, micro_batches=1, group=group)
    model.head.bias.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: Dict[str, object] = {"refused": outcome(lambda: step(model, tree, opt, rank))}
    tree = GradientTree(model, micro_batches=1, group=group)
    out["rebuilt"] = outcome(lambda: step(model, tree, opt, rank))
    out["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return out


def refusal_worker(rank: int, world_size: int) -> Dict[str, object]:
    out: Dict[str, object] = {}

    def case(name: str, fn: Callable[[dist.ProcessGroup], object]) -> None:
        group = dist.new_group([0, 1], timeout=GROUP_TIMEOUT)
        out[name] = fn(group)

    one = 1  # the rank that differs
    case("frozen", lambda g: _frozen(rank, g, everywhere=True))
    case("frozen on one rank", lambda g: _frozen(rank, g, everywhere=False))
    case("unfrozen", lambda g: _unfrozen(rank, g))
    case("order", lambda g: outcome(lambda: GradientTree(Tiny(("second", "first") if rank == one else
                                                              ("first", "second")), 1, g)))
    case("micro_batches", lambda g: outcome(lambda: GradientTree(Tiny(), 3 if rank == one else 1, g)))
    for name, setting in (("global_aux_loss", dict(load_balancing_type="global_aux_loss")),):
        case(name, lambda g, setting=setting: outcome(lambda: GradientTree(
            Net(CONFIG.replace(**(setting if rank == one else {})), g, "cpu"), 1, g)))

    def added_once(g: dist.ProcessGroup) -> Optional[str]:  # rank 1 adds 1 micro-batch of 2
        model = Tiny()
        tree = GradientTree(model, micro_batches=2, group=g)
        model(torch.randn(3, 4)).sum().backward()
        tree.add_micro_batch()

        def rest() -> None:  # rank 0's second add_micro_batch meets rank 1's reduce: both raise
            if rank != one:
                model(torch.randn(3, 4)).sum().backward()
                tree.add_micro_batch()
            tree.reduce()

        return outcome(rest)

    case("micro-batch count", added_once)
    # last: the old code's reduction of mismatched sizes aborts the process in gloo
    def head_in_float64() -> Tiny:
        model = Tiny()
        if rank == one:
            model.head.double()
        return model

    case("float64", lambda g: outcome(lambda: GradientTree(head_in_float64(), 1, g)))
    return out
