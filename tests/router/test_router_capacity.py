"""Capacity dropping and padding: Megatron-core parity where Megatron is well defined, our tie rule."""

import warnings

import pytest
import torch

from moe_dispatch.router import apply_capacity, expert_capacity, topk_routing

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mu

T, E, K = 64, 8, 2


def routed(seed=0, t=T):
    logits = torch.randn(t, E, generator=torch.Generator().manual_seed(seed))
    return topk_routing(logits, K)


def reference(probs, rmap, capacity, policy, pad):
    """Per expert: routed tokens first (by prob desc or position), then unrouted by position."""
    keep = torch.zeros_like(rmap)
    for e in range(E):
        routed_t = [t for t in range(rmap.shape[0]) if rmap[t, e]]
        if policy == "probs":
            routed_t.sort(key=lambda t: (-float(probs[t, e]), t))
        unrouted = [t for t in range(rmap.shape[0]) if not rmap[t, e]]
        for t in (routed_t + unrouted)[:capacity]:
            keep[t, e] = True
    final = keep if pad else keep & rmap
    return probs * final, final


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 1.3, 4.0, 9.0])
def test_capacity_formula_matches_megatron(factor):
    for t in (1, 7, 64, 1000):
        assert expert_capacity(t, E, K, factor) == mu.get_capacity(t * K, E, factor)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5, 5.0])
def test_against_reference_and_megatron(policy, pad, factor):
    probs, rmap = routed()
    out_p, out_m = apply_capacity(probs, rmap, K, factor, policy, pad)
    ref_p, ref_m = reference(probs, rmap, expert_capacity(T, E, K, factor), policy, pad)
    assert torch.equal(out_m, ref_m) and torch.equal(out_p, ref_p)
    m_p, m_m = mu.apply_router_token_dropping(probs, rmap, K, factor, policy, pad)
    # Megatron picks with torch.topk, whose order among equal keys is unspecified: among the
    # zero-prob padding rows, and (policy 'position') among the routed rows too, where it does
    # not keep the earliest tokens on CPU. Compare what it does define.
    assert torch.equal(out_m.sum(0), m_m.sum(0))
    if policy == "probs":
        assert torch.equal(out_m & rmap, m_m & rmap)
        assert torch.equal(out_p, m_p)


def test_ties_drop_later_tokens_and_pad_with_earliest():
    probs = torch.full((6, 2), 0.5)
    rmap = torch.ones(6, 2, dtype=torch.bool)
    rmap[0, 1] = False
    probs[0, 1] = 0.0
    # capacity = ceil(6 * 1 / 2 * 0.5) = 2
    p, m = apply_capacity(probs, rmap, 1, 0.5, "probs", False)
    assert m.tolist() == [[True, False], [True, True], [False, True], [False, False], [False, False], [False, False]]
    p, m = apply_capacity(probs * 0, rmap, 1, 0.5, "position", True)  # routed zero probs still rank first
    assert m[:, 1].nonzero().flatten().tolist() == [1, 2]


def test_no_drop_when_capacity_covers_all_tokens_and_dtype_kept():
    probs, rmap = routed(t=10)
    p, m = apply_capacity(probs.double(), rmap, K, 100.0, "probs", False)
    assert torch.equal(m, rmap) and p.dtype == torch.float64
    p, m = apply_capacity(probs, rmap, K, 100.0, "probs", True)  # Megatron: everything is kept
    assert m.all() and torch.equal(p, probs)


def test_pad_gives_every_expert_exactly_capacity():
    probs, rmap = routed(t=200)
    cap = expert_capacity(200, E, K, 0.7)
    _, m = apply_capacity(probs, rmap, K, 0.7, "probs", True)
    assert (m.sum(0) == cap).all()


def test_bad_policy():
    probs, rmap = routed()
    with pytest.raises(ValueError, match="drop_policy"):
        apply_capacity(probs, rmap, K, 1.0, "random")
