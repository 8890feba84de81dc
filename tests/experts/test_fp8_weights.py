"""The experts' FP8 weights quantised once (moe_dispatch/experts/fp8_weights.py): bitwise the
per-call quantisation's results, for the GEMM, the layer over micro-batches and at EP 2 with both
dispatchers; a stale or foreign handle is a ValueError, on every EP rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.dlpack import from_dlpack, to_dlpack

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.experts import ExpertRows, fp8_expert_gemm, quantize_weight
from moe_dispatch.ops import Fp8Rows, quantize_rows
from tests.dispatcher.harness import run_ranks, value_error_of

H, F = 32, 48


def _config(**overrides) -> MoEConfig:
    base = dict(hidden_size=H, num_experts=4, topk=2, ffn_hidden_size=F, fp8="e4m3", params_dtype=torch.bfloat16,
                init_seed=3)
    return MoEConfig(**{**base, **overrides})


def _batches(seed: int, sizes=(9, 14)) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, H, generator=gen).to(torch.bfloat16), torch.randn(t, H, generator=gen).to(torch.bfloat16))
            for t in sizes]


def _micro_batches(layer: MoELayer, batches: list, once: bool) -> list:
    """Forward + backward of each (x, upstream), the gradients accumulating as between two optimizer
    steps; with ``once``, one handle for all of them. -> outputs, input gradients, then every
    parameter's accumulated gradient."""
    weights = layer.quantize_fp8_weights() if once else None
    outs, gxs = [], []
    for x, upstream in batches:
        x = x.clone().requires_grad_()
        out = layer(x, fp8_weights=weights)
        out.backward(upstream)
        outs.append(out.detach())
        gxs.append(x.grad)
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return outs + gxs + grads


def test_gemm_with_weight_operands_is_bitwise_per_call():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3, H, F, generator=gen) / 6).to(torch.bfloat16)
    counts = torch.tensor([4, 0, 7])
    x = torch.randn(11, H, generator=gen).to(torch.bfloat16)
    upstream = torch.randn(11, F, generator=gen).to(torch.bfloat16)
    results = []
    for operands in (None, quantize_weight(w)):
        wi, xi = w.clone().requires_grad_(), x.clone().requires_grad_()
        out = fp8_expert_gemm(xi, None, wi, counts, weight_operands=operands)
        out.backward(upstream)
        results.append((out.detach(), xi.grad, wi.grad))
    for per_call, once in zip(*results):
        assert torch.equal(per_call, once)


def test_bad_weight_operands_name_the_argument():
    w = torch.randn(3, H, F).to(torch.bfloat16)
    x = torch.randn(5, H).to(torch.bfloat16)
    counts = torch.tensor([2, 2, 1])
    q = quantize_weight(w)
    for bad in (q[:2], (q[2], q[3], q[0], q[1]), quantize_weight(w[:2]), (q[0].float(), *q[1:]), "q"):
        with pytest.raises(ValueError, match="weight_operands must be quantize_weight"):
            fp8_expert_gemm(x, None, w, counts, weight_operands=bad)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_micro_batches_with_one_handle_are_bitwise_per_call(dispatcher):
    config = _config(dispatcher=dispatcher, shared_expert_ffn_hidden_size=16, probs_in_experts=True)
    per_call = _micro_batches(MoELayer(config, layer_index=0), _batches(1), once=False)
    once = _micro_batches(MoELayer(config, layer_index=0), _batches(1), once=True)
    assert len(per_call) == len(once)
    for a, b in zip(per_call, once):
        assert torch.equal(a, b)


def _stale(case: str, layer: MoELayer, other: MoELayer):
    """A handle ``layer`` must refuse after ``case``."""
    weights = layer.quantize_fp8_weights()
    if case.startswith("adamw"):  # fused AdamW changes no autograd version: the step hook sees it
        kind = case.split("-")[1]
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3, **{kind: True} if kind != "loop" else {})
        layer(_batches(2)[0][0]).sum().backward()
        optimizer.step()
    elif case == "other optimizer":  # any optimizer step: whether it held these weights is not asked
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.1).step()
    elif case == "copy_":
        with torch.no_grad():
            layer.experts.weight2.copy_(layer.experts.weight2 * 2)
    elif case == ".data =":  # no autograd version changes; the storage does
        layer.experts.weight1.data = layer.experts.weight1.data.clone()
    elif case == "load_state_dict":
        layer.load_state_dict(other.state_dict())
    elif case == "replaced":
        layer.experts.weight1 = nn.Parameter(layer.experts.weight1.detach().clone())
    elif case == "another layer's":
        weights = other.quantize_fp8_weights()
    elif case == "not a handle":
        weights = (weights.weight1, weights.weight2)
    return weights


STALE = {"adamw-loop": "1 optimizer step", "adamw-foreach": "1 optimizer step", "adamw-fused": "1 optimizer step",
         "other optimizer": "1 optimizer step", "copy_": "weight2 changed in place or moved",
         "load_state_dict": "weight1 changed in place", ".data =": "weight1 changed in place or moved",
         "replaced": "other experts' weights",
         "another layer's": "other experts' weights", "not a handle": "must be the Fp8ExpertWeights"}


@pytest.mark.parametrize("case", list(STALE))
def test_a_stale_or_foreign_handle_is_refused(case):
    layer, other = MoELayer(_config(), layer_index=0), MoELayer(_config(init_seed=4), layer_index=1)
    weights = _stale(case, layer, other)
    x = _batches(3)[0][0]
    message = value_error_of(lambda: layer(x, fp8_weights=weights))
    assert message is not None and STALE[case] in message, message
    if case != "not a handle":
        assert "quantise" in message or "other experts" in message
    layer(x, fp8_weights=layer.quantize_fp8_weights())  # quantised again: accepted


def test_not_for_a_bf16_layer_and_nothing_to_quantise():
    fp8 = MoELayer(_config(), layer_index=0)
    bf16 = MoELayer(_config(fp8=None), layer_index=1)
    x = _batches(3)[0][0]
    assert "layer is not FP8" in value_error_of(lambda: bf16(x, fp8_weights=fp8.quantize_fp8_weights()))
    assert "not FP8" in value_error_of(bf16.quantize_fp8_weights)


def test_compiled_layer_takes_a_handle_and_still_refuses_a_stale_one():
    """torch.compile (aot_eager, EP 1): bitwise eager with a handle; the check runs at every call."""
    layer = MoELayer(_config(), layer_index=0)
    x = _batches(4)[0][0]
    weights = layer.quantize_fp8_weights()
    compiled = torch.compile(layer, backend="aot_eager")
    assert torch.equal(compiled(x, fp8_weights=weights), layer(x, fp8_weights=weights))
    _stale("other optimizer", layer, layer)
    assert "1 optimizer step" in value_error_of(lambda: compiled(x, fp8_weights=weights))


def test_a_new_storage_at_the_old_address_is_refused():
    """#46 item 1: a weight given a new storage at the very address of the old one (the CUDA
    caching allocator reuses a freed address as a rule) passed the stamp, whose pointers were equal.
    A DLPack alias makes it deterministic: a second storage over the same memory, then a write
    through the old tensor, which the parameter's autograd version does not see."""
    layer = MoELayer(_config(), layer_index=0)
    w = layer.experts.weight1
    weights = layer.quantize_fp8_weights()
    old = w.data
    w.data = from_dlpack(to_dlpack(old))
    assert w.data_ptr() == old.data_ptr() and w._version == weights.stamp.versions[0]
    old.mul_(2)
    message = value_error_of(lambda: layer(_batches(3)[0][0], fp8_weights=weights))
    assert message is not None and "weight1 changed in place or moved" in message, message


def test_the_issue_recipe_is_refused_whatever_the_allocator_does():
    """#46 item 1's recipe, ``w.data = torch.empty_like(w); w.data = new.clone()``: refused whether
    or not the clone landed at the freed address. The handle holds the old storage's identity (a
    weak reference), not its memory: that is freed, and no new storage can take the identity."""
    x = _batches(3)[0][0]
    for _ in range(3):
        layer = MoELayer(_config(), layer_index=0)
        w = layer.experts.weight1
        new = w.detach() * 2
        weights = layer.quantize_fp8_weights()
        w.data = torch.empty_like(w)
        w.data = new.clone()
        ref = weights.stamp.storages[0]
        assert ref._ref.expired() and not ref.holds(w)  # the old memory is freed; its identity is not reused
        message = value_error_of(lambda: layer(x, fp8_weights=weights))
        assert message is not None and "weight1 changed in place or moved" in message, message


def _unseen_write(case: str, layer: MoELayer) -> None:
    """A write into the weights that autograd does not count (no version moves)."""
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    versions = (w1._version, w2._version)
    if case == "data.copy_":
        w2.data.copy_(w2.data * 2)
    elif case == "swap":  # two elements exchanged: a plain sum of the bits would not see it
        flat = w1.data.view(-1)
        i, j = 0, int((flat != flat[0]).nonzero()[0])
        flat[[i, j]] = flat[[j, i]]
    elif case == "one bit":
        w1.data.view(-1).view(torch.int16)[-1] ^= 1
    assert (w1._version, w2._version) == versions


UNSEEN = {"data.copy_": "weight2's bits differ", "swap": "weight1's bits differ", "one bit": "weight1's bits differ"}


@pytest.mark.parametrize("sync_free", [True, False], ids=["sync-free", "dropless"])
@pytest.mark.parametrize("case", list(UNSEEN))
def test_a_write_autograd_does_not_count_is_refused(case, sync_free):
    """#46 item 2 at EP 1: the weights' bits are compared with the handle's fingerprint at each
    forward (EP 1 is sync-free unless padded: pad_multiple makes it dropless); the direct experts
    forward refuses it too. An unchanged handle is accepted (the bitwise tests above)."""
    layer = MoELayer(_config(**({} if sync_free else dict(pad_multiple=16))), layer_index=0)
    assert layer.dispatcher.sync_free == sync_free
    weights = layer.quantize_fp8_weights()
    x = _batches(3)[0][0]
    layer(x, fp8_weights=weights)
    _unseen_write(case, layer)
    message = value_error_of(lambda: layer(x, fp8_weights=weights))
    assert message is not None and UNSEEN[case] in message and "quantise" in message, message
    q, scales = quantize_rows(x, torch.float8_e4m3fn)
    counts = torch.tensor([4, 0, 3, 2])
    sink = torch.zeros(9, H, dtype=torch.bfloat16)
    rows = ExpertRows(Fp8Rows(q, scales, sink), host_rows_per_expert=counts)
    direct = value_error_of(lambda: layer.experts(rows, fp8_weights=weights))
    assert direct is not None and UNSEEN[case] in direct, direct
    layer(x, fp8_weights=layer.quantize_fp8_weights())  # quantised again: accepted


def _write_on(ranks: tuple, case: str, layer: MoELayer) -> None:
    rank = dist.get_rank()
    if case == "broadcast":  # rank 0's weights into every rank's: the receivers' versions do not move
        with torch.no_grad():
            dist.broadcast(layer.experts.weight1, src=0)
    elif rank in ranks and case == "data.copy_":
        _unseen_write("data.copy_", layer)
    elif rank in ranks and case == "stepped":
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.1).step()


def _unseen_writes_worker(rank: int, world_size: int) -> dict:
    """EP 2, dropless and sync-free (its first step, which runs the size exchange, and a later
    step): a handle stale on rank 1, on rank 0, or on both. -> each case's error (None: none)."""
    out = {}
    x = _batches(30 + rank, sizes=(6,))[0][0]
    cases = (((1,), "broadcast"), ((0,), "data.copy_"), ((0, 1), "data.copy_"), ((0, 1), "stepped"))
    for mode in ("dropless", "sync-free first", "sync-free"):
        for i, (ranks, case) in enumerate(cases):
            # sync-free: a factor of its own per case, so that each case's plan has its first step
            config = _config(dispatcher="allgather" if mode == "sync-free" else "alltoall",
                             ep_capacity_factor=None if mode == "dropless" else 2.0 + i / 4)
            layer = MoELayer(config, layer_index=0)
            if mode == "sync-free":
                layer(x)  # the plan's first step: later steps exchange no sizes
            weights = layer.quantize_fp8_weights()
            _write_on(ranks, case, layer)
            error = value_error_of(lambda: layer(x, fp8_weights=weights).sum().backward())
            if mode == "sync-free" and error is None:  # NaN outputs, then every rank raises at the next call
                error = value_error_of(lambda: layer(x))
            out[(mode, ranks, case)] = error
    return out


def _named(mode: str, ranks: tuple, case: str) -> list:
    """What the error must say, in order."""
    if mode == "sync-free":
        return [("EP rank 1" if ranks == (1,) else "EP rank 0" if ranks == (0,) else "EP ranks 0, 1")
                + " passed inputs"]
    what = {"broadcast": "weight1's bits differ", "data.copy_": "weight2's bits differ",
            "stepped": "1 optimizer step"}[case]
    return [what, "on EP ranks 0, 1" if len(ranks) == 2 else f"on EP rank {ranks[0]}"]


def test_ep2_a_write_autograd_does_not_count_raises_on_every_rank_naming_each():
    """#46 items 2 and 16: dist.broadcast from rank 0 into rank 1's weights, weight.data.copy_ on
    one rank or both, after the handle was made: the same ValueError on both ranks, naming every
    rank at fault; dropless and at a sync-free plan's first step before any row moves (in the size
    exchange), at a later sync-free step after NaN outputs (the input words)."""
    ranks = run_ranks(_unseen_writes_worker, 2, timeout=300)
    for key, error in ranks[0].items():
        assert error is not None and error == ranks[1][key], (key, ranks[0][key], ranks[1][key])
        at = -1
        for part in _named(*key):
            assert part in error[at + 1:], (key, part, error)
            at = error.index(part, at + 1)
        if key[1] == (1,):
            assert "EP rank 0" not in error, (key, error)


def _ep2_worker(rank: int, world_size: int) -> dict:
    """Both dispatchers, dropless and sync-free: two micro-batches per-call and with one handle; then
    rank 1 alone steps an optimizer, so its handle is stale and every rank must raise."""
    out = {}
    for kind in ("alltoall", "allgather"):
        for sync_free in (False, True):
            config = _config(dispatcher=kind, ep_capacity_factor=2.0 if sync_free else None)
            batches = _batches(10 + rank, sizes=(5 + rank, 8 - rank))
            case = {"bitwise": [torch.equal(a, b) for a, b in zip(
                _micro_batches(MoELayer(config, layer_index=0), batches, once=False),
                _micro_batches(MoELayer(config, layer_index=0), batches, once=True))]}
            layer = MoELayer(config, layer_index=0)
            weights = layer.quantize_fp8_weights()
            if rank == 1:
                p = nn.Parameter(torch.ones(2))
                p.grad = torch.ones(2)
                torch.optim.SGD([p], lr=0.1).step()
            x = batches[0][0]
            case["error"] = value_error_of(lambda: layer(x, fp8_weights=weights).sum().backward())
            if sync_free and case["error"] is None:  # after its first step: NaN, and the next call raises
                case["error"] = value_error_of(lambda: layer(x))
            out[(kind, sync_free)] = case
    return out


def test_ep2_bitwise_and_a_stale_handle_raises_on_every_rank():
    ranks = run_ranks(_ep2_worker, 2, timeout=300)
    for key in ranks[0]:
        for rank, result in enumerate(ranks):
            assert result[key]["bitwise"] and all(result[key]["bitwise"]), (key, rank, result[key]["bitwise"])
            # sync-free after its first step: the peers are in no size exchange; the flag names the rank
            expected = "EP rank 1 passed inputs" if key[1] else "1 optimizer step"
            assert result[key]["error"] is not None and expected in result[key]["error"], (key, rank)
        assert ranks[0][key]["error"] == ranks[1][key]["error"], key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_once_is_bitwise_per_call_eager_and_captured():
    """On CUDA (torch._scaled_grouped_mm, the Triton quantisers): with one handle, two micro-batches
    bitwise the per-call ones for both dispatchers, and a CUDA-graph replay bitwise its eager step."""
    from moe_dispatch.tools.capture import capture_step

    dev = torch.device("cuda")
    kw = dict(hidden_size=256, num_experts=16, topk=4, ffn_hidden_size=128, params_dtype=torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(7)
    batches = [tuple(torch.randn(t, 256, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
               for t in (300, 512)]
    results = {}
    for kind in ("alltoall", "allgather"):
        config = MoEConfig(fp8="e4m3", dispatcher=kind, **kw)
        results[kind] = _micro_batches(MoELayer(config, layer_index=0).to(dev), batches, once=False)
        once = _micro_batches(MoELayer(config, layer_index=0).to(dev), batches, once=True)
        assert all(torch.equal(a, b) for a, b in zip(results[kind], once)), kind
    per_call = results["alltoall"]
    layer = MoELayer(MoEConfig(fp8="e4m3", **kw), layer_index=0).to(dev)
    weights = layer.quantize_fp8_weights()
    x, upstream = batches[1]
    xs = x.clone().requires_grad_()

    def step() -> torch.Tensor:
        out = layer(xs, fp8_weights=weights)
        out.backward(upstream)
        return out
    graph, out = capture_step(layer, xs, step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, per_call[1]) and torch.equal(xs.grad, per_call[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bits_check_eager_and_in_a_replay():
    """On CUDA (EP 1, sync-free): a write autograd does not count makes the eager step's output NaN
    and check_device_errors() raise (no host read in the step); a captured step replayed after
    such a write does the same (the bits comparison is captured with the step)."""
    from moe_dispatch.ops import check_device_errors
    from moe_dispatch.tools.capture import capture_step

    dev = torch.device("cuda")
    kw = dict(hidden_size=256, num_experts=16, topk=4, ffn_hidden_size=128, params_dtype=torch.bfloat16)
    layer = MoELayer(MoEConfig(fp8="e4m3", **kw), layer_index=0).to(dev)
    gen = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(300, 256, device=dev, generator=gen).to(torch.bfloat16)
    weights = layer.quantize_fp8_weights()
    good = layer(x, fp8_weights=weights)
    check_device_errors()
    assert not good.isnan().any()
    with torch.no_grad():
        layer.experts.weight2.data.mul_(2)
    bad = layer(x, fp8_weights=weights)
    assert bad.isnan().all()
    message = value_error_of(check_device_errors)
    assert message is not None and "EP rank 0 passed inputs" in message, message
    weights = layer.quantize_fp8_weights()

    def step() -> torch.Tensor:
        return layer(x, fp8_weights=weights)
    graph, out = capture_step(layer, x, step)
    graph.replay()
    check_device_errors()
    assert not out.isnan().any()
    with torch.no_grad():
        layer.experts.weight1.data.mul_(2)
    graph.replay()
    assert out.isnan().all()
    message = value_error_of(check_device_errors)
    assert message is not None and "EP rank 0 passed inputs" in message, message
