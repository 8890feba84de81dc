"""Build megatron-core's MoELayer (SequentialMLP without TransformerEngine, or TE's experts; 0.16.1
through 0.19.2) outside Megatron's training set-up: for ``moe-dispatch check --megatron``, the benchmark and
training scripts, and the plug-in tests.

No ``initialize_model_parallel``: each layer gets an explicit ``ProcessGroupCollection`` whose EP
group is any subgroup (so one process can hold an EP-1 and an EP-2 layer side by side) and whose
other groups are this rank alone. The weights are seeded per global expert id, as our own experts'
(``moe_dispatch.experts.init_expert_weights``), so layers of every EP size are the same model::

    prepare_megatron(device)                        # TE-less router, Megatron's global buffer
    single = [dist.new_group([r]) for r in range(world)][rank]
    config = moe_transformer_config(64, 128, 8, 2, "alltoall", torch.bfloat16, ep_size=2)
    layer = build_moe_layer(config, process_groups(ep_group, single), ours=True, device=device)
    load_seeded_weights(layer, init_seed=1234)
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["build_from_spec", "build_moe_layer", "disable_te_router_gemm", "load_seeded_weights",
           "moe_transformer_config", "prepare_megatron", "process_groups"]


def prepare_megatron(device: torch.device) -> None:
    """Make megatron-core's MoELayer runnable in this process without initialize_model_parallel.

    Allocates Megatron's global memory buffer (its allgather dispatcher gathers into it) and runs
    :func:`disable_te_router_gemm` (without TE, 0.16.1's fp32 router raises NameError otherwise).

    Megatron's MoE code asks for CUDA devices and streams even for CPU tensors. A CPU ``device`` is
    accepted only where ``torch.cuda.current_device()`` already works, i.e. with CUDA, or in a
    process that patched torch.cuda (the test suite's CPU shims, tests/megatron_cpu.py; never
    part of this package because they patch torch.cuda process-wide)."""
    if torch.device(device).type == "cpu":
        try:
            torch.cuda.current_device()
        except (AssertionError, RuntimeError) as exc:
            raise RuntimeError("megatron-core's MoELayer needs CUDA here: its MoE code calls "
                               "torch.cuda.current_device() and CUDA streams even for CPU tensors "
                               f"({exc}). CPU ranks are a test set-up (the test suite's CPU shims)") from exc
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    disable_te_router_gemm()


def disable_te_router_gemm() -> None:
    """Let megatron-core 0.16.1 run an fp32 router without TransformerEngine (it raises NameError
    on te_general_gemm otherwise; 0.17+ define it as None themselves): its router then uses the
    plain torch GEMM. A no-op where TransformerEngine provides the name."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm") or moe_utils.te_general_gemm is None:
        moe_utils.te_general_gemm = None


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


def build_from_spec(spec: Any, **kwargs: Any) -> Any:
    """Build a module from a Megatron spec of either kind: a ``ModuleSpec`` (``build_module``) or a
    builder callable such as the ``functools.partial`` that megatron-core 0.18+ returns."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(spec, ModuleSpec):
        return build_module(spec, **kwargs)
    return spec(**kwargs)


def _moe_submodules(spec: Any) -> Any:
    """The MoESubmodules of an MoE spec (ModuleSpec.submodules, or the partial's keyword)."""
    submodules = getattr(spec, "submodules", None)
    if submodules is None and hasattr(spec, "keywords"):
        submodules = spec.keywords.get("submodules")
    if submodules is None:
        raise ValueError(f"expected an MoE spec with submodules, got {spec!r}")
    return submodules


def build_moe_layer(config: Any, pg_collection: Any, ours: bool, device: Optional[torch.device] = None,
                    row_stable_gemms: bool = True, use_te: bool = False) -> Any:
    """megatron-core's MoELayer from its own module spec: ``get_moe_module_spec(use_te=False)``
    (SequentialMLP experts), or with ``use_te`` TransformerEngine's (TEGroupedMLP experts where
    ``config.moe_grouped_gemm``, else SequentialMLP with TE linears; needs TransformerEngine).
    ``ours``: built through our spec helper as DeterministicMoELayer (our dispatcher of the same
    kind installed, and with ``row_stable_gemms`` our row-stable router / expert GEMMs); else
    Megatron's stock MoELayer, with its own dispatcher, from Megatron's spec. In train mode, on
    ``device``."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as megatron_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from .dispatcher import is_installed
    from .specs import get_moe_module_spec

    spec_args = dict(use_te=use_te, num_experts=config.num_moe_experts,
                     moe_grouped_gemm=bool(getattr(config, "moe_grouped_gemm", False)))
    if ours:
        spec = get_moe_module_spec(row_stable_gemms=row_stable_gemms, **spec_args)
        layer = build_from_spec(spec, config=config, pg_collection=pg_collection)
    else:
        submodules = _moe_submodules(megatron_spec(**spec_args))
        layer = MoELayer(config=config, submodules=submodules, pg_collection=pg_collection)
    if is_installed(layer) != ours:
        raise RuntimeError(f"build_moe_layer(ours={ours}) built {type(layer).__name__} with "
                           f"{type(layer.token_dispatcher).__name__}")
    if device is not None:
        layer.to(device)
    return layer.train()


@torch.no_grad()
def load_seeded_weights(layer: Any, init_seed: int) -> Any:
    """Set a Megatron MoELayer's (SequentialMLP) weights from ``init_seed`` as our MoELayer draws
    its own: each global expert's fc1 / fc2 from its own generator (normal, std 1/sqrt(fan in)), the
    router's normal(0, 0.02) from ``init_seed + ROUTER_SEED_OFFSET``. A global expert's weights
    depend only on (init_seed, its id): layers of every EP size are the same model. Returns layer."""
    from ...experts import WEIGHT1, WEIGHT2, init_expert_weights
    from ...router import INIT_STD, ROUTER_SEED_OFFSET

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
