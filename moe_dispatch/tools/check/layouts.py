"""The layouts rows: a short training run with GradientTree is bitwise the same across layouts.

A small model (a dense layer, an MoELayer with a shared expert and aux loss, a dense head; fp32
master weights, activations in --dtype) trains for a few steps with AdamW (weight decay) and
clipping at 1.0 on L = N micro-batches per step (N: the check's ranks), on these layouts
(world W, EP size, micro-batches per rank A), W x A = L:

  reference  (N, 1, 1)      every rank holds every expert;
  EP N       (N, N, 1)      the experts sharded over all ranks;
  half       (N/2, N/2, 2)  ranks 0..N/2-1 only, two micro-batches each (N >= 2; the other ranks
                            sit it out, and join the check's collectives around it);

and EP N and half again with the sync-free step at EP > 1 (``ep_capacity_factor`` = N, which caps
no row: the reference's EP 1 step is sync-free already).

Every parameter and each step's clipped gradient (the routed experts by global expert id), each
step's loss (the tree's global mean) and each step's clipped norm must be bitwise those of the
reference on the same rank, and the reference the same on every rank. The limits are
GradientTree's: power-of-two sizes, the dropless dispatch or the sync-free step within its
capacity, micro-batches of equal size (docs/parallel.md). ``--fp8`` runs with FP8 wgrad (its
column scales then per (expert, source) block) and with ``--no-fp8-wgrad``.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .args import DTYPES, base_config
from .contract import Result, bitwise, gather_results, largest_diff, progress

LABEL = "layouts: "
STEPS = 3
CLASSES = 16
Layout = Tuple[int, int, int]  # (world W, EP size, micro-batches per rank A)
SYNC_FREE = " sync-free"  # a row's layout with the sync-free step at EP > 1

# Under the table when the layouts rows ran (report.py).
LEGEND = """\
The layouts rows: a small model (a dense layer, an MoELayer with a shared expert and aux loss, a
dense head; AdamW with weight decay, clipping at 1.0) trains for %d steps with GradientTree on
L = {ranks} micro-batches of {tokens} tokens per step ({dtype} activations, fp32 weights) on each
layout (world, EP size, A micro-batches per rank; "sync-free": the sync-free step at EP > 1,
ep_capacity_factor={ranks}); every parameter and clipped gradient (experts by global id), each step's
loss and clipped norm must be the (world {ranks}, EP 1, A 1) run's, bitwise.""" % STEPS


class _Model(nn.Module):
    """x [T, H] -> logits [T, CLASSES]: dense (tanh), MoELayer with a residual, dense head. The
    dense weights are fp32 masters used in the activations' dtype, as the MoELayer's experts are."""

    def __init__(self, args: argparse.Namespace, ep_group: dist.ProcessGroup, device: torch.device,
                 ep_capacity_factor: Optional[float] = None) -> None:
        from ...layer import MoELayer

        super().__init__()
        config = base_config(args, dispatcher=_dispatcher(args), shared_expert_ffn_hidden_size=args.ffn,
                             aux_loss_coeff=1e-2, ep_capacity_factor=ep_capacity_factor)
        self.embed = nn.Linear(args.hidden, args.hidden)
        self.moe = MoELayer(config, ep_group, layer_index=0)
        self.head = nn.Linear(args.hidden, CLASSES)
        gen = torch.Generator().manual_seed(args.seed + 300)  # the same dense weights on every rank and layout
        with torch.no_grad():
            for p in (*self.embed.parameters(), *self.head.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(x, self.embed.weight.to(x.dtype), self.embed.bias.to(x.dtype)))
        h = h + self.moe(h)
        return F.linear(h, self.head.weight.to(h.dtype), self.head.bias.to(h.dtype))


def _dispatcher(args: argparse.Namespace) -> str:
    """The one dispatcher the rows train with: --dispatcher, alltoall for both."""
    return "alltoall" if args.dispatcher == "both" else args.dispatcher


def _micro_batch(args: argparse.Namespace, step: int, index: int,
                 device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``index`` of ``step`` ([T, H] tokens in --dtype, [T] labels): the same
    whatever rank runs it."""
    gen = torch.Generator().manual_seed(args.seed + 10_000 * (step + 1) + index)
    x = torch.randn((args.tokens, args.hidden), generator=gen).to(DTYPES[args.dtype])
    return x.to(device), torch.randint(0, CLASSES, (args.tokens,), generator=gen).to(device)


def train(args: argparse.Namespace, device: torch.device, layout: Layout, data: dist.ProcessGroup,
          ep_group: dist.ProcessGroup, sync_free: bool = False) -> Dict[str, torch.Tensor]:
    """STEPS optimizer steps of the model on one layout with a GradientTree over ``data``; returns
    its parameters (``by_global_id``) and each step's loss, clipped norm and clipped gradients.
    ``sync_free``: the sync-free step at EP > 1, with ep_capacity_factor = the check's ranks (>= the
    EP size: no row is capped). Collective over ``data``."""
    from ...parallel import GradientTree
    from ..gradient_tree_layouts import by_global_id

    _, _, A = layout
    model = _Model(args, ep_group, device, float(dist.get_world_size()) if sync_free else None)
    tree = GradientTree(model, micro_batches=A, group=data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out: Dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        losses = []
        for a in range(A):  # group rank r runs global micro-batch a*W + r (GradientTree.micro_batch_index)
            x, y = _micro_batch(args, step, tree.micro_batch_index(a), device)
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            tree.add_micro_batch()
            losses.append(loss.detach())
        tree.reduce()
        out[f"step {step} clipped norm"] = tree.clip_grad_norm_(1.0).cpu()
        out[f"step {step} loss"] = tree.global_mean(torch.stack(losses)).cpu()
        # the clipped gradients too: AdamW's first steps move a weight by about lr whatever the
        # last bits of its gradient, so the parameters alone would hide a gradient that differs
        out.update(by_global_id(model, f"step {step} gradient ", grads=True))
        opt.step()
        opt.zero_grad()
    return {**by_global_id(model), **out}


def _compare(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Tuple[float, bool]:
    """Every key of ``got`` (a rank holds its own experts only) against ``ref``'s, bitwise."""
    worst, same = 0.0, True
    for key, value in got.items():
        other = ref[key]
        same &= bitwise(value, other)
        worst = max(worst, largest_diff(value, other) if value.shape == other.shape else float("inf"))
    return worst, same


def _same_everywhere(values: Dict[str, torch.Tensor], device: torch.device) -> Tuple[float, bool]:
    """This rank's ``values`` (keys and shapes alike on every rank) against rank 0's, bitwise."""
    mine = torch.cat([v.double().reshape(-1) for v in values.values()]).to(device)
    first = mine.clone()
    dist.broadcast(first, 0)
    return largest_diff(mine, first), bitwise(mine, first)


def _skip(args: argparse.Namespace, world: int) -> Optional[str]:
    """Why the rows cannot run here (alike on every rank: flags and world size only), or None."""
    if world == 1:
        return "one rank: L = 1 micro-batch has only one layout"
    if world & (world - 1):
        return f"{world} ranks: GradientTree needs a power of two"
    return None


def _name(layout: Layout) -> str:
    return f"(world {layout[0]}, EP {layout[1]}, A {layout[2]})"


def _on_ranks(W: int, world: int) -> str:
    """Where a layout on fewer than all ranks runs (empty when on all)."""
    if W == world:
        return ""
    return " on rank 0" if W == 1 else f" on ranks 0-{W - 1}"


def layout_rows(args: argparse.Namespace, device: torch.device) -> List[Result]:
    """The layouts rows (module docstring): each layout against the reference. Collective: every
    rank calls it, alike."""
    world = dist.get_world_size()
    reference: Layout = (world, 1, 1)
    runs: List[Tuple[Layout, bool]] = [((world, world, 1), False), ((world // 2, world // 2, 2), False),
                                       ((world, world, 1), True), ((world // 2, world // 2, 2), True)]
    checks = [f"{LABEL}{STEPS} training steps, {_name(lay)}{SYNC_FREE if sync_free else ''}{_on_ranks(lay[0], world)} "
              f"vs {_name(reference)}, {_dispatcher(args)}" for lay, sync_free in runs]
    if why := _skip(args, world):  # one row: the layouts' names may mean nothing here (world 1)
        return [Result(f"{LABEL}a GradientTree training run across layouts with L={world}", 0.0, True, skipped=why)]
    rank, half = dist.get_rank(), world // 2
    # every rank creates every group, in one order (new_group is collective over the world)
    single = [dist.new_group([r]) for r in range(world)][rank]
    halves = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, world)))]
    groups = {world: dist.group.WORLD, 1: single, half: halves[rank // half]}

    progress(rank, f"{LABEL}{STEPS} training steps on {_name(reference)}, "
                   + ", ".join(_name(lay) + (SYNC_FREE if sync_free else "") for lay, sync_free in runs))
    ref = train(args, device, reference, groups[world], groups[1])
    worst, same = _same_everywhere(ref, device)
    results = []
    for ((W, ep, A), sync_free), check in zip(runs, checks):
        diff, ok = 0.0, True
        if rank < W:  # the half layout's other ranks sit it out
            diff, ok = _compare(train(args, device, (W, ep, A), groups[W], groups[ep], sync_free), ref)
        results.append(Result(check, max(diff, worst), ok and same))
    return gather_results(results, device)
