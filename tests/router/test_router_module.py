"""TopKRouter as a module: weight init, shapes, dtypes, input validation, gradients, expert bias."""

import pytest
import torch

from moe_dispatch.config import MoEConfig
from moe_dispatch.router import AuxLossScaler, TopKRouter
from moe_dispatch.router.router import INIT_STD, ROUTER_SEED_OFFSET

H, E, K = 16, 8, 2


def cfg(**kw):
    base = dict(hidden_size=H, num_experts=E, topk=K, ffn_hidden_size=8)
    base.update(kw)
    return MoEConfig(**base)


def test_weight_is_seeded_and_identical_across_instances():
    a, b = TopKRouter(cfg()), TopKRouter(cfg())
    assert a.weight.shape == (E, H) and a.weight.dtype == torch.float32
    assert torch.equal(a.weight, b.weight)
    gen = torch.Generator().manual_seed(1234 + ROUTER_SEED_OFFSET)
    assert torch.equal(a.weight, torch.empty(E, H).normal_(0, INIT_STD, generator=gen))
    assert not torch.equal(a.weight, TopKRouter(cfg(init_seed=1)).weight)
    bf = TopKRouter(cfg(params_dtype=torch.bfloat16))
    assert bf.weight.dtype == torch.bfloat16 and torch.equal(bf.weight, a.weight.bfloat16())


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64", None])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_output_contract(router_dtype, in_dtype):
    router = TopKRouter(cfg(router_dtype=router_dtype, capacity_factor=1.0, aux_loss_coeff=0.1, z_loss_coeff=0.1))
    x = torch.randn(5, 3, H).to(in_dtype)
    probs, rmap = router(x)
    expected = {"fp32": torch.float32, "fp64": torch.float64, None: in_dtype}[router_dtype]
    assert probs.dtype == expected == router.config.probs_dtype(in_dtype)
    assert probs.shape == rmap.shape == (15, E) and rmap.dtype == torch.bool
    assert torch.equal(probs[~rmap], torch.zeros_like(probs[~rmap]))
    p2, m2 = router(x.reshape(15, H))  # [S, B, H] is the S-major flattening
    assert torch.equal(p2, probs) and torch.equal(m2, rmap)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_zero_tokens(kind):
    router = TopKRouter(cfg(load_balancing_type=kind, aux_loss_coeff=0.1, z_loss_coeff=0.1, capacity_factor=1.0))
    for x in (torch.zeros(0, H), torch.zeros(0, 3, H)):
        probs, rmap = router(x.requires_grad_(True))
        assert probs.shape == rmap.shape == (0, E) and router.last_losses == {}
        probs.sum().backward()


def test_bad_input_names_the_argument():
    router = TopKRouter(cfg())
    for bad in (torch.zeros(4, H + 1), torch.zeros(H), torch.zeros(2, 2, 2, H), torch.zeros(4, H, dtype=torch.int64)):
        with pytest.raises(ValueError, match="hidden"):
            router(bad)
    with pytest.raises(ValueError, match="hidden"):
        router([[0.0] * H])
    x = torch.randn(4, H)
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        router(x)
    x[2, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        router(x)
    TopKRouter(cfg(), check_finite=False)(x)  # opted out: no sync, no error
    with pytest.raises(ValueError, match="logits"):
        router.routing(torch.zeros(6, E), seq_length=4, batch=2)
    with pytest.raises(ValueError, match="enable_expert_bias"):
        router.update_expert_bias(torch.zeros(E))


def _gradcheck_config(**kw):
    return cfg(router_dtype="fp64", params_dtype=torch.float64, **kw)


LOSS_CONFIGS = {
    "plain-softmax": dict(),
    "aux+z": dict(aux_loss_coeff=0.3, z_loss_coeff=0.2),
    "seq-aux-sigmoid-groups": dict(score_function="sigmoid", num_groups=4, group_topk=2,
                                   load_balancing_type="seq_aux_loss", aux_loss_coeff=0.3),
    "global-aux-pre-softmax-scaled": dict(pre_softmax=True, topk_scaling_factor=2.0,
                                          load_balancing_type="global_aux_loss", aux_loss_coeff=0.3,
                                          z_loss_coeff=0.1),
}


@pytest.fixture
def one_thread():
    # Thousands of tiny forwards: with 2 OpenMP threads on a shared 2-core machine each op can
    # wait milliseconds for the other thread. Results do not depend on it; speed does.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gradcheck_setup(name):
    router = TopKRouter(_gradcheck_config(**LOSS_CONFIGS[name]))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a larger weight separates the logits: routing is stable under eps
        router.weight.copy_(torch.randn(E, H, generator=gen, dtype=torch.float64))
    x = torch.randn(3, 2, H, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, E, generator=gen, dtype=torch.float64)
    w = router.weight.detach().clone().requires_grad_(True)
    return router, x, w, g


@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_gradcheck_probs_wrt_weight_and_input(name, one_thread):
    """gradcheck of probs with the losses attached (their injected gradient scaled to 0 here:
    gradcheck requires the backward to be linear in grad_output, which an injected loss is not)."""
    router, x, w, _ = _gradcheck_setup(name)
    AuxLossScaler.set_loss_scale(0.0)
    try:
        fn = lambda x, w: torch.func.functional_call(router, {"weight": w}, (x,))[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
    finally:
        AuxLossScaler.set_loss_scale(1.0)
    expected = {
        "plain-softmax": set(),
        "aux+z": {"load_balancing_loss", "z_loss"},
        "seq-aux-sigmoid-groups": {"seq_load_balancing_loss"},
        "global-aux-pre-softmax-scaled": {"global_load_balancing_loss", "z_loss"},
    }[name]
    assert set(router.last_losses) == expected


@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_injected_loss_gradient_is_the_true_gradient(name, one_thread):
    """f = <probs, G> + attached losses. Autograd sees the losses only through the AuxLossScaler
    injection; central differences see their values (last_losses). They must agree."""
    router, x, w, g = _gradcheck_setup(name)

    def f(x, w):
        probs, _ = torch.func.functional_call(router, {"weight": w}, (x,))
        return (probs * g).sum() + sum(router.last_losses.values(), torch.zeros((), dtype=torch.float64))

    gx, gw = torch.autograd.grad(f(x, w), (x, w))
    eps = 1e-6
    for inp, grad in ((x, gx), (w, gw)):
        flat = inp.detach().view(-1)
        numeric = torch.empty_like(flat)
        for i in range(flat.numel()):
            orig = flat[i].item()
            flat[i] = orig + eps
            up = f(x.detach(), w.detach()).item()
            flat[i] = orig - eps
            down = f(x.detach(), w.detach()).item()
            flat[i] = orig
            numeric[i] = (up - down) / (2 * eps)
        torch.testing.assert_close(grad.reshape(-1), numeric, rtol=1e-5, atol=1e-7)


def test_backward_is_deterministic():
    router = TopKRouter(cfg(aux_loss_coeff=0.1, z_loss_coeff=0.1, num_groups=4, group_topk=2))
    x = torch.randn(300, H, requires_grad=True)
    g = torch.randn(300, E)
    grads = []
    for _ in range(2):
        x.grad = None
        router.weight.grad = None
        probs, _ = router(x)
        (probs * g).sum().backward()
        grads.append((x.grad.clone(), router.weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_expert_bias_selection_only_and_update():
    router = TopKRouter(cfg(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.5))
    x = torch.randn(200, H)
    probs0, map0 = router(x)
    assert router.local_tokens_per_expert.sum().item() == 200 * K
    counts = map0.sum(0)
    router.update_expert_bias()
    expected = torch.sign(counts.float().mean() - counts.float()) * 0.5
    assert torch.equal(router.expert_bias, expected)
    assert router.local_tokens_per_expert.sum().item() == 0
    probs1, map1 = router(x)
    assert not torch.equal(map0, map1)  # the bias moved tokens towards under-loaded experts
    # selection only: each chosen prob is the normalised sigmoid of its logit, bias-free
    scores = torch.sigmoid(router.gating(x)) * map1
    torch.testing.assert_close(probs1, scores / scores.sum(-1, keepdim=True))
    router.update_expert_bias(torch.full((E,), 7.0))  # balanced: no change
    assert torch.equal(router.expert_bias, expected)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        router.update_expert_bias(torch.zeros(E + 1))


def test_fp32_buffers_survive_module_casts():
    router = TopKRouter(cfg(score_function="sigmoid", enable_expert_bias=True, aux_loss_coeff=0.1,
                            load_balancing_type="global_aux_loss"))
    router.expert_bias += 1e-3 * torch.arange(E)
    before = router.expert_bias.clone()
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps"):
        assert getattr(router, name).dtype == torch.float32, name
    assert torch.equal(router.expert_bias, before)
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()
