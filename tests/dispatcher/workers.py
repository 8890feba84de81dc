"""Code that runs on the spawned gloo ranks (importable by the spawn children)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_dispatch.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from moe_dispatch.ops import permute, unpermute

from . import helpers
from .helpers import E, G, H, batch, config, expert_weights, run_experts

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def contract_configs() -> dict:
    """name -> (dispatcher kind, token dtype, config). Names: kind-dtype-mode[-variant]."""
    out = {}
    for kind in DISPATCHERS:
        for dt in DTYPES:
            for mode in ("combine", "experts"):
                out[f"{kind}-{dt}-{mode}"] = (kind, DTYPES[dt], config(probs_in_experts=mode == "experts"))
        out[f"{kind}-bf16-combine-fp64pad4"] = (kind, torch.bfloat16, config(router_dtype="fp64", pad_multiple=4))
        for mode in ("combine", "experts"):
            out[f"{kind}-bf16-{mode}-capacity"] = (kind, torch.bfloat16, config(
                probs_in_experts=mode == "experts", capacity_factor=2.0, pad_to_capacity=True, pad_multiple=4))
    return out


def _split(ids: list, parts: int) -> list:
    n = len(ids)
    return [ids[j * n // parts:(j + 1) * n // parts] for j in range(parts)]


def scenarios() -> dict:
    """name -> (data seed/kind, {ep: token ids per group rank}). Global token ids index the batch."""
    full = list(range(G))
    subset = [i for i in full if i % 3]
    return {
        "full": {ep: _split(full, ep) for ep in (1, 2, 4)},
        "trunc": {ep: _split(full, ep) for ep in (1, 2, 4)},  # tokens >= 90 zeroed and re-routed
        "subset": {ep: _split(subset, ep) for ep in (2, 4)},  # every third token dropped
        "uneven": {4: [full[:100], [], full[100:150], full[150:]]},  # rank 1 has no tokens
        "identical": {4: [full[:48]] * 4},  # the same tokens on every rank
        "sparse": {ep: _split(full, ep) for ep in (1, 2, 4)},  # only experts 0-2: ranks with no rows
    }


def scenario_data(name: str, dtype: torch.dtype) -> dict:
    if name == "sparse":
        return batch(dtype, seed=5, allowed=[0, 1, 2], k=2)
    data = batch(dtype, seed=0)
    if name == "trunc":
        other = batch(dtype, seed=9)
        data["x"][90:] = 0
        data["rmap"][90:], data["probs"][90:] = other["rmap"][90:], other["probs"][90:]
    return data


def make_groups(rank: int) -> dict:
    """EP groups of size 1, 2 and 4 out of 4 ranks: ep -> (group, index of the group)."""
    ones = [dist.new_group([r]) for r in range(4)]
    twos = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {1: (ones[rank], rank), 2: (twos[rank // 2], rank // 2), 4: (dist.group.WORLD, 0)}


def run_once(kind: str, dtype: torch.dtype, cfg, data: dict, ids: list, group, api: str, shape3d: bool = False):
    """One forward + backward; returns the rank's results (detached)."""
    El = cfg.num_experts // dist.get_world_size(group)
    grank = dist.get_rank(group)
    idx = torch.tensor(ids, dtype=torch.int64)
    x = data["x"][idx].clone()
    if shape3d:
        x = x.view(-1, 8, H)
    x.requires_grad_()
    pdtype = torch.float64 if cfg.router_dtype == "fp64" else torch.float32
    p = data["probs"][idx].to(pdtype).requires_grad_()
    w_all, b_all = expert_weights(dtype)
    w = w_all[grank * El:(grank + 1) * El].clone().requires_grad_()
    b = b_all[grank * El:(grank + 1) * El].clone().requires_grad_()
    d = DISPATCHERS[kind](cfg, group)
    if api == "functional":
        rows, tpe, handle = d.dispatch(x, data["rmap"][idx], p)
        pp = handle.permuted_probs
    else:  # Megatron's six steps
        h, hp = d.dispatch_preprocess(x, data["rmap"][idx], p)
        h, hp = d.token_dispatch(h, hp)
        rows, tpe, pp = d.dispatch_postprocess(h, hp)
    y = run_experts(rows, tpe, w, b, pp if cfg.probs_in_experts else None)
    if api == "functional":
        out = d.combine(y, handle)
    else:
        out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
    assert out.shape == x.shape, (out.shape, x.shape)
    out.backward(data["r"][idx].view(x.shape))
    return dict(ids=idx, out=out.detach().reshape(-1, H), gx=x.grad.reshape(-1, H), gp=p.grad,
                gw=w.grad, gb=b.grad, tpe=tpe)


def naive_combine(data: dict, ids: list, group) -> torch.Tensor:
    """Negative control (Megatron allgather style): each rank sums its local experts' weighted
    outputs into bf16 partials, then the partials are reduce-scattered (summed across ranks)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    El = E // P
    idx = torch.tensor(ids, dtype=torch.int64)
    x, rmap, probs = data["x"][idx], data["rmap"][idx], data["probs"][idx]
    if P > 1:
        x = torch.cat([t for t in _gather(x, group)])
        rmap = torch.cat([t for t in _gather(rmap, group)])
        probs = torch.cat([t for t in _gather(probs, group)])
    cols = slice(me * El, (me + 1) * El)
    rows, _, row_map = permute(x, rmap[:, cols].contiguous(), probs[:, cols].contiguous())
    w, b = expert_weights(x.dtype)
    y = run_experts(rows, row_map.tokens_per_expert, w[cols], b[cols])
    partial = unpermute(y, row_map, probs[:, cols].contiguous())  # [P * T, H] bf16 partial sums
    if P == 1:
        return partial
    out = partial.new_empty((partial.shape[0] // P, H))
    dist.reduce_scatter_tensor(out, partial, group=group)  # bf16 sum across ranks
    return out


def _gather(t: torch.Tensor, group) -> list:
    out = t.new_empty((dist.get_world_size(group) * t.shape[0],) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return list(out.chunk(dist.get_world_size(group)))


def contract_worker(rank: int, world_size: int) -> list:
    assert world_size == 4
    groups = make_groups(rank)
    records = []
    for name, (kind, dtype, cfg) in contract_configs().items():
        for scen, layouts in scenarios().items():
            if "capacity" in name and scen not in ("full", "uneven"):
                continue
            data = scenario_data(scen, dtype)
            for ep, per_rank in layouts.items():
                group, replica = groups[ep]
                ids = per_rank[dist.get_rank(group)]
                api = "megatron" if ep == 2 else "functional"
                rec = run_once(kind, dtype, cfg, data, ids, group, api, shape3d=scen == "identical")
                rec.update(cfg=name, scen=scen, ep=ep, replica=replica, rank=rank)
                records.append(rec)
    naive = {}
    data = scenario_data("full", torch.bfloat16)
    for ep, per_rank in scenarios()["full"].items():
        group, _ = groups[ep]
        naive[ep] = (torch.tensor(per_rank[dist.get_rank(group)]), naive_combine(data, per_rank[dist.get_rank(group)], group))
    return dict(records=records, naive=naive)
