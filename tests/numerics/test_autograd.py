"""Double backward (create_graph=True) through any of our backward formulas is one clear error
naming the formula (moe_dispatch/numerics/autograd.py): router, experts, ops and dispatcher paths, and the
whole layer at EP 1 and on 2 gloo ranks (every rank raises it, none waits)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from moe_dispatch import MoEConfig, MoELayer, dispatch, permute, sort_chunks, unpermute
from moe_dispatch.config import DISPATCHER_KINDS
from moe_dispatch.dispatcher.dropless.exchange import ReturnRoute, ToOwners
from moe_dispatch.distributed.agreement import ErrorLatch
from moe_dispatch.distributed.identity import FUNCTIONAL_LAYER, CallId
from moe_dispatch.experts.activations import activate, scale_rows
from moe_dispatch.experts.gemm import expert_gemm
from moe_dispatch.router.gating import gating_linear
from moe_dispatch.router.losses import attach_loss

from ..dispatcher.harness import run_ranks

DISPATCHERS = DISPATCHER_KINDS


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).requires_grad_(True)


def _routing(T: int = 6, E: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    top = torch.rand(T, E, generator=g).topk(2, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    return routing_map, torch.rand(T, E, generator=g).requires_grad_(True)


def _gating():
    x, w = _leaf(6, 8), _leaf(4, 8)
    return gating_linear(x, w, torch.float32), (x, w)


def _aux_loss():
    x, loss = _leaf(6, 8), _leaf(1)
    return attach_loss(x * 1, loss.sum()), (x,)


def _activation():
    h = _leaf(6, 8)
    return activate(h, "gelu"), (h,)


def _scale_rows():
    act, probs = _leaf(6, 8), _leaf(6)
    return scale_rows(act, probs), (act, probs)


def _gemm(strategy: str) -> Callable:
    def make():
        x, w = _leaf(6, 8), _leaf(2, 8, 8)
        return expert_gemm(x, w, torch.tensor([2, 4]), strategy), (x, w)
    return make


def _permute():
    x = _leaf(6, 8)
    routing_map, probs = _routing()
    rows, _, _ = permute(x, routing_map, probs)
    return rows, (x,)


def _unpermute():
    routing_map, probs = _routing()
    _, _, row_id_map = permute(torch.zeros(6, 8), routing_map)
    rows = _leaf(int(routing_map.sum()), 8)
    return unpermute(rows, row_id_map, probs), (rows, probs)


def _gather():
    x = _leaf(6, 8)
    return sort_chunks(x, [2, 4], [1, 0])[0], (x,)


def _expand():
    x = _leaf(6, 8)
    routing_map, probs = _routing()
    rows, _, _ = dispatch(x, routing_map, probs, MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=8))
    return rows, (x,)


def _to_owners():
    # One rank's route (nothing crosses the wire): the function itself, without a process group.
    rows = _leaf(6, 8)
    index, none = torch.tensor([5, 4, 3, 2, 1, 0]), torch.zeros(0, dtype=torch.int64)
    route = ReturnRoute(index=index, gather=index, n_self=6, send_splits=(0,), recv_splits=(0,), num_rows=6,
                        send_status=none, recv_status=none, group=None, latch=ErrorLatch(),
                        call=CallId(FUNCTIONAL_LAYER, 0), strict=False)
    return ToOwners.apply(rows, route, None), (rows,)


PATHS = {
    "_GatingLinear": _gating, "AuxLossScaler": _aux_loss,
    "_ExactActivation": _activation, "_ScaleRows": _scale_rows, "_LoopMM": _gemm("loop"),
    "_GroupedMM": _gemm("grouped"),
    "moe_dispatch::permute_rows": _permute, "moe_dispatch::unpermute_rows": _unpermute,
    "moe_dispatch::gather_rows": _gather,
    "Expand": _expand, "dropless.ToOwners": _to_owners,
}


def _message(name: str) -> str:
    return f"moe_dispatch: double backward \\(create_graph=True\\) through {name} is not supported"


@pytest.mark.parametrize("name", list(PATHS))
def test_double_backward_is_a_clear_error(name):
    out, inputs = PATHS[name]()
    # First order still works (and is unchanged: the check is a no-op without create_graph).
    first = torch.autograd.grad(out.square().sum(), inputs, retain_graph=True)
    assert all(g is not None for g in first)
    with pytest.raises(RuntimeError, match=_message(name)):
        torch.autograd.grad(out.square().sum(), inputs, create_graph=True)


def test_layer_double_backward_is_a_clear_error():
    layer = MoELayer(MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16), layer_index=0)
    x = _leaf(6, 8)
    with pytest.raises(RuntimeError, match=_message(r"\S+")):
        torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)


def _layer_worker(rank: int, world_size: int) -> dict:
    out = {}
    for kind in DISPATCHERS:
        config = MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16, dispatcher=kind)
        layer = MoELayer(config, layer_index=0)
        x = _leaf(5 + rank, 8)
        try:
            torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
            out[kind] = "no error"
        except RuntimeError as exc:
            out[kind] = str(exc)
        # The layer still runs a normal step afterwards on every rank (nothing was left half-done).
        layer(x).sum().backward()
    return out


def test_layer_double_backward_on_two_ranks():
    for rank, res in enumerate(run_ranks(_layer_worker, 2)):
        for kind, msg in res.items():
            assert "double backward (create_graph=True) through" in msg, (rank, kind, msg)
