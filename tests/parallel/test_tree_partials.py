"""The tree's store for the experts' per-source gradients (`PairedSourceGrads`): it pairs each
backward's P blocks over the sources in order as they arrive, and holds one partial per weight."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.parallel.tree_partials import PairedSourceGrads, pair_sources


def _blocks(P: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[E_local = 3, P, 5, 7] with values whose fp32 sums round differently in other orders."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-6, 6, P, dtype=torch.float64).view(1, P, 1, 1)
    return (torch.randn(3, P, 5, 7, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_pair_sources_is_the_pairwise_tree_over_the_sources(dtype):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    b = _blocks(8, dtype, seed=1).to(acc)
    s = [b[:, i] for i in range(8)]
    tree = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
    got = pair_sources(_blocks(8, dtype, seed=1))
    assert got.dtype == acc and got.shape == (3, 5, 7)
    assert torch.equal(got, tree)
    left_fold = ((((((s[0] + s[1]) + s[2]) + s[3]) + s[4]) + s[5]) + s[6]) + s[7]
    assert not torch.equal(got, left_fold)  # the blocks tell the orders apart
    one = _blocks(1, dtype, seed=2)
    assert torch.equal(pair_sources(one), one[:, 0].to(acc))


def test_store_holds_one_partial_per_weight_and_adds_a_second_backward_in_order():
    store = PairedSourceGrads()
    first, second = _blocks(4, torch.bfloat16, seed=3), _blocks(4, torch.bfloat16, seed=4)
    store.add("weight1", first)
    assert store.held_bytes() == 3 * 5 * 7 * 4  # one fp32 [E_local, ...], not the 4 bf16 blocks
    store.add("weight1", second)
    store.add("weight2", first)
    assert store.held_bytes() == 2 * 3 * 5 * 7 * 4
    (got,) = store.take("weight1")
    assert torch.equal(got, pair_sources(first) + pair_sources(second))
    assert store.take("weight1") == []
    (other,) = store.take("weight2")
    assert torch.equal(other, pair_sources(first))
    assert store.held_bytes() == 0
