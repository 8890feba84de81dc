"""Workers of test_dispatch.py (importable by spawned ranks): the sync-free layer against the
dropless one on the same weights and tokens, and a static-capacity overflow."""
from __future__ import annotations

import torch

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.config import DISPATCHER_KINDS
from moe_dispatch.ops import guard
from tests.cuda_host_waits import count_scalar_copies
from tests.dispatcher.harness import value_error_of


def _config(kind: str, **changes) -> MoEConfig:
    base = dict(hidden_size=16, num_experts=8, topk=2, ffn_hidden_size=8, dispatcher=kind)
    return MoEConfig(**{**base, **changes})


def _step(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    layer.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    out = layer(xx)
    out.backward(upstream)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return {"out": out.detach(), "x_grad": xx.grad, **grads}


def fit_worker(rank: int, world_size: int, dtype: torch.dtype, probs_in_experts: bool, device: str = "cpu") -> dict:
    """Per kind: (sync_free - dropless) bitwise equal for outputs and every gradient, two steps."""
    if device == "cuda":
        torch.cuda.set_device(0)  # the ranks share the one GPU over gloo
    results = {}
    for kind in DISPATCHER_KINDS:
        dropless = MoELayer(_config(kind, probs_in_experts=probs_in_experts), layer_index=0).to(device, dtype)
        # A factor of P makes every capacity the most a rank can need: it always fits.
        sync_free = MoELayer(_config(kind, probs_in_experts=probs_in_experts,
                                  ep_capacity_factor=float(world_size)), layer_index=0).to(device, dtype)
        assert sync_free.dispatcher.sync_free and not dropless.dispatcher.sync_free
        same = []
        for step in range(2):
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(6, 16, generator=gen).to(device, dtype)
            upstream = torch.randn(6, 16, generator=gen).to(device, dtype)
            a = _step(dropless, x, upstream)
            with count_scalar_copies() as scalar_copies:
                b = _step(sync_free, x, upstream)
            same.append({k: torch.equal(a[k], b[k]) for k in a})
            same[-1]["no scalar copies"] = not scalar_copies  # on CUDA each a host sync
            same[-1]["finite"] = bool(torch.isfinite(b["out"]).all())
        results[kind] = same
    return results


def overflow_worker(rank: int, world_size: int) -> dict:
    """A factor far too small: NaN outputs on every rank, then the same ValueError at the next
    dispatch (CPU) and after it nothing latched; then check_device_errors() raising it instead."""
    results = {}
    for kind in DISPATCHER_KINDS:
        layer = MoELayer(_config(kind, ep_capacity_factor=0.25), layer_index=0)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(6, 16, generator=gen)
        first = _step(layer, x, torch.ones(6, 16))
        try:
            layer(x)
            error = None
        except ValueError as exc:
            error = str(exc)
        after = _step(layer, x, torch.ones(6, 16))  # raised once: the next step runs (and overflows again)
        try:
            guard.check_device_errors()
            polled = None
        except ValueError as exc:
            polled = str(exc)
        results[kind] = dict(first_nan=bool(torch.isnan(first["out"]).all()),
                             grad_nan=bool(torch.isnan(first["x_grad"]).all()), error=error,
                             after_nan=bool(torch.isnan(after["out"]).all()), polled=polled)
    return results


def overflow_cuda_worker(rank: int, world_size: int) -> dict:
    """On the GPU (ranks sharing it over gloo): NaN outputs, and check_device_errors() raises
    (the next dispatch does not read the words on CUDA)."""
    torch.cuda.set_device(0)
    layer = MoELayer(_config("alltoall", ep_capacity_factor=0.25), layer_index=0).cuda()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank)).cuda()
    out = _step(layer, x, torch.ones(6, 16, device="cuda"))["out"]
    try:
        guard.check_device_errors()
        error = None
    except ValueError as exc:
        error = str(exc)
    return dict(nan=bool(torch.isnan(out).all()), error=error)


def bad_input_worker(rank: int, world_size: int) -> dict:
    """After the first step, rank 1 passes a wrong hidden size: no hang; NaN everywhere; the next
    dispatch raises the same ValueError on every rank naming rank 1. (Another T is no bad input:
    test_steps.py.)"""
    layer = MoELayer(_config("alltoall", ep_capacity_factor=2.0), layer_index=0)
    x = torch.randn(6, 16)
    _step(layer, x, torch.ones(6, 16))
    bad = torch.randn(6, 12) if rank == 1 else x
    out = layer(bad)
    out.sum().backward()
    try:
        layer(x)
        error = None
    except ValueError as exc:
        error = str(exc)
    return dict(nan=bool(torch.isnan(out).all()), error=error)


def call_order_worker(rank: int, world_size: int, case: str) -> dict:
    """Two sync-free layers of one config. 'swapped': after a first step in order, rank 1 calls
    them in the other order. 'combine': rank 1 combines its two micro-batches in the other order.
    'strict': the same with strict_call_order (raises before the rows move). Returns whether the
    outputs were NaN and the error of the next dispatch (CPU: it reads the latched words)."""
    config = _config("alltoall", ep_capacity_factor=float(world_size), strict_call_order=case == "strict")
    layers = [MoELayer(config, layer_index=i) for i in range(2)]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 16, generator=gen)
    for layer in layers:  # in order: the first step agrees every rank's inputs
        layer(x)
    if case == "swapped":
        order = layers if rank == 0 else layers[::-1]
        nan = bool(torch.isnan(order[0](x)).all())
        return {"nan": nan, "error": value_error_of(lambda: order[1](x))}  # CPU: the next dispatch raises
    d = layers[0].dispatcher
    handles = []
    for mb in range(2):
        probs, routing_map = layers[0].router(x + mb)
        rows, handle = d.dispatch_rows(x + mb, routing_map, probs)
        handles.append((rows, handle))
    if rank == 1:
        handles = handles[::-1]
    strict_error = None
    outs = []
    try:
        outs = [d.combine(rows, handle) for rows, handle in handles]
    except ValueError as e:
        strict_error = str(e)
    nan = bool(outs) and all(bool(torch.isnan(o).all()) for o in outs)
    error = strict_error or value_error_of(lambda: layers[0](x))
    return {"nan": nan, "error": error, "strict": strict_error is not None}


def exchange_worker(rank: int, world_size: int, cases: dict) -> dict:
    """Every case of one world size in one spawn (spawning the ranks costs more than the cases):
    {name: fit_worker(...), overflow_worker(...), bad_input_worker(...) or call_order_worker(...)};
    the fit cases run first, so they never start with a latched error (each other case reads its own
    error back at its last dispatch)."""
    results = {}
    workers = {"fit": fit_worker, "overflow": overflow_worker, "bad_input": bad_input_worker,
               "call_order": call_order_worker}
    for name, args in sorted(cases.items(), key=lambda item: item[1][0] != "fit"):
        results[name] = workers[args[0]](rank, world_size, *args[1:])
    return results
