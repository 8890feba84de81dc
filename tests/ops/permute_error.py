"""How far permute / unpermute and their gradients sit from a float64 oracle in the
TransformerEngine report's scenario (8192 tokens, H=2048, E=16, K=4), both sides given the same
upstream gradients, on the torch twin (CPU). tests/ops/test_permutation.py asserts the bounds
with 256 of the tokens; this prints that test's check at all 8192 (it lives beside the test, as it
is the test's oracle that it runs).

Run, from the repository root:  python -m tests.ops.permute_error
"""
from __future__ import annotations

from tests.ops.test_permutation import DTYPES, _check_against_oracle

if __name__ == "__main__":
    print("max |ours - float64| (8192 tokens, H=2048, E=16, K=4):")
    for dtype in DTYPES:
        _, errors = _check_against_oracle(8192, 16, 4, 2048, dtype, seed=3)
        print(f"{str(dtype):>15}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
