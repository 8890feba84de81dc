"""Seeded init across EP layouts; zero-token experts; N = 0; input validation."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.experts import GroupedMLP, SequentialMLP, expert_seed
from tests.experts.reference import make_config, routed_batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_ep_slices_equal_full_build(dtype, activation):
    cfg = make_config(activation, dtype)
    full = GroupedMLP(cfg, 4)
    for offset in (0, 2):
        part = SequentialMLP(cfg, 2, local_expert_offset=offset)
        assert torch.equal(part.weight1, full.weight1[offset : offset + 2])
        assert torch.equal(part.weight2, full.weight2[offset : offset + 2])
    for e in range(4):  # EP=4: one expert per rank
        assert torch.equal(GroupedMLP(cfg, 1, local_expert_offset=e).weight1[0], full.weight1[e])
    assert full.weight1.dtype == dtype


def test_seeds_are_distinct_and_weights_differ():
    seeds = {expert_seed(s, e, w) for s in range(3) for e in range(64) for w in (1, 2)}
    assert len(seeds) == 3 * 64 * 2 and all(0 <= s < 2**63 for s in seeds)
    full = GroupedMLP(make_config("gelu"), 4)
    assert not torch.equal(full.weight1[0], full.weight1[1])
    other = GroupedMLP(make_config("gelu", seed=4321), 4)
    assert not torch.equal(full.weight1, other.weight1)
    std = full.weight1.std().item()
    assert abs(std - 64**-0.5) < 0.1 * 64**-0.5  # normal(0, 1/sqrt(H))


def test_reset_parameters_restores_init():
    experts = GroupedMLP(make_config("relu"), 4)
    before = experts.weight1.detach().clone()
    with torch.no_grad():
        experts.weight1.add_(1.0)
    experts.reset_parameters()
    assert torch.equal(experts.weight1, before)


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_token_experts(cls, dtype):
    cfg = make_config("swiglu", dtype, probs_in_experts=True, num_experts=4)
    experts = cls(cfg, 4)
    x, tpe, probs = routed_batch([0, 6, 0, 3], cfg.hidden_size, dtype)
    x.requires_grad_()
    y = experts(x, tpe, probs)
    y.float().pow(2).sum().backward()
    assert torch.isfinite(y).all()
    for e in (0, 2):
        assert torch.count_nonzero(experts.weight1.grad[e]) == 0
        assert torch.count_nonzero(experts.weight2.grad[e]) == 0
    assert torch.count_nonzero(experts.weight1.grad[1]) > 0


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_at_all(cls, dtype):
    cfg = make_config("gelu", dtype, probs_in_experts=True)
    experts = cls(cfg, 4)
    x = torch.zeros(0, cfg.hidden_size, dtype=dtype, requires_grad=True)
    y = experts(x, torch.zeros(4, dtype=torch.int64), torch.zeros(0))
    assert y.shape == (0, cfg.hidden_size) and y.dtype == dtype
    y.sum().backward()
    # Gradients exist (zeros, not None) so every rank's optimizer sees the same parameters.
    assert torch.count_nonzero(experts.weight1.grad) == 0 and torch.count_nonzero(experts.weight2.grad) == 0
    assert x.grad.shape == x.shape


def test_bad_inputs():
    experts = GroupedMLP(make_config("gelu"), 4)
    x, tpe, _ = routed_batch([1, 2, 3, 4], 64, torch.float32)
    with pytest.raises(ValueError, match="sum to"):
        experts(x, torch.tensor([1, 2, 3, 3]))
    with pytest.raises(ValueError, match="rows_per_expert must be"):
        experts(x, torch.tensor([10]))
    with pytest.raises(ValueError, match="rows must be"):
        experts(x[:, :32], tpe)
    with pytest.raises(ValueError, match="exceed num_experts"):
        GroupedMLP(make_config("gelu"), 2, local_expert_offset=3)
    bf16 = GroupedMLP(make_config("gelu", torch.bfloat16), 4)  # the grouped path validates too
    with pytest.raises(ValueError, match="sum to"):
        bf16(x.bfloat16(), torch.tensor([1, 2, 3, 3]))


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_of_input_does_not_matter(cls, dtype):
    """Transposed and misaligned views give the same bits as a fresh contiguous tensor
    (kernels may choose their path from strides and pointer alignment, so views are copied)."""
    experts = cls(make_config("gelu", dtype), 4)
    x, tpe, _ = routed_batch([3, 9, 0, 20], 64, dtype)
    ref = experts(x, tpe)
    transposed = x.t().contiguous().t()
    misaligned = torch.cat([x.new_zeros(1), x.flatten()])[1:].view_as(x)
    assert misaligned.data_ptr() % 16 != 0 and not transposed.is_contiguous()
    assert torch.equal(experts(transposed, tpe), ref)
    assert torch.equal(experts(misaligned, tpe), ref)
