"""The layer's bits at fixed weights and inputs: one sha256 per result, to compare two commits.

    PYTHONPATH=<checkout> python scripts/measure/layer_bits.py [--device cuda]

Runs MoELayer forward + backward at EP 1 in three modes (the default sync-free step, the dropless
dispatch by ``pad_multiple=8``, per-token FP8 ``fp8='e4m3'`` on CUDA) and prints, per mode, the
sha256 of the output, the input's gradient and every parameter's gradient. It uses only the
public API (MoEConfig, MoELayer), so the same file runs against an older checkout: run it under
each commit's PYTHONPATH and diff the two outputs. Equal lines mean bitwise equal results.
"""
from __future__ import annotations

import argparse
import hashlib

import torch

from moe_dispatch import MoEConfig, MoELayer


def digest(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes (its dtype and shape in front), first 16 hex digits."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def run_mode(name: str, device: torch.device, tokens: int, **fields) -> list[str]:
    """Lines 'mode what sha' of one forward + backward."""
    config = MoEConfig(hidden_size=256, num_experts=16, topk=4, ffn_hidden_size=512, params_dtype=torch.bfloat16,
                       load_balancing_type="none", **fields)
    layer = MoELayer(config, None, layer_index=0).to(device)
    gen = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn((tokens, 256), generator=gen).to(device, torch.bfloat16).requires_grad_()
    g = torch.randn((tokens, 256), generator=gen).to(device, torch.bfloat16)
    out = layer(x)
    out.backward(g)
    lines = [f"{name} out {digest(out)}", f"{name} x.grad {digest(x.grad)}"]
    lines += [f"{name} {pname}.grad {digest(p.grad)}" for pname, p in sorted(layer.named_parameters())
              if p.grad is not None]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    device = torch.device(args.device)
    modes = {"sync-free": {}, "dropless": {"pad_multiple": 8}}
    if device.type == "cuda":
        modes["fp8"] = {"fp8": "e4m3"}
    for name, fields in modes.items():
        for line in run_mode(name, device, args.tokens, **fields):
            print(line)


if __name__ == "__main__":
    main()
