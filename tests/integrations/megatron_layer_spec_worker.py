"""Code for tests/integrations/test_megatron_layer_spec.py: ``deterministic_layer_spec`` as
Megatron-LM's ``pretrain_gpt.py --spec`` calls it (core_v0.19.0 and HEAD), and a GPTModel built
from it on one CPU gloo rank.

Megatron-LM's ``megatron.training`` is not part of the megatron-core wheel; from a Megatron-LM source
tree on PYTHONPATH it imports (Python 3.11 needs ``tests.megatron_cpu.apply_typing_override``). Where
it does not import, ``install_default_layer_spec_stand_in`` puts a STAND-IN module under its name whose
``default_layer_spec(config, vp_stage)`` is HEAD's MoE branch: ``get_gpt_decoder_block_spec(
config.transformer, use_transformer_engine=..., normalization=..., qk_l2_norm=..., vp_stage=...)``
with ``config`` a GPTModelConfig (here: an object with ``.transformer``).
"""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import torch
import torch.distributed as dist

LAYER_FREQ = [0, 1, 0, 1]  # --moe-layer-freq: dense, MoE, dense, MoE
H, VOCAB, SEQ, BATCH = 64, 64, 16, 2


def real_default_layer_spec_imports() -> bool:
    """Whether Megatron-LM's own megatron.training.models.gpt imports here (not the stand-in); a
    Megatron-LM source tree first on PYTHONPATH (MEGATRON_SOURCE of scripts/test_megatron_versions.sh)
    provides it, on Python 3.11 through ``apply_typing_override``."""
    from tests.megatron_cpu import apply_typing_override

    apply_typing_override()
    try:
        from megatron.training.models import gpt
    except (ImportError, SyntaxError):
        return False
    return hasattr(gpt, "default_layer_spec") and not getattr(gpt, "STAND_IN", False)


def install_default_layer_spec_stand_in() -> None:
    """Put the STAND-IN megatron.training.models.gpt into sys.modules (see the module doc)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def default_layer_spec(config, vp_stage):
        transformer = config.transformer
        return get_gpt_decoder_block_spec(transformer, use_transformer_engine=transformer.transformer_impl ==
                                          "transformer_engine", normalization=transformer.normalization,
                                          qk_l2_norm=transformer.qk_l2_norm, vp_stage=vp_stage)

    for name in ("megatron.training", "megatron.training.models"):
        sys.modules.setdefault(name, types.ModuleType(name))
    module = types.ModuleType("megatron.training.models.gpt")
    module.default_layer_spec = default_layer_spec
    module.STAND_IN = True
    sys.modules["megatron.training.models.gpt"] = module


def transformer_config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=len(LAYER_FREQ), hidden_size=H, num_attention_heads=4, ffn_hidden_size=128,
                  moe_ffn_hidden_size=32, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=LAYER_FREQ,
                  moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", transformer_impl="local",
                  use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                  gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    fields.update(extra)
    return TransformerConfig(**fields)


def gpt_model_config(**extra):
    """What the spec callable receives from Megatron-LM: a GPTModelConfig (``.transformer``)."""
    if real_default_layer_spec_imports():
        from megatron.training.models.gpt import GPTModelConfig

        return GPTModelConfig(transformer=transformer_config(**extra), vocab_size=VOCAB)
    return SimpleNamespace(transformer=transformer_config(**extra))


def mlp_kinds(spec) -> list:
    """Per layer spec of a block spec: the MoE layer class's name, or 'dense' (Megatron's MLP, a
    ModuleSpec or, from 0.19, a partial of its builder)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    out = []
    for layer in spec.layer_specs:
        mlp = layer.submodules.mlp
        module = mlp.module if isinstance(mlp, ModuleSpec) else getattr(mlp, "func", mlp)
        name = getattr(module, "__name__", str(module))
        out.append(name if name in ("MoELayer", "DeterministicMoELayer") else "dense")
    return out


def _options(mlp) -> tuple:
    """(fp8, row_stable_gemms) that an MoE spec (ModuleSpec or partial) hands DeterministicMoELayer."""
    params = mlp.params if hasattr(mlp, "params") else mlp.keywords
    return params["fp8"], params["row_stable_gemms"]


def build_worker(rank: int, world_size: int) -> dict:
    """A GPTModel from ``--spec moe_dispatch.integrations.megatron deterministic_layer_spec`` (resolved
    as Megatron-LM resolves --spec) on one CPU rank: which MLPs it holds, and one training step."""
    from tests.megatron_cpu import apply_cpu_rng, apply_cpu_shims

    assert world_size == 1
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    apply_cpu_shims(prepare=False)
    apply_cpu_rng()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import import_module

    from moe_dispatch.integrations.megatron import is_installed

    model_parallel_cuda_manual_seed(1234)
    if not real_default_layer_spec_imports():
        install_default_layer_spec_stand_in()
    from megatron.training.models.gpt import default_layer_spec

    layer_spec = import_module(("moe_dispatch.integrations.megatron", "deterministic_layer_spec"))
    fp8_layer_spec = import_module(("moe_dispatch.integrations.megatron", "deterministic_layer_spec_fp8"))
    config = gpt_model_config()
    spec = layer_spec(config, vp_stage=None)
    specs = {"ours": spec, "ours_fp8": fp8_layer_spec(config, vp_stage=None), "stock": default_layer_spec(config, None)}
    spec_mlps = {name: mlp_kinds(s) for name, s in specs.items()}
    spec_options = {name: [_options(layer.submodules.mlp) for layer, f in zip(s.layer_specs, LAYER_FREQ) if f]
                    for name, s in specs.items() if name != "stock"}
    model = GPTModel(config=config.transformer, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ).train()
    mlps = [layer.mlp for layer in model.decoder.layers]
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    positions = torch.arange(SEQ)[None].expand(BATCH, -1)
    loss = model(tokens, positions, mask, labels=(tokens + 1) % VOCAB).float().mean()
    loss.backward()
    grads = [p.grad is not None for layer in mlps for p in layer.parameters()]
    out = dict(mlps=[type(m).__name__ for m in mlps], installed=[is_installed(m) for m in mlps],
               loss=float(loss.detach()), all_grads=all(grads), spec_mlps=spec_mlps, spec_options=spec_options)
    parallel_state.destroy_model_parallel()
    dist.barrier()
    return out
