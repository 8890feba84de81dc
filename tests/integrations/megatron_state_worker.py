"""Run Megatron-core's SequentialMLP on CPU beside ours, in a process of its own.

Megatron needs torch.distributed and its parallel state initialised and
``torch.cuda.current_device`` pointing at the CPU (tests/megatron_cpu.py); a subprocess keeps that
away from the other tests. Prints one JSON line per (activation, dtype): row-wise relative
differences and bitwise flags.
Usage: python -m tests.integrations.megatron_state_worker PORT
"""
from __future__ import annotations

import json
import os
import sys

import torch


def main(port: str) -> None:
    import torch.distributed as dist

    from tests.megatron_cpu import apply_cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    apply_cpu_shims()  # Megatron asks for a CUDA device even with CPU initialisation
    for activation in ("gelu", "relu", "swiglu"):
        for dtype in (torch.float32, torch.bfloat16):
            report = compare(activation, dtype)
            print(json.dumps(dict(activation=activation, dtype=str(dtype), **report)), flush=True)
    dist.destroy_process_group()


def compare(activation: str, dtype: torch.dtype) -> dict:
    """Ours (probs_in_experts) and Megatron's SequentialMLP on the same weights and tokens."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP as MegatronSequentialMLP
    from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_dispatch.experts import GroupedMLP
    from moe_dispatch.integrations.megatron import megatron_state_dict, to_megatron_sequential
    from tests.experts.reference import make_config, routed_batch

    counts = [7, 0, 30, 3]
    ours = GroupedMLP(make_config(activation, dtype, probs_in_experts=True), 4)
    func = {"gelu": F.gelu, "relu": F.relu, "swiglu": F.silu}[activation]
    tc = TransformerConfig(
        num_layers=1, hidden_size=ours.hidden_size, num_attention_heads=4, num_moe_experts=4,
        moe_ffn_hidden_size=ours.ffn_hidden_size, ffn_hidden_size=ours.ffn_hidden_size,
        add_bias_linear=False, use_cpu_initialization=True, activation_func=func,
        gated_linear_unit=activation == "swiglu", bias_activation_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
    )
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    theirs = MegatronSequentialMLP(4, tc, submodules, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    result = theirs.load_state_dict(megatron_state_dict(ours, "sequential"), strict=False)
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys), result

    x, tpe, probs = routed_batch(counts, ours.hidden_size, dtype, seed=5)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    grads = []
    for module in (ours, theirs):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out = module(xi, tpe, pi)
        y = out[0] if isinstance(out, tuple) else out
        y.backward(dy)
        grads.append((y.detach(), xi.grad, pi.grad))
    # Our weight gradients under Megatron's names, in the order of its sorted parameter names.
    named = to_megatron_sequential(ours.weight1.grad, ours.weight2.grad)
    wgrad_ours = [named[k] for k in sorted(named)]
    wgrad_theirs = [p.grad for _, p in sorted(theirs.named_parameters())]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double().reshape(len(a), -1), b.double().reshape(len(b), -1)
        return ((a - b).abs().amax(1) / b.abs().amax(1).clamp_min(1e-300)).max().item()

    (y0, dx0, dp0), (y1, dx1, dp1) = grads
    return {
        "out": rel(y0, y1), "dx": rel(dx0, dx1),
        "dprobs": ((dp0.double() - dp1.double()).abs().max() / dp1.double().abs().max()).item(),
        "dw": max(rel(a, b) for a, b in zip(wgrad_ours, wgrad_theirs) if b.abs().max() > 0),
        "bitwise": [bool(torch.equal(a, b)) for a, b in ((y0, y1), (dx0, dx1), (dp0, dp1))],
    }


if __name__ == "__main__":
    main(sys.argv[1])
