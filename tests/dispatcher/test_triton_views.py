"""The Triton kernels read the exchange's packed buffers through strided views (tokens at a
16-byte offset in each row, probs and routing beside them): at EP 2 on gloo, under the Triton
interpreter on CPU (on the GPU, the same kernels compiled), they agree with the torch twin."""
from __future__ import annotations

import torch

from .harness import run_ranks
from .workers import triton_views_worker


def test_kernels_on_packed_views_match_the_twin():
    for rank in run_ranks(triton_views_worker, 2, timeout=240):
        for kind, (kernels, twin) in rank.items():
            for field in ("out", "gx", "gw", "gb"):
                assert torch.equal(kernels[field], twin[field]), (kind, field)
            assert torch.allclose(kernels["gp"], twin["gp"], rtol=1e-5, atol=1e-7), kind
            assert kernels["reuse_equal"], kind
            assert kernels["out"].abs().sum() > 0
