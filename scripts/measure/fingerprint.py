"""What the FP8 handle's bits check costs beside the quantisation it saves, at the FP8 bench's layer
shape (scripts/bench_fp8_layer.py: E 64, H 4096, ffn 1024, bf16 expert weights, gelu).

Run on a CUDA machine:  python scripts/measure/fingerprint.py [--hidden 4096 --ffn 1024 --experts 64]

One row per expert weight (weight1 [E, H, F], weight2 [E, F, H]) and for the layer's whole check
(``fp8_weights_bits_problem``: both fingerprints and their comparison): the fused Triton kernel
(``ops.bits_fingerprint`` on CUDA), its torch twin (``ops.fingerprint.bits_fingerprint``, about
10 bytes of traffic per bf16 element), the byte floor (each weight read once, 2 bytes per bf16
element, over the given HBM bandwidth, 3.35 TB/s for an H100 SXM by default, and over the
device-to-device copy bandwidth measured in this run) and ``quantize_weight`` of the same weight
(what a forward without a handle runs). Every time is a CUDA-graph replay median
(``graph_median_ms``: GPU time alone). The kernel's value is checked bitwise against the twin's.
"""
from __future__ import annotations

import argparse

import torch
import triton

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.experts import quantize_weight
from moe_dispatch.experts.fp8_weights import fp8_weights_bits_problem
from moe_dispatch.ops import bits_fingerprint, fingerprint
from moe_dispatch.tools.benchmarks import copy_bandwidth
from moe_dispatch.tools.profiling import graph_median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hbm-tb-per-s", type=float, default=3.35, help="the floor's bandwidth (H100 SXM: 3.35)")
    args = parser.parse_args()
    config = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=2, ffn_hidden_size=args.ffn,
                       params_dtype=torch.bfloat16, fp8="e4m3")
    layer = MoELayer(config, layer_index=0).to("cuda")
    experts = layer.experts
    copy_bw = copy_bandwidth()
    hbm = args.hbm_tb_per_s * 1e12
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}; "
          f"device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write)")
    print("| what | shape | kernel ms | torch twin ms | floor ms at "
          f"{args.hbm_tb_per_s} TB/s | floor ms at copy bw | kernel / floor | quantize_weight ms | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("weight1", "weight2"):
        w = getattr(experts, name).detach()
        nbytes = w.numel() * w.element_size()
        same = torch.equal(bits_fingerprint(w), fingerprint.bits_fingerprint(w))
        kernel_ms = graph_median_ms(lambda: bits_fingerprint(w))
        twin_ms = graph_median_ms(lambda: fingerprint.bits_fingerprint(w))
        quant_ms = graph_median_ms(lambda: quantize_weight(w))
        floor_ms, copy_floor_ms = nbytes / hbm * 1e3, nbytes / copy_bw * 1e3
        print(f"| {name} | {list(w.shape)} bf16 | {kernel_ms:.3f} | {twin_ms:.3f} | {floor_ms:.3f} | "
              f"{copy_floor_ms:.3f} | {kernel_ms / floor_ms:.2f} | {quant_ms:.3f} | {same} |")
    handle = layer.quantize_fp8_weights()
    nbytes = sum(p.numel() * p.element_size() for p in (experts.weight1, experts.weight2))
    check_ms = graph_median_ms(lambda: fp8_weights_bits_problem(handle, experts))
    quant_ms = graph_median_ms(lambda: (quantize_weight(experts.weight1), quantize_weight(experts.weight2)))
    print(f"| the handle's check (both weights, compared) | | {check_ms:.3f} | | {nbytes / hbm * 1e3:.3f} | "
          f"{nbytes / copy_bw * 1e3:.3f} | {check_ms / (nbytes / hbm * 1e3):.2f} | {quant_ms:.3f} | |")


if __name__ == "__main__":
    main()
