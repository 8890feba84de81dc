"""Calls in another order on one rank, autograd needs that differ across ranks, and EP groups a
rank cannot use (2 gloo ranks, one spawn under a timeout: a hang fails it). Every error is the same
ValueError on every rank; rows of another call are never taken for this call's."""
from __future__ import annotations

import pytest
import torch

from .call_workers import call_identity_worker
from .harness import run_ranks, same_value_error


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(call_identity_worker, 2, timeout=400)


def test_layers_called_in_another_order_name_the_layers(ranks):
    layers = [rank["layers"] for rank in ranks]
    a, b = layers[0]["ids"]
    assert layers[1]["ids"] == (a, b) and a != b
    for case in ("first_1", "first_2"):  # the very first forward: the configuration agreement
        message = same_value_error([rank[case] for rank in layers], "MoE layers called in a different order",
                                   f"MoE layer #{a}", f"MoE layer #{b}", "ranks [1] differ")
        assert "init_seed" not in message, message
    for case in ("later_1", "later_2"):  # after it: the step's size exchange
        same_value_error([rank[case] for rank in layers], "MoE layers called in a different order",
                         f"MoE layer #{a} forward 1", f"MoE layer #{b} forward 1")
    same_value_error([rank["skip"] for rank in layers], f"MoE layer #{a} is at different forwards", "[2, 3] by rank")
    for rank in layers:  # in order, before and after the errors: the same result
        assert rank["in_order"][0] == "ok" and rank["after"][0] == "ok"
        assert torch.equal(rank["in_order"][2], rank["after"][2])


def test_microbatches_combined_in_another_order_pad_to_capacity(ranks):
    """The split sizes agree (capacity): no abort, no error yet, every row NaN; the next dispatch
    raises on every rank."""
    cases = [rank["microbatches"]["capacity_combine"] for rank in ranks]
    for r, case in enumerate(cases):
        for mb in (0, 1):
            assert case[f"combine{mb}"][0] == "ok", (r, case[f"combine{mb}"])
            assert case[f"nan{mb}"], f"rank {r}: micro-batch {mb}'s output is not NaN"
    same_value_error([case["next"] for case in cases],
                     "the previous combine on this group paired rows of different calls",
                     "forward 0", "forward 1", "on EP rank 0", "on EP rank 1")


def test_microbatches_combined_in_another_order_without_rows(ranks):
    """Rank 1's experts receive no rows: the calls still meet in the combine's status rows, so
    every rank's output is NaN and the next dispatch raises on every rank."""
    cases = [rank["microbatches"]["empty_combine"] for rank in ranks]
    for r, case in enumerate(cases):
        for mb in (0, 1):
            assert case[f"combine{mb}"][0] == "ok", (r, case[f"combine{mb}"])
            assert case[f"nan{mb}"], f"rank {r}: micro-batch {mb}'s output is not NaN"
    same_value_error([case["next"] for case in cases],
                     "the previous combine on this group paired rows of different calls",
                     "on EP rank 0", "on EP rank 1")


def test_microbatches_backpropagated_in_another_order_pad_to_capacity(ranks):
    cases = [rank["microbatches"]["capacity_backward"] for rank in ranks]
    for r, case in enumerate(cases):
        for mb in (0, 1):
            assert case[f"combine{mb}"][0] == "ok" and not case[f"nan{mb}"], (r, mb)
            assert case[f"backward{mb}"][0] == "ok", (r, case[f"backward{mb}"])
            assert case[f"grad_nan{mb}"], f"rank {r}: micro-batch {mb}'s input gradient is not NaN"
    same_value_error([case["next"] for case in cases], "the previous combine's backward on this group paired rows")


@pytest.mark.parametrize("case", ["strict_combine", "strict_capacity_combine"])
def test_strict_call_order_raises_before_rows_move(ranks, case):
    """Dropless: the split sizes differ (without strict mode gloo would abort the process)."""
    cases = [rank["microbatches"][case] for rank in ranks]
    for i in (0, 1):  # the i-th combine: micro-batch i on rank 0, 1 - i on rank 1
        same_value_error([cases[0][f"combine{i}"], cases[1][f"combine{1 - i}"]],
                         "the combine on the EP group pairs rows of different calls", "no row was exchanged",
                         "[MoE layer #", f"forward {i}, MoE layer #")
    for c in cases:
        assert c["next"][0] == "ok", c["next"]  # nothing latched


def test_strict_call_order_in_the_backward(ranks):
    cases = [rank["microbatches"]["strict_backward"] for rank in ranks]
    for i in (0, 1):
        same_value_error([cases[0][f"backward{i}"], cases[1][f"backward{1 - i}"]],
                         "the combine's backward on the EP group pairs rows")
    for c in cases:
        assert c["next"][0] == "ok", c["next"]


def test_calls_in_order_and_the_group_after(ranks):
    for rank in ranks:
        mbs = rank["microbatches"]
        case = mbs["in_order"]
        for key in ("combine0", "combine1", "backward0", "backward1", "next"):
            assert case[key][0] == "ok", (key, case[key])
        assert not case["nan0"] and not case["grad_nan1"]
        assert torch.equal(mbs["after"], mbs["reference"])
        assert torch.equal(mbs["after_capacity"], mbs["reference_capacity"])


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", ["hidden", "experts", "nothing"])
def test_autograd_needs_that_differ_across_ranks(ranks, kind, case):
    """Rank 1's hidden states need no grad, or its experts are frozen, or nothing on it needs a
    gradient: both ranks complete (no rank waits in the backward), and every gradient that exists
    is bitwise the all-ranks-need-grad one."""
    for r, rank in enumerate(ranks):
        ref, got = rank["autograd"][kind]["reference"], rank["autograd"][kind][case]
        assert torch.equal(got["out"], ref["out"]), (r, "output")
        assert got["out_requires_grad"], f"rank {r}: the output must require grad (another rank's backward needs it)"
        if r == 1 and case in ("hidden", "nothing"):
            assert got["x_grad"] is None
        else:
            assert torch.equal(got["x_grad"], ref["x_grad"]), (r, "input gradient")
        for name, grad in got["grads"].items():
            frozen = r == 1 and (case == "nothing" or (case == "experts" and name.startswith("experts.")))
            if frozen:
                assert grad is None, (r, name)
            else:
                assert torch.equal(grad, ref["grads"][name]), (r, name)


def test_grad_mode_that_differs_is_an_error(ranks):
    same_value_error([rank["autograd"]["grad_mode"] for rank in ranks], "torch.is_grad_enabled() differs",
                     "ranks [1] differ")
    for rank in ranks:
        assert rank["autograd"]["grad_mode_after"][0] == "ok"


def test_ep_group_outside_or_destroyed(ranks):
    for case in ("outside_layer", "outside_dispatcher"):
        assert ranks[0]["groups"][case][0] == "ok", ranks[0]["groups"][case]  # rank 0: a group of one
        kind, message = ranks[1]["groups"][case]
        assert kind == "ValueError" and "ep_group does not contain this process (global rank 1)" in message, message
    for case in ("destroyed_layer", "destroyed_functional"):
        same_value_error([rank["groups"][case] for rank in ranks], "ep_group is not a live process group")


def test_host_reads_per_step(ranks):
    """After the first step, an EP-2 layer step (forward + backward) reads the host once, as
    before; strict_call_order adds one read per return exchange (combine, its backward, the
    dispatch's backward)."""
    for rank in ranks:
        assert rank["host_reads"][False] == {"read_host": 1, "to_device": 2}, rank["host_reads"]
        assert rank["host_reads"][True] == {"read_host": 4, "to_device": 2}, rank["host_reads"]
