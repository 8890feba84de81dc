"""Data parallelism around the layer, EP 2 x DP 2 on 4 gloo ranks (one spawn).

EP groups {0, 1}, {2, 3}; expert-data-parallel groups {0, 2}, {1, 3}; DDP over all 4 ranks.
Each rank's loss is sum(y * u) over its own 6 tokens; the reference is one process at EP 1 on
the same 24 tokens. What is bitwise and what is within rounding:

- outputs and input gradients: bitwise (the per-token contract);
- routed expert gradients: a rank's local expert gradient sums its EP group's rows in one GEMM,
  bitwise a single process's gradient on those 12 tokens (pA, pB); allreduce_expert_grads adds
  the two partials (a + b = b + a in floating point, so bitwise) and divides by 4 (exact):
  bitwise (pA + pB) / 4. Against one GEMM over all 24 tokens it is a different summation order:
  within rounding;
- router gradients: DDP all-reduces 4 partials (rank r's partial is bitwise a single process's on
  rank r's tokens) in the backend's order: within 3 fp32 roundings of their exact sum / 4.

The same holds with FSDP2 (``fully_shard`` over the 4 ranks, the routed experts passed as
``ignored_params``): its reduce-scatter of the router gradient replaces DDP's all-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.parallel import allreduce_expert_grads, expert_parameters, ignore_experts_in_ddp
from tests.dispatcher.harness import run_ranks, value_error_of

CONFIG = MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16)
T = 6


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + rank)
    return torch.randn(T, CONFIG.hidden_size, generator=gen), torch.randn(T, CONFIG.hidden_size, generator=gen)


def _grads(layer: MoELayer, ranks: list[int]) -> dict:
    """One process (EP 1) on the tokens of ``ranks``: output, input grad, parameter grads."""
    x, u = (torch.cat(t) for t in zip(*(_batch(r) for r in ranks)))
    x.requires_grad_(True)
    layer.zero_grad()
    y = layer(x)
    (y * u).sum().backward()
    return {"y": y.detach(), "dx": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def _expert_bias_checks(rank: int, ep: dist.ProcessGroup, expert_dp: dist.ProcessGroup, out: dict) -> None:
    """update_expert_bias at EP 2: the EP ranks count different tokens, so a group spanning the EP
    group is required; with one, the bias is the same on every rank."""
    layer = MoELayer(CONFIG.replace(score_function="sigmoid", enable_expert_bias=True), ep, layer_index=1)
    layer(_batch(rank)[0])  # training forward: each rank counts its own tokens
    router = layer.router
    out["bias no group"] = value_error_of(router.update_expert_bias)
    out["bias counts no group"] = value_error_of(lambda: router.update_expert_bias(torch.ones(CONFIG.num_experts)))
    out["bias expert-dp group"] = value_error_of(lambda: router.update_expert_bias(group=expert_dp))
    out["bias world"] = value_error_of(lambda: router.update_expert_bias(group=dist.group.WORLD))
    out["bias"] = router.expert_bias.clone()


def ddp_worker(rank: int, world_size: int) -> dict:
    single = [dist.new_group([r]) for r in range(4)][rank]
    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    expert_dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    out: dict = {}

    # DDP owning the experts: a ValueError at the first forward, on every rank
    ddp = DistributedDataParallel(MoELayer(CONFIG, ep, layer_index=0))
    try:
        ddp(_batch(rank)[0])
        out["unguarded"] = "ran"
    except ValueError as exc:
        out["unguarded"] = str(exc)

    layer = MoELayer(CONFIG, ep, layer_index=0)
    out["ignored"] = ignore_experts_in_ddp(layer)
    ddp = DistributedDataParallel(layer)
    x, u = _batch(rank)
    x.requires_grad_(True)
    y = ddp(x)
    (y * u).sum().backward()
    allreduce_expert_grads(layer, expert_dp, dp_size=4)
    out["ours"] = {"y": y.detach(), "dx": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    out["experts"] = list(layer.experts.global_expert_ids)
    out["twice"] = value_error_of(lambda: allreduce_expert_grads(layer, expert_dp, dp_size=4))  # no backward since
    out["after twice"] = {n: p.grad.clone() for n, p in layer.named_parameters()}
    y = ddp(_batch(rank)[0])
    (y * u).sum().backward()  # a new backward accumulates into the reduced grads: reducing is right again
    out["next step"] = value_error_of(lambda: allreduce_expert_grads(layer, expert_dp, dp_size=4))
    _expert_bias_checks(rank, ep, expert_dp, out)
    try:  # the EP group is not an expert-data-parallel group: its ranks hold different experts
        allreduce_expert_grads(layer, ep, dp_size=4)
        out["wrong group"] = "ran"
    except ValueError as exc:
        out["wrong group"] = str(exc)

    layer = MoELayer(CONFIG, ep, layer_index=0)
    fully_shard(layer, mesh=init_device_mesh("cpu", (4,)), ignored_params={p for _, p in expert_parameters(layer)})
    x, u = _batch(rank)
    x.requires_grad_(True)
    y = layer(x)
    (y * u).sum().backward()
    allreduce_expert_grads(layer, expert_dp, dp_size=4)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in layer.named_parameters()}
    out["fsdp"] = {"y": y.detach(), "dx": x.grad, **grads}

    if rank == 0:  # single-process references (EP 1, the same seed)
        ref = MoELayer(CONFIG, single, layer_index=0)
        out["all"] = _grads(ref, [0, 1, 2, 3])
        out["groups"] = [_grads(ref, [0, 1]), _grads(ref, [2, 3])]
        out["per_rank"] = [_grads(ref, [r]) for r in range(4)]
    return out


def test_ddp_and_fsdp2_with_expert_data_parallel_grads():
    results = run_ranks(ddp_worker, 4, timeout=240)
    ref = results[0]
    eps = torch.finfo(torch.float32).eps
    for rank, out in enumerate(results):
        assert "DistributedDataParallel" in out["unguarded"] and "ignore_experts_in_ddp" in out["unguarded"], \
            (rank, out["unguarded"])
        assert out["ignored"] == ["experts.weight1", "experts.weight2"]
        assert "expert_dp_group" in out["wrong group"], (rank, out["wrong group"])
        # a second call with no backward between: refused on every rank, the gradients left as they were
        assert out["twice"] == results[0]["twice"] and "twice" in out["twice"], (rank, out["twice"])
        assert "backward" in out["twice"], out["twice"]
        for name, grad in out["ours"].items():
            if name not in ("y", "dx"):
                assert torch.equal(out["after twice"][name], grad), (rank, name)
        assert out["next step"] is None, (rank, out["next step"])
        for key in ("bias no group", "bias counts no group", "bias expert-dp group"):
            assert out[key] == results[0][key] and "group" in out[key] and "EP" in out[key], (rank, key, out[key])
        assert out["bias world"] is None, (rank, out["bias world"])
        assert torch.equal(out["bias"], ref["bias"]) and out["bias"].abs().sum() > 0, rank
        rows, held = slice(T * rank, T * (rank + 1)), out["experts"]
        for wrapper in ("ours", "fsdp"):
            ours = out[wrapper]
            assert torch.equal(ours["y"], ref["all"]["y"][rows]), (rank, wrapper)
            assert torch.equal(ours["dx"], ref["all"]["dx"][rows]), (rank, wrapper)
            for name in ("experts.weight1", "experts.weight2"):
                pa, pb = (g[name][held] for g in ref["groups"])
                assert torch.equal(ours[name], (pa + pb) / 4), (rank, wrapper, name)
                one_gemm = ref["all"][name][held] / 4
                assert torch.allclose(ours[name], one_gemm, rtol=1e-5, atol=1e-6), (rank, wrapper, name)
            partials = torch.stack([g["router.weight"] for g in ref["per_rank"]]).double()
            exact, bound = partials.sum(0) / 4, 3 * eps * partials.abs().sum(0) / 4
            assert ((ours["router.weight"].double() - exact).abs() <= bound).all(), (rank, wrapper)


def test_expert_parameters_single_process():
    # EP 1: every rank would hold every expert; nothing is sharded, DDP averages all as usual
    assert expert_parameters(MoELayer(CONFIG, layer_index=0)) == []
