"""Per-(expert, source) weight gradients (expert_gemm's source_blocks, LocalExperts.collect_source_grads):
each block's gradient is the product of that block's rows alone, bitwise what the same rows give
as an expert's only rows; padding rows after an expert's blocks add nothing; the forward and the
input gradient are the strategy's own."""
from __future__ import annotations

import copy

import pytest
import torch

from moe_dispatch.experts import ExpertRows, GroupedMLP, SourceGrads, expert_gemm
from moe_dispatch.experts.gemm import grouped_mm_supported
from tests.dispatcher.harness import value_error_of
from tests.experts.reference import make_config

# [E=3][P=3] (first row, rows); expert 1 has 2 padding rows after its blocks, expert 2 none at all
COUNTS = [7, 6, 0]
BLOCKS = (((0, 3), (3, 0), (3, 4)), ((7, 1), (8, 3), (11, 0)), ((13, 0), (13, 0), (13, 0)))
# the same without the padding: every row in a block (the grouped path's output is its GEMM's)
TIGHT = ([7, 4, 0], (((0, 3), (3, 0), (3, 4)), ((7, 1), (8, 3), (11, 0)), ((11, 0), (11, 0), (11, 0))))
K, M = 8, 12


def _strategies():
    x, w = torch.zeros(4, K), torch.zeros(3, K, M)
    return ["ordered", "loop", "tiled"] + (["grouped"] if grouped_mm_supported(x, w) else [])


def _run(strategy, x, w, dy, counts, blocks=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = []
    y = expert_gemm(x, w, torch.tensor(counts), strategy, 4, source_blocks=blocks,
                    sink=got.append if blocks is not None else None)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, got


@pytest.mark.parametrize("strategy", _strategies())
@pytest.mark.parametrize("counts, blocks", [(COUNTS, BLOCKS), TIGHT], ids=["padded", "tight"])
def test_block_gradient_is_its_rows_alone(strategy, counts, blocks):
    g = torch.Generator().manual_seed(0)
    n = sum(counts)
    x, dy, w = torch.randn(n, K, generator=g), torch.randn(n, M, generator=g), torch.randn(3, K, M, generator=g)
    y, gx, gw, got = _run(strategy, x, w, dy, counts, blocks)
    y_ref, gx_ref, gw_ref, _ = _run(strategy, x, w, dy, counts)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert gw is None and len(got) == 1 and got[0].shape == (3, 3, K, M)
    per_source = got[0]
    for e, row in enumerate(blocks):
        for s, (first, rows) in enumerate(row):
            if rows == 0:
                assert not per_source[e, s].any(), (e, s)
                continue
            alone = [rows if i == e else 0 for i in range(3)]
            *_, w_alone, _ = _run(strategy, x[first:first + rows], w, dy[first:first + rows], alone)
            assert torch.equal(per_source[e, s], w_alone[e]), (strategy, e, s)
    # padded: expert 1's 2 padding rows (11, 12) are in no block; the rest sums to the usual gradient
    padded = gw_ref.clone()
    padded[1] -= x[11:n].t() @ dy[11:n]
    torch.testing.assert_close(per_source.sum(1), padded, rtol=1e-5, atol=1e-5)


def _run_on(strategy, x, w, dy, counts, blocks, trailing):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = []
    counts = torch.tensor(counts, device=x.device)
    y = expert_gemm(x, w, counts, strategy, 4, trailing_rows=trailing, source_blocks=blocks, sink=got.append)
    y.backward(dy)
    return got[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_blocks_with_trailing_rows(device):
    """Issue 50, item 4: the sync-free plan's blocks, an int tensor [E, P] of rows on the device
    tiling the rows from 0, with trailing rows (junk, here huge) after them: each block's gradient
    is bitwise the host blocks' of the same rows without the trailing rows (grouped: the device
    ends are its groups, no host read; the loop paths read them)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    counts, blocks = TIGHT
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # CUDA's grouped GEMM needs 16-byte rows (M = 12 in bf16 is 24 bytes): 16 x 16 there
    k, m = (16, 16) if device == "cuda" else (K, M)
    g = torch.Generator().manual_seed(1)
    n = sum(counts)
    x, dy, w = torch.randn(n + 3, k, generator=g), torch.randn(n + 3, m, generator=g), torch.randn(3, k, m, generator=g)
    x[n:], dy[n:] = 1e30, -1e30
    x, dy, w = (t.to(device, dtype) for t in (x, dy, w))
    rows = torch.tensor([[r for _, r in row] for row in blocks], device=device)
    strategies = ["grouped"] if device == "cuda" else _strategies()
    assert device == "cpu" or grouped_mm_supported(x, w)
    for strategy in strategies:
        got = _run_on(strategy, x, w, dy, counts, rows, True)
        ref = _run_on(strategy, x[:n], w, dy[:n], counts, blocks, False)
        assert torch.equal(got, ref), strategy
    assert "integer [3, P]" in value_error_of(lambda: expert_gemm(x, w, torch.tensor(counts), "ordered",
                                                                  source_blocks=rows[:2], sink=print))


def test_bad_blocks_are_refused():
    x, w = torch.randn(13, K), torch.randn(3, K, M)
    counts = torch.tensor(COUNTS)
    assert "[3][P]" in value_error_of(lambda: expert_gemm(x, w, counts, "ordered", source_blocks=BLOCKS[:2],
                                                          sink=print))
    shifted = (((1, 2), (3, 0), (3, 4)), *BLOCKS[1:])
    assert "first block starts at row 1" in value_error_of(
        lambda: expert_gemm(x, w, counts, "ordered", source_blocks=shifted, sink=print))
    gap = (((0, 2), (3, 0), (3, 4)), *BLOCKS[1:])
    assert "not consecutive" in value_error_of(lambda: expert_gemm(x, w, counts, "ordered", source_blocks=gap,
                                                                   sink=print))
    over = (((0, 3), (3, 0), (3, 5)), *BLOCKS[1:])
    assert "past its 7 rows" in value_error_of(lambda: expert_gemm(x, w, counts, "ordered", source_blocks=over,
                                                                   sink=print))
    assert "needs a sink" in value_error_of(lambda: expert_gemm(x, w, counts, "ordered", source_blocks=BLOCKS))


def test_local_experts_collect_per_source_grads():
    """The experts put per-source gradients only in a store handed to collect_source_grads; the
    store gives each backward's, in order, once; None turns it off (.grad as usual again)."""
    experts = GroupedMLP(make_config(hidden=K, ffn=M, num_experts=3), 3, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), K, generator=g)
    rows = ExpertRows(x, host_rows_per_expert=torch.tensor(COUNTS), source_blocks=BLOCKS)
    assert experts.source_grads is None
    assert "per-source weight gradients are off" in value_error_of(lambda: experts(rows))
    assert "store must be a moe_dispatch.experts.SourceGrads" in value_error_of(
        lambda: experts.collect_source_grads({}))
    with pytest.raises(AttributeError):  # the old way (an attribute set from outside) is gone, not ignored
        experts.source_grads = {}
    store = SourceGrads()
    experts.collect_source_grads(store)
    assert experts.source_grads is store
    for _ in range(2):
        experts(rows).square().sum().backward()
    assert experts.weight1.grad is None and experts.weight2.grad is None
    assert [t.shape for t in store.take("weight1")] == [(3, 3, *experts.weight1.shape[1:])] * 2
    assert [t.shape for t in store.take("weight2")] == [(3, 3, *experts.weight2.shape[1:])] * 2
    assert store.take("weight1") == []
    assert copy.deepcopy(experts).source_grads is None
    experts.collect_source_grads(None)
    experts(ExpertRows(x, host_rows_per_expert=torch.tensor(COUNTS))).square().sum().backward()
    assert experts.weight1.grad is not None and store.take("weight1") == []


def test_store_held_bytes_counts_what_waits():
    store = SourceGrads()
    assert store.held_bytes() == 0
    store.add("weight1", torch.zeros(2, 3, 4))  # fp32: 96 bytes
    store.add("weight1", torch.zeros(2, 3, 4, dtype=torch.bfloat16))  # 48
    store.add("weight2", torch.zeros(5, dtype=torch.float64))  # 40
    assert store.held_bytes() == 96 + 48 + 40
    store.take("weight1")
    assert store.held_bytes() == 40
