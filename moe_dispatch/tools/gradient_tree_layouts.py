"""The issue's model trained with a GradientTree on six layouts with L = 4 micro-batches per step:
the run that tests/parallel/test_gradient_tree.py checks bitwise and scripts/bench_gradient_tree.py
repeats on CUDA.

One spawn of 4 ranks runs every layout: (4, 4, 1), (4, 2, 1), (4, 1, 1) on all four ranks;
(2, 2, 2) on ranks {0, 1} while (2, 1, 2) runs on {2, 3}; (1, 1, 4) on rank 0. Layout (W, EP, A):
W ranks in the GradientTree's group, EP groups of EP consecutive ranks, A micro-batches per rank.
``by_global_id`` (parameters keyed by global expert id) is also what ``moe-dispatch check``'s
layouts rows compare (tools/check/layouts.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from ..experts import LocalExperts
from ..layer import MoELayer
from ..parallel import GradientTree

Layout = Tuple[int, int, int]  # (world W, EP size, micro-batches per rank A)

L = 4  # global micro-batches per step
T = 8  # tokens per micro-batch
H = 16
CLASSES = 16
STEPS = 3
CONFIG = MoEConfig(hidden_size=H, num_experts=4, topk=2, ffn_hidden_size=16, shared_expert_ffn_hidden_size=16,
                   aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
LAYOUTS = ((4, 4, 1), (4, 2, 1), (4, 1, 1), (2, 2, 2), (2, 1, 2), (1, 1, 4))
# The sync-free step's ep_capacity_factor: f >= P at every EP size P <= 4 caps no row (SyncFreeSizes),
# so every layout's step is the dropless one's, rows and sums, with padding and trailing rows.
SYNC_FREE_FACTOR = 4.0


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


def by_global_id(model: nn.Module, prefix: str = "", grads: bool = False) -> Dict[str, torch.Tensor]:
    """The model's parameters (or their gradients) by name, on the CPU, each key after ``prefix``;
    a routed expert's row under its global expert id (``...weight1[3]``)."""
    out: Dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            key, value = f"{prefix}{module_name}.{name}", (p.grad if grads else p).detach().cpu().clone()
            if isinstance(module, LocalExperts):
                out.update({f"{key}[{i}]": value[j] for j, i in enumerate(module.global_expert_ids)})
            else:
                out[key] = value
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
    model = Net(config, ep_group, device)
    initial = by_global_id(model)
    tree = GradientTree(model, micro_batches=A, group=data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        mine = []
        for a in range(A):
            x, y = micro_batch(step, tree.micro_batch_index(a), config, device)
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


def rank_layouts(rank: int) -> List[Layout]:
    """The layouts ``rank`` (of the 4) runs, in the order every rank runs its own."""
    return [*LAYOUTS[:3], LAYOUTS[3] if rank < 2 else LAYOUTS[4], *([LAYOUTS[5]] if rank == 0 else [])]


def layout_config(dtype: torch.dtype = torch.float32, fp8: bool = False, sync_free: bool = False,
                  fp8_wgrad: bool = False) -> MoEConfig:
    """CONFIG with activations in ``dtype``; ``fp8``: the MoE layers in FP8 (``fp8="e4m3"``), their
    expert weight gradients in FP8 with ``fp8_wgrad``, else in the tokens' dtype (``fp8_wgrad=False``);
    ``sync_free``: the sync-free step at EP > 1 (``ep_capacity_factor=SYNC_FREE_FACTOR``; EP 1 is
    sync-free anyway)."""
    fields: dict = dict(fp8="e4m3", fp8_wgrad=fp8_wgrad) if fp8 else {}
    if sync_free:
        fields["ep_capacity_factor"] = SYNC_FREE_FACTOR
    return CONFIG.replace(params_dtype=dtype, **fields)


def layouts_worker(rank: int, world_size: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   fp8: bool = False, groups: Optional[Groups] = None, sync_free: bool = False,
                   fp8_wgrad: bool = False) -> dict:
    """Rank ``rank`` of 4 trains each of its layouts (``rank_layouts``) with a GradientTree:
    ``{"tree": {layout: train's result}, "initial": {layout: the parameters before training}}``.
    ``groups``: the Groups to use (built here if None; new_group is collective); ``fp8``,
    ``sync_free``, ``fp8_wgrad``: as `layout_config`'s."""
    groups = Groups(rank) if groups is None else groups
    config = layout_config(dtype, fp8, sync_free, fp8_wgrad)
    out: dict = {"tree": {}, "initial": {}}
    for layout in rank_layouts(rank):
        out["tree"][layout] = train(config, groups, rank, layout, device)
        out["initial"][layout] = out["tree"][layout].pop("initial")
    return out


def assemble(results: List[dict], mode: str) -> Dict[tuple, dict]:
    """Per layout: the union over its ranks of what they hold (a key two ranks hold must agree bitwise)."""
    merged: Dict[tuple, dict] = {}
    for rank, out in enumerate(results):
        for layout, got in out[mode].items():
            mine = merged.setdefault(layout, {})
            trained = isinstance(got, dict) and "params" in got  # train's result, else a flat dict
            flat = got if not trained else {**got["params"], **{f"loss {i}": v for i, v in enumerate(got["losses"])},
                                                **{f"norm {i}": v for i, v in enumerate(got["norms"])}}
            for key, value in flat.items():
                if key in mine:
                    assert torch.equal(mine[key], value), (mode, layout, rank, key)
                mine[key] = value
    return merged
