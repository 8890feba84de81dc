"""GroupedMLP / SequentialMLP against a float64 per-expert reference: forward and all gradients.

Stated bounds (u = unit roundoff of the dtype: 2^-24 fp32, 2^-8 bf16), each measured row-wise
(per token row for the output and input gradient, per expert for weight gradients):

    max |ours - ref| <= TOL[dtype] * max |ref|,   TOL = 64 u (fp32), 8 u (bf16).

The fp32 error is dominated by fp32 accumulation over H + ffn terms (measured <= 18 u); bf16
GEMMs accumulate in fp32 too, so bf16 is dominated by the handful of roundings to bf16 between
the ops (measured <= 3 u). The probs gradient is a dot over ffn with cancellation, so it is
bounded normwise over the whole tensor (measured <= 6 u fp32, 3.2 u bf16). The module's weights
(already in the dtype) feed the reference, so init rounding is not part of the error.
"""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.experts import GroupedMLP, SequentialMLP
from tests.experts.reference import make_config, reference_forward, routed_batch

TOL = {torch.float32: 64 * 2.0**-24, torch.bfloat16: 8 * 2.0**-8}
COUNTS = [5, 0, 37, 22, 1, 3]


def _row_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    got, ref = got.double().reshape(ref.shape[0], -1), ref.reshape(ref.shape[0], -1)
    return (got - ref).abs().amax(1) / ref.abs().amax(1).clamp_min(1e-300)


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("probs_in_experts", [False, True])
def test_matches_float64_reference(cls, dtype, activation, probs_in_experts):
    cfg = make_config(activation, dtype, probs_in_experts, num_experts=len(COUNTS))
    experts = cls(cfg, len(COUNTS))
    x, tpe, probs = routed_batch(COUNTS, cfg.hidden_size, dtype, seed=3)
    x.requires_grad_()
    probs.requires_grad_()
    y = experts(x, tpe, probs)
    assert y.dtype == dtype and y.shape == x.shape
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    y.backward(dy)

    x64 = x.detach().double().requires_grad_()
    w1 = experts.weight1.detach().double().requires_grad_()
    w2 = experts.weight2.detach().double().requires_grad_()
    p64 = probs.detach().double().requires_grad_()
    ref = reference_forward(x64, w1, w2, COUNTS, activation, p64 if probs_in_experts else None)
    ref.backward(dy.double())

    tol = TOL[dtype]
    used = [e for e, c in enumerate(COUNTS) if c]
    assert _row_err(y, ref).max() <= tol
    assert _row_err(x.grad, x64.grad).max() <= tol
    assert _row_err(experts.weight1.grad[used], w1.grad[used]).max() <= tol
    assert _row_err(experts.weight2.grad[used], w2.grad[used]).max() <= tol
    if probs_in_experts:
        assert (probs.grad.double() - p64.grad).abs().max() <= tol * p64.grad.abs().max()
    else:
        assert probs.grad is None  # probs ignored: applied by the combine instead


def test_params_dtype_differs_from_input():
    """float32 master weights with bf16 tokens compute in bf16 and return bf16."""
    cfg = make_config("gelu", torch.float32)
    experts = GroupedMLP(cfg, 4)
    x, tpe, _ = routed_batch([3, 4, 0, 2], cfg.hidden_size, torch.bfloat16)
    y = experts(x, tpe)
    assert y.dtype == torch.bfloat16
    ref = reference_forward(x.double(), experts.weight1.detach().bfloat16().double(),
                            experts.weight2.detach().bfloat16().double(), [3, 4, 0, 2], "gelu", None)
    assert _row_err(y, ref).max() <= TOL[torch.bfloat16]
