"""Bitwise row stability: a row's output, input gradient and prob gradient do not depend on how
many rows its expert received, on where the row sits, or on the other experts' rows.

Each case places one fixed token (with a fixed upstream gradient row and prob) at several
positions of an expert block of 1, 3, 7, 8, 64 or 200 rows, with other experts holding 0 or more
rows, and compares against the token alone. ffn=104 leaves a SIMD tail in a lone row, and 200+
rows x 208 columns pass torch's 32768-element parallel grain, so multi-threaded chunking of the
elementwise kernels is exercised as well. The same checks run under `tests.fake_blas.FakeBlas`, a
BLAS whose rows change with the row count and position, so they hold whatever the CPU's BLAS does.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_dispatch.experts import GroupedMLP, SequentialMLP, expert_gemm, scale_rows
from moe_dispatch.experts.activations import _row_sum, _unary, activate
from moe_dispatch.experts.gemm import select_gemm
from moe_dispatch.tools.batch_invariance import activation_mismatches
from tests.experts.reference import make_config
from tests.fake_blas import FakeBlas

BLOCK_SIZES = [1, 3, 7, 8, 64, 200]
# (rows of the other two experts): empty neighbours, and neighbours whose blocks shift the row.
NEIGHBOURS = [(0, 0), (5, 130)]


def _run_with_row(experts, token, grad_row, prob, block, pos, before, after, seed):
    """Forward + backward with `token` at position `pos` of expert 1's block; returns the row's
    (output, input grad, prob grad)."""
    g = torch.Generator().manual_seed(seed)
    h, dtype, device = token.shape[0], token.dtype, token.device
    counts = [before, block, after]
    n = sum(counts)
    x = torch.randn(n, h, generator=g).to(device, dtype)
    dy = torch.randn(n, h, generator=g).to(device, dtype)
    probs = torch.rand(n, generator=g).to(device)
    row = before + pos
    x[row], dy[row], probs[row] = token, grad_row, prob
    x.requires_grad_()
    probs.requires_grad_()
    y = experts(x, torch.tensor(counts), probs)
    y.backward(dy)
    pgrad = probs.grad[row] if probs.grad is not None else None
    return y[row].detach(), x.grad[row], pgrad


def _assert_row_stable(experts, dtype, blocks=BLOCK_SIZES, neighbours=NEIGHBOURS):
    device = experts.weight1.device
    g = torch.Generator().manual_seed(123)
    token = torch.randn(experts.hidden_size, generator=g).to(device, dtype)
    grad_row = torch.randn(experts.hidden_size, generator=g).to(device, dtype)
    prob = torch.tensor(0.37, device=device)
    ref = _run_with_row(experts, token, grad_row, prob, 1, 0, 0, 0, seed=0)
    for i, (block, (before, after)) in enumerate(itertools.product(blocks, neighbours)):
        for pos in sorted({0, (block // 2) * (before > 0), block - 1}):
            got = _run_with_row(experts, token, grad_row, prob, block, pos, before, after, seed=i + 1)
            where = f"block={block} pos={pos} neighbours={before},{after}"
            assert torch.equal(got[0], ref[0]), f"output differs at {where}"
            assert torch.equal(got[1], ref[1]), f"input grad differs at {where}"
            if ref[2] is not None:
                assert torch.equal(got[2], ref[2]), f"prob grad differs at {where}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
def test_module_row_stable(dtype, activation):
    """Under a BLAS whose rows change with the row count and position: the CPU paths take no
    matrix product from the BLAS at all, so this holds on any CPU. GroupedMLP only: on CPU
    SequentialMLP computes the same, bitwise (test_both_classes_compute_the_same_on_cpu)."""
    # ffn=104 is not a multiple of the SIMD step, so a lone row's activations end in a scalar tail.
    cfg = make_config(activation, dtype, probs_in_experts=activation != "relu", ffn=104, num_experts=3)
    with FakeBlas() as blas:
        _assert_row_stable(GroupedMLP(cfg, 3), dtype)
    assert blas.calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_classes_compute_the_same_on_cpu(dtype):
    """GroupedMLP and SequentialMLP share LocalExperts' forward and differ only in prefer_grouped,
    and GroupedMLP's grouped_mm is row-stable on CUDA bf16 only: on CPU both take the "ordered"
    GEMMs, with bitwise the same output and gradients (so the sweep above needs one of them)."""
    cfg = make_config("swiglu", dtype, probs_in_experts=True, ffn=104, num_experts=3)
    g = torch.Generator().manual_seed(7)
    counts = torch.tensor([5, 130, 65])
    x, dy = (torch.randn(200, 64, generator=g).to(dtype) for _ in range(2))
    probs = torch.rand(200, generator=g)
    grouped, sequential = GroupedMLP(cfg, 3), SequentialMLP(cfg, 3)
    sequential.load_state_dict(grouped.state_dict())
    results = []
    for experts in (grouped, sequential):
        name = type(experts).__name__
        assert select_gemm(x, experts.weight1.to(dtype), experts.prefer_grouped, experts.row_stable) == "ordered", name
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        with FakeBlas() as blas:
            experts(xi, counts, pi).backward(dy)
        assert blas.calls == 0, name
        results.append([xi.grad, pi.grad, experts.weight1.grad, experts.weight2.grad])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_fake_blas_is_row_unstable():
    """The fake BLAS really changes rows with the row count (so the tests here can fail), even
    through the fixed-shape "tiled" calls (a row's position in the tile matters to it)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 64, 96, generator=g)
    token = torch.randn(64, generator=g)
    with FakeBlas() as blas:
        for strategy in ("loop", "tiled"):
            rows = []
            for m in range(1, 5):
                x = torch.randn(m, 64, generator=g)
                x[m - 1] = token
                rows.append(expert_gemm(x, w, torch.tensor([m]), strategy)[m - 1])
            assert not all(torch.equal(r, rows[0]) for r in rows), strategy
    assert blas.calls > 0


# Every row count up to 70, and 200 (float32, bfloat16); a sample for float16 and float64.
GEMM_COUNTS = {torch.float32: list(range(1, 71)) + [200], torch.bfloat16: list(range(1, 71)) + [200],
               torch.float16: [1, 2, 3, 7, 8, 9, 64, 65, 200], torch.float64: [1, 2, 3, 7, 8, 9, 64, 65, 200]}


@pytest.mark.parametrize("dtype", list(GEMM_COUNTS))
def test_ordered_gemm_every_row_count_and_position(dtype):
    """expert_gemm "ordered" forward and input gradient: one token at the first, middle and last
    position of an expert block of each size in GEMM_COUNTS, other rows random and another
    expert before it, equals the token alone, bitwise, under the fake BLAS."""
    g = torch.Generator().manual_seed(7)
    k, n = 72, 40  # K = 72 halves to 9: an odd tree level
    w = torch.randn(2, k, n, generator=g).to(dtype)
    token, grad_row = torch.randn(k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)

    def row(m, pos, before):
        x = torch.randn(before + m, k, generator=g).to(dtype)
        dy = torch.randn(before + m, n, generator=g).to(dtype)
        x[before + pos], dy[before + pos] = token, grad_row
        x.requires_grad_()
        y = expert_gemm(x, w, torch.tensor([before, m]), "ordered")
        y.backward(dy)
        return y[before + pos].detach(), x.grad[before + pos]

    with FakeBlas() as blas:
        ref = row(1, 0, 0)
        for m in GEMM_COUNTS[dtype]:
            for pos, before in sorted({(0, 0), (m // 2, 3), (m - 1, 11)}):
                got = row(m, pos, before)
                assert torch.equal(got[0], ref[0]), f"output differs at rows={m} pos={pos}"
                assert torch.equal(got[1], ref[1]), f"input grad differs at rows={m} pos={pos}"
    assert blas.calls == 0
    ref64 = token.double() @ w[1].double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    torch.testing.assert_close(ref[0].double(), ref64, rtol=tol, atol=tol * ref64.abs().max().item())


def test_ordered_weight_grad_depends_on_the_experts_rows_only():
    """dw of an expert is a fixed-order sum over its rows: the same rows in the same order give
    the same bits whatever precedes them (another offset in memory, other experts' rows) and
    whatever BLAS is installed; it equals x^T dy within rounding."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(2, 24, 16, generator=g)
    x1, dy1 = torch.randn(37, 24, generator=g), torch.randn(37, 16, generator=g)

    def dw(before):
        x = torch.cat([torch.randn(before, 24, generator=g), x1]).requires_grad_()
        wg = w.clone().requires_grad_()
        expert_gemm(x, wg, torch.tensor([before, 37]), "ordered").backward(
            torch.cat([torch.randn(before, 16, generator=g), dy1]))
        return wg.grad[1]

    ref = dw(0)
    with FakeBlas():
        for before in (1, 5, 64, 301):
            assert torch.equal(dw(before), ref), before
    torch.testing.assert_close(ref, x1.t() @ dy1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["grouped", "loop"])
def test_fast_paths_take_their_products_from_the_blas(strategy):
    """Why the CPU default is "ordered": the fast paths hand their products to the BLAS, so their
    rows are whatever this CPU's BLAS gives (the fake BLAS sees the call; it changes rows with the
    row count, see test_fake_blas_is_row_unstable). What the installed BLAS does at which sizes is
    a measurement: scripts/measure/cpu_row_stability.py."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 64, 96, generator=g)
    x = torch.randn(8, 64, generator=g)
    with FakeBlas() as blas:
        try:
            expert_gemm(x, w, torch.tensor([8]), strategy)
        except AssertionError as e:  # the fake BLAS has no _grouped_mm; it raises once it has counted it
            assert "_grouped_mm" in str(e), e
    assert blas.calls > 0


def test_unaligned_hidden_stays_row_stable():
    """H=20 bf16 rows are 40 bytes (grouped_mm would reject them); H=20 halves to an odd level."""
    experts = GroupedMLP(make_config("swiglu", torch.bfloat16, True, hidden=20, ffn=24, num_experts=3), 3)
    assert experts.gemm_strategies(torch.zeros(1, 20, dtype=torch.bfloat16)) == ("ordered", "ordered")
    _assert_row_stable(experts, torch.bfloat16)


def test_strategy_selection_cpu():
    cfg = make_config("gelu", torch.float32)
    for x in (torch.zeros(1, 64), torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 64, dtype=torch.float16)):
        assert GroupedMLP(cfg, 4).gemm_strategies(x) == ("ordered", "ordered")  # never the CPU BLAS
        assert SequentialMLP(cfg, 4).gemm_strategies(x) == ("ordered", "ordered")
        assert GroupedMLP(cfg, 4, row_stable=False).gemm_strategies(x) == ("grouped", "grouped")
        assert SequentialMLP(cfg, 4, row_stable=False).gemm_strategies(x) == ("loop", "loop")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_cpu_activations_do_not_depend_on_batch(dtype, name):
    """The hand-built CPU activations (fwd + bwd): any row, or single element, equals the same
    computed inside a large batch (SIMD tails, multi-threaded chunks)."""
    assert activation_mismatches(lambda h: _unary(h, name), dtype) == 0


# torch's transcendental CPU kernels: each has a SIMD body and a scalar tail with other code.
_NATIVE_TRANSCENDENTALS = {"silu", "silu_backward", "gelu", "gelu_backward", "sigmoid", "sigmoid_backward",
                           "exp", "expm1", "erf", "erfc", "tanh", "tanh_backward", "log", "log1p"}


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_cpu_activations_take_no_native_transcendental(dtype, activation):
    """Why they are hand-built: torch's CPU silu/gelu/exp kernels run SIMD and scalar code that
    may give other bits for an element alone than inside a batch (how often on this CPU:
    scripts/measure/cpu_row_stability.py). The CPU activations, forward and backward, call none
    of them: only IEEE-exact arithmetic, so no CPU's vectorisation can change a row."""
    h = torch.randn(9, 2 * 40, dtype=dtype, requires_grad=True)
    with _OpNames() as ops:
        activate(h, activation).float().square().sum().backward()
    assert not ops.names & _NATIVE_TRANSCENDENTALS, sorted(ops.names & _NATIVE_TRANSCENDENTALS)
    assert "mul" in ops.names  # the recorder saw the activation's ops


def test_row_sum_is_exactly_a_fixed_tree():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 77, generator=g)
    s = _row_sum(x)
    assert torch.allclose(s.double(), x.double().sum(1), rtol=0, atol=77 * 2**-24 * x.abs().sum(1).max().item())
    assert all(torch.equal(_row_sum(x[i : i + 1])[0], s[i]) for i in range(50))
    assert _row_sum(torch.zeros(4, 0)).shape == (4,)


def test_scale_rows_matches_megatron_rounding():
    """bf16 act times fp32 prob is one fp32 product rounded once to bf16, as torch promotion does."""
    g = torch.Generator().manual_seed(3)
    act = torch.randn(9, 16, generator=g).bfloat16()
    probs = torch.rand(9, generator=g)
    assert torch.equal(scale_rows(act, probs), (act * probs.unsqueeze(-1)).to(torch.bfloat16))


def _expert_one_result(experts, x1, dy1, p1, before, after, seed):
    """Output rows, input grads, prob grads and weight grads of global expert 1's rows (x1)."""
    g = torch.Generator().manual_seed(seed)
    device, dtype, h = x1.device, x1.dtype, x1.shape[1]
    local = experts.num_local_experts
    counts = [before, x1.shape[0], after] if local == 3 else [x1.shape[0]]
    lead = counts[0] if local == 3 else 0
    n = sum(counts)
    x = torch.randn(n, h, generator=g).to(device, dtype)
    dy = torch.randn(n, h, generator=g).to(device, dtype)
    probs = torch.rand(n, generator=g).to(device)
    rows = slice(lead, lead + x1.shape[0])
    x[rows], dy[rows], probs[rows] = x1, dy1, p1
    x.requires_grad_()
    probs.requires_grad_()
    experts.zero_grad(set_to_none=True)
    experts(x, torch.tensor(counts), probs).backward(dy)
    k = 1 - experts.local_expert_offset
    y = experts(x.detach(), torch.tensor(counts), probs.detach())[rows]
    return y, x.grad[rows], probs.grad[rows], experts.weight1.grad[k], experts.weight2.grad[k]


def assert_ep_layouts_agree(cls, dtype, activation, device="cpu", rows=37, hidden=64):
    """Global expert 1 as local expert 1 of 3 (EP=1 of a 3-expert model, with other experts'
    rows around it) and as the only local expert (EP=3): bitwise equal rows and gradients."""
    cfg = make_config(activation, dtype, probs_in_experts=True, hidden=hidden, num_experts=3)
    g = torch.Generator().manual_seed(5)
    x1 = torch.randn(rows, hidden, generator=g).to(device, dtype)
    dy1 = torch.randn(rows, hidden, generator=g).to(device, dtype)
    p1 = torch.rand(rows, generator=g).to(device)
    alone = _expert_one_result(cls(cfg, 1, local_expert_offset=1, device=device), x1, dy1, p1, 0, 0, 1)
    full = cls(cfg, 3, device=device)
    for i, (before, after) in enumerate([(0, 0), (5, 0), (2, 130), (300, 7)]):
        got = _expert_one_result(full, x1, dy1, p1, before, after, seed=i + 2)
        for name, a, b in zip(("out", "dx", "dprobs", "dw1", "dw2"), got, alone):
            assert torch.equal(a, b), f"{name} differs with neighbours {before},{after}"


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ep_layouts_agree_including_weight_grads(cls, dtype):
    assert_ep_layouts_agree(cls, dtype, "swiglu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_vs_sequential(dtype):
    """Same weights, same tokens: bitwise equal on CPU (both run "ordered"), and within rounding
    of the fast grouped_mm path."""
    cfg = make_config("swiglu", dtype, probs_in_experts=True)
    x, tpe, probs = torch.randn(60, 64).to(dtype), torch.tensor([10, 0, 45, 5]), torch.rand(60)
    a, b = GroupedMLP(cfg, 4)(x, tpe, probs), SequentialMLP(cfg, 4)(x, tpe, probs)
    assert torch.equal(a, b)
    fast = GroupedMLP(cfg, 4, row_stable=False)(x, tpe, probs)
    assert (a.float() - fast.float()).abs().max() <= 8 * 2**-8 * a.float().abs().max()
