"""Adversarial input to the permutation ops: host-supplied sizes that do not match the routing map,
NaN/inf/negative probs, RowIdMap misuse, and kernels that must stay inside their buffers whatever
the slots say. Both backends (the torch twin and the Triton kernels under the interpreter) must
raise the same ValueError, with the same message."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_dispatch.ops import RowIdMap, check_device_errors, guard, permute, set_backend, unpermute
from moe_dispatch.ops import torch_twin as TW
from moe_dispatch.ops.kernels.row_map import _expert_weights
from tests.ops.oracle import random_routing

BACKENDS = ["torch", "triton"]


def _case(T=23, E=8, K=3, H=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    routing_map = random_routing(T, E, K, gen)
    tokens = torch.randn((T, H), generator=gen)
    probs = torch.rand((T, E), generator=gen) * routing_map
    return routing_map, tokens, probs


def _message(backend: str, call) -> str:
    with set_backend(backend):
        with pytest.raises(ValueError) as info:
            call()
    assert guard.status(torch.device("cpu")).eq(0).all(), "raising must clear the status"
    return str(info.value)


def _same_error_on_both_backends(call, match: str) -> str:
    messages = [_message(b, call) for b in BACKENDS]
    assert messages[0] == messages[1], messages
    assert match in messages[0], messages[0]
    return messages[0]


def _swap_two(counts: list[int]) -> list[int]:
    """Same sum, another split: one token moved between two experts."""
    out = list(counts)
    i = next(e for e, c in enumerate(out) if c > 0)
    out[i] -= 1
    out[(i + 1) % len(out)] += 1
    return out


# ---------------------------------------------------------------------------------------------
# Host-supplied sizes against the routing map.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("make_counts,what", [
    (lambda c: [max(0, v - 1) for v in c], "short"),
    (lambda c: [v + 1 for v in c], "long"),
    (_swap_two, "right sum, wrong split"),
    (lambda c: [sum(c)] + [0] * (len(c) - 1), "all on expert 0"),
])
def test_wrong_tokens_per_expert_raises_alike(pad_multiple, make_counts, what):
    routing_map, tokens, probs = _case()
    counts = routing_map.sum(0).tolist()
    given = make_counts(counts)
    assert given != counts, what
    message = _same_error_on_both_backends(
        lambda: permute(tokens, routing_map, probs, tokens_per_expert=given, pad_multiple=pad_multiple),
        "tokens_per_expert does not match routing_map")
    assert f"totals {sum(given)} given, {sum(counts)} routed" in message


@pytest.mark.parametrize("with_counts", [True, False])
def test_max_experts_per_token_too_small_raises_alike(with_counts):
    routing_map, tokens, probs = _case(K=3)
    kw = {"tokens_per_expert": routing_map.sum(0).tolist()} if with_counts else {}
    _same_error_on_both_backends(lambda: permute(tokens, routing_map, probs, max_experts_per_token=2, **kw),
                                 "max_experts_per_token=2 is below 3")


def test_both_sizes_wrong_name_both_arguments():
    routing_map, tokens, probs = _case(K=3)
    counts = _swap_two(routing_map.sum(0).tolist())
    message = _same_error_on_both_backends(
        lambda: permute(tokens, routing_map, probs, tokens_per_expert=counts, max_experts_per_token=1),
        "tokens_per_expert")
    assert "max_experts_per_token=1" in message


@pytest.mark.parametrize("kw,match", [
    ({"tokens_per_expert": [1, -1, 0, 0, 0, 0, 0, 0]}, "tokens_per_expert must hold ints >= 0"),
    ({"tokens_per_expert": [1.5] * 8}, "tokens_per_expert must hold ints >= 0"),
    ({"tokens_per_expert": [1] * 7}, "tokens_per_expert must have E = 8"),
    ({"max_experts_per_token": -1}, "max_experts_per_token must be None or an int"),
    ({"max_experts_per_token": 2.0}, "max_experts_per_token must be None or an int"),
    ({"num_out_tokens": -3}, "num_out_tokens must be None or an int"),
    ({"num_out_tokens": 2 ** 31}, "num_out_tokens must be None or an int"),
])
def test_malformed_sizes_are_refused_on_the_host(kw, match):
    routing_map, tokens, probs = _case()
    _same_error_on_both_backends(lambda: permute(tokens, routing_map, probs, **kw), match)


def test_right_sizes_pass_and_give_the_synchronising_result():
    routing_map, tokens, probs = _case()
    counts = routing_map.sum(0).tolist()
    for backend in BACKENDS:
        with set_backend(backend):
            a = permute(tokens, routing_map, probs, pad_multiple=4)
            b = permute(tokens, routing_map, probs, pad_multiple=4, tokens_per_expert=counts,
                        max_experts_per_token=3)
            c = permute(tokens, routing_map, probs, pad_multiple=4, tokens_per_expert=counts,
                        max_experts_per_token=8)
        for other in (b, c):
            assert torch.equal(a[0], other[0]) and torch.equal(a[1], other[1])
            assert torch.equal(a[2].slots, other[2].slots)


# ---------------------------------------------------------------------------------------------
# The device-side check itself (what the CUDA path relies on), run by the interpreter.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("E", [1, 8, 64, 256])
def test_kernel_flags_exactly_the_wrong_sizes(E):
    """_slots_kernel sets the SIZES status word iff the given total, split (hashed) or bound on
    experts per token is wrong: the same verdict as the host's exact comparison."""
    from moe_dispatch.ops.kernels import row_map as K

    gen = torch.Generator().manual_seed(E)
    T, k = 40, min(4, E)
    routing_map = random_routing(T, E, k, gen)
    counts = routing_map.sum(0).tolist()
    cpu = torch.device("cpu")
    variants = [(counts, k, False), (counts, E, False), (counts, k - 1, True),
                ([c + 1 for c in counts], k, True), (_swap_two(counts), k, E > 1)]
    if E > 2:
        swapped = list(counts)  # a different permutation of the same values, same total
        swapped[0], swapped[2] = swapped[2], swapped[0]
        variants.append((swapped, k, swapped != counts))
    for given, most, bad in variants:
        stats = K._make_slots(routing_map, 1, None, given, most, snapshot=True)[1]
        words = guard.status(cpu).tolist()
        assert words[guard.SIZES] == int(bad), (given, most)
        assert stats[E + 1:].tolist() == words
        guard.status(cpu).zero_()


@triton.jit
def _weights_kernel(out_ptr, E, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _expert_weights(offs), mask=offs < E)


def test_counts_hash_matches_the_kernels_weights():
    """guard.expert_weight (host) and _expert_weights (kernel) are the same wrapping int64 function."""
    E = 300
    out = torch.empty(E, dtype=torch.int64)
    _weights_kernel[(1,)](out, E, BLOCK=512)
    assert out.tolist() == [guard.expert_weight(e) for e in range(E)]
    assert guard.counts_hash([3, 1]) != guard.counts_hash([1, 3]) != guard.counts_hash([2, 2])


def test_status_poisons_every_kernel():
    """Once the device's status records a bad input, every kernel writes NaN (here set by hand,
    as the CUDA path would before the error reaches the host)."""
    from moe_dispatch.ops import kernels as K

    routing_map, tokens, probs = _case()
    slots, stats = K.make_slots(routing_map, 1)
    N = int(stats[:-1].sum())
    y = torch.randn(N, tokens.shape[1])
    g = torch.randn_like(tokens)
    status = guard.status(torch.device("cpu"))
    clean = (K.permute_rows(tokens, slots, probs, N, False), K.unpermute_rows(y, slots, None),
             K.permute_rows_backward(y, slots, torch.ones(N), torch.float32),
             K.unpermute_rows_backward(g, y, slots, probs, False, 3))
    try:
        status[guard.SIZES] = 1
        outs = (K.permute_rows(tokens, slots, probs, N, False), K.unpermute_rows(y, slots, None),
                K.permute_rows_backward(y, slots, torch.ones(N), torch.float32),
                K.unpermute_rows_backward(g, y, slots, probs, False, 3))
    finally:
        status.zero_()
    (rows, row_probs, _), out, (grad_tokens, grad_token_probs), (grad_rows, grad_probs) = outs
    assert rows.isnan().all() and row_probs.isnan().all() and out[routing_map.any(1)].isnan().all()
    assert grad_tokens.isnan().all() and grad_token_probs[routing_map].isnan().all()
    assert grad_rows.isnan().all() and grad_probs.isnan().all()
    assert not clean[0][0].isnan().any() and not clean[3][1].isnan().any()


def test_status_poisons_float8_results():
    """The same for float8 rows and results (written as bytes): NaN bytes, NaN row scales."""
    from moe_dispatch.ops import kernels as K

    routing_map, tokens, probs = _case()
    fp8 = torch.float8_e4m3fn
    slots, stats = K.make_slots(routing_map, 1)
    N = int(stats[:-1].sum())
    q, y, g = tokens.to(fp8), torch.randn(N, tokens.shape[1]).to(fp8), torch.randn_like(tokens).to(fp8)
    status = guard.status(torch.device("cpu"))
    try:
        status[guard.SIZES] = 1
        rows, _, row_scales = K.permute_rows(q, slots, probs, N, False, row_scales=torch.ones(tokens.shape[0]))
        out = K.unpermute_rows(y, slots, None, row_scales=torch.ones(N))  # with probs the CPU raises at once
        grad_tokens, _ = K.permute_rows_backward(y, slots, None, torch.float32)
        grad_rows, _ = K.unpermute_rows_backward(g, y, slots, probs, False, 3, row_scales=torch.ones(N))
    finally:
        status.zero_()
    assert rows.float().isnan().all() and row_scales.isnan().all() and out[routing_map.any(1)].float().isnan().all()
    assert grad_tokens.float().isnan().all() and grad_rows.float().isnan().all()


# ---------------------------------------------------------------------------------------------
# Kernels stay inside their buffers whatever the slots say (what compute-sanitizer checks on
# CUDA): every buffer the launchers allocate gets sentinel rows after it that must survive.
# ---------------------------------------------------------------------------------------------
class _GuardedTorch:
    """Stands in for ``torch`` inside the permutation kernels' modules: empty/zeros return the leading view of a
    buffer with PAD sentinel rows after it; ``check()`` asserts the sentinels are intact."""

    PAD = 64

    def __init__(self):
        self.buffers = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def _alloc(self, fill_zero: bool, *size, dtype=None, device=None):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        shape = tuple(shape)
        big = torch.full((shape[0] + self.PAD, *shape[1:]), 77, dtype=dtype or torch.float32, device=device)
        view = big[:shape[0]]
        view.fill_(0 if fill_zero else 55)
        self.buffers.append((big, shape[0], big[shape[0]:].clone()))
        return view

    def empty(self, *size, dtype=None, device=None):
        return self._alloc(False, *size, dtype=dtype, device=device)

    def zeros(self, *size, dtype=None, device=None):
        return self._alloc(True, *size, dtype=dtype, device=device)

    def check(self):
        for big, n, tail in self.buffers:
            assert torch.equal(big[n:], tail), f"a kernel wrote past a buffer of {n} rows"


@pytest.fixture
def guarded(monkeypatch):
    from moe_dispatch.ops import kernels as K
    from moe_dispatch.ops.kernels import permute, row_map, slot_rows, unpermute

    fake = _GuardedTorch()
    for module in (permute, row_map, slot_rows, unpermute):
        monkeypatch.setattr(module, "torch", fake)
    yield K
    fake.check()


def test_kernels_never_touch_rows_outside_their_buffers(guarded):
    """Slots that name rows past N (sizes too small), a backward bound below n_t, and an index past
    the gathered tensor: no write outside any buffer, no read outside (the interpreter would crash),
    and the same values as the twin, which states the semantics: such rows are skipped, and a
    token with more experts than the bound gets a NaN probability gradient."""
    K = guarded
    routing_map, tokens, probs = _case(T=30, E=8, K=4, H=40, seed=4)
    slots, stats = TW.make_slots(routing_map, 1)
    N_true = int(stats[:-1].sum())
    N = N_true - 9  # the last 9 rows exist only in the slots
    y = torch.randn(N, 40)
    g = torch.randn_like(tokens)
    grad_probs_in = torch.randn(N)

    ours = K.permute_rows(tokens, slots, probs, N, False)
    theirs = TW.permute_rows(tokens, slots, probs, N, False)
    routed_rows = slots[:, 1:9][slots[:, 1:9].ge(0) & slots[:, 1:9].lt(N)].long()
    assert torch.equal(ours[0][routed_rows], theirs[0][routed_rows])
    assert torch.equal(ours[1][routed_rows], theirs[1][routed_rows])
    assert torch.equal(K.unpermute_rows(y, slots, probs), TW.unpermute_rows(y, slots, probs))
    a = K.permute_rows_backward(y, slots, grad_probs_in, torch.float32)
    b = TW.permute_rows_backward(y, slots, grad_probs_in, torch.float32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for max_slots in (4, 2, 1):
        a = K.unpermute_rows_backward(g, y, slots, probs, True, max_slots)
        b = TW.unpermute_rows_backward(g, y, slots, probs, True, max_slots)
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[1].isnan(), b[1].isnan())
        assert torch.allclose(a[1].nan_to_num(), b[1].nan_to_num(), rtol=1e-5, atol=1e-5)
        assert bool(b[1][slots[:, 0] > max_slots].isnan().all()) and not b[1][slots[:, 0] <= max_slots].isnan().any()
    index = torch.tensor([0, N + 100, 3, -5, N - 1])
    out = K.gather_rows(y, index)
    assert torch.equal(out[[0, 2, 4]], y[[0, 3, N - 1]]) and torch.equal(out[[1, 3]], torch.zeros(2, 40))


def test_hand_made_slots_with_bad_counts_and_experts_stay_inside(guarded):
    """n_t beyond E or negative, expert ids outside [0, E): clamped and skipped like the twin."""
    K = guarded
    routing_map, tokens, probs = _case(T=12, E=4, K=2, H=24, seed=2)
    slots, stats = TW.make_slots(routing_map, 1)
    N = int(stats[:-1].sum())
    slots = slots.clone()
    slots[0, 0] = 99
    slots[1, 0] = -3
    slots[2, 1 + 4] = 17  # expert id past E
    slots[3, 1 + 4 + 1] = -2
    y = torch.randn(N, 24)
    g = torch.randn_like(tokens)
    a, b = K.permute_rows(tokens, slots, probs, N, True), TW.permute_rows(tokens, slots, probs, N, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(K.unpermute_rows(y, slots, probs), TW.unpermute_rows(y, slots, probs))
    a = K.unpermute_rows_backward(g, y, slots, probs, True, 4)
    b = TW.unpermute_rows_backward(g, y, slots, probs, True, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].isnan(), b[1].isnan())


# ---------------------------------------------------------------------------------------------
# NaN, inf and negative probs: rejected NaN/inf (every [T, E] entry, as the dispatchers), accepted
# negative values.
# ---------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf * 0 in the interpreter's numpy
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("routed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nonfinite_probs_rejected_by_permute_and_unpermute(value, routed, dtype):
    routing_map, tokens, probs = _case()
    probs = probs.to(dtype)
    t = 5
    e = int(routing_map[t].nonzero()[0]) if routed else int((~routing_map[t]).nonzero()[0])
    bad = probs.clone()
    bad[t, e] = value
    _same_error_on_both_backends(lambda: permute(tokens, routing_map, bad), "probs passed to permute contain NaN")
    counts = routing_map.sum(0).tolist()
    _same_error_on_both_backends(lambda: permute(tokens, routing_map, bad, tokens_per_expert=counts),
                                 "probs passed to permute contain NaN")
    with set_backend("torch"):
        permuted, _, rmap = permute(tokens, routing_map)
    _same_error_on_both_backends(lambda: unpermute(permuted, rmap, bad), "probs passed to unpermute contain NaN")


def test_negative_probs_are_accepted_alike():
    routing_map, tokens, probs = _case()
    probs = probs * torch.where(torch.rand(probs.shape) < 0.5, -1.0, 1.0)
    results = []
    for backend in BACKENDS:
        with set_backend(backend):
            tok = tokens.clone().requires_grad_()
            pr = probs.clone().requires_grad_()
            permuted, permuted_probs, rmap = permute(tok, routing_map, pr)
            out = unpermute(permuted * 3, rmap, pr)
            out.sum().backward()
            results.append((permuted_probs.detach(), out.detach(), tok.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    expect = (probs.double() @ torch.ones(8, 1, dtype=torch.float64)) * tokens.double() * 3
    assert torch.allclose(results[0][1].double(), expect, atol=1e-5)
    assert bool((results[0][0] < 0).any())


def test_status_is_clean_after_an_error():
    routing_map, tokens, probs = _case()
    counts = routing_map.sum(0).tolist()
    for backend in BACKENDS:
        with set_backend(backend):
            with pytest.raises(ValueError):
                permute(tokens, routing_map, probs, tokens_per_expert=_swap_two(counts))
            a = permute(tokens, routing_map, probs, tokens_per_expert=counts)
            assert not a[0].isnan().any()
    check_device_errors()  # nothing pending, nothing set: returns


# ---------------------------------------------------------------------------------------------
# RowIdMap misuse.
# ---------------------------------------------------------------------------------------------
def test_row_id_map_misuse_is_reported():
    routing_map, tokens, probs = _case(T=23)
    other_map, other_tokens, other_probs = _case(T=17, seed=1)
    permuted, _, rmap = permute(tokens, routing_map, probs)
    _, _, small_map = permute(other_tokens, other_map, other_probs)
    with pytest.raises(ValueError, match="permuted_tokens has"):
        unpermute(permuted, small_map, other_probs)  # another call's N
    with pytest.raises(ValueError, match=r"probs must have shape \[T, E\] = \[23, 8\]"):
        unpermute(permuted, rmap, other_probs)  # another call's T
    with pytest.raises(ValueError, match="probs must have shape"):
        unpermute(permuted, rmap, probs[:, :4])  # another E
    with pytest.raises(ValueError, match="restore_shape"):
        unpermute(permuted, rmap, probs, restore_shape=(17, 40))
    with pytest.raises(ValueError, match="restore_shape"):
        unpermute(permuted, rmap, probs, restore_shape=(23, 2, 20))
    assert unpermute(permuted, rmap, probs, restore_shape=(23, 1, 40)).shape == (23, 1, 40)


@pytest.mark.parametrize("change,match", [
    (dict(slots=torch.zeros(3, 4, dtype=torch.int32)), "RowIdMap.slots"),
    (dict(slots=torch.zeros(3, 5, dtype=torch.int64)), "RowIdMap.slots"),
    (dict(expert_rows=torch.zeros(3)), "RowIdMap.expert_rows"),
    (dict(padded_expert_rows=[1, 2]), "RowIdMap.padded_expert_rows"),
    (dict(num_out_tokens=-1), "RowIdMap.num_out_tokens"),
    (dict(num_out_tokens=2 ** 31), "RowIdMap.num_out_tokens"),
    (dict(num_out_tokens=4.0), "RowIdMap.num_out_tokens"),
    (dict(max_experts_per_token=3), "RowIdMap.max_experts_per_token"),
])
def test_row_id_map_fields_are_checked(change, match):
    fields = dict(slots=torch.full((3, 5), -1, dtype=torch.int32), expert_rows=torch.zeros(2),
                  padded_expert_rows=torch.zeros(2), num_out_tokens=4, has_pad_rows=True,
                  max_experts_per_token=2)
    RowIdMap(**fields)
    RowIdMap(*fields.values())  # positional, as the dispatchers build it
    with pytest.raises((ValueError, TypeError), match=match):
        RowIdMap(**{**fields, **change})


# ---------------------------------------------------------------------------------------------
# CUDA: the deferred error and the poisoned results.
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_wrong_sizes_poison_then_raise_the_cpu_error():
    routing_map, tokens, probs = _case(T=300, E=16, K=4, H=64)
    counts = routing_map.sum(0).tolist()
    for given, most in ((_swap_two(counts), 4), ([c - 1 if c else 0 for c in counts], 4), (counts, 3)):
        cpu_message = _message("torch", lambda: permute(tokens, routing_map, probs, tokens_per_expert=given,
                                                        max_experts_per_token=most))
        permuted, permuted_probs, rmap = permute(tokens.cuda(), routing_map.cuda(), probs.cuda(),
                                                 tokens_per_expert=given, max_experts_per_token=most)
        assert permuted.isnan().any()
        # The deferred error is raised by the first later op that finds the status copy arrived
        # (on a fast GPU often this unpermute), else by check_device_errors().
        try:
            out = unpermute(permuted, rmap, probs.cuda())
        except ValueError as early:
            assert str(early) == cpu_message
        else:
            assert out[routing_map.cuda().any(1)].isnan().all()
            with pytest.raises(ValueError) as info:
                check_device_errors()
            assert str(info.value) == cpu_message
        good = permute(tokens.cuda(), routing_map.cuda(), probs.cuda(), tokens_per_expert=counts)[0]
        check_device_errors()
        assert torch.equal(good.cpu(), permute(tokens, routing_map, probs)[0])


@pytest.mark.gpu
def test_cuda_nonfinite_probs_raise_the_cpu_error():
    routing_map, tokens, probs = _case(T=300, E=16, K=4, H=64)
    bad = probs.clone()
    bad[7, 3] = float("nan")
    cpu_message = _message("torch", lambda: permute(tokens, routing_map, bad))
    with pytest.raises(ValueError) as info:
        permute(tokens.cuda(), routing_map.cuda(), bad.cuda())  # synchronises: raises at once
    assert str(info.value) == cpu_message
    permuted, _, rmap = permute(tokens.cuda(), routing_map.cuda())
    cpu_message = _message("torch", lambda: unpermute(permuted.cpu(), permute(tokens, routing_map)[2], bad))
    unpermute(permuted, rmap, bad.cuda())
    with pytest.raises(ValueError) as info:
        check_device_errors()
    assert str(info.value) == cpu_message
