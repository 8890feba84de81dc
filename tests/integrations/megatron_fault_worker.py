"""Code that runs on the spawned gloo ranks for the Megatron fault tests (test_megatron_faults.py).

An install()'d megatron-core MoELayer (DeterministicMoELayer from our spec, row-stable GEMMs, fp32
params) at EP 2, in a layout where the router's collectives cross the EP ranks: the EP group is
also the context-parallel group (EP folded over CP, as Megatron lays EP over TP x CP x DP), so the
aux-loss token counts of aux_loss and seq_aux_loss (all-reduced over tp_cp) and of global_aux_loss
(over tp_dp_cp) are all-reduced between the two EP ranks, before the dispatcher's size exchange.
All three losses are on, with sigmoid scores and the expert bias (its token counts accumulate in
the forward), and a shared expert. Every group has a 60 s timeout; a case must end within 30 s.

For each dispatcher: one reference step (forward + backward), then each fault case (one rank's
bad input, a forward), each followed by the reference step again on the same layer and group;
then each setting case (one rank's fresh layer built with another MoE setting, a forward),
each followed by the reference step on the first layer.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_dispatch.config import DISPATCHER_KINDS

from .megatron_worker import _setup

H, FFN, E, K, S, B = 64, 32, 8, 2, 16, 2
GROUP_TIMEOUT = timedelta(seconds=60)
# name -> (bad rank, bad input for that rank given the good x [S, B, H])
CASES = {
    "hidden_size": (1, lambda x: x[..., : H // 2].contiguous()),
    "int64_hidden": (1, lambda x: x.to(torch.int64)),
    "nan_hidden": (1, lambda x: x.index_fill(0, torch.tensor([3]), float("nan"))),
    "not_tensor": (1, lambda x: x.tolist()),
    "two_dims_wrong_size": (0, lambda x: x.reshape(S * B, H)[:, : H - 8].contiguous()),
}
ROUTER_BUFFERS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps")


# one rank's router setting differs from its peer's (a layer built fresh, so that its first
# forward agrees on the settings): the aux-loss coefficients, and the loss types' order, which
# would pair Megatron's seq_aux_loss counts with the peer's aux_loss counts in the all-reduce
SETTING_CASES = {
    "moe_aux_loss_coeff": dict(moe_aux_loss_coeff=[1e-2, 1e-2, 3e-2]),
    "moe_router_load_balancing_type": dict(moe_router_load_balancing_type=["seq_aux_loss", "aux_loss",
                                                                           "global_aux_loss"]),
}
SETTING_BAD_RANK = 1


def _layer(kind: str, pg, **overrides):
    from moe_dispatch.integrations.megatron.build import build_moe_layer, load_seeded_weights, moe_transformer_config

    settings = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                    moe_aux_loss_coeff=[1e-2, 1e-2, 1e-2], moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=FFN)
    cfg = moe_transformer_config(H, FFN, E, K, kind, torch.float32, 2, context_parallel_size=2,
                                 **{**settings, **overrides})
    layer = build_moe_layer(cfg, pg, ours=True, row_stable_gemms=True)
    return load_seeded_weights(layer, init_seed=5)


def _step(layer, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    out, _ = layer(xi)
    out.backward(dy)
    return out.detach().clone(), xi.grad.clone()


def _forward_outcome(layer, given) -> tuple[str, str, float]:
    """(exception type or 'ok', its message, seconds) of one forward."""
    start = time.monotonic()
    try:
        layer(given)
        kind, message = "ok", ""
    except Exception as exc:  # noqa: BLE001  (the test asserts the kind)
        kind, message = type(exc).__name__, str(exc)
    return kind, message, time.monotonic() - start


def _buffers(layer) -> dict:
    return {name: getattr(layer.router, name).clone() for name in ROUTER_BUFFERS}


def fault_worker(rank: int, world_size: int) -> dict:
    assert world_size == 2
    _setup()
    from megatron.core.process_groups_config import ProcessGroupCollection

    from moe_dispatch.integrations.megatron import is_installed

    ep = dist.new_group([0, 1], timeout=GROUP_TIMEOUT)
    single = [dist.new_group([r], timeout=GROUP_TIMEOUT) for r in range(world_size)][rank]
    pg = ProcessGroupCollection(tp=single, cp=ep, tp_cp=ep, tp_dp_cp=ep, dp=single, dp_cp=ep, pp=single, ep=ep,
                                expt_tp=single, tp_ep=ep, expt_dp=single)
    gen = torch.Generator().manual_seed(40 + rank)
    x, dy = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    records = {}
    for kind in DISPATCHER_KINDS:
        layer = _layer(kind, pg)
        assert is_installed(layer) and layer._moe_dispatch_row_stable
        ref_out, ref_gx = _step(layer, x, dy)
        rec = {"nonzero_bias_counts": bool(layer.router.local_tokens_per_expert.sum() > 0)}
        for name, (bad_rank, make_bad) in CASES.items():
            before = _buffers(layer)
            given = make_bad(x) if rank == bad_rank else x.clone().requires_grad_()
            outcome, message, seconds = _forward_outcome(layer, given)
            after = _buffers(layer)
            out, gx = _step(layer, x, dy)
            rec[name] = dict(kind=outcome, message=message, seconds=seconds,
                             buffers_kept=all(torch.equal(before[k], after[k]) for k in ROUTER_BUFFERS),
                             works_after=torch.equal(out, ref_out) and torch.equal(gx, ref_gx))
        for name, change in SETTING_CASES.items():
            fresh = _layer(kind, pg, **(change if rank == SETTING_BAD_RANK else {}))
            outcome, message, seconds = _forward_outcome(fresh, x.clone().requires_grad_())
            out, gx = _step(layer, x, dy)
            rec[name] = dict(kind=outcome, message=message, seconds=seconds,
                             works_after=torch.equal(out, ref_out) and torch.equal(gx, ref_gx))
        records[kind] = rec
    return records
