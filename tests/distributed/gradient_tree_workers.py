"""Workers of test_gradient_tree.py: the issue's model trained on six layouts with L = 4 micro-batches.

One spawn of 4 gloo ranks runs every layout: (4, 4, 1), (4, 2, 1), (4, 1, 1) on all four ranks;
(2, 2, 2) on ranks {0, 1} while (2, 1, 2) runs on {2, 3}; (1, 1, 4) on rank 0. Layout (W, EP, A):
W ranks in the GradientTree's group, EP groups of EP consecutive ranks, A micro-batches per rank.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.experts import LocalExperts
from moe_dispatch.parallel import GradientTree, allreduce_expert_grads
from moe_dispatch.router import AuxLossScaler
from tests.dispatcher.harness import value_error_of

L = 4  # global micro-batches per step
T = 8  # tokens per micro-batch
H = 16
CLASSES = 16
STEPS = 3
CONFIG = MoEConfig(hidden_size=H, num_experts=4, topk=2, ffn_hidden_size=16, shared_expert_ffn_hidden_size=16,
                   aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
LAYOUTS = ((4, 4, 1), (4, 2, 1), (4, 1, 1), (2, 2, 2), (2, 1, 2), (1, 1, 4))


class Net(nn.Module):
    """A dense layer, two MoE layers (shared expert, aux loss, z-loss) with residuals, a dense head."""

    def __init__(self, config: MoEConfig, ep_group: dist.ProcessGroup, device: str) -> None:
        super().__init__()
        self.embed = nn.Linear(H, H, dtype=config.params_dtype)
        self.moe = nn.ModuleList([MoELayer(config, ep_group, layer_index=i) for i in (0, 1)])
        self.head = nn.Linear(H, CLASSES, dtype=config.params_dtype)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in (*self.embed.parameters(), *self.head.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.moe:
            h = h + layer(h)
        return self.head(h)


def micro_batch(step: int, index: int, config: MoEConfig, device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``index`` of ``step``: the same tokens whatever rank runs it."""
    gen = torch.Generator().manual_seed(1000 * step + index)
    x = torch.randn(T, H, generator=gen).to(config.params_dtype)
    return x.to(device), torch.randint(0, CLASSES, (T,), generator=gen).to(device)


def by_global_id(model: nn.Module, grads: bool = False) -> Dict[str, torch.Tensor]:
    """Parameters (or their gradients) keyed by name; the routed experts' rows by global expert id."""
    out = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            t = p.grad if grads else p
            t = t.detach().cpu().clone()
            key = f"{module_name}.{name}"
            if isinstance(module, LocalExperts):
                out.update({f"{key}[{i}]": t[j] for j, i in enumerate(module.global_expert_ids)})
            else:
                out[key] = t
    return out


class Groups:
    """Every process group the layouts need, built in one order on every rank (new_group is collective)."""

    def __init__(self, rank: int) -> None:
        self.single = [dist.new_group([r]) for r in range(4)][rank]
        self.pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        self.strided = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        self.world = dist.new_group([0, 1, 2, 3])

    def of(self, rank: int, world: int, ep: int) -> Tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
        """(data group, EP group, expert-data-parallel group) of ``rank`` in layout (world, ep, .)."""
        data = {1: self.single, 2: self.pair, 4: self.world}[world]
        ep_group = {1: self.single, 2: self.pair, 4: self.world}[ep]
        expert_dp = {1: self.single, 2: self.pair if world == 2 else self.strided, 4: self.world}[world // ep]
        return data, ep_group, expert_dp


def train(config: MoEConfig, groups: Groups, rank: int, layout: Tuple[int, int, int], device: str,
          steps: int = STEPS) -> dict:
    """The layout's run with a GradientTree: AdamW with weight decay, clipping at 1.0."""
    world, ep, A = layout
    data, ep_group, _ = groups.of(rank, world, ep)
    r = dist.get_rank(data)
    model = Net(config, ep_group, device)
    initial = by_global_id(model)
    tree = GradientTree(model, micro_batches=A, group=data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        mine = []
        for a in range(A):
            x, y = micro_batch(step, a * world + r, config, device)
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            tree.add_micro_batch()
            mine.append(loss.detach())
        tree.reduce()
        norms.append(tree.clip_grad_norm_(1.0).cpu())
        losses.append(tree.global_mean(torch.stack(mine)).cpu())
        opt.step()
        opt.zero_grad()
    return {"params": by_global_id(model), "losses": losses, "norms": norms, "initial": initial}


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
    out["sync_free"] = value_error_of(lambda: GradientTree(
        Net(CONFIG.replace(ep_capacity_factor=2.0), groups.pair, device), 1, groups.world))
    out["micro_batches"] = value_error_of(lambda: GradientTree(Net(CONFIG, groups.pair, device), 3, groups.world))
    out["micro_batches differ"] = value_error_of(lambda: GradientTree(Net(CONFIG, groups.pair, device),
                                                                      2 if rank == 0 else 1, groups.world))
    out["fp8_wgrad"] = value_error_of(lambda: GradientTree(Net(CONFIG.replace(fp8="e4m3"), groups.pair, device), 1,
                                                           groups.world))
    three = dist.new_group([0, 1, 2])
    if rank < 3:
        out["group of 3"] = value_error_of(lambda: GradientTree(Net(CONFIG, groups.single, device), 1, three))
    return out


def layouts_worker(rank: int, world_size: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   with_today: bool = True, fp8: bool = False) -> dict:
    """``fp8``: the MoE layers in FP8 with their expert weight gradients in the tokens' dtype
    (``fp8="e4m3", fp8_wgrad=False``), the tree only."""
    groups = Groups(rank)
    config = CONFIG.replace(params_dtype=dtype, **(dict(fp8="e4m3", fp8_wgrad=False) if fp8 else {}))
    out: dict = {"tree": {}, "today": {}, "initial": {}}

    def run(layout: Tuple[int, int, int]) -> None:
        out["tree"][layout] = train(config, groups, rank, layout, device)
        out["initial"][layout] = out["tree"][layout].pop("initial")
        if with_today:
            out["today"][layout] = today(config, groups, rank, layout, device)

    for layout in LAYOUTS[:3]:
        run(layout)
    run(LAYOUTS[3] if rank < 2 else LAYOUTS[4])
    if rank == 0:
        run(LAYOUTS[5])
    out["refusals"] = _refusals(rank, groups, device) if device == "cpu" else {}
    return out


def assemble(results: List[dict], mode: str) -> Dict[tuple, dict]:
    """Per layout: the union over its ranks of what they hold (a key two ranks hold must agree bitwise)."""
    merged: Dict[tuple, dict] = {}
    for rank, out in enumerate(results):
        for layout, got in out[mode].items():
            mine = merged.setdefault(layout, {})
            flat = got if mode != "tree" else {**got["params"], **{f"loss {i}": v for i, v in enumerate(got["losses"])},
                                                **{f"norm {i}": v for i, v in enumerate(got["norms"])}}
            for key, value in flat.items():
                if key in mine:
                    assert torch.equal(mine[key], value), (mode, layout, rank, key)
                mine[key] = value
    return merged


def held_bytes_worker(rank: int, world_size: int) -> List[int]:
    """The issue's model at (2, 2, 4): the bytes the tree holds after each of the 4 micro-batches,
    in units of this rank's trained parameters in fp32 (its expert shard, the replicated rest)."""
    model = Net(CONFIG, dist.group.WORLD, "cpu")
    tree = GradientTree(model, micro_batches=4)
    unit = sum(p.numel() * 4 for p in model.parameters())
    held = []
    for a in range(4):
        x, y = micro_batch(0, tree.micro_batch_index(a), CONFIG, "cpu")
        F.cross_entropy(model(x).float(), y).backward()
        tree.add_micro_batch()
        held.append(tree.held_bytes() / unit)
    tree.reduce()
    return held
