"""A seeded fault fuzzer for the spawned gloo ranks: one rank gets one bad input, every rank must
raise the same ValueError (or, for a rank without tokens, succeed), fast, and the group must still
work afterwards. Runs inside the shared 4-rank spawn (conftest.py), cases one after another."""
from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from moe_dispatch import MoEConfig, MoELayer

from .helpers import batch, config, expert_weights, run_experts
from .workers import DISPATCHERS

H, E, K, FFN, T = 64, 8, 2, 16, 12

# class -> variants; each class is picked at least twice by the fuzzer
CLASSES = {
    "shape": ["hidden_size", "one_dim", "not_tensor", "routing_columns"],
    "dtype": ["int64_hidden", "float64_hidden", "int_routing"],
    "nan": ["nan_hidden", "inf_probs"],
    "config": ["num_experts", "topk", "pad_to_capacity", "router_dtype", "probs_in_experts", "pad_multiple",
               "hidden_size"],
    # the layer's own settings: the exchange would run, but a token's result would depend on its rank
    "layer_config": ["score_function", "load_balancing_type", "aux_loss_coeff", "activation", "init_seed"],
    "expert_rows": ["extra_row", "missing_row", "wrong_dtype"],
    "zero_tokens": ["layer", "dispatcher"],
    "kind": ["layer", "dispatcher"],
}
# class -> words every rank's message must contain ({rank}: the bad rank; {field}: the variant)
WORDS = {
    "shape": ["EP rank {rank}"],
    "dtype": ["EP rank {rank}"],
    "nan": ["NaN or inf", "EP rank {rank}"],
    "config": ["configuration mismatch", "{field} differs", "ranks [{rank}] differ"],
    "layer_config": ["layer configuration mismatch", "{field} differs", "ranks [{rank}] differ"],
    "expert_rows": ["expert_output", "EP rank {rank}"],
    "kind": ["configuration mismatch", "kind differs", "ranks [{rank}] differ"],
}


def fault_cases(seed: int = 2026, count: int = 40) -> list[tuple[str, str, int]]:
    """[(class, variant, bad rank)]: every (class, variant) once (bad ranks in turn), then seeded
    random picks; the same list on every rank."""
    rng = random.Random(seed)
    every = [(c, v) for c in sorted(CLASSES) for v in CLASSES[c]]
    fixed = [(c, v, i % 4) for i, (c, v) in enumerate(every)]
    return fixed + [(*rng.choice(every), rng.randrange(4)) for _ in range(count - len(fixed))]


def _layer_config(**changes) -> MoEConfig:
    # aux loss on: the router computes it (on each rank's own tokens) before the dispatch
    fields = dict(hidden_size=H, num_experts=E, topk=K, ffn_hidden_size=FFN, params_dtype=torch.bfloat16,
                  load_balancing_type="aux_loss", aux_loss_coeff=0.01)
    return MoEConfig(**{**fields, **changes})


_CONFIG_CHANGES = {"num_experts": dict(num_experts=4), "topk": dict(topk=3),
                   "pad_to_capacity": dict(capacity_factor=4.0, pad_to_capacity=True),
                   "router_dtype": dict(router_dtype="fp64"), "probs_in_experts": dict(probs_in_experts=True),
                   "pad_multiple": dict(pad_multiple=4), "hidden_size": dict(hidden_size=32),
                   "score_function": dict(score_function="sigmoid"), "load_balancing_type": dict(
                       load_balancing_type="seq_aux_loss"), "aux_loss_coeff": dict(aux_loss_coeff=0.02),
                   "activation": dict(activation="relu"), "init_seed": dict(init_seed=99)}


def _tokens(rank: int, cfg: MoEConfig = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn((T, cfg.hidden_size if cfg else H), generator=g).to(torch.bfloat16)


def _layer_step(cfg: MoEConfig, x, group) -> torch.Tensor:
    layer = MoELayer(cfg, group, layer_index=0)
    xx = x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    out = layer(xx)
    out.float().sum().backward()
    return out.detach()


def _dispatcher_step(kind: str, cfg, x, rmap, probs, group, bad_rows=None) -> torch.Tensor:
    d = DISPATCHERS[kind](cfg, group)
    xs = x.clone().requires_grad_()
    ps = probs.clone().requires_grad_()
    rows, tpe, handle = d.dispatch(xs, rmap, ps)
    El = E // dist.get_world_size(group)
    w, b = expert_weights(x.dtype)
    me = dist.get_rank(group)
    y = run_experts(rows, tpe, w[me * El:(me + 1) * El], b[me * El:(me + 1) * El])
    if bad_rows is not None:
        y = bad_rows(y)
    out = d.combine(y, handle)
    out.float().sum().backward()
    return out.detach()


def run_case(cls: str, variant: str, bad: int, rank: int, group) -> tuple:
    """One case on every rank; returns (outcome type, message, output or None)."""
    me_bad = rank == bad
    cfg = _layer_config()
    x = _tokens(rank)
    data = batch(torch.bfloat16, seed=rank, n=T)
    try:
        if cls == "shape":
            if variant == "routing_columns":
                rmap = torch.cat([data["rmap"], torch.zeros(T, 1, dtype=torch.bool)], 1) if me_bad else data["rmap"]
                return ("ok", "", _dispatcher_step("alltoall", config(), data["x"], rmap, data["probs"], group))
            bad_x = {"hidden_size": x[:, :H - 8], "one_dim": x.reshape(-1), "not_tensor": x.tolist()}[variant]
            return ("ok", "", _layer_step(cfg, bad_x if me_bad else x, group))
        if cls == "dtype":
            if variant == "int_routing":
                rmap = data["rmap"].to(torch.int64) if me_bad else data["rmap"]
                return ("ok", "", _dispatcher_step("allgather", config(kind="allgather"), data["x"], rmap,
                                                   data["probs"], group))
            bad_x = x.to(torch.int64 if variant == "int64_hidden" else torch.float64)
            return ("ok", "", _layer_step(cfg, bad_x if me_bad else x, group))
        if cls == "nan":
            if variant == "nan_hidden":
                bad_x = x.clone()
                bad_x[3, 7] = float("nan")
                return ("ok", "", _layer_step(cfg, bad_x if me_bad else x, group))
            probs = data["probs"].clone()
            if me_bad:
                probs[2, data["rmap"][2].nonzero()[0, 0]] = float("inf")
            return ("ok", "", _dispatcher_step("alltoall", config(), data["x"], data["rmap"], probs, group))
        if cls in ("config", "layer_config"):
            mine = _layer_config(**_CONFIG_CHANGES[variant]) if me_bad else cfg
            return ("ok", "", _layer_step(mine, _tokens(rank, mine), group))
        if cls == "kind":
            kind = "allgather" if me_bad else "alltoall"
            if variant == "layer":
                return ("ok", "", _layer_step(cfg.replace(dispatcher=kind), x, group))
            return ("ok", "", _dispatcher_step(kind, config(kind=kind), data["x"], data["rmap"], data["probs"], group))
        if cls == "expert_rows":
            change = {"extra_row": lambda y: torch.cat([y, y.new_zeros(1, y.shape[1])]),
                      "missing_row": lambda y: y[:-1] if y.shape[0] else y.new_zeros(1, y.shape[1]),
                      "wrong_dtype": lambda y: y.float()}[variant]
            out = _dispatcher_step("alltoall", config(), data["x"], data["rmap"], data["probs"], group,
                                   bad_rows=change if me_bad else None)
            nan_here = bool(torch.isnan(out.float()).any())
            # the flagged step raises at the next size exchange on the group, on every rank
            _dispatcher_step("alltoall", config(), data["x"], data["rmap"], data["probs"], group)
            return ("ok", f"no error (NaN in output: {nan_here})", out)
        if cls == "zero_tokens":
            if variant == "layer":
                return ("ok", "", _layer_step(cfg, x[:0] if me_bad else x, group))
            keep = slice(0, 0) if me_bad else slice(None)
            return ("ok", "", _dispatcher_step("alltoall", config(), data["x"][keep], data["rmap"][keep],
                                               data["probs"][keep], group))
        raise AssertionError(f"unknown class {cls}")
    except Exception as exc:  # the test compares type and message across ranks
        return (type(exc).__name__, str(exc), None)


def fault_worker(rank: int, world_size: int) -> dict:
    """Every fuzzer case on the 4-rank world group, then a valid step that must match the one
    before any fault (the group still works)."""
    group = dist.group.WORLD
    cfg = _layer_config()
    reference = _layer_step(cfg, _tokens(rank), group)
    data = batch(torch.bfloat16, seed=rank, n=T)
    reference_dispatch = _dispatcher_step("alltoall", config(), data["x"], data["rmap"], data["probs"], group)
    results = []
    for cls, variant, bad in fault_cases():
        start = time.monotonic()
        kind, message, out = run_case(cls, variant, bad, rank, group)
        seconds = time.monotonic() - start
        after = _layer_step(cfg, _tokens(rank), group)
        after_dispatch = _dispatcher_step("alltoall", config(), data["x"], data["rmap"], data["probs"], group)
        results.append(dict(cls=cls, variant=variant, bad=bad, kind=kind, message=message, seconds=seconds,
                            out=out, works_after=torch.equal(after, reference)
                            and torch.equal(after_dispatch, reference_dispatch)))
    # a zero-token rank's peers must get exactly their normal outputs
    return dict(results=results, reference=reference, reference_dispatch=reference_dispatch)


def step_transfers(rank: int, world_size: int) -> dict:
    """Host reads (each one host sync on CUDA) and host-to-device copies of one EP-4 layer step
    (forward + backward), after the layer's first step (which also agrees on the configuration)."""
    from tests.cuda_host_waits import count_host_transfers

    layer = MoELayer(_layer_config(), dist.group.WORLD, layer_index=0)
    x = _tokens(rank).requires_grad_()
    layer(x).float().sum().backward()
    with count_host_transfers() as counts:
        layer(x).float().sum().backward()
    return counts
