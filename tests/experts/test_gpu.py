"""CUDA checks (skipped without a GPU): bitwise row stability of the default paths. What plain
cuBLAS mm does is a measurement: scripts/measure/gpu_plain_paths.py. Run on a GPU with:
pytest tests/experts/test_gpu.py"""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.experts import GroupedMLP, SequentialMLP
from moe_dispatch.experts.activations import _unary
from moe_dispatch.tools.batch_invariance import activation_mismatches
from tests.experts.reference import make_config
from tests.experts.test_row_stability import _assert_row_stable, assert_ep_layouts_agree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_BLOCKS = [1, 3, 7, 8, 64, 128, 200, 1000, 4096]
GPU_NEIGHBOURS = [(0, 0), (5, 0), (300, 2000)]


def _experts(cls, dtype, hidden=512, **kw):
    cfg = make_config("swiglu", dtype, probs_in_experts=True, hidden=hidden, ffn=256, num_experts=3)
    return cls(cfg, 3, device="cuda", **kw)


def test_grouped_bf16_row_stable():
    experts = _experts(GroupedMLP, torch.bfloat16)
    assert experts.gemm_strategies(torch.zeros(1, 512, dtype=torch.bfloat16, device="cuda")) == ("grouped", "grouped")
    _assert_row_stable(experts, torch.bfloat16, GPU_BLOCKS, GPU_NEIGHBOURS)


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_row_stable(cls, dtype):
    """The CUDA fallback: cuBLAS mm in fixed 256-row calls. H=520 makes rows 1040/2080 bytes,
    so tiles start at addresses aligned to 16 or 32 bytes only, not 256."""
    experts = _experts(cls, dtype, hidden=520)
    expected = "grouped" if (cls is GroupedMLP and dtype == torch.bfloat16) else "tiled"
    assert experts.gemm_strategies(torch.zeros(1, 520, dtype=dtype, device="cuda"))[0] == expected
    _assert_row_stable(experts, dtype, GPU_BLOCKS, GPU_NEIGHBOURS)


@pytest.mark.parametrize("cls,dtype", [(GroupedMLP, torch.bfloat16), (SequentialMLP, torch.bfloat16),
                                       (SequentialMLP, torch.float32)])
def test_ep_layouts_agree_including_weight_grads(cls, dtype):
    """Expert 1 alone (EP=3) vs among 3 local experts with other rows: bitwise rows, input/prob
    gradients and weight gradients (grouped_mm's dw groups split the reduction dim)."""
    assert_ep_layouts_agree(cls, dtype, "swiglu", device="cuda", rows=1000, hidden=512)


def test_grouped_and_tiled_agree_within_rounding():
    """GroupedMLP (grouped_mm) and SequentialMLP (tiled cuBLAS) on the same weights: different
    kernels, so bitwise equality is not promised; within rounding."""
    grouped, tiled = _experts(GroupedMLP, torch.bfloat16), _experts(SequentialMLP, torch.bfloat16)
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    tpe = torch.tensor([100, 0, 900])
    a, b = grouped(x, tpe), tiled(x, tpe)
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= 8 * 2**-8 * a.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_cuda_activations_batch_independent(dtype, name):
    assert activation_mismatches(lambda h: _unary(h, name), dtype, "cuda") == 0


def test_tokens_per_expert_on_device_and_empty_experts():
    experts = _experts(GroupedMLP, torch.bfloat16)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tpe = torch.tensor([0, 300, 0], device="cuda")
    y = experts(x, tpe, torch.rand(300, device="cuda"))
    y.float().square().sum().backward()
    assert torch.isfinite(y).all()
    for e in (0, 2):  # empty groups: zero weight gradients, not garbage
        assert torch.count_nonzero(experts.weight1.grad[e]) == 0
        assert torch.count_nonzero(experts.weight2.grad[e]) == 0
    probs = torch.rand(300, device="cuda")
    assert torch.equal(experts(x, tpe, probs), experts(x, tpe.cpu(), probs))  # CPU or device counts
