"""What the benchmark scripts (scripts/bench_*.py, scripts/measure/) share: the device-to-device copy
bandwidth that their byte floors divide by, random routings, and the EP-1 layer's shape flags, inputs
and forward + backward step. One definition each, so that two scripts' figures measure the same thing."""
from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from ..config import MoEConfig
from ..layer import MoELayer

__all__ = ["add_shape_args", "copy_bandwidth", "layer_inputs", "layer_step", "routing"]


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy on the current CUDA device, counting read plus write
    (triton's do_bench median)."""
    import triton.testing  # lazily, as the ops import triton: CPU-only users need none

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def routing(T: int, E: int, K: int, seed: Optional[int] = None,
            device: torch.device | str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map [T, E] bool, probs [T, E] fp32): each token's top-K of random scores, the
    softmax over all E masked to them. seed None: the global generator."""
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    scores = torch.rand((T, E), device=device, generator=gen)
    idx = scores.topk(K, dim=1).indices
    routing_map = torch.zeros((T, E), dtype=torch.bool, device=device).scatter_(1, idx, True)
    probs = torch.softmax(scores, dim=1) * routing_map
    return routing_map, probs


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The layer's shape flags; the defaults are the standard EP-1 shape."""
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=6)


def layer_inputs(tokens: int, hidden: int,
                 device: torch.device | str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, upstream), each [tokens, hidden] bf16 on ``device``, from seed 0: the same on every device."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    upstream = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    return x, upstream


def layer_step(config: MoEConfig, x: torch.Tensor, upstream: torch.Tensor,
               once: bool = False) -> tuple[MoELayer, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """(the layer, its forward + backward) on x's device: x [T, H], upstream [T, H]; the step returns
    (output [T, H], input gradient [T, H]) and drops the layer's gradients. ``once``: with the FP8
    weights quantised once, here."""
    layer = MoELayer(config, layer_index=0).to(x.device)
    weights = layer.quantize_fp8_weights() if once else None

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        xi = x.detach().requires_grad_()
        out = layer(xi, fp8_weights=weights)
        out.backward(upstream)
        layer.zero_grad(set_to_none=True)
        return out.detach(), xi.grad
    return layer, step
