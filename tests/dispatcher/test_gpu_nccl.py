"""The contract on 2 GPUs with NCCL and the Triton kernels: (a) replicas, (b) allgather ==
alltoall, (c) EP 1 == EP 2, (d) truncation and a batch of 96 identical-prefix tokens; bitwise.
The elementwise expert stand-in is row-stable on CUDA too."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from .harness import run_ranks
from .test_contract import assert_same_tokens
from .workers import nccl_worker

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def runs():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    recs = [r for rank in run_ranks(nccl_worker, 2, timeout=300, backend="nccl") for r in rank]
    grouped = defaultdict(list)
    for rec in sorted(recs, key=lambda r: r["rank"]):
        grouped[(rec["cfg"], rec["scen"], rec["ep"], rec["replica"])].append(rec)
    out = defaultdict(list)
    for (cfg, scen, ep, _), group in sorted(grouped.items()):
        run = {k: torch.cat([r[k] for r in group]) for k in ("ids", "out", "gx", "gp", "gw", "gb")}
        out[(cfg, scen, ep)].append(run)
    return out


def test_contract_on_gpu(runs):
    cfgs = sorted({cfg for cfg, _, _ in runs})
    assert len(cfgs) == 10
    for cfg in cfgs:
        ep1, ep2 = runs[(cfg, "full", 1)], runs[(cfg, "full", 2)][0]
        assert_same_tokens(ep1[0], ep1[1], f"(a) {cfg} EP1 on both GPUs")
        assert_same_tokens(ep1[0], ep2, f"(c) {cfg} EP1 vs EP2")
        if "capacity" not in cfg:
            assert torch.equal(ep1[0]["gw"], ep2["gw"]), f"(c) {cfg} weight grads"
        for ep in (1, 2):
            assert_same_tokens(runs[(cfg, "full", ep)][0], runs[(cfg, "trunc", ep)][0],
                               f"(d) {cfg} truncation EP{ep}", ids=list(range(90)))
        ident = runs[(cfg, "identical", 2)][0]
        halves = [{k: ident[k][96 * j:96 * (j + 1)] for k in ("ids", "out", "gx", "gp")} for j in range(2)]
        assert_same_tokens(halves[0], halves[1], f"(a) {cfg} identical tokens on both GPUs")
        assert_same_tokens(halves[0], ep2, f"(d) {cfg} 96 tokens vs 192", ids=list(range(96)))
        if cfg.startswith("alltoall"):
            other = cfg.replace("alltoall", "allgather")
            for scen, ep in (("full", 1), ("full", 2), ("trunc", 2)):
                assert_same_tokens(runs[(cfg, scen, ep)][0], runs[(other, scen, ep)][0], f"(b) {cfg} {scen} EP{ep}")
