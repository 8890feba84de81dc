"""Aux losses and z-loss: Megatron-core values, gradient injection, and group reductions."""

import warnings

import pytest
import torch

from moe_dispatch.config import MoEConfig
from moe_dispatch.router import AuxLossScaler, TopKRouter, attach_loss, scores_for_aux_loss, switch_aux_loss, z_loss
from moe_dispatch.router import router as router_module

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mu

H, E, K = 32, 16, 4


def cfg(**kw):
    base = dict(hidden_size=H, num_experts=E, topk=K, ffn_hidden_size=8, aux_loss_coeff=1e-2)
    base.update(kw)
    return MoEConfig(**base)


def hidden(t, dtype=torch.float32, seed=0):
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(autouse=True)
def _reset_scales():
    yield
    AuxLossScaler.set_loss_scale(1.0)
    mu.MoEAuxLossAutoScaler.main_loss_backward_scale = None


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_functions_match_megatron(score_function, dtype):
    logits = torch.randn(100, E, generator=torch.Generator().manual_seed(1), dtype=dtype) * 3
    rmap, scores = scores_for_aux_loss(logits, K, score_function)
    m_map, m_scores = mu.compute_routing_scores_for_aux_loss(logits, K, score_function)
    assert torch.equal(rmap, m_map)
    torch.testing.assert_close(scores.double(), m_scores.double(), rtol=1e-6, atol=1e-7)
    counts = rmap.sum(0)
    ours = switch_aux_loss(scores, counts, 100, K, 1e-2)
    theirs = mu.switch_load_balancing_loss_func(m_scores, counts, 100, K, E, 1e-2)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(z_loss(logits, 1e-3), mu.z_loss_func(logits, 1e-3), rtol=1e-12, atol=0)


def megatron_aux(logits, kind, coeff, seq=None, batch=1, counts_history=()):
    """The loss Megatron's TopKRouter attaches, from its own functions (one rank, no TP/CP)."""
    rmap, scores = mu.compute_routing_scores_for_aux_loss(logits, K, "softmax")
    if kind == "aux_loss":
        return mu.switch_load_balancing_loss_func(scores, rmap.sum(0), logits.shape[0], K, E, coeff)
    if kind == "seq_aux_loss":
        s, m = scores.reshape(seq, -1), rmap.reshape(seq, -1)
        return mu.switch_load_balancing_loss_func(s, m.sum(0), seq, K, E, coeff) / batch
    counts = torch.stack([*counts_history, rmap.sum(0).float()]).sum(0) / (len(counts_history) + 1)
    return mu.switch_load_balancing_loss_func(scores, counts, logits.shape[0], K, E, coeff)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_router_losses_match_megatron(kind):
    router = TopKRouter(cfg(load_balancing_type=kind, z_loss_coeff=1e-3))
    x = hidden(6 * 5).view(6, 5, H)  # [S, B, H]
    probs, _ = router(x)
    logits = router.gating(x.view(-1, H))
    names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
             "global_aux_loss": "global_load_balancing_loss"}
    assert set(router.last_losses) == {names[kind], "z_loss"}
    expected = megatron_aux(logits, kind, 1e-2, seq=6, batch=5)
    torch.testing.assert_close(router.last_losses[names[kind]], expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(router.last_losses["z_loss"], mu.z_loss_func(logits, 1e-3), rtol=1e-6, atol=0)
    assert all(not v.requires_grad for v in router.last_losses.values())


def test_global_aux_loss_averages_counts_until_reset():
    router = TopKRouter(cfg(load_balancing_type="global_aux_loss"))
    xs = [hidden(40, seed=s) for s in range(3)]
    history = []
    for x in xs:
        router(x)
        logits = router.gating(x)
        expected = megatron_aux(logits, "global_aux_loss", 1e-2, counts_history=history)
        torch.testing.assert_close(router.last_losses["global_load_balancing_loss"], expected, rtol=1e-6, atol=0)
        history.append(mu.compute_routing_scores_for_aux_loss(logits, K, "softmax")[0].sum(0).float())
    router.reset_global_aux_loss_tracker()
    router(xs[0])
    expected = megatron_aux(router.gating(xs[0]), "global_aux_loss", 1e-2)
    torch.testing.assert_close(router.last_losses["global_load_balancing_loss"], expected, rtol=1e-6, atol=0)


def test_losses_across_micro_batches():
    """What a per-micro-batch reducer (GradientTree) asks the router: global_aux_loss's counts span
    earlier forwards; aux_loss and seq_aux_loss (and global_aux_loss at coefficient 0) do not."""
    for kind in ("aux_loss", "seq_aux_loss"):
        assert TopKRouter(cfg(load_balancing_type=kind)).losses_across_micro_batches() == []
    assert TopKRouter(cfg(load_balancing_type="global_aux_loss", aux_loss_coeff=0.0)).losses_across_micro_batches() \
        == []
    (why,) = TopKRouter(cfg(load_balancing_type="global_aux_loss")).losses_across_micro_batches()
    assert "global_aux_loss" in why and "'aux_loss' or 'seq_aux_loss'" in why


def test_no_losses_in_eval_or_without_grad():
    router = TopKRouter(cfg(z_loss_coeff=1e-3, load_balancing_type="global_aux_loss"))
    router(hidden(8))
    assert router.last_losses
    with torch.no_grad():
        router(hidden(8))
    assert router.last_losses == {} and router.ga_steps.item() == 1
    router.eval()
    router(hidden(8))
    assert router.last_losses == {}
    router.train()
    router_none = TopKRouter(cfg(load_balancing_type="none"))
    router_none(hidden(8))
    assert router_none.last_losses == {}


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_scaler_injects_the_same_gradient_as_megatron(scale):
    x = torch.randn(10, E, dtype=torch.float64, requires_grad=True)
    g = torch.randn(10, E, dtype=torch.float64)
    AuxLossScaler.set_loss_scale(scale)
    mu.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float64))
    grads = []
    for apply in (attach_loss, mu.MoEAuxLossAutoScaler.apply):
        x.grad = None
        y = torch.softmax(x, -1)
        out = apply(y, z_loss(x, 0.1))
        assert torch.equal(out, y)
        out.backward(g)
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])
    x.grad = None
    (torch.softmax(x, -1) * g).sum().backward(retain_graph=True)
    (z_loss(x, 0.1) * scale).backward()
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-13, atol=1e-15)


class _FakeTwoRankGroup:
    """Stands in for a 2-rank process group inside one process: all_reduce adds what the other
    rank would contribute (precomputed), so the router's reduction wiring is tested in
    milliseconds instead of spawning gloo ranks (about 10 s on the shared CI machine)."""

    def __init__(self, others):
        self.others = list(others)  # tensors the other rank contributes, in call order
        self.calls = 0

    def all_reduce(self, tensor, group=None):
        assert group is self
        tensor += self.others[self.calls].to(tensor.dtype)
        self.calls += 1

    def get_world_size(self, group=None):
        assert group is self
        return 2


def test_loss_groups_sum_counts_over_ranks(monkeypatch):
    x = hidden(6 * 2 * 2).view(12, 2, H)  # one [S, B, H] micro-batch, S split over 2 ranks
    flat = x.view(-1, H)
    base = dict(z_loss_coeff=1e-3, score_function="sigmoid", enable_expert_bias=True)
    full = TopKRouter(cfg(**base))
    logits = full.gating(flat)
    rmap, scores = scores_for_aux_loss(logits, K, "sigmoid")
    mine, theirs = slice(0, 12), slice(12, 24)  # rank 0 holds the first half of the sequence
    for kind, other in (
        ("aux_loss", rmap[theirs].sum(0)),
        ("seq_aux_loss", rmap.view(12, 2, E)[6:].sum(0)),
        ("global_aux_loss", rmap[theirs].sum(0)),
    ):
        group = _FakeTwoRankGroup([other])
        monkeypatch.setattr(torch.distributed, "all_reduce", group.all_reduce)
        monkeypatch.setattr(torch.distributed, "get_world_size", group.get_world_size)
        agreed = []  # the config agreement's all-gather (test_router_agreement.py runs it on gloo)
        monkeypatch.setattr(router_module, "agree_settings", lambda *args: agreed.append(args[1:]))
        router = TopKRouter(cfg(load_balancing_type=kind, **base), loss_group=group, global_loss_group=group)
        assert any("loss group" in why for why in router.losses_across_micro_batches())
        router(x[:6])
        assert group.calls == 1
        assert agreed == [(group, torch.device("cpu"), "router", "router's loss_group")], agreed  # once per group
        if kind == "seq_aux_loss":
            local_seq = scores[mine].view(6, 2, E).sum(0)
            counts = rmap.view(12, 2, E).sum(0)
            expected = (local_seq * counts).sum() * E * 1e-2 / (K * 12**2) / 2
            got = router.last_losses["seq_load_balancing_loss"]
        else:
            expected = switch_aux_loss(scores[mine], rmap.sum(0), 24, K, 1e-2)
            got = router.last_losses["load_balancing_loss" if kind == "aux_loss" else "global_load_balancing_loss"]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        # the z-loss coefficient is shared by the group's ranks
        lse = torch.logsumexp(logits[mine], -1)
        torch.testing.assert_close(router.last_losses["z_loss"], (lse**2).mean() * 1e-3 / 2, rtol=1e-6, atol=0)
        group.others.append(other)
        router(x[:6])
        assert len(agreed) == 1 and group.calls == 2, "the config is agreed at the first call only"
    # expert bias: counts summed over the group, so every rank applies the same update
    group = _FakeTwoRankGroup([torch.zeros(E)])
    monkeypatch.setattr(torch.distributed, "all_reduce", group.all_reduce)
    router.update_expert_bias(group=group)
    _, routed = full(x[:6])
    expected = torch.sign(routed.sum(0).float().mean() - routed.sum(0).float()) * 1e-3
    assert torch.equal(router.expert_bias, expected) and group.calls == 1
