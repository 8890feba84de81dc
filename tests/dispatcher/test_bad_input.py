"""Bad input on one rank gives the same clear ValueError on every rank, with no hang (the spawn
runs under a timeout, see conftest.py; these checks run first in it), and the group stays usable
afterwards. Also: every rank empty."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.config import DISPATCHER_KINDS

# case -> (ranks that take part, words the message must contain)
CASES = {
    "ctor_indivisible": (range(4), ["num_experts=6", "EP size 4"]),
    "functional_indivisible": (range(4), ["num_experts=6", "EP size 4"]),
    "expert_tp": (range(4), ["expt_tp", "size 2"]),
}
for _kind in DISPATCHER_KINDS:
    CASES.update({
        f"{_kind}_map_columns": (range(4), ["routing_map", "EP rank 2", "[8, 9]", "num_experts"]),
        f"{_kind}_hidden_size": (range(4), ["hidden_states", "[T, 64]", "[8, 32] on EP rank 1"]),
        f"{_kind}_probs_shape_megatron_api": (range(4), ["probs", "EP rank 3", "[8, 7]"]),
        f"{_kind}_map_dtype_ep2": (range(2), ["routing_map", "bool", "EP rank 0", "int64"]),
        f"{_kind}_hidden_dtype": (range(4), ["hidden_states dtype differs", "float32"]),
        f"{_kind}_capacity_overflow": (range(4), ["capacity", "the router must drop"]),
        f"{_kind}_probs_nan": (range(4), ["probs contain NaN or inf", "EP rank 1"]),
    })


@pytest.fixture(scope="module")
def ranks(gloo_ranks):
    return [rank["bad_input"] for rank in gloo_ranks]


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_value_error_on_every_rank(ranks, case):
    members, words = CASES[case]
    outcomes = [ranks[r]["outcomes"][case] for r in members]
    for r, (kind, message) in zip(members, outcomes):
        assert kind == "ValueError", f"rank {r}: expected ValueError, got {kind}: {message}"
        for word in words:
            assert word in message, f"rank {r}: {word!r} not in {message!r}"
    assert len({m for _, m in outcomes}) == 1, f"messages differ across ranks: {outcomes}"


def test_group_still_works_and_empty_batches(ranks):
    for r, rank in enumerate(ranks):
        checks = rank["checks"]
        for kind in DISPATCHER_KINDS:
            assert torch.equal(checks[kind], checks[f"{kind}_ep1"]), (r, kind)
            assert torch.equal(checks[kind], checks["alltoall"]), (r, kind)
            assert checks[f"{kind}_empty"] == ((0, 64), (0, 64), (0, 8)), (r, kind)
