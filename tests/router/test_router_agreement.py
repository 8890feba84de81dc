"""A router with loss groups agrees on its configuration before its first loss collective (2
gloo ranks): a setting that differs on one rank, including one that decides whether the aux-loss
all-reduce runs at all, is the same ValueError on every rank, naming the setting and the rank,
instead of a rank left waiting in the all-reduce; the group then still works."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_dispatch.config import MoEConfig
from moe_dispatch.router import TopKRouter
from tests.dispatcher.harness import run_ranks

H, E, K, T = 32, 8, 2, 10
# setting -> rank 1's value (rank 0 keeps the base config's)
CHANGES = {"aux_loss_coeff": 0.0, "load_balancing_type": "seq_aux_loss", "topk_scaling_factor": 2.0}


def _config(**changes) -> MoEConfig:
    fields = dict(hidden_size=H, num_experts=E, topk=K, ffn_hidden_size=8, aux_loss_coeff=1e-2,
                  load_balancing_type="aux_loss")
    return MoEConfig(**{**fields, **changes})


def _route(config: MoEConfig, rank: int) -> tuple:
    router = TopKRouter(config, loss_group=dist.group.WORLD, global_loss_group=dist.group.WORLD)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    try:
        router(x)
        return "ok", "", router.last_losses["load_balancing_loss"]
    except ValueError as exc:
        return "ValueError", str(exc), None


def agreement_worker(rank: int, world_size: int) -> dict:
    out = {"reference": _route(_config(), rank)}
    for name, value in CHANGES.items():
        out[name] = _route(_config(**{name: value}) if rank == 1 else _config(), rank)
        out[name + "/after"] = _route(_config(), rank)
    return out


def test_a_router_setting_that_differs_raises_on_every_rank():
    ranks = run_ranks(agreement_worker, 2, timeout=120)
    for rank in ranks:
        assert rank["reference"][0] == "ok", rank["reference"]
    for name in CHANGES:
        outcomes = [rank[name] for rank in ranks]
        for r, (kind, message, _) in enumerate(outcomes):
            assert kind == "ValueError", (name, r, kind)
            for word in ("router configuration mismatch", f"{name} differs across the router's loss_group",
                         "ranks [1] differ"):
                assert word in message, (name, r, word, message)
        assert outcomes[0][1] == outcomes[1][1], (name, [o[1] for o in outcomes])
        for r, rank in enumerate(ranks):  # the group still works, with the same result as before
            kind, _, loss = rank[name + "/after"]
            assert kind == "ok" and torch.equal(loss, rank["reference"][2]), (name, r, kind)
