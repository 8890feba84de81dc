"""Batch invariance: a token's logits, probs and routing map are bitwise independent of the batch.

Capacity dropping is batch-dependent by definition and is excluded (see capacity.py).
"""

import pytest
import torch

from moe_dispatch.config import MoEConfig
from moe_dispatch.router import TopKRouter

H, E = 64, 32
CONFIGS = {
    "softmax": dict(topk=4),
    "softmax-pre-scaled": dict(topk=4, pre_softmax=True, topk_scaling_factor=2.5),
    "sigmoid-bias-groups": dict(topk=8, score_function="sigmoid", enable_expert_bias=True, num_groups=8, group_topk=4),
    "softmax-groups-losses": dict(topk=6, num_groups=4, group_topk=2, aux_loss_coeff=0.1, z_loss_coeff=0.1),
}
# (router_dtype, input dtype)
DTYPES = [("fp32", torch.float32), ("fp32", torch.bfloat16), ("fp64", torch.float64), ("fp64", torch.bfloat16),
          (None, torch.bfloat16)]
DTYPE_IDS = ["fp32", "fp32-bf16in", "fp64", "fp64-bf16in", "bf16"]


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    # Many small ops: on a shared 2-core machine, 2 OpenMP threads can wait milliseconds per op
    # for each other. (test_router_gating.py checks row stability with the default threads.)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_router(name, router_dtype, device="cpu"):
    cfg = MoEConfig(hidden_size=H, num_experts=E, ffn_hidden_size=8, router_dtype=router_dtype, **CONFIGS[name])
    router = TopKRouter(cfg, device=device)
    if router.expert_bias is not None:  # a non-trivial bias, as after some balancing steps
        router.expert_bias.copy_(torch.linspace(-0.02, 0.02, E).roll(5))
    return router


def tokens(t, dtype, device="cpu", seed=0):
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def check_invariance(router, x, sizes, singles):
    t = x.shape[0]
    logits = router.gating(x)
    probs, rmap = router(x)
    for n in sizes:
        assert torch.equal(router.gating(x[:n]), logits[:n]), n
        p, m = router(x[:n])
        assert torch.equal(p, probs[:n]) and torch.equal(m, rmap[:n]), n
    for i in singles:
        p, m = router(x[i : i + 1])
        assert torch.equal(p, probs[i : i + 1]) and torch.equal(m, rmap[i : i + 1]), i
    truncated = x.clone()
    truncated[90:] = 0
    p, m = router(truncated)
    assert torch.equal(p[:90], probs[:90]) and torch.equal(m[:90], rmap[:90])
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(1)).to(x.device)
    p, m = router(x[perm])
    assert torch.equal(p, probs[perm]) and torch.equal(m, rmap[perm])
    # other tokens with different content (not just a different count)
    other = x.clone()
    other[1::2] = tokens(t, x.dtype, x.device, seed=9)[1::2]
    p, m = router(other)
    assert torch.equal(p[0::2], probs[0::2]) and torch.equal(m[0::2], rmap[0::2])
    # an [S, B, H] batch is the same tokens
    p, m = router(x[:100].view(25, 4, H))
    assert torch.equal(p, probs[:100])


@pytest.mark.parametrize("router_dtype,in_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cpu_batch_invariance(name, router_dtype, in_dtype):
    router = make_router(name, router_dtype)
    x = tokens(1000, in_dtype)
    check_invariance(router, x, sizes=(1, 3, 7, 8, 100, 129), singles=(0, 1, 500, 999))


def test_eval_and_train_give_the_same_values():
    router = make_router("softmax-groups-losses", "fp32")
    x = tokens(200, torch.bfloat16)
    p_train, m_train = router(x)
    assert router.last_losses  # losses are attached in training...
    router.eval()
    with torch.no_grad():
        p_eval, m_eval = router(x)
    assert torch.equal(p_train, p_eval) and torch.equal(m_train, m_eval)  # ...without changing values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("router_dtype,in_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_batch_invariance(name, router_dtype, in_dtype):
    router = make_router(name, router_dtype, device="cuda")
    x = tokens(16384, in_dtype, device="cuda")
    check_invariance(router, x, sizes=(1, 3, 8, 64, 65, 128, 1000, 8192), singles=(0, 77, 16383))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_routing_matches_cpu_given_the_same_logits(name):
    """Same logits in, same map and tie-breaks out on both devices (logits come from CPU)."""
    router = make_router(name, "fp32")
    x = tokens(2048, torch.float32)
    logits = router.gating(x).detach()
    logits[::7, :4] = logits[::7, 4:8]  # plant exact ties
    p_cpu, m_cpu = router.routing(logits)
    router_gpu = make_router(name, "fp32", device="cuda")
    p_gpu, m_gpu = router_gpu.routing(logits.cuda())
    assert torch.equal(m_gpu.cpu(), m_cpu)
    torch.testing.assert_close(p_gpu.cpu(), p_cpu, rtol=1e-6, atol=1e-7)
