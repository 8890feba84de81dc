"""moe_config_from_megatron on Megatron-core's own TransformerConfig: every field mapped, the
defaults, and the features our whole layer does not implement."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from moe_dispatch.integrations.megatron import moe_config_from_megatron

pytest.importorskip("megatron.core")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


def tc(**kw):
    base = dict(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=16, moe_router_topk=4,
        moe_ffn_hidden_size=24, add_bias_linear=False,
    )
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**base)


def test_from_megatron_maps_every_field():
    c = moe_config_from_megatron(
        tc(
            moe_router_dtype="fp64", moe_router_score_function="sigmoid", moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
            moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-4,
            moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
            moe_token_drop_policy="position", moe_token_dispatcher_type="alltoall",
            gated_linear_unit=True, activation_func=F.silu, params_dtype=torch.bfloat16,
            moe_shared_expert_intermediate_size=48,
        ),
        init_seed=7,
    )
    assert (c.hidden_size, c.num_experts, c.topk, c.ffn_hidden_size) == (64, 16, 4, 24)
    assert (c.router_dtype, c.score_function, c.pre_softmax, c.topk_scaling_factor) == ("fp64", "sigmoid", True, 2.5)
    assert (c.num_groups, c.group_topk, c.enable_expert_bias, c.bias_update_rate) == (4, 2, True, 1e-2)
    assert (c.load_balancing_type, c.aux_loss_coeff, c.z_loss_coeff) == ("seq_aux_loss", 1e-3, 1e-4)
    assert (c.capacity_factor, c.pad_to_capacity, c.drop_policy, c.dispatcher) == (1.5, True, "position", "alltoall")
    assert (c.activation, c.params_dtype, c.shared_expert_ffn_hidden_size, c.init_seed) == (
        "swiglu", torch.bfloat16, 48, 7)


def test_from_megatron_defaults_and_activations():
    c = moe_config_from_megatron(tc(moe_ffn_hidden_size=None, ffn_hidden_size=40))
    assert c.router_dtype is None  # Megatron's default: the input dtype
    assert (c.ffn_hidden_size, c.dispatcher, c.activation, c.capacity_factor) == (40, "allgather", "gelu", None)
    assert moe_config_from_megatron(tc(activation_func=F.relu)).activation == "relu"
    single = tc(moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.1])
    assert moe_config_from_megatron(single).aux_loss_coeff == 0.1


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(add_bias_linear=True), "add_bias_linear"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
        (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.1]),
         "moe_router_load_balancing_type"),
        (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type"),
        (dict(gated_linear_unit=True, activation_func=F.gelu), "activation_func"),
        (dict(moe_input_jitter_eps=0.1), "moe_input_jitter_eps"),
        (dict(calculate_per_token_loss=True, moe_aux_loss_coeff=0.1), "calculate_per_token_loss"),
    ],
)
def test_from_megatron_rejects_unsupported(kw, field):
    with pytest.raises(ValueError, match=field):
        moe_config_from_megatron(tc(**kw))
