"""TreeExchange (GradientTree's cross-rank step): the reduce-scatter by recursive halving and the
all-gather give every value the same bits as recursive doubling (both partners adding the whole
joined prefix at each level), on 2, 4 and 8 gloo ranks, for vectors whose segments split unevenly
or are empty and values that join at later levels; each rank then sends 2 (W - 1) / W times the
values instead of log2(W) times. Below ``halving_min_bytes`` it takes recursive doubling itself:
the same bits, log2(W) times the values."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from moe_dispatch.parallel.tree_exchange import TreeExchange
from tests.dispatcher.harness import run_ranks


def _doubling(flat: torch.Tensor, prefix, world: int, rank: int, levels) -> torch.Tensor:
    """The reference: at each level k in ``levels``, both partners add the first prefix[k] values."""
    flat = flat.clone()
    for k in levels:
        n = prefix[k]
        if n == 0:
            continue
        peer = rank ^ (1 << k)
        splits = [n if r == peer else 0 for r in range(world)]
        received = torch.empty(n, dtype=flat.dtype)
        dist.all_to_all_single(received, flat[:n].contiguous(), splits, splits)
        flat[:n].add_(received)
    return flat


def _cases(world: int):
    """(n, prefix) pairs: every value from level 0; uneven and tiny lengths; values joining later
    (the experts of an EP group of 2 or 4 join at level 1 or 2); nothing at the first levels."""
    steps = int(math.log2(world))
    out = [(n, [n] * steps) for n in (1, 2, 3, 7, 64, 1001)]
    if steps >= 2:
        out += [(10, [6] + [10] * (steps - 1)), (9, [0] + [9] * (steps - 1)), (5, [1] + [5] * (steps - 1))]
    if steps >= 3:
        out += [(40, [13, 29, 40]), (6, [0, 0, 6]), (12, [5, 5, 12])]
    return out


def _worker(rank: int, world: int) -> dict:
    """{halving: results}: halving_min_bytes 0 (every vector halved) and 1 GiB (every vector here doubled)."""
    return {halving: _run(rank, world, 0 if halving else 1 << 30) for halving in (True, False)}


def _run(rank: int, world: int, halving_min_bytes: int) -> list:
    results = []
    exchange = TreeExchange(dist.group.WORLD, world, rank, overlap=False, halving_min_bytes=halving_min_bytes)
    steps = int(math.log2(world))
    for n, prefix in _cases(world):
        gen = torch.Generator().manual_seed(1000 * n + rank)
        # values of many magnitudes: a sum's bits depend on its order
        flat = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen).float())
        want = _doubling(flat, prefix, world, rank, range(steps))
        other_order = _doubling(flat, prefix, world, rank, reversed(range(steps)))
        got = flat.clone()
        sent_before = exchange.sent_bytes
        done = []
        exchange.start(got, prefix, lambda: done.append(True), at_once=True)
        results.append({"n": n, "prefix": prefix, "same": torch.equal(got, want), "done": done == [True],
                        "order matters": not torch.equal(other_order, want),
                        "sent": (exchange.sent_bytes - sent_before) // 4, "untouched": torch.equal(got[prefix[-1]:],
                                                                                                   flat[prefix[-1]:])})
    return results


@pytest.fixture(scope="module")
def spawned():
    return {world: run_ranks(_worker, world, timeout=240) for world in (2, 4, 8)}


@pytest.mark.parametrize("halving", [True, False], ids=["halving", "doubling"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_value_gets_recursive_doublings_bits(spawned, world, halving):
    per_rank = [out[halving] for out in spawned[world]]
    for rank, results in enumerate(per_rank):
        for r in results:
            assert r["same"] and r["done"] and r["untouched"], (world, rank, r)
    steps = int(math.log2(world))
    if steps >= 2:  # the data can tell two orders apart, so "same" above is not vacuous
        assert any(r["order matters"] for results in per_rank for r in results)
    for n, prefix in _cases(world):  # summed over the ranks, so no rounding of uneven halves
        sent = sum(next(r["sent"] for r in results if r["n"] == n and r["prefix"] == prefix) for results in per_rank)
        joined = [prefix[0]] + [prefix[j] - prefix[j - 1] for j in range(1, steps)]
        if halving:  # a value joining at level j: 2 (1 - 2^(j - steps)) sends per rank
            want = sum(2 * count * (world - world // 2 ** (steps - j)) for j, count in enumerate(joined))
        else:  # every rank sends it at each level from j on
            want = sum(count * world * (steps - j) for j, count in enumerate(joined))
        assert sent == want, (world, halving, n, prefix, sent, want)
