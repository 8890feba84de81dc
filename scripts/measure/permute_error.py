"""How far permute / unpermute and their gradients sit from a float64 oracle in the
TransformerEngine report's scenario (8192 tokens, H=2048, E=16, K=4), both sides given the same
upstream gradients, on the torch twin (CPU). tests/ops/test_permutation.py asserts the bounds.

Run:  python scripts/measure/permute_error.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests/
from tests.ops.test_permutation import DTYPES, _check_against_oracle  # noqa: E402

if __name__ == "__main__":
    print("max |ours - float64| (8192 tokens, H=2048, E=16, K=4):")
    for dtype in DTYPES:
        _, errors = _check_against_oracle(8192, 16, 4, 2048, dtype, seed=3)
        print(f"{str(dtype):>15}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
