"""The fault fuzzer (faults.py) on the shared 4-rank gloo spawn: for each seeded case one rank gets
one bad input; every rank raises the same ValueError within 30 s (the spawn's own timeout is far
below gloo's 30-minute default), a rank without tokens is valid and changes no other rank's
output, and after every case the group still computes the same step as before any fault."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from .faults import CLASSES, WORDS, fault_cases

CASE_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def faults(gloo_ranks):
    return [rank["faults"] for rank in gloo_ranks]


def test_fuzzer_covers_every_class_at_least_twice():
    counts = Counter(cls for cls, _, _ in fault_cases())
    assert set(counts) == set(CLASSES) and min(counts.values()) >= 2, counts
    assert len({bad for _, _, bad in fault_cases()}) == 4  # every rank is the bad one at least once


@pytest.mark.parametrize("index", range(len(fault_cases())))
def test_case(faults, index):
    cls, variant, bad = fault_cases()[index]
    outs = [rank["results"][index] for rank in faults]
    what = f"case {index}: {cls}/{variant} on rank {bad}"
    for r, o in enumerate(outs):
        assert o["seconds"] < CASE_TIMEOUT_S, f"{what}: rank {r} took {o['seconds']:.1f} s"
        assert o["works_after"], f"{what}: rank {r}: the group no longer reproduces the reference step"
    if cls == "zero_tokens":
        for r, o in enumerate(outs):
            assert o["kind"] == "ok", f"{what}: rank {r} raised {o['kind']}: {o['message']}"
            ref = faults[r]["reference" if variant == "layer" else "reference_dispatch"]
            if r == bad:
                assert o["out"].shape[0] == 0, what
            else:
                assert torch.equal(o["out"], ref), f"{what}: rank {r}'s output changed"
        return
    messages = {o["message"] for o in outs}
    for r, o in enumerate(outs):
        assert o["kind"] == "ValueError", f"{what}: rank {r} got {o['kind']}: {o['message']}"
        for word in WORDS[cls]:
            word = word.format(rank=bad, field=variant)
            assert word in o["message"], f"{what}: {word!r} not in rank {r}'s {o['message']!r}"
    assert len(messages) == 1, f"{what}: messages differ across ranks: {messages}"


def test_ep4_layer_step_reads_the_host_once(gloo_ranks):
    """After its first step, an EP-4 layer step (forward + backward) reads the host once (the
    size exchange) and copies two small tables to the device (the exchange's descriptor and the
    row maps), on every rank."""
    for rank in gloo_ranks:
        assert rank["transfers"] == {"read_host": 1, "to_device": 2}, rank["transfers"]
