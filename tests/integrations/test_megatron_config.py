"""install() / check_supported() / moe_config_from_megatron(megatron_layer=True) on plain config
objects: no processes, no megatron import (the real TransformerConfig cases run in
test_megatron_plugin.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_dispatch import MoEConfig
from moe_dispatch.integrations.megatron import (
    TESTED_MEGATRON_CORE,
    check_supported,
    install,
    is_installed,
    moe_config_from_megatron,
    sync_free_obstacle,
    warn_if_untested,
)


def dispatcher_config(tc) -> MoEConfig:
    return moe_config_from_megatron(tc, megatron_layer=True)


def megatron_config(**changes) -> SimpleNamespace:
    """The fields of a Megatron TransformerConfig that the plug-in reads, with their defaults."""
    fields = dict(num_moe_experts=8, hidden_size=64, moe_ffn_hidden_size=32, ffn_hidden_size=32, moe_router_topk=2,
                  moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", tensor_model_parallel_size=1,
                  expert_tensor_parallel_size=1, moe_shared_expert_overlap=False,
                  overlap_moe_expert_parallel_comm=False, moe_router_padding_for_quantization=False,
                  cuda_graph_impl="none", cuda_graph_scope=[], moe_expert_capacity_factor=None,
                  moe_pad_expert_input_to_capacity=False, params_dtype=torch.bfloat16, moe_permute_fusion=False)
    fields.update(changes)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("changes, field", [
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex'"),
    (dict(moe_token_dispatcher_type="alltoall_seq"), "moe_token_dispatcher_type='alltoall_seq'"),
    (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size=2"),
    (dict(expert_tensor_parallel_size=None, tensor_model_parallel_size=4), "expert_tensor_parallel_size=4"),
    (dict(moe_shared_expert_overlap=True), "moe_shared_expert_overlap=True"),
    (dict(overlap_moe_expert_parallel_comm=True), "overlap_moe_expert_parallel_comm=True"),
    (dict(moe_router_padding_for_quantization=True), "moe_router_padding_for_quantization=True"),
    # dispatch_preprocess captured alone: never (the other five calls run eagerly around it)
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router", "moe_preprocess"]),
     "without moe_preprocess"),
    # the whole MoE layer captured: only sync-free (EP 1, dropless, row_stable_gemms) and bf16
    (dict(cuda_graph_impl="local", cuda_graph_scope=[], expert_model_parallel_size=2),
     "cuda_graph_scope=[] (whole layer) would capture the dispatch"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=[], expert_model_parallel_size=2),
     "EP group has size 2, expected 1"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe"], moe_expert_capacity_factor=1.0,
          moe_pad_expert_input_to_capacity=True), "moe_expert_capacity_factor=1.0"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=["moe"], moe_expert_capacity_factor=1.5),
     "expected None (dropless)"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=[], params_dtype=torch.float32),
     "expected params_dtype=torch.bfloat16"),
    # megatron-core 0.18+: cuda_graph_modules (cuda_graph_scope migrated into it), full_iteration
    (dict(cuda_graph_impl="local", cuda_graph_scope=None, cuda_graph_modules=["moe_router", "moe_preprocess"]),
     "cuda_graph_modules=['moe_router', 'moe_preprocess']"),
    (dict(cuda_graph_impl="full_iteration", cuda_graph_scope=None, cuda_graph_modules=[], expert_model_parallel_size=4),
     "cuda_graph_impl='full_iteration' would capture the dispatch"),
    (dict(transformer_impl="inference_optimized"), "transformer_impl='inference_optimized'"),
    (dict(num_moe_experts=None), "num_moe_experts"),
])
def test_unsupported_settings_raise(changes, field):
    layer = SimpleNamespace(config=megatron_config(**changes))
    with pytest.raises(ValueError) as err:
        install(layer)
    assert field in str(err.value)
    assert not is_installed(layer)


def test_supported_settings_pass():
    for changes in (dict(), dict(moe_permute_fusion=True), dict(moe_token_dispatcher_type="allgather"),
                    dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "moe_router"]),
                    dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=None,
                         cuda_graph_modules=["moe_router"]),
                    # the whole MoE layer captured, sync-free (EP 1 here: the config names no other)
                    dict(cuda_graph_impl="local", cuda_graph_scope=[]),
                    dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "moe"],
                         expert_model_parallel_size=1, moe_expert_capacity_factor=-1.0),
                    dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]),
                    dict(cuda_graph_impl="full_iteration", cuda_graph_scope=None, cuda_graph_modules=[]),
                    # a capture without the MoE layer: any EP size, capacity or dtype
                    dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"], expert_model_parallel_size=2,
                         moe_expert_capacity_factor=1.0, params_dtype=torch.float32),
                    dict(transformer_impl="local"),
                    dict(expert_tensor_parallel_size=None, tensor_model_parallel_size=1)):
        check_supported(megatron_config(**changes))


def test_sync_free_obstacle():
    """install()'s dispatcher runs sync-free exactly at EP 1, dropless, with row_stable_gemms."""
    assert sync_free_obstacle(megatron_config(), 1, True) is None
    assert sync_free_obstacle(megatron_config(moe_expert_capacity_factor=-1.0), 1, True) is None  # Megatron: dropless
    assert "size 2, expected 1" in sync_free_obstacle(megatron_config(), 2, True)
    assert "row_stable_gemms=False" in sync_free_obstacle(megatron_config(), 1, False)
    assert "moe_expert_capacity_factor=1.0" in sync_free_obstacle(megatron_config(moe_expert_capacity_factor=1.0),
                                                                  1, True)


def test_whole_layer_capture_needs_row_stable_gemms():
    """row_stable_gemms=False keeps Megatron's experts, which read tokens_per_expert on the host."""
    whole = megatron_config(cuda_graph_impl="local", cuda_graph_scope=[])
    check_supported(whole)
    with pytest.raises(ValueError, match="row_stable_gemms=False: Megatron's own experts"):
        check_supported(whole, row_stable_gemms=False)
    with pytest.raises(ValueError, match="size 2"):
        check_supported(whole, ep_size=2)
    layer = SimpleNamespace(config=whole)
    with pytest.raises(ValueError, match="row_stable_gemms=False"):
        install(layer, row_stable_gemms=False)
    assert not is_installed(layer)


def test_dispatcher_config():
    cfg = dispatcher_config(megatron_config())
    assert (cfg.dispatcher, cfg.num_experts, cfg.topk, cfg.probs_in_experts, cfg.pad_to_capacity) == \
        ("alltoall", 8, 2, True, False)
    assert cfg.router_dtype == "fp32" and cfg.capacity_factor is None
    # top-1 post-softmax is fine in Megatron; our router's rules must not reject it (not used)
    cfg = dispatcher_config(megatron_config(moe_router_topk=1, moe_router_dtype="fp64",
                                            moe_token_dispatcher_type="allgather"))
    assert (cfg.topk, cfg.router_dtype, cfg.dispatcher) == (1, "fp64", "allgather")
    cfg = dispatcher_config(megatron_config(moe_expert_capacity_factor=1.5))  # dropping, no padding
    assert cfg.capacity_factor is None and not cfg.pad_to_capacity
    cfg = dispatcher_config(megatron_config(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True))
    assert cfg.capacity_factor == 1.5 and cfg.pad_to_capacity
    # Router features we do not implement are Megatron's business here: its router runs.
    cfg = dispatcher_config(megatron_config(moe_router_load_balancing_type="sinkhorn", moe_input_jitter_eps=0.1,
                                            activation_func=object()))
    assert cfg.probs_in_experts and cfg.load_balancing_type == "none"
    # ... but not for our whole layer, which would have to implement them.
    with pytest.raises(ValueError, match="moe_input_jitter_eps"):
        moe_config_from_megatron(megatron_config(moe_input_jitter_eps=0.1))
    assert not moe_config_from_megatron(megatron_config()).probs_in_experts


def test_one_translator_shares_the_dispatch_fields():
    """Our whole layer and our dispatcher in Megatron's layer read the dispatch fields alike."""
    tc = megatron_config(moe_router_dtype="fp64", moe_token_dispatcher_type="allgather", moe_router_topk=3)
    whole, dispatch = moe_config_from_megatron(tc), dispatcher_config(tc)
    for field in ("hidden_size", "num_experts", "topk", "ffn_hidden_size", "router_dtype", "dispatcher",
                  "params_dtype", "pad_multiple"):
        assert getattr(whole, field) == getattr(dispatch, field), field
    with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor"):
        dispatcher_config(megatron_config(moe_pad_expert_input_to_capacity=True))


def test_version_warning_names_the_tested_range():
    low, high = TESTED_MEGATRON_CORE
    for inside in (low, high, "0.18.0", f"{high}+27280d6"):
        assert warn_if_untested(inside) is False
    for outside in ("0.15.3", "0.20.0", "0.20.0rc1"):
        with pytest.warns(UserWarning, match=f"tested with megatron-core {low} through {high}"):
            assert warn_if_untested(outside) is True

