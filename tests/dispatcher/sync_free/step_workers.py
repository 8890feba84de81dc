"""Workers of test_steps.py (importable by spawned ranks): the sync-free step as a training
run uses it: another T per step, empty steps, grad mode per rank, the documented dispatcher
example, and config values of different Python types."""
from __future__ import annotations

import torch

from moe_dispatch import AllToAllDispatcher, GroupedMLP, MoEConfig, MoELayer, TopKRouter
from tests.dispatcher.harness import value_error_of
from tests.dispatcher.sync_free.workers import _config


def _pair(kind: str, **changes) -> tuple[MoELayer, MoELayer]:
    """(sync-free layer, dropless layer), the same weights."""
    return (MoELayer(_config(kind, ep_capacity_factor=2.0, **changes), layer_index=0),
            MoELayer(_config(kind, **changes), layer_index=0))


def _run(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    layer.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    out = layer(xx)
    out.backward(upstream)
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in layer.named_parameters()}
    return {"out": out.detach(), "x_grad": xx.grad, **grads}


def token_counts_worker(rank: int, world_size: int, runs: list) -> list:
    """Per (kind, counts) of ``runs``: _token_counts."""
    return [_token_counts(rank, kind, counts) for kind, counts in runs]


def _token_counts(rank: int, kind: str, counts: list) -> list:
    """One step per entry of ``counts`` (T of each rank: an int, or a list by rank) on a new
    sync-free layer and on the dropless one: per step, which results are bitwise equal (or the
    error)."""
    sync_free, dropless = _pair(kind)
    steps = []
    for step, T in enumerate(counts):
        T = T[rank] if isinstance(T, list) else T
        gen = torch.Generator().manual_seed(10 * rank + step)
        x, upstream = torch.randn(T, 16, generator=gen), torch.randn(T, 16, generator=gen)
        try:
            a, b = _run(dropless, x, upstream), _run(sync_free, x, upstream)
        except Exception as exc:  # the test shows it
            steps.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        steps.append({k: b[k] is not None and torch.equal(a[k], b[k]) for k in a})
    return steps


def no_grad_worker(rank: int, world_size: int, modes: list) -> dict:
    """mode -> _no_grad(mode)."""
    return {mode: _no_grad(rank, mode) for mode in modes}


def _no_grad(rank: int, mode: str) -> dict:
    """After a first step in grad mode, rank 1 runs the next forward under torch.no_grad() while
    rank 0 trains: the error of each rank at that step, then whether a normal step still gives
    the first step's results."""
    f = None if mode == "dropless" else 2.0
    layer = MoELayer(_config("alltoall", ep_capacity_factor=f, strict_call_order=mode == "strict"), layer_index=0)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    first = _run(layer, x, torch.ones(6, 16))

    def mixed() -> None:
        if rank == 1:
            with torch.no_grad():
                layer(x)
        else:
            layer(x.clone().requires_grad_()).sum().backward()

    error = value_error_of(mixed)
    after = _run(layer, x, torch.ones(6, 16))
    return {"error": error, "after": all(torch.equal(first[k], after[k]) for k in first)}


def docs_example_worker(rank: int, world_size: int, cases: list) -> list:
    """Per (factor, skewed) of ``cases``: _docs_example."""
    return [_docs_example(rank, factor, skewed) for factor, skewed in cases]


def _docs_example(rank: int, factor: float, skewed: bool) -> dict:
    """docs/dispatchers.md's example at EP 2 with ep_capacity_factor=factor (sync-free), against
    the same code with the dropless config: per result whether bitwise equal, or the error."""
    def example(config: MoEConfig) -> dict:
        router = TopKRouter(config)
        dispatcher = AllToAllDispatcher(config, ep_group=None)
        experts = GroupedMLP(config, dispatcher.num_local_experts,
                             dispatcher.ep_rank * dispatcher.num_local_experts)
        hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        probs, routing_map = router(hidden)
        if skewed:  # every token to rank 0's experts 0 and 1
            routing_map = torch.zeros_like(routing_map)
            routing_map[:, :2] = True
            probs = torch.where(routing_map, probs, 0.0)
        expert_input, tokens_per_expert, handle = dispatcher.dispatch(hidden, routing_map, probs)
        expert_output = experts(expert_input, tokens_per_expert, handle.permuted_probs,
                                offsets=handle.expert_offsets)
        output = dispatcher.combine(expert_output, handle)
        output.sum().backward()
        again, _, _ = dispatcher.dispatch(hidden, routing_map, probs, handle=handle)
        assert torch.equal(again, expert_input)
        return {"out": output.detach(), "x_grad": hidden.grad, "router": router.weight.grad,
                **{n: p.grad for n, p in experts.named_parameters()}}

    base = dict(hidden_size=64, num_experts=8, topk=2, ffn_hidden_size=128)
    reference = example(MoEConfig(**base))
    try:
        got = example(MoEConfig(**base, ep_capacity_factor=factor))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None, "same": {k: torch.equal(reference[k], got[k]) for k in reference}}


def config_values_worker(rank: int, world_size: int, cases: list) -> list:
    """Per case, a sync-free layer with (capacity_factor, ep_capacity_factor) = case[rank] (the
    Python types may differ by rank): whether its output is finite, or the error."""
    out = []
    for case in cases:
        cf, ecf = case[rank]
        layer = MoELayer(_config("alltoall", capacity_factor=cf, ep_capacity_factor=ecf), layer_index=0)
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
        try:
            out.append(bool(torch.isfinite(layer(x)).all()))
        except ValueError as exc:
            out.append(str(exc))
    return out


def cuda_token_counts_worker(rank: int, world_size: int) -> dict:
    """On the GPU (ranks sharing it over gloo): fewer tokens than the plan's T are bitwise the
    dropless step; more give NaN and check_device_errors() raises (CUDA does not re-plan: that
    would need a host read)."""
    from moe_dispatch.ops import guard
    torch.cuda.set_device(0)
    sync_free, dropless = (layer.to("cuda", torch.bfloat16) for layer in _pair("alltoall"))
    same = []
    for step, T in enumerate([6, 4, 0]):
        gen = torch.Generator().manual_seed(10 * rank + step)
        x, upstream = (torch.randn(T, 16, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        a, b = _run(dropless, x, upstream), _run(sync_free, x, upstream)
        same.append(all(b[k] is not None and torch.equal(a[k], b[k]) for k in a))
    out = sync_free(torch.randn(9, 16, device="cuda", dtype=torch.bfloat16))
    return {"same": same, "nan": bool(torch.isnan(out).all()), "error": value_error_of(guard.check_device_errors)}
