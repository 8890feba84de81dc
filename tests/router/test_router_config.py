"""MoEConfig: validation and probs_dtype."""

import pytest
import torch

from moe_dispatch.config import MoEConfig

BASE = dict(hidden_size=32, num_experts=8, topk=2, ffn_hidden_size=16)


def cfg(**kw):
    return MoEConfig(**{**BASE, **kw})


def test_defaults_and_probs_dtype():
    c = cfg()
    assert (c.router_dtype, c.score_function, c.load_balancing_type, c.dispatcher) == (
        "fp32", "softmax", "aux_loss", "alltoall")
    assert c.capacity_factor is None and c.pad_multiple == 1 and c.params_dtype == torch.float32
    assert c.probs_dtype(torch.bfloat16) == torch.float32
    assert cfg(router_dtype="fp64").probs_dtype(torch.bfloat16) == torch.float64
    assert cfg(router_dtype=None).probs_dtype(torch.bfloat16) == torch.bfloat16
    assert cfg(router_dtype=None).probs_dtype(torch.float16) == torch.float16


BAD = [
    (dict(topk=9), "topk"),
    (dict(topk=0), "topk"),
    (dict(num_experts=0), "num_experts"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(num_groups=3, group_topk=1), "num_groups"),
    (dict(num_groups=4, group_topk=5, topk=6), "group_topk"),
    (dict(group_topk=1), "group_topk"),
    (dict(num_groups=4, group_topk=3, topk=2), "group_topk"),  # ranks groups by top-0 scores
    (dict(num_groups=4, group_topk=1, topk=3), "topk"),  # 1 group of 2 experts cannot give 3
    (dict(pad_to_capacity=True), "pad_to_capacity"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(router_dtype="bf16"), "router_dtype"),
    (dict(score_function="relu"), "score_function"),
    (dict(load_balancing_type="sinkhorn"), "load_balancing_type"),
    (dict(drop_policy="random"), "drop_policy"),
    (dict(dispatcher="flex"), "dispatcher"),
    (dict(activation="geglu"), "activation"),
    (dict(expert_impl="fused"), "expert_impl"),
    (dict(pad_multiple=0), "pad_multiple"),
    (dict(enable_expert_bias=True), "enable_expert_bias"),
    (dict(topk=1), "pre_softmax"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
    (dict(z_loss_coeff=float("nan")), "z_loss_coeff"),
    (dict(topk_scaling_factor=0.0), "topk_scaling_factor"),
    (dict(bias_update_rate=-1e-3), "bias_update_rate"),
    (dict(params_dtype=torch.int32), "params_dtype"),
    (dict(shared_expert_ffn_hidden_size=0), "shared_expert_ffn_hidden_size"),
]


@pytest.mark.parametrize("changes,field", BAD, ids=[f for _, f in BAD])
def test_bad_config_names_field(changes, field):
    with pytest.raises(ValueError, match=field):
        cfg(**changes)


def test_valid_combinations():
    cfg(topk=1, pre_softmax=True)
    cfg(topk=1, score_function="sigmoid")
    cfg(num_groups=4)  # alone: allowed and ignored, as in Megatron
    cfg(num_groups=4, group_topk=2, topk=4, score_function="sigmoid", enable_expert_bias=True)
    cfg(capacity_factor=1.0, pad_to_capacity=True, drop_policy="position")
    with pytest.raises(ValueError, match="topk"):
        cfg().replace(topk=100)


