"""Code that runs on the spawned gloo ranks (importable by the spawn children)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_dispatch.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from moe_dispatch.distributed.comm import group_size_rank
from moe_dispatch.integrations.megatron import MegatronTokenDispatcher
from moe_dispatch.ops import permute, unpermute

from .harness import outcome_of
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


def run_once(kind: str, dtype: torch.dtype, cfg, data: dict, ids: list, group, api: str, shape3d: bool = False,
             device: str = "cpu", reuse: bool = False):
    """One forward + backward; returns the rank's results (detached, on the CPU). ``reuse``: the
    functional API dispatches twice, the second time with the first's handle, and the step goes on
    with the second (``reuse_equal``: both gave the same rows, bitwise). ``group`` None without an
    initialised process group: EP 1 in this process."""
    data = {k: v.to(device) for k, v in data.items()}
    P, grank = group_size_rank(group)
    El = cfg.num_experts // P
    idx = torch.tensor(ids, dtype=torch.int64, device=device)
    x = data["x"][idx].clone()
    if shape3d:
        x = x.view(-1, 8, H)
    x.requires_grad_()
    pdtype = torch.float64 if cfg.router_dtype == "fp64" else torch.float32
    p = data["probs"][idx].to(pdtype).requires_grad_()
    w_all, b_all = (t.to(device) for t in expert_weights(dtype))
    w = w_all[grank * El:(grank + 1) * El].clone().requires_grad_()
    b = b_all[grank * El:(grank + 1) * El].clone().requires_grad_()
    d = DISPATCHERS[kind](cfg, group)
    reuse_equal = None
    if api == "functional":
        rows, tpe, handle = d.dispatch(x, data["rmap"][idx], p)
        if reuse:
            first = rows.detach()
            rows, tpe, handle = d.dispatch(x, data["rmap"][idx].clone(), p, handle=handle)
            reuse_equal = torch.equal(first, rows)
        pp = handle.permuted_probs
    else:  # Megatron's six steps
        d = MegatronTokenDispatcher(d)
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
    result = dict(ids=idx, out=out.detach().reshape(-1, H), gx=x.grad.reshape(-1, H), gp=p.grad,
                  gw=w.grad, gb=b.grad, tpe=tpe)
    return {**{k: v.cpu() for k, v in result.items()}, "reuse_equal": reuse_equal}


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
    y = run_experts(rows, row_map.expert_rows, w[cols], b[cols])
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


def gloo_worker(rank: int, world_size: int) -> dict:
    """Everything the 4-rank gloo tests need, in one spawn (starting ranks costs more than the
    checks): the bad-input checks first, then the contract matrix."""
    from .faults import fault_worker, step_transfers

    return dict(bad_input=bad_input_worker(rank, world_size), faults=fault_worker(rank, world_size),
                transfers=step_transfers(rank, world_size), contract=contract_worker(rank, world_size))


def contract_worker(rank: int, world_size: int, device: str = "cpu") -> dict:
    """The contract matrix on 4 ranks. device 'cuda': gloo ranks sharing GPU 0 (gloo's collectives
    take CUDA tensors), the Triton kernels instead of the torch twin."""
    assert world_size == 4
    if device == "cuda":
        torch.cuda.set_device(0)
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
                rec = run_once(kind, dtype, cfg, data, ids, group, api, shape3d=scen == "identical", device=device)
                rec.update(cfg=name, scen=scen, ep=ep, replica=replica, rank=rank)
                records.append(rec)
    naive = {}
    data = scenario_data("full", torch.bfloat16)
    for ep, per_rank in scenarios()["full"].items():
        group, _ = groups[ep]
        ids = per_rank[dist.get_rank(group)]
        naive[ep] = (torch.tensor(ids), naive_combine(data, ids, group))
    return dict(records=records, naive=naive)


def round_trip(kind: str, cfg, x, rmap, probs, group) -> torch.Tensor:
    """Identity experts: the combine returns sum_e p_e x (probs in the combine)."""
    d = DISPATCHERS[kind](cfg, group)
    rows, tpe, handle = d.dispatch(x, rmap, probs)
    out = d.combine(rows * 1, handle)
    if out.requires_grad:
        out.sum().backward()
    return out


def bad_input_worker(rank: int, world_size: int) -> dict:
    """Bad input on one rank must raise the same ValueError on every rank, without a hang, and
    leave the group usable. Also: every rank empty."""
    from types import SimpleNamespace

    from moe_dispatch.dispatcher import dispatch
    from moe_dispatch.integrations.megatron import dispatcher_from_megatron

    groups = make_groups(rank)
    world, (pair, _) = dist.group.WORLD, groups[2]
    data = batch(torch.bfloat16, n=32)
    sl = slice(8 * rank, 8 * rank + 8)
    x, rmap, probs = data["x"][sl], data["rmap"][sl], data["probs"][sl]
    cfg = config()
    out = {}
    out["ctor_indivisible"] = outcome_of(lambda: AllToAllDispatcher(config(num_experts=6), world))
    out["functional_indivisible"] = outcome_of(
        lambda: dispatch(x, rmap[:, :6], probs[:, :6], config(num_experts=6), world, "allgather"))
    for kind in DISPATCHERS:
        wide = torch.cat([rmap, torch.zeros(8, 1, dtype=torch.bool)], 1) if rank == 2 else rmap
        wide_p = torch.cat([probs, torch.zeros(8, 1)], 1) if rank == 2 else probs
        out[f"{kind}_map_columns"] = outcome_of(lambda: DISPATCHERS[kind](cfg, world).dispatch(x, wide, wide_p))
        narrow_h = x[:, :32] if rank == 1 else x
        out[f"{kind}_hidden_size"] = outcome_of(lambda: DISPATCHERS[kind](cfg, world).dispatch(narrow_h, rmap, probs))
        bad_p = probs[:, :-1] if rank == 3 else probs
        out[f"{kind}_probs_shape_megatron_api"] = outcome_of(
            lambda: MegatronTokenDispatcher(DISPATCHERS[kind](cfg, world)).dispatch_preprocess(x, rmap, bad_p))
        int_map = rmap.to(torch.int64) if rank == 0 else rmap
        out[f"{kind}_map_dtype_ep2"] = outcome_of(lambda: DISPATCHERS[kind](cfg, pair).dispatch(x, int_map, probs))
        mixed = x.float() if rank == 3 else x
        out[f"{kind}_hidden_dtype"] = outcome_of(lambda: DISPATCHERS[kind](cfg, world).dispatch(mixed, rmap, probs))
        nan_p = probs.clone()
        if rank == 1:
            nan_p[3, 0] = float("nan")  # what NaN router logits produce
        out[f"{kind}_probs_nan"] = outcome_of(lambda: DISPATCHERS[kind](cfg, world).dispatch(x, rmap, nan_p))
        tight = config(capacity_factor=0.25, pad_to_capacity=True)  # capacity 1 < routed tokens
        out[f"{kind}_capacity_overflow"] = outcome_of(lambda: DISPATCHERS[kind](tight, world).dispatch(x, rmap, probs))
    expt_tp = SimpleNamespace(ep=world, tp_ep=world, expt_tp=pair)
    out["expert_tp"] = outcome_of(lambda: dispatcher_from_megatron(cfg, expt_tp))
    # The group still works after all the errors, and an all-empty step works too.
    checks = {}
    for kind in DISPATCHERS:
        xs = x.clone().requires_grad_()
        ps = probs.clone().requires_grad_()
        checks[kind] = round_trip(kind, cfg, xs, rmap, ps, world).detach()
        checks[f"{kind}_ep1"] = round_trip(kind, cfg, x, rmap, probs, groups[1][0]).detach()
        e_x = torch.zeros(0, H, dtype=torch.bfloat16, requires_grad=True)
        e_p = torch.zeros(0, E, requires_grad=True)
        empty = round_trip(kind, cfg, e_x, torch.zeros(0, E, dtype=torch.bool), e_p, world)
        checks[f"{kind}_empty"] = (tuple(empty.shape), tuple(e_x.grad.shape), tuple(e_p.grad.shape))
    return dict(outcomes=out, checks=checks)


def nccl_worker(rank: int, world_size: int, device_type: str = "cuda") -> list:
    """The contract on CUDA/NCCL (Triton kernels): EP 1 and 2 on 2 GPUs, both dispatchers.
    device_type 'cpu' runs the same checks on gloo (to test this test without a GPU)."""
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    ones = [dist.new_group([r]) for r in range(world_size)]
    groups = {1: (ones[rank], rank), world_size: (dist.group.WORLD, 0)}
    records = []
    for name, (kind, dtype, cfg) in contract_configs().items():
        if "fp32" in name:
            continue
        for scen in ("full", "trunc", "identical"):
            data = scenario_data(scen, dtype)
            full = list(range(G))
            layouts = ({1: [full], 2: _split(full, 2)} if scen != "identical" else {2: [full[:96]] * 2})
            for ep, per_rank in layouts.items():
                group, replica = groups[ep]
                rec = run_once(kind, dtype, cfg, data, per_rank[dist.get_rank(group)], group,
                               "megatron" if ep == 2 and scen == "trunc" else "functional", device=device)
                rec.update(cfg=name, scen=scen, ep=ep, replica=replica, rank=rank)
                records.append(rec)
    return records


def ep8_configs() -> dict:
    """name -> (kind, dtype, config) for the EP-8 check (tiny: one local expert per rank)."""
    return {
        "alltoall-bf16-combine": ("alltoall", torch.bfloat16, config()),
        "allgather-bf16-experts": ("allgather", torch.bfloat16, config(kind="allgather", probs_in_experts=True)),
        "alltoall-fp32-capacity": ("alltoall", torch.float32, config(capacity_factor=2.0, pad_to_capacity=True,
                                                                     pad_multiple=4, router_dtype="fp64")),
    }


def ep8_split() -> list:
    """Token ids per rank at EP 8: uneven, rank 3 holds none."""
    full = list(range(G))
    cuts = [0, 30, 50, 80, 80, 110, 130, 170, G]
    return [full[cuts[r]:cuts[r + 1]] for r in range(8)]


def ep8_worker(rank: int, world_size: int) -> list:
    """Every EP-8 configuration on the world group, through the reused handle (see run_once)."""
    assert world_size == 8
    records = []
    for name, (kind, dtype, cfg) in ep8_configs().items():
        data = scenario_data("full", dtype)
        rec = run_once(kind, dtype, cfg, data, ep8_split()[rank], dist.group.WORLD, "functional", reuse=True)
        rec.update(cfg=name, rank=rank)
        records.append(rec)
        megatron = run_once(kind, dtype, cfg, data, ep8_split()[rank], dist.group.WORLD, "megatron")
        megatron.update(cfg=name + "-megatron", rank=rank)
        records.append(megatron)
    return records


def triton_views_worker(rank: int, world_size: int) -> dict:
    """EP 2 through the Triton kernels (the interpreter on CPU; set_backend('triton')), which read
    the exchange's packed byte buffers through strided views, against the torch twin: outputs,
    input and weight gradients bitwise (fp32), probs gradients within rounding (their in-chunk sum
    order differs, see ops)."""
    from moe_dispatch.ops import set_backend

    out = {}
    for kind, cfg in (("alltoall", config()),
                      ("allgather", config(kind="allgather", probs_in_experts=True, router_dtype="fp64",
                                           pad_multiple=4))):
        data = scenario_data("full", torch.float32)
        ids = _split(list(range(48)), world_size)[rank]
        with set_backend("triton"):
            kernels = run_once(kind, torch.float32, cfg, data, ids, dist.group.WORLD, "functional", reuse=True)
        twin = run_once(kind, torch.float32, cfg, data, ids, dist.group.WORLD, "megatron")
        out[kind] = (kernels, twin)
    return out
