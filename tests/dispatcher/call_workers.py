"""Code for the 2-rank gloo spawn of test_call_identity.py: calls in another order on one rank
(layers, micro-batches' combines and backwards), autograd needs that differ across ranks, and
EP groups a rank cannot use. Every case records, per rank, its outcome (type, message) or result."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.dispatcher import AllToAllDispatcher, dispatch

from .helpers import batch, config

LH, LE, LK, LT = 16, 4, 2, 10  # the layer cases' shapes


def _outcome(fn) -> tuple:
    try:
        return ("ok", "", fn())
    except Exception as exc:  # the test compares type and message across ranks
        return (type(exc).__name__, str(exc), None)


def _layer_config(**changes) -> MoEConfig:
    fields = dict(hidden_size=LH, num_experts=LE, topk=LK, ffn_hidden_size=16, expert_impl="sequential")
    return MoEConfig(**{**fields, **changes})


def _tokens(rank: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((LT, LH), generator=torch.Generator().manual_seed(100 * seed + rank))


# ---- layers called in another order -------------------------------------------------------------
def layer_order_cases(rank: int) -> dict:
    """Layers A and B of one model (same config but the seed); rank 1 calls them B, A."""
    group = dist.group.WORLD
    a = MoELayer(_layer_config(init_seed=1), group, layer_index=0)
    b = MoELayer(_layer_config(init_seed=2), group, layer_index=1)
    x = _tokens(rank)
    first, second = (a, b) if rank == 0 else (b, a)
    out = {"ids": (a.dispatcher.layer_id, b.dispatcher.layer_id)}
    # the very first forward of both layers (their configuration agreement)
    out["first_1"] = _outcome(lambda: first(x))[:2]
    out["first_2"] = _outcome(lambda: second(x))[:2]
    out["in_order"] = _outcome(lambda: b(a(x)).detach())
    # after the agreement: the step's size exchange
    out["later_1"] = _outcome(lambda: first(x))[:2]
    out["later_2"] = _outcome(lambda: second(x))[:2]
    out["after"] = _outcome(lambda: b(a(x)).detach())
    # one rank's forward count of A is one ahead (as if it had run a forward the other skipped)
    if rank == 1:
        a.dispatcher.steps.advance()
    out["skip"] = _outcome(lambda: a(x))[:2]
    return out


# ---- micro-batches combined or backpropagated in another order ----------------------------------
def _microbatches(cfg, group, rank: int, combine_order, backward_order=None, allowed=None) -> dict:
    """Two micro-batches dispatched in order; combined in ``combine_order`` (and backpropagated in
    ``backward_order``) on this rank. Identity experts times 2. ``allowed``: the experts the tokens
    route to, and then both micro-batches have the same routing (the same split sizes)."""
    d = AllToAllDispatcher(cfg, group)
    steps = []
    for mb in range(2):
        data = batch(torch.float32, seed=10 * (mb if allowed is None else 0) + rank, n=12, allowed=allowed)
        x, probs = data["x"].requires_grad_(), data["probs"].requires_grad_()
        rows, _, handle = d.dispatch(x, data["rmap"], probs)
        steps.append(dict(x=x, probs=probs, rows=rows, handle=handle))
    outs = {}
    for mb in combine_order:
        outs[mb] = _outcome(lambda: d.combine(steps[mb]["rows"] * 2, steps[mb]["handle"]))
    result = {f"combine{mb}": outs[mb][:2] for mb in outs}
    result.update({f"nan{mb}": bool(torch.isnan(outs[mb][2]).all()) for mb in outs if outs[mb][2] is not None})
    for mb in backward_order or ():
        result[f"backward{mb}"] = _outcome(lambda: outs[mb][2].sum().backward())[:2]
        grad = steps[mb]["x"].grad
        result[f"grad_nan{mb}"] = grad is not None and bool(torch.isnan(grad).all())
    # the next dispatch on the group: the latched error, if any, on every rank
    data = batch(torch.float32, seed=rank, n=12)
    result["next"] = _outcome(lambda: d.dispatch(data["x"], data["rmap"], data["probs"]))[:2]
    return result


def _round_trip(cfg, group, rank: int) -> torch.Tensor:
    d = AllToAllDispatcher(cfg, group)
    data = batch(torch.float32, seed=rank, n=12)
    rows, _, handle = d.dispatch(data["x"], data["rmap"], data["probs"])
    return d.combine(rows * 2, handle).detach()


def microbatch_cases(rank: int) -> dict:
    group = dist.group.WORLD
    swapped = (0, 1) if rank == 0 else (1, 0)
    capacity = config(capacity_factor=4.0, pad_to_capacity=True)
    out = {"reference": _round_trip(config(), group, rank), "reference_capacity": _round_trip(capacity, group, rank)}
    out["capacity_combine"] = _microbatches(capacity, group, rank, swapped)
    out["capacity_backward"] = _microbatches(capacity, group, rank, (0, 1), swapped)
    # dropless, only rank 0's experts: rank 1's experts get no rows, its chunks only status rows
    out["empty_combine"] = _microbatches(config(), group, rank, swapped, allowed=range(4))
    strict = config(strict_call_order=True)
    out["strict_combine"] = _microbatches(strict, group, rank, swapped)
    out["strict_backward"] = _microbatches(strict, group, rank, (0, 1), swapped)
    out["strict_capacity_combine"] = _microbatches(config(capacity_factor=4.0, pad_to_capacity=True,
                                                          strict_call_order=True), group, rank, swapped)
    out["in_order"] = _microbatches(strict, group, rank, (0, 1), (0, 1))
    out["after"] = _round_trip(config(), group, rank)
    out["after_capacity"] = _round_trip(capacity, group, rank)
    return out


# ---- autograd needs that differ across ranks ------------------------------------------------------
def _grad_step(rank: int, kind: str, hidden_grad: bool = True, experts_grad: bool = True,
               router_grad: bool = True) -> dict:
    """One layer step; the flags apply to rank 1 (rank 0 needs every gradient)."""
    layer = MoELayer(_layer_config(dispatcher=kind), dist.group.WORLD, layer_index=0)
    mine = rank == 0
    for p in layer.experts.parameters():
        p.requires_grad_(mine or experts_grad)
    layer.router.weight.requires_grad_(mine or router_grad)
    x = _tokens(rank, seed=3).requires_grad_(mine or hidden_grad)
    out = layer(x)
    requires = out.requires_grad
    (out * _tokens(rank, seed=4)).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return dict(out=out.detach(), x_grad=x.grad, grads=grads, out_requires_grad=requires)


def autograd_cases(rank: int) -> dict:
    out = {}
    for kind in ("alltoall", "allgather"):
        out[kind] = dict(reference=_grad_step(rank, kind),
                         hidden=_grad_step(rank, kind, hidden_grad=False),
                         experts=_grad_step(rank, kind, experts_grad=False),
                         nothing=_grad_step(rank, kind, hidden_grad=False, experts_grad=False, router_grad=False))
    layer = MoELayer(_layer_config(), dist.group.WORLD, layer_index=0)
    x = _tokens(rank)

    def no_grad_on_rank1():
        with torch.set_grad_enabled(rank == 0):
            return layer(x)
    out["grad_mode"] = _outcome(no_grad_on_rank1)[:2]
    out["grad_mode_after"] = _outcome(lambda: layer(x).sum().backward())[:2]
    return out


# ---- EP groups a rank cannot use ----------------------------------------------------------------
def group_cases(rank: int) -> dict:
    cfg = _layer_config()
    only_rank0 = dist.new_group([0])  # rank 1 gets a placeholder: not a member
    gone = dist.new_group([0, 1])
    # new_group has no barrier (TORCH_DIST_INIT_BARRIER is off) and destroy shuts the group's gloo
    # connections down at once: without this barrier rank 0 can close them while rank 1 is still
    # connecting ("Gloo connectFullMesh failed ... Connection closed by peer").
    dist.barrier(group=gone)
    dist.destroy_process_group(gone)
    data = batch(torch.float32, seed=rank, n=8)
    return {
        "outside_layer": _outcome(lambda: MoELayer(cfg, only_rank0, layer_index=0) and None)[:2],
        "outside_dispatcher": _outcome(lambda: AllToAllDispatcher(config(), only_rank0) and None)[:2],
        "destroyed_layer": _outcome(lambda: MoELayer(cfg, gone, layer_index=0) and None)[:2],
        "destroyed_functional": _outcome(lambda: dispatch(data["x"], data["rmap"], data["probs"], config(), gone)
                                         and None)[:2],
    }


def host_read_cases(rank: int) -> dict:
    """Host reads of one EP-2 layer step (forward + backward) after the first, default and strict."""
    from tests.cuda_host_waits import count_host_transfers

    out = {}
    for strict in (False, True):
        layer = MoELayer(_layer_config(strict_call_order=strict), dist.group.WORLD, layer_index=0)
        x = _tokens(rank).requires_grad_()
        layer(x).sum().backward()
        with count_host_transfers() as counts:
            layer(x).sum().backward()
        out[strict] = dict(counts)
    return out


def call_identity_worker(rank: int, world_size: int) -> dict:
    assert world_size == 2
    return dict(layers=layer_order_cases(rank), microbatches=microbatch_cases(rank),
                autograd=autograd_cases(rank), host_reads=host_read_cases(rank), groups=group_cases(rank))
