"""`moe-dispatch check`'s device choice per backend (the GPU case: tests/test_layer.py)."""
import pytest
import torch

from moe_dispatch.distributed.launch import rank_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_gloo_without_cuda_runs_on_the_cpu():
    assert rank_device("gloo", 3) == torch.device("cpu")
