"""tools/batch_invariance.py: the probe counts a function that reads the rest of its batch, and
none for an elementwise one (its use on the activations: tests/experts/test_row_stability.py)."""
from __future__ import annotations

import torch

from moe_dispatch.tools.batch_invariance import activation_mismatches


def test_elementwise_function_has_no_mismatch():
    assert activation_mismatches(lambda h: h * 3 - 1, torch.float32) == 0


def test_function_of_the_batch_mismatches_at_every_probe():
    # each row minus the batch's mean: a row alone (mean of itself) or an element alone (0) differs
    assert activation_mismatches(lambda h: h - h.mean(), torch.float32) == 180
