"""A bad hidden_states on one EP rank of an install()'d megatron-core MoELayer (2 gloo ranks, one
spawn, see megatron_fault_worker.py): every rank raises the same ValueError within 30 s (the
groups' timeout is 60 s), naming the argument and the rank; the router's collectives before the
dispatcher (aux_loss, seq_aux_loss and global_aux_loss counts, all-reduced between the two EP
ranks here) stay matched; the router's in-place counts are as before the failed step; and the
next good step on the same layer and group reproduces the reference step bitwise (output and
input gradient). Both dispatchers."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from moe_dispatch.config import DISPATCHER_KINDS  # noqa: E402
from tests.dispatcher.harness import run_ranks  # noqa: E402

from .megatron_fault_worker import CASES, SETTING_BAD_RANK, SETTING_CASES, fault_worker  # noqa: E402

CASE_TIMEOUT_S = 30
KINDS = DISPATCHER_KINDS
# case -> words every rank's message must contain
WORDS = {
    "hidden_size": ["hidden_states must have hidden size 64", "got 32", "EP rank 1"],
    "int64_hidden": ["hidden_states must be float32, float16 or bfloat16", "int64", "EP rank 1"],
    # NaN hidden states are a float input like any other; the router's probs turn NaN and the
    # dispatcher's exchange rejects those
    "nan_hidden": ["probs contain NaN or inf", "EP rank 1"],
    "not_tensor": ["hidden_states must be a tensor", "EP rank 1"],
    "two_dims_wrong_size": ["hidden_states must have hidden size 64", "got 56", "EP rank 0"],
}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(fault_worker, 2, timeout=150)


def test_every_case_is_checked():
    assert set(WORDS) == set(CASES)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_on_every_rank(ranks, kind, case):
    outs = [rank[kind][case] for rank in ranks]
    for r, o in enumerate(outs):
        assert o["seconds"] < CASE_TIMEOUT_S, (case, kind, r, o["seconds"])
        assert o["kind"] == "ValueError", (case, kind, r, o["kind"], o["message"])
        for word in WORDS[case]:
            assert word in o["message"], (case, kind, r, word, o["message"])
        assert o["buffers_kept"], (case, kind, r, "the failed step left its counts in the router")
        assert o["works_after"], (case, kind, r, "the next good step differs from the reference")
    assert outs[0]["message"] == outs[1]["message"], (case, kind, [o["message"] for o in outs])


def test_router_counts_are_live(ranks):
    """The expert-bias counts do accumulate in these layers (so keeping them is not vacuous)."""
    assert all(rank[kind]["nonzero_bias_counts"] for rank in ranks for kind in KINDS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", list(SETTING_CASES))
def test_a_moe_setting_that_differs_raises_on_every_rank(ranks, kind, setting):
    """One rank's layer has another moe_* setting: before the router's first collective, every
    rank raises the same ValueError naming the setting and the rank, and the group still works."""
    outs = [rank[kind][setting] for rank in ranks]
    for r, o in enumerate(outs):
        assert o["seconds"] < CASE_TIMEOUT_S, (setting, kind, r, o["seconds"])
        assert o["kind"] == "ValueError", (setting, kind, r, o["kind"], o["message"])
        for word in ("layer configuration mismatch", f"{setting} differs", f"ranks [{SETTING_BAD_RANK}] differ"):
            assert word in o["message"], (setting, kind, r, word, o["message"])
        assert o["works_after"], (setting, kind, r, "the next good step differs from the reference")
    assert outs[0]["message"] == outs[1]["message"], (setting, kind, [o["message"] for o in outs])
