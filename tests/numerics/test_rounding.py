"""The one is_int and round_up that the config, the permutation and the layouts share."""
from __future__ import annotations

import numpy as np
import torch

from moe_dispatch.numerics.rounding import is_int, round_up


def test_is_int_takes_python_ints_only():
    assert is_int(0) and is_int(-3) and is_int(2**70)
    assert not any(is_int(v) for v in (True, False, 1.0, "1", None, np.int64(1), torch.tensor(1)))


def test_round_up_on_ints_and_tensors():
    assert [round_up(c, 4) for c in (0, 1, 3, 4, 5, 8)] == [0, 4, 4, 4, 8, 8]
    assert [round_up(c, 1) for c in (0, 7)] == [0, 7]
    counts = torch.tensor([0, 1, 15, 16, 17, 2**40 + 1])
    padded = round_up(counts, 16)
    assert padded.dtype == counts.dtype
    assert padded.tolist() == [0, 16, 16, 16, 32, 2**40 + 16]
