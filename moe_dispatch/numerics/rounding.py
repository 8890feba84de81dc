"""Integer helpers shared by the config's validation, the permutation's padding and the
dispatcher's layouts: one definition each, so a size is judged and padded alike everywhere."""
from __future__ import annotations

from typing import Any, TypeVar

import torch

Count = TypeVar("Count", int, torch.Tensor)


def is_int(value: Any) -> bool:
    """True for a Python int that is not a bool: True as a size is a typo, not a size."""
    return isinstance(value, int) and not isinstance(value, bool)


def round_up(count: Count, multiple: int) -> Count:
    """count rounded up to a multiple of `multiple` (an int, or an integer tensor elementwise);
    count >= 0, multiple >= 1."""
    return (count + multiple - 1) // multiple * multiple
