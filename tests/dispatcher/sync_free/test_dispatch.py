"""The sync-free dispatch (dispatcher/sync_free/): EP 1 without host reads, and the static-capacity
exchange at EP 2, 4 and 8 on gloo ranks: bitwise the dropless path when it fits, NaN and the same
ValueError on every rank when it overflows."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.dispatcher import AllToAllDispatcher
from moe_dispatch.dispatcher.sync_free.sizes import SyncFreeSizes
from moe_dispatch.ops import check_device_errors
from tests.cuda_host_waits import count_host_transfers, count_scalar_copies
from tests.dispatcher.harness import run_ranks
from tests.dispatcher.sync_free import workers


def _dropless_twin(config: MoEConfig) -> MoELayer:
    layer = MoELayer(config, layer_index=0)
    layer.dispatcher = AllToAllDispatcher(config)  # the dropless dispatch (one host read per step)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("probs_in_experts", [False, True])
def test_ep1_layer_is_sync_free_and_bitwise_dropless(dtype, probs_in_experts):
    config = MoEConfig(hidden_size=32, num_experts=8, topk=3, ffn_hidden_size=16, probs_in_experts=probs_in_experts,
                       shared_expert_ffn_hidden_size=8)
    a, b = MoELayer(config, layer_index=0).to(dtype), _dropless_twin(config).to(dtype)
    assert a.dispatcher.sync_free and not b.dispatcher.sync_free
    x = torch.randn(2, 10, 32).to(dtype)
    upstream = torch.randn(2, 10, 32).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_host_transfers() as counts, count_scalar_copies() as scalar_copies:
        ya = a(xa)
        ya.backward(upstream)
    assert counts == {"read_host": 0, "to_device": 0}, counts
    assert not scalar_copies, scalar_copies[0]  # on CUDA: a host sync, and capture would fail
    yb = b(xb)
    yb.backward(upstream)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_ep1_fewer_than_k_experts_leaves_trailing_rows():
    """A router that drops (capacity_factor) routes some tokens to fewer than K experts: the
    rows past the last expert's block belong to no expert; results equal the dropless path."""
    config = MoEConfig(hidden_size=16, num_experts=4, topk=2, ffn_hidden_size=8, capacity_factor=0.5)
    a, b = MoELayer(config, layer_index=0), _dropless_twin(config)
    x = torch.randn(12, 16)
    assert torch.equal(a(x), b(x))
    probs, routing_map = a.router(x)
    rows, handle = a.dispatcher.dispatch_rows(x, routing_map, probs)
    assert rows.shape[0] == 12 * 2 and int(handle.rows_per_expert.sum()) < 12 * 2 and handle.trailing_rows


def test_ep1_bad_probs_raise_at_once_on_cpu():
    layer = MoELayer(MoEConfig(hidden_size=16, num_experts=4, topk=2, ffn_hidden_size=8), layer_index=0)
    probs, routing_map = layer.router(torch.randn(5, 16))
    probs = probs.detach().clone()
    probs[1, routing_map[1].nonzero()[0, 0]] = float("inf")
    with pytest.raises(ValueError, match="probs contain NaN or inf"):
        layer.dispatcher.dispatch_rows(torch.randn(5, 16), routing_map, probs)
    routing_map = routing_map.clone()
    routing_map[2] = True  # 4 experts for one token, topk=2
    with pytest.raises(ValueError, match="routed to 4 experts, more than topk=2"):
        layer.dispatcher.dispatch_rows(torch.randn(5, 16), routing_map, probs.abs().nan_to_num(0.0, 0.0))
    check_device_errors()  # raised once: nothing left


def test_sync_free_sizes_and_config_validation():
    from moe_dispatch.config import DispatchConfig
    cfg = DispatchConfig(kind="alltoall", num_experts=8, topk=2, hidden_size=16, sync_free=True, ep_capacity_factor=1.5)
    sizes = SyncFreeSizes.build(cfg, 4, 0, 10)
    assert (sizes.send_capacity, sizes.recv_rows, sizes.return_capacity) == (8, 30, 8)
    assert SyncFreeSizes.build(cfg.replace(kind="allgather"), 4, 0, 10).send_capacity == 10
    assert SyncFreeSizes.build(cfg, 1, 0, 10).recv_rows == 20
    with pytest.raises(ValueError, match="ep_capacity_factor must be None or a finite number > 0"):
        cfg.replace(ep_capacity_factor=0.0)
    with pytest.raises(ValueError, match="ep_capacity_factor must be a finite number > 0"):
        MoEConfig(hidden_size=16, num_experts=8, topk=2, ffn_hidden_size=8, ep_capacity_factor=float("inf"))
    with pytest.raises(ValueError, match="needs pad_to_capacity=False and pad_multiple=1"):
        MoEConfig(hidden_size=16, num_experts=8, topk=2, ffn_hidden_size=8, ep_capacity_factor=1.0, pad_multiple=4)
    with pytest.raises(ValueError, match="sync_free=True .* needs pad_to_capacity=False"):
        cfg.replace(pad_multiple=2)


# The cases of one world size share one spawn (starting 8 ranks on 2 cores costs more than the cases).
EXCHANGE_CASES = {2: {"fit": ("fit", torch.float32, True), "overflow": ("overflow",), "bad_input": ("bad_input",),
                      # "swapped" keeps its own spawn: its message names the first two layers built (#0, #1)
                      **{case: ("call_order", case) for case in ("combine", "strict")}},
                  4: {"fit": ("fit", torch.float32, False), "fit_bf16": ("fit", torch.bfloat16, True),
                      "overflow": ("overflow",)},
                  8: {"fit": ("fit", torch.float32, False), "overflow": ("overflow",)}}


@pytest.fixture(scope="module")
def exchange():
    """exchange(world_size, case) -> that case's per-rank results; one spawn per world size."""
    runs: dict = {}

    def get(world_size: int, case: str) -> list:
        if world_size not in runs:
            try:
                runs[world_size] = run_ranks(workers.exchange_worker, world_size, EXCHANGE_CASES[world_size],
                                             timeout=360)
            except Exception as exc:  # the other tests of this world size fail alike, without a second spawn
                runs[world_size] = exc
        if isinstance(runs[world_size], Exception):
            raise runs[world_size]
        return [rank[case] for rank in runs[world_size]]
    return get


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_static_exchange_fits_bitwise_equal_to_dropless(exchange, world_size):
    """float32; probs_in_experts at EP 2 (the probs' gradient travels back through the exchange)."""
    for rank, result in enumerate(exchange(world_size, "fit")):
        for kind, steps in result.items():
            for step, same in enumerate(steps):
                assert all(same.values()), (rank, kind, step, same)


def test_static_exchange_fits_bf16_ep4(exchange):
    for rank, result in enumerate(exchange(4, "fit_bf16")):
        for kind, steps in result.items():
            assert all(all(s.values()) for s in steps), (rank, kind, steps)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_static_exchange_overflow_nan_then_same_error_everywhere(exchange, world_size):
    results = exchange(world_size, "overflow")
    for kind in results[0]:
        errors = {r[kind]["error"] for r in results}
        assert len(errors) == 1, errors  # the same message on every rank
        error = errors.pop()
        assert error is not None and "static-capacity overflow (ep_capacity_factor=0.25)" in error, error
        assert "more than its capacity" in error and "that step's outputs were NaN" in error, error
        for r in results:
            assert r[kind]["first_nan"] and r[kind]["grad_nan"] and r[kind]["after_nan"], r[kind]
            assert r[kind]["polled"] is not None and "static-capacity overflow" in r[kind]["polled"]


def test_static_exchange_bad_input_after_first_step_no_hang(exchange):
    results = exchange(2, "bad_input")
    assert all(r["nan"] for r in results), results
    assert len({r["error"] for r in results}) == 1 and "EP rank 1 passed inputs" in results[0]["error"], results


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpu_static_exchange_gloo_ranks_share_the_gpu(world_size):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for rank, result in enumerate(run_ranks(workers.fit_worker, world_size, torch.bfloat16, True, "cuda",
                                            timeout=300)):
        for kind, steps in result.items():
            assert all(all(s.values()) for s in steps), (rank, kind, steps)
    results = run_ranks(workers.overflow_cuda_worker, world_size, timeout=300)
    assert all(r["nan"] for r in results), results
    assert len({r["error"] for r in results}) == 1 and "static-capacity overflow" in results[0]["error"], results


def test_static_exchange_layers_called_in_another_order():
    """The call travels in the status rows: swapped layers on one rank pair chunks of different
    layers: NaN outputs, then the same ValueError naming both layers on every rank."""
    results = run_ranks(workers.call_order_worker, 2, "swapped", timeout=120)
    assert all(r["nan"] for r in results), results
    assert len({r["error"] for r in results}) == 1, results
    error = results[0]["error"]
    assert "MoE layers called in a different order" in error and "dispatch paired MoE layer #0 with MoE layer #1" \
        in error, error


@pytest.mark.parametrize("strict", [False, True])
def test_static_exchange_micro_batches_combined_in_another_order(exchange, strict):
    """Rank 1 combines its two micro-batches swapped: NaN and the same error at the next dispatch,
    or with strict_call_order the same error at once, before any row moves."""
    results = exchange(2, "strict" if strict else "combine")
    assert len({r["error"] for r in results}) == 1, results
    error = results[0]["error"]
    if strict:
        assert all(r["strict"] for r in results) and "the combine on the EP group pairs rows of different calls" \
            in error, results
    else:
        assert all(r["nan"] for r in results), results
        assert "at different forwards" in error and "combine paired its forwards" in error, error
