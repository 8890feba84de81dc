"""Build megatron-core 0.16.1's MoELayer (SequentialMLP, no TransformerEngine) outside Megatron's
training set-up: for ``moe-dispatch check --megatron`` and the plug-in tests.

No ``initialize_model_parallel``: each layer gets an explicit ``ProcessGroupCollection`` whose EP
group is any subgroup (so one process can hold an EP-1 and an EP-2 layer side by side) and whose
other groups are this rank alone. The weights are seeded per global expert id, as our own experts'
(``moe_dispatch.experts.init_expert_weights``), so layers of every EP size are the same model::

    prepare_megatron(device)                        # CPU shims on CPU, TE-less router on CUDA
    single = [dist.new_group([r]) for r in range(world)][rank]
    config = moe_transformer_config(64, 128, 8, 2, "alltoall", torch.bfloat16, ep_size=2)
    layer = build_moe_layer(config, process_groups(ep_group, single), ours=True, device=device)
    load_seeded_weights(layer, init_seed=1234)
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["build_moe_layer", "load_seeded_weights", "moe_transformer_config", "prepare_megatron",
           "process_groups"]


def prepare_megatron(device: torch.device) -> None:
    """Make megatron-core 0.16.1's MoELayer runnable here without initialize_model_parallel.

    CPU: :func:`~moe_dispatch.integrations.megatron_cpu.apply_cpu_shims` (process-wide test shims).
    CUDA: :func:`~moe_dispatch.integrations.megatron_cpu.disable_te_router_gemm` (without TE, an
    fp32 router raises NameError otherwise) and Megatron's global memory buffer, which its allgather
    dispatcher gathers into."""
    from .megatron_cpu import apply_cpu_shims, disable_te_router_gemm

    if torch.device(device).type == "cpu":
        if torch.cuda.is_available():
            raise RuntimeError("megatron-core's MoELayer on CPU ranks needs the CPU shims, which are for "
                               "processes without CUDA: hide the GPUs (CUDA_VISIBLE_DEVICES=) or use NCCL")
        apply_cpu_shims()
        return
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    disable_te_router_gemm()


def process_groups(ep_group: Any, single: Any) -> Any:
    """A ProcessGroupCollection for one MoE layer: expert parallelism over ``ep_group``, every
    other parallelism (TP, CP, DP, PP, expert TP, expert DP) of size 1 (``single``: a group of
    this rank alone)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=single, cp=single, tp_cp=single, tp_dp_cp=single, dp=single, dp_cp=single,
                                  pp=single, ep=ep_group, expt_tp=single, tp_ep=ep_group, expt_dp=single)


def moe_transformer_config(hidden: int, ffn: int, experts: int, topk: int, dispatcher: str, dtype: torch.dtype,
                           ep_size: int, router_dtype: Optional[str] = "fp32", **extra: Any) -> Any:
    """A TransformerConfig for one MoE layer: no aux loss, no biases, gelu, CPU initialisation
    (the weights are then set by :func:`load_seeded_weights` or by the caller); ``extra`` overrides
    any field."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=experts,
                  moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn, moe_router_topk=topk,
                  moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_router_dtype=router_dtype, add_bias_linear=False,
                  use_cpu_initialization=True, bias_activation_fusion=False, params_dtype=dtype,
                  bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, expert_model_parallel_size=ep_size)
    fields.update(extra)
    return TransformerConfig(**fields)


def build_moe_layer(config: Any, pg_collection: Any, ours: bool, device: Optional[torch.device] = None,
                    row_stable_gemms: bool = True) -> Any:
    """megatron-core's MoELayer from its own module spec (``get_moe_module_spec(use_te=False)``:
    SequentialMLP experts). ``ours``: built as DeterministicMoELayer (our dispatcher of the same kind
    installed, and with ``row_stable_gemms`` our row-stable router / expert GEMMs); else Megatron's
    stock MoELayer with its own dispatcher. In train mode, on ``device``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import build_module

    from .megatron import get_moe_module_spec, is_installed

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, row_stable_gemms=row_stable_gemms)
    if not ours:
        spec.module = MoELayer
        spec.params = {k: v for k, v in spec.params.items() if k != "row_stable_gemms"}
    layer = build_module(spec, config=config, pg_collection=pg_collection)
    assert is_installed(layer) == ours
    if device is not None:
        layer.to(device)
    return layer.train()


@torch.no_grad()
def load_seeded_weights(layer: Any, init_seed: int) -> Any:
    """Set a Megatron MoELayer's (SequentialMLP) weights from ``init_seed`` as our MoELayer draws
    its own: each global expert's fc1 / fc2 from its own generator (normal, std 1/sqrt(fan in)), the
    router's normal(0, 0.02) from ``init_seed + ROUTER_SEED_OFFSET``. A global expert's weights
    depend only on (init_seed, its id): layers of every EP size are the same model. Returns layer."""
    from ..experts.init import WEIGHT1, WEIGHT2, init_expert_weights
    from ..router.router import INIT_STD, ROUTER_SEED_OFFSET

    router = layer.router.weight
    gen = torch.Generator().manual_seed(init_seed + ROUTER_SEED_OFFSET)
    router.copy_(torch.empty(router.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen))
    ids = list(layer.local_expert_indices)
    experts = list(layer.experts.local_experts)
    if len(experts) != len(ids):
        raise ValueError(f"expected SequentialMLP experts ({len(ids)} local), got {type(layer.experts).__name__}")
    hidden = layer.config.hidden_size
    fc1_out, _ = experts[0].linear_fc1.weight.shape  # [ffn (x2 if gated), H]
    ffn = experts[0].linear_fc2.weight.shape[1]
    w1 = init_expert_weights((hidden, fc1_out), init_seed, ids, WEIGHT1, hidden ** -0.5, torch.float32)
    w2 = init_expert_weights((ffn, hidden), init_seed, ids, WEIGHT2, ffn ** -0.5, torch.float32)
    for i, expert in enumerate(experts):  # torch Linear layout: the transposes of ours
        expert.linear_fc1.weight.copy_(w1[i].t())
        expert.linear_fc2.weight.copy_(w2[i].t())
    return layer
