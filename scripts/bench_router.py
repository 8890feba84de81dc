"""Benchmark TopKRouter forward and forward+backward against Megatron-core's unfused router.

Run on a CUDA machine:  python scripts/bench_router.py [--no-megatron]

"Megatron" is its pure-torch router path composed as its TopKRouter.routing does it (gating in
the router dtype, top-k with score function, aux-loss scores, switch loss, MoEAuxLossAutoScaler),
without process groups or the logging tracker. Both sides take bf16 activations and an fp32 router
dtype. Timings are triton.testing.do_bench medians. Each case also checks row stability: the
logits of the first rows must be bitwise the same when computed alone.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from moe_dispatch.config import MoEConfig
from moe_dispatch.router import TopKRouter, gating_linear

CASES = {
    "T=16384 H=4096 E=128 K=6 softmax aux": dict(
        T=16384, cfg=dict(hidden_size=4096, num_experts=128, topk=6, aux_loss_coeff=1e-2)),
    "T=16384 H=7168 E=256 K=8 sigmoid groups 8/4 bias seq-aux": dict(
        T=16384, seq=4096, cfg=dict(
            hidden_size=7168, num_experts=256, topk=8, score_function="sigmoid", num_groups=8, group_topk=4,
            enable_expert_bias=True, topk_scaling_factor=2.5, load_balancing_type="seq_aux_loss", aux_loss_coeff=1e-4)),
}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def megatron_router(mu, cfg: MoEConfig, weight, expert_bias, seq, batch):
    """Megatron-core 0.16.1's TopKRouter.forward from its own functions (one rank, no TP/CP)."""
    counts = torch.zeros(cfg.num_experts, device=weight.device)

    def forward(x):
        logits = mu.router_gating_linear(x, weight, None, torch.float32)
        logits = logits.view(-1, cfg.num_experts)
        probs, rmap = mu.topk_routing_with_score_function(
            logits, cfg.topk, use_pre_softmax=cfg.pre_softmax, num_groups=cfg.num_groups,
            group_topk=cfg.group_topk, scaling_factor=cfg.topk_scaling_factor,
            score_function=cfg.score_function, expert_bias=expert_bias)
        aux_map, scores = mu.compute_routing_scores_for_aux_loss(logits, cfg.topk, cfg.score_function)
        if cfg.load_balancing_type == "seq_aux_loss":
            s, m = scores.reshape(seq, -1), aux_map.reshape(seq, -1)
            loss = mu.switch_load_balancing_loss_func(s, m.sum(0), seq, cfg.topk, cfg.num_experts,
                                                      cfg.aux_loss_coeff) / batch
        else:
            loss = mu.switch_load_balancing_loss_func(
                scores, aux_map.sum(0), logits.shape[0], cfg.topk, cfg.num_experts, cfg.aux_loss_coeff)
        probs = mu.MoEAuxLossAutoScaler.apply(probs, loss)
        if expert_bias is not None:
            with torch.no_grad():
                counts.add_(rmap.sum(0))
        return probs, rmap

    return forward


def run_case(name: str, case: dict, weight_dtype: torch.dtype, mu) -> list:
    T, seq = case["T"], case.get("seq")
    cfg = MoEConfig(ffn_hidden_size=1024, params_dtype=weight_dtype, **case["cfg"])
    H, E = cfg.hidden_size, cfg.num_experts
    shape = (seq, T // seq, H) if seq else (T, H)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    g = torch.randn(T, E, device="cuda", dtype=torch.float32)
    rows = []
    variants = {"ours": TopKRouter(cfg, device="cuda"),
                "ours, check_finite=False": TopKRouter(cfg, device="cuda", check_finite=False)}
    for label, router in variants.items():
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.linspace(-0.01, 0.01, E, device="cuda"))
        fwd = bench(lambda: router(x))
        fb = bench(lambda: torch.autograd.backward(router(x)[0], g))
        rows.append((name, str(weight_dtype).replace("torch.", ""), label, fwd, fb))
    router = variants["ours"]
    if mu is not None:
        mg = megatron_router(mu, cfg, router.weight, router.expert_bias, seq or T, T // (seq or T))
        p_ours, m_ours = router(x)
        p_mg, m_mg = mg(x)
        agree = (m_ours == m_mg).all(-1).float().mean().item()
        fwd = bench(lambda: mg(x))
        fb = bench(lambda: torch.autograd.backward(mg(x)[0], g))
        rows.append((name, str(weight_dtype).replace("torch.", ""), f"Megatron (maps agree on {agree:.4%} of tokens)",
                     fwd, fb))
    # gating alone: our fixed-config Triton GEMM against cuBLAS on the fp32 upcasts
    x2 = x.detach().view(T, H)
    w = router.weight.detach()
    ours_ms = bench(lambda: gating_linear(x2, w, torch.float32))
    cublas_ms = bench(lambda: x2.float() @ w.float().t())
    full = gating_linear(x2, w, torch.float32)
    full_cublas = x2.float() @ w.float().t()
    stable = all(torch.equal(gating_linear(x2[:n], w, torch.float32), full[:n]) for n in (1, 7, 64, 65, 128, 1000))
    stable_cublas = all(torch.equal(x2[:n].float() @ w.float().t(), full_cublas[:n]) for n in (1, 7, 64, 65, 128, 1000))
    err = ((full.double() - x2.double() @ w.double().t()).abs().max().item(),
           (full_cublas.double() - x2.double() @ w.double().t()).abs().max().item())
    rows.append((name, str(weight_dtype).replace("torch.", ""),
                 f"gating GEMM only: ours row-stable={stable} max|err|={err[0]:.1e} / "
                 f"cuBLAS fp32 row-stable={stable_cublas} max|err|={err[1]:.1e}",
                 ours_ms, cublas_ms))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-megatron", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_router.py needs a CUDA device")
    mu = None
    if not args.no_megatron:
        try:
            from megatron.core.transformer.moe import moe_utils as mu

            mu.te_general_gemm = None  # 0.16.1 without TE, fp32 router on CUDA: NameError te_general_gemm
        except Exception as exc:  # optional
            print(f"# megatron-core not importable ({exc}); skipping it", file=sys.stderr)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("# bf16 activations, fp32 router dtype; do_bench medians in ms; training mode (aux loss attached)")
    print("| case | weight | router | fwd (ms) | fwd+bwd (ms) |")
    print("|---|---|---|---|---|")
    for name, case in CASES.items():
        for weight_dtype in (torch.bfloat16, torch.float32):
            print(f"# measuring {name}, {weight_dtype} weight ...", flush=True)
            for row in run_case(name, case, weight_dtype, mu):
                print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]:.3f} | {row[4]:.3f} |", flush=True)
            torch.cuda.empty_cache()
    print("# gating rows: fwd column = ours, fwd+bwd column = cuBLAS fp32 mm (forward only)")


if __name__ == "__main__":
    main()
