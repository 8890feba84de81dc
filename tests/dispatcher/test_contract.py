"""The headline contract, bitwise, on 4 gloo ranks (one spawn; EP groups of size 1, 2 and 4).

For fixed weights a token's MoE output and its input and probs gradients are bitwise identical
(a) on every rank holding the token, (b) with either dispatcher, (c) at EP size 1, 2 and 4,
(d) whatever other tokens share the batch. Per-expert weight gradients are compared bitwise across
EP sizes too: the test gives every expert the same rows in the same order at every EP size
(rank j of an EP-P group holds the j-th P-th of the global batch), so they are fixed-order sums.
Configurations: both dispatchers x fp32/bf16 tokens x probs applied in the combine / in the
experts, plus fp64 probs with pad_multiple 4, plus pad-to-capacity mode. The functional API runs
at EP 1 and 4, Megatron's six-method API at EP 2, so (c) also compares the two APIs.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from .helpers import E
from .workers import contract_configs

FIELDS = ("out", "gx", "gp")
# The EP sizes each scenario runs at; pad-to-capacity configs run "full" and "uneven" only.
SCENARIO_EPS = {"full": (1, 2, 4), "trunc": (1, 2, 4), "subset": (2, 4), "uneven": (4,), "identical": (4,),
                "sparse": (1, 2, 4)}
CAPACITY_SCENARIOS = ("full", "uneven")


def expected_runs() -> set:
    """Every (config, scenario, EP size) the contract must cover."""
    return {(cfg, scen, ep) for cfg in contract_configs() for scen, eps in SCENARIO_EPS.items() for ep in eps
            if "capacity" not in cfg or scen in CAPACITY_SCENARIOS}


@pytest.fixture(scope="module")
def results(gloo_ranks):
    return assemble([rank["contract"] for rank in gloo_ranks])


def assemble(ranks: list) -> dict:
    """contract_worker's per-rank records -> {runs: (cfg, scen, ep) -> replicas, naive: ...}."""
    replicas = defaultdict(list)  # (cfg, scen, ep, replica) -> records in group-rank order
    for rec in sorted((r for rank in ranks for r in rank["records"]), key=lambda r: r["rank"]):
        replicas[(rec["cfg"], rec["scen"], rec["ep"], rec["replica"])].append(rec)
    runs = defaultdict(list)  # (cfg, scen, ep) -> replicas, each assembled over its group
    for (cfg, scen, ep, _), recs in sorted(replicas.items()):
        run = {k: torch.cat([r[k] for r in recs]) for k in ("ids", *FIELDS)}
        run["gw"] = torch.cat([r["gw"] for r in recs])  # [E, H]: group rank j holds experts j*El..
        run["gb"] = torch.cat([r["gb"] for r in recs])
        run["tpe"] = [r["tpe"] for r in recs]
        runs[(cfg, scen, ep)].append(run)
    return dict(runs=runs, naive=[rank["naive"] for rank in ranks])


def by_token(run: dict, field: str) -> dict:
    return {int(i): row for i, row in zip(run["ids"], run[field])}


def assert_same_tokens(a: dict, b: dict, what: str, ids=None) -> None:
    """Bitwise equality of every field for the token ids `ids` (default: all of a's)."""
    ids = sorted(by_token(a, "out")) if ids is None else ids
    for field in FIELDS:
        ta, tb = by_token(a, field), by_token(b, field)
        x, y = torch.stack([ta[i] for i in ids]), torch.stack([tb[i] for i in ids])
        if not torch.equal(x, y):
            bad = (x != y).flatten(1).any(1).nonzero()[:, 0].tolist()
            raise AssertionError(f"{what}: {field} differs for {len(bad)} of {len(ids)} tokens "
                                 f"(first ids {[ids[i] for i in bad[:5]]}), max diff "
                                 f"{(x.double() - y.double()).abs().max().item():.3e}")


def test_runs_cover_the_matrix(results):
    runs = results["runs"]
    assert len(contract_configs()) == 14
    assert set(runs) == expected_runs()  # no row of the matrix missing, so no check below skips one
    # every non-empty result has a non-zero gradient, so equalities below are not vacuous
    for key, reps in runs.items():
        for field in FIELDS:
            assert reps[0][field].abs().sum() > 0, (key, field)


def test_a_every_rank_holding_a_token_agrees(results):
    for (cfg, scen, ep), reps in results["runs"].items():
        assert len(reps) == 4 // ep, (cfg, scen, ep)
        for rep in reps[1:]:
            assert_same_tokens(reps[0], rep, f"(a) {cfg} {scen} EP{ep} replicas")
            assert torch.equal(reps[0]["gw"], rep["gw"]) and torch.equal(reps[0]["gb"], rep["gb"])
        if scen == "identical":  # the 4 ranks of one EP-4 group hold the same 48 tokens
            run = reps[0]
            chunks = [{k: run[k][48 * j:48 * (j + 1)] for k in ("ids", *FIELDS)} for j in range(4)]
            for j in range(1, 4):
                assert_same_tokens(chunks[0], chunks[j], f"(a) {cfg} identical tokens, rank 0 vs {j}")


def test_b_allgather_equals_alltoall(results):
    runs = results["runs"]
    for (cfg, scen, ep), reps in runs.items():
        if cfg.startswith("alltoall"):
            other = runs[(cfg.replace("alltoall", "allgather"), scen, ep)][0]
            assert_same_tokens(reps[0], other, f"(b) {cfg} vs allgather, {scen} EP{ep}")
            assert torch.equal(reps[0]["gw"], other["gw"]), f"(b) {cfg} {scen} EP{ep} weight grads"


def test_c_ep_sizes_agree(results):
    runs = results["runs"]
    for cfg in contract_configs():
        for scen in ("full", "sparse", "subset"):
            if "capacity" in cfg and scen not in CAPACITY_SCENARIOS:
                continue
            first, *others = SCENARIO_EPS[scen]
            for ep in others:
                a, b = runs[(cfg, scen, first)][0], runs[(cfg, scen, ep)][0]
                assert_same_tokens(a, b, f"(c) {cfg} {scen} EP{first} vs EP{ep}")
                if "capacity" not in cfg:  # capacity padding changes the blocks' shapes
                    assert torch.equal(a["gw"], b["gw"]), f"(c) {cfg} {scen} weight grads EP{first} vs EP{ep}"
                    assert torch.equal(a["gb"], b["gb"]), f"(c) {cfg} {scen} bias grads EP{first} vs EP{ep}"


def test_d_other_tokens_do_not_matter(results):
    runs = results["runs"]
    for cfg in contract_configs():
        full4 = runs[(cfg, "full", 4)][0]
        assert_same_tokens(runs[(cfg, "uneven", 4)][0], full4, f"(d) {cfg} uneven split, empty rank")
        if "capacity" in cfg:  # runs "full" and "uneven" only (test_runs_cover_the_matrix)
            continue
        for ep in SCENARIO_EPS["trunc"]:  # tokens 90+ zeroed and re-routed: 0-89 unchanged
            assert_same_tokens(runs[(cfg, "full", ep)][0], runs[(cfg, "trunc", ep)][0],
                               f"(d) {cfg} truncation EP{ep}", ids=list(range(90)))
        for ep in SCENARIO_EPS["subset"]:  # every third token dropped
            assert_same_tokens(runs[(cfg, "subset", ep)][0], runs[(cfg, "full", ep)][0], f"(d) {cfg} subset EP{ep}")
        assert_same_tokens(runs[(cfg, "identical", 4)][0], full4, f"(d) {cfg} 48 tokens", ids=list(range(48)))


def test_capacity_mode_without_drops_equals_dropless(results):
    runs = results["runs"]
    for cfg in contract_configs():
        if "capacity" not in cfg:
            continue
        dropless = cfg.replace("-capacity", "")
        for scen, ep in (("full", 1), ("full", 2), ("full", 4), ("uneven", 4)):
            assert_same_tokens(runs[(cfg, scen, ep)][0], runs[(dropless, scen, ep)][0],
                               f"{cfg} vs dropless, {scen} EP{ep}")
        # fixed shapes: every local expert gets sum over sources of the capacity (a multiple of 4)
        for ep, cap in ((1, 144), (2, 72), (4, 36)):
            for tpe in runs[(cfg, "full", ep)][0]["tpe"]:
                assert tpe.tolist() == [cap * ep] * (E // ep), (cfg, ep, tpe)


def test_negative_control_bf16_partial_sums_break_c(results):
    """A combine that sums local experts into bf16 partials and then sums across ranks (as
    Megatron's allgather combine does) is NOT EP-size invariant on this data, while ours is."""
    naive = results["naive"][0]  # rank 0 holds tokens of EP1 (all), EP2 (0-95), EP4 (0-47)
    ids4 = naive[4][0].tolist()
    ref = naive[1][1][ids4]
    assert torch.allclose(naive[4][1].float(), ref.float(), rtol=2e-2, atol=2e-2)  # a sane combine...
    differ2 = (naive[2][1] != naive[1][1][naive[2][0]]).any(1).sum().item()
    differ4 = (naive[4][1] != ref).any(1).sum().item()
    assert differ2 + differ4 > 0, "the naive combine should differ across EP sizes on this data"
    ours = results["runs"][("alltoall-bf16-combine", "full", 1)][0]
    ours4 = results["runs"][("alltoall-bf16-combine", "full", 4)][0]
    assert torch.equal(by_token(ours, "out")[0], by_token(ours4, "out")[0])
    print(f"naive bf16 partial-sum combine: {differ2}/96 tokens differ EP1 vs EP2, {differ4}/48 EP1 vs EP4")
