"""How many collectives each stage of a step makes, on 2 gloo ranks (issue 30, item 5): a dropless
dispatch is one size exchange (an all-gather) and one data exchange, a combine one all-to-all, the
backward the mirror exchanges only; the return exchanges carry the call in their status rows.
strict_call_order adds its host-side call check (one all-gather) before each return exchange."""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from moe_dispatch.dispatcher import AllGatherDispatcher, AllToAllDispatcher

from .harness import run_ranks
from .helpers import batch, config

# Every collective of torch.distributed that the package could call, by the name counted.
_COLLECTIVES = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "all_gather": "all_gather",
                "all_gather_object": "all_gather", "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
                "all_reduce": "all_reduce", "broadcast": "broadcast", "reduce_scatter_tensor": "reduce_scatter",
                "barrier": "barrier", "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p"}


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the calls of torch.distributed's collectives inside the block (by kind)."""
    counts: Counter = Counter()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[_COLLECTIVES[name]] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _step(d, rank: int, seed: int) -> dict:
    """One dispatch, combine and backward; the collectives of each."""
    data = batch(torch.float32, seed=10 * seed + rank, n=12)
    x, probs = data["x"].requires_grad_(), data["probs"].requires_grad_()
    with count_collectives() as dispatch:
        rows, _, handle = d.dispatch(x, data["rmap"], probs)
    with count_collectives() as combine:
        out = d.combine(rows * 2, handle)
    with count_collectives() as backward:
        out.backward(data["r"])
    return dict(dispatch=dict(dispatch), combine=dict(combine), backward=dict(backward))


def collectives_worker(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    out = {}
    for name, cls, cfg in (("alltoall", AllToAllDispatcher, config()),
                           ("allgather", AllGatherDispatcher, config(kind="allgather")),
                           ("strict", AllToAllDispatcher, config(strict_call_order=True))):
        d = cls(cfg, group)
        out[name] = [_step(d, rank, seed) for seed in range(2)]  # the first has the configuration agreement
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(collectives_worker, 2, timeout=120)


DATA = {"alltoall": "all_to_all", "allgather": "all_gather", "strict": "all_to_all"}


@pytest.mark.parametrize("kind", ["alltoall", "allgather", "strict"])
def test_one_collective_per_direction(ranks, kind):
    strict = kind == "strict"
    for r, rank in enumerate(ranks):
        later = rank[kind][1]
        data = Counter({"all_gather": 1}) + Counter({DATA[kind]: 1})  # the size exchange, the rows
        assert later["dispatch"] == dict(data), (r, later)
        assert later["combine"] == ({"all_to_all": 1, "all_gather": 1} if strict else {"all_to_all": 1}), (r, later)
        # the combine's backward and the dispatch's backward (the gradients travel back to the owners)
        assert later["backward"] == ({"all_to_all": 2, "all_gather": 2} if strict else {"all_to_all": 2}), (r, later)
        first = rank[kind][0]  # the first step adds only its configuration agreement (one all-gather)
        assert first["dispatch"] == dict(data + Counter({"all_gather": 1})), (r, first)
        assert first["combine"] == later["combine"] and first["backward"] == later["backward"], (r, first)
