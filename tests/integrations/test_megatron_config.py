"""install() / check_supported() / dispatcher_config() on plain config objects: no processes, no
megatron import (the real TransformerConfig cases run in test_megatron_plugin.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_dispatch.integrations.megatron import check_supported, dispatcher_config, install, is_installed


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
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_preprocess"]), "cuda_graph_impl="),
    (dict(cuda_graph_impl="local", cuda_graph_scope=[]), "cuda_graph_impl="),
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
                    dict(expert_tensor_parallel_size=None, tensor_model_parallel_size=1)):
        check_supported(megatron_config(**changes))


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

