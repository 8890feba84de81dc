"""Top-k routing: Megatron-core parity, float64 reference, tie-breaking, dtype contract."""

import math
import warnings

import pytest
import torch

from moe_dispatch.router import group_limited_topk_indices, stable_topk_indices, topk_routing

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mu

E = 32
# name: (kwargs for both implementations)
CONFIGS = {
    "softmax": dict(topk=4),
    "softmax-pre-scaled": dict(topk=4, pre_softmax=True, scaling_factor=2.5),
    "softmax-groups": dict(topk=4, num_groups=8, group_topk=2),
    "softmax-pre-groups": dict(topk=6, pre_softmax=True, num_groups=4, group_topk=3),
    "sigmoid": dict(topk=4, score_function="sigmoid"),
    "sigmoid-top1": dict(topk=1, score_function="sigmoid"),
    "sigmoid-bias-groups-scaled": dict(topk=8, score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5,
                                       bias=True),
}


def distinct_logits(t, dtype, seed=0, blocks=8):
    """Logits with no ties between experts nor between groups, before or after scoring, in bf16.

    Each row is a permutation of the multiples of 1/16 in [-1, 1) (exact in bf16; softmax and
    sigmoid keep them apart in bf16), arranged so every block of E/8 consecutive experts holds
    consecutive ranks: the sums that rank groups then never tie either (torch.topk, which
    Megatron uses, breaks ties arbitrarily).
    """
    g = torch.Generator().manual_seed(seed)
    size = E // blocks
    rows = []
    for _ in range(t):
        level = torch.randperm(blocks, generator=g).repeat_interleave(size) * size
        rows.append(level + torch.cat([torch.randperm(size, generator=g) for _ in range(blocks)]))
    return ((torch.stack(rows).double() - E / 2) / 16).to(dtype)


def expert_bias():
    return torch.linspace(-0.05, 0.05, E, dtype=torch.float32).flip(0) * (torch.arange(E) % 3 == 0)


def run_both(logits, kw):
    kw = dict(kw)
    bias = expert_bias() if kw.pop("bias", False) else None
    ours = topk_routing(logits, expert_bias=bias, **kw)
    theirs = mu.topk_routing_with_score_function(
        logits, kw["topk"], use_pre_softmax=kw.get("pre_softmax", False), num_groups=kw.get("num_groups"),
        group_topk=kw.get("group_topk"), scaling_factor=kw.get("scaling_factor"),
        score_function=kw.get("score_function", "softmax"), expert_bias=bias,
    )
    return ours, theirs, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_megatron(name, dtype):
    logits = distinct_logits(200, dtype)
    (probs, rmap), (m_probs, m_map), _ = run_both(logits, CONFIGS[name])
    assert probs.dtype == dtype and rmap.dtype == torch.bool
    assert torch.equal(rmap, m_map)
    assert torch.equal(probs != 0, rmap)
    # Megatron computes softmax/sigmoid in fp32 even for fp64 logits: compare at fp32 rounding.
    tol = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(probs.double(), m_probs.double(), rtol=tol, atol=tol)


def reference(logits, topk, score_function="softmax", pre_softmax=False, num_groups=None, group_topk=None,
              scaling_factor=None, bias=None):
    """Float64, one token at a time, straight from the definitions (ties -> lower index)."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for t, row in enumerate(logits.double().tolist()):
        if score_function == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            soft = [v / sum(ex) for v in ex]
            key = soft if pre_softmax else row
        else:
            sig = [1 / (1 + math.exp(-v)) for v in row]
            key = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(sig)]
        allowed = range(E)
        if group_topk:
            size = E // num_groups
            gscore = [sum(sorted(key[g * size:(g + 1) * size], reverse=True)[: topk // group_topk])
                      for g in range(num_groups)]
            groups = sorted(range(num_groups), key=lambda g: (-gscore[g], g))[:group_topk]
            allowed = [e for e in range(E) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: (-key[e], e))[:topk]
        if score_function == "softmax" and pre_softmax:
            vals = [soft[e] for e in chosen]
        elif score_function == "softmax":
            m = max(row[e] for e in chosen)
            ex = [math.exp(row[e] - m) for e in chosen]
            vals = [v / sum(ex) for v in ex]
        else:
            vals = [sig[e] for e in chosen]
            if topk > 1:
                vals = [v / sum(vals) for v in vals]
        for e, v in zip(chosen, vals):
            out[t, e] = v * (scaling_factor or 1.0)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_float64_reference(name):
    kw = dict(CONFIGS[name])
    bias = expert_bias() if kw.pop("bias", False) else None
    logits = torch.randn(64, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    ref = reference(logits, bias=bias, **kw)
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 2e-6)):
        probs, rmap = topk_routing(logits.to(dtype), expert_bias=bias, **kw)
        assert torch.equal(rmap, ref != 0)
        torch.testing.assert_close(probs.double(), ref, rtol=tol, atol=tol)


def test_exact_ties_go_to_lower_index():
    assert stable_topk_indices(torch.zeros(1, 8), 3).tolist() == [[0, 1, 2]]
    assert stable_topk_indices(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]), 2).tolist() == [[1, 2]]
    assert stable_topk_indices(torch.tensor([[0.0, -0.0, 0.0]]), 2).tolist() == [[0, 1]]
    assert stable_topk_indices(torch.tensor([[-0.0, 0.0, -1.0]]), 1).tolist() == [[0]]
    # two groups with equal scores: the lower group wins, then lower experts inside it
    key = torch.tensor([[1.0, 2.0, 2.0, 1.0, 0.0, 0.0]])
    assert group_limited_topk_indices(key, 2, 3, 1).tolist() == [[1, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_topk_indices_with_special_values(dtype):
    g = torch.Generator().manual_seed(6)
    key = torch.randint(-3, 4, (500, 40), generator=g).to(dtype) * 0.5  # many exact ties
    key[::5] = torch.randn(100, 40, generator=g).to(dtype) * 1e30 if dtype != torch.float16 else key[::5]
    key[1::7, ::3] = float("-inf")
    key[2::7, 1::4] = -0.0
    key[3::7, 2::5] = float("inf")
    rows = key.double().tolist()
    for k in (1, 5, 40):
        expected = [sorted(range(40), key=lambda e: (-row[e], e))[:k] for row in rows]
        assert stable_topk_indices(key, k).tolist() == expected, k


@pytest.mark.parametrize("name", list(CONFIGS))
def test_many_ties_match_reference_rule(name):
    """Integer-valued logits make ties everywhere; every choice must follow the lower-index rule."""
    kw = dict(CONFIGS[name])
    bias = torch.zeros(E) if kw.pop("bias", False) else None  # zero bias keeps the ties exact
    logits = torch.randint(-2, 3, (300, E), generator=torch.Generator().manual_seed(4)).double()
    probs, rmap = topk_routing(logits, expert_bias=bias, **kw)
    ref = reference(logits, bias=bias, **kw)
    assert torch.equal(rmap, ref != 0)
    torch.testing.assert_close(probs, ref, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_probs_dtype_is_logits_dtype_in_every_configuration(in_dtype):
    logits = distinct_logits(16, in_dtype)
    for name, kw in CONFIGS.items():
        kw = dict(kw)
        bias = expert_bias() if kw.pop("bias", False) else None
        probs, rmap = topk_routing(logits, expert_bias=bias, **kw)
        assert probs.dtype == in_dtype and rmap.dtype == torch.bool, name
        assert (rmap.sum(1) == kw["topk"]).all(), name


def test_probs_are_differentiable_wrt_logits():
    logits = distinct_logits(3, torch.float64).requires_grad_(True)
    for name, kw in CONFIGS.items():
        kw = dict(kw)
        bias = expert_bias().double() if kw.pop("bias", False) else None
        assert torch.autograd.gradcheck(lambda x: topk_routing(x, expert_bias=bias, **kw)[0], (logits,),
                                        fast_mode=True), name


def test_bad_arguments():
    with pytest.raises(ValueError, match="logits"):
        topk_routing(torch.zeros(2, 3, 4), 2)
    with pytest.raises(ValueError, match="score_function"):
        topk_routing(torch.zeros(2, 4), 2, score_function="tanh")
