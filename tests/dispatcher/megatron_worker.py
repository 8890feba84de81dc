"""Megatron-core's dispatchers next to ours on the spawned gloo ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_dispatch.integrations.megatron import MegatronTokenDispatcher

from . import helpers
from .helpers import E, G, H, batch, config, expert_weights, run_experts
from .workers import DISPATCHERS, _split, make_groups


def _six_steps(d, x, rmap, probs, w, b, apply_probs: bool):
    h, hp = d.dispatch_preprocess(x, rmap, probs)
    h, hp = d.token_dispatch(h, hp)
    rows, tpe, pp = d.dispatch_postprocess(h, hp)
    rows.retain_grad()
    y = run_experts(rows, torch.as_tensor(tpe), w, b, pp if apply_probs else None)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
    return rows, tpe, y, out


def megatron_worker(rank: int, world_size: int) -> list:
    """Megatron-core's MoEAlltoAllTokenDispatcher / MoEAllGatherTokenDispatcher vs ours, same input."""
    from tests.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()
    import warnings

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    warnings.filterwarnings("ignore")
    megatron = {"alltoall": MoEAlltoAllTokenDispatcher, "allgather": MoEAllGatherTokenDispatcher}
    groups = make_groups(rank)
    data = batch(torch.bfloat16, seed=3)
    w_all, b_all = expert_weights(torch.bfloat16)
    records = []
    for ep in (2, 4):
        group, _ = groups[ep]
        P, me = dist.get_world_size(group), dist.get_rank(group)
        El = E // P
        idx = torch.tensor(_split(list(range(G)), P)[me])
        pg = ProcessGroupCollection(ep=group, tp_ep=group, expt_tp=groups[1][0])
        for kind in DISPATCHERS:
            tc = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                                   moe_router_topk=helpers.K, moe_token_dispatcher_type=kind,
                                   moe_permute_fusion=False, add_bias_linear=False, bf16=True,
                                   params_dtype=torch.bfloat16, expert_model_parallel_size=P)
            from moe_dispatch.integrations.megatron import dispatcher_from_megatron

            built = dispatcher_from_megatron(tc, pg)  # TransformerConfig -> MoEConfig -> dispatcher
            rec = dict(ep=ep, kind=kind, rank=rank,
                       built=(type(built.dispatcher).__name__, built.ep_size, built.local_expert_indices))
            for impl in ("megatron", "ours-experts", "ours-combine"):
                x = data["x"][idx].clone().requires_grad_()
                p = data["probs"][idx].clone().requires_grad_()
                w = w_all[me * El:(me + 1) * El]
                b = b_all[me * El:(me + 1) * El]
                if impl == "megatron":
                    d = megatron[kind](El, list(range(me * El, (me + 1) * El)), tc, pg_collection=pg)
                else:
                    ours = DISPATCHERS[kind](config(probs_in_experts=impl == "ours-experts"), group)
                    d = MegatronTokenDispatcher(ours)
                rows, tpe, y, out = _six_steps(d, x, data["rmap"][idx], p, w, b, impl != "ours-combine")
                out.backward(data["r"][idx])
                # clone: Megatron's allgather gathers into (and reduce-scatters out of) a reused
                # global buffer, so x.grad can be a view that the next step overwrites
                rec[impl] = {k: torch.as_tensor(v).detach().clone() for k, v in dict(
                    rows=rows, tpe=tpe, out=out, gx=x.grad, gp=p.grad, row_grads=rows.grad).items()}
                if impl == "ours-experts":  # magnitudes for the bounds: sum_e |p_e y_e|, sum_e |g_e|
                    d2 = DISPATCHERS[kind](config(probs_in_experts=True), group)
                    _, _, h2 = d2.dispatch(x.detach(), data["rmap"][idx], p.detach())
                    rec["mag_out"] = d2.combine(y.detach().abs(), h2)
                    rec["mag_gx"] = d2.combine(rows.grad.abs(), h2)
            records.append(rec)
    return records
