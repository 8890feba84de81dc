"""A Megatron-core ``TransformerConfig`` as our ``MoEConfig`` (``moe_config_from_megatron``), and
its MoE settings that the EP ranks agree on (``megatron_moe_settings``)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...config import MoEConfig
from .supported import (
    check_dispatcher_supported,
    check_layer_supported,
    megatron_activation,
    megatron_field,
    megatron_fp8_wgrad,
    one_loss,
)


def moe_config_from_megatron(transformer_config: Any, *, megatron_layer: bool = False, **overrides: Any) -> MoEConfig:
    """Build a MoEConfig from a Megatron-core ``TransformerConfig``; ``overrides`` set our own fields.

    ``megatron_layer=False``: the config of our whole MoELayer (router, dispatcher, experts).
    Megatron features we do not implement raise a ValueError naming the Megatron field, so a
    ported configuration never silently changes meaning.

    ``megatron_layer=True``: the config of our dispatcher inside Megatron's own MoELayer
    (``install``, ``dispatcher_from_megatron``). Megatron's router and experts keep running, so
    only the dispatch fields are read (experts, top-k, sizes, router dtype, capacity padding,
    dispatcher kind, params dtype); ``probs_in_experts=True`` because Megatron's experts
    multiply the probs themselves (the combine then sums unweighted: probs applied once;
    ``install`` overrides it with False for its row-stable experts, which leave them to the
    combine); the
    router / expert fields keep neutral values that no Megatron setting can make invalid.
    Capacity dropping is Megatron's router's, so the dispatcher sees a capacity only when
    Megatron pads each expert to it (``moe_pad_expert_input_to_capacity``).

    With ``fp8`` among the overrides, ``fp8_wgrad`` follows the TransformerConfig's own ``fp8_wgrad``
    (Megatron's ``--no-fp8-wgrad`` sets it False) unless overridden too.
    """
    tc = transformer_config
    check_dispatcher_supported(tc)
    if not megatron_layer:
        check_layer_supported(tc)
    fields = _dispatch_fields(tc, megatron_layer)
    if not megatron_layer:
        fields.update(_router_expert_fields(tc))
    fields.update(overrides)
    if fields.get("fp8") is not None and "fp8_wgrad" not in overrides:
        # Megatron's --no-fp8-wgrad: the expert weight gradients in the tokens' dtype
        fields["fp8_wgrad"] = megatron_fp8_wgrad(tc)
    return MoEConfig(**fields)


def _dispatch_fields(tc: Any, megatron_layer: bool) -> dict:
    """The fields the dispatcher needs (see ``moe_config_from_megatron``)."""
    capacity = megatron_field(tc, "moe_expert_capacity_factor")
    if capacity is not None and capacity < 0:
        capacity = None  # Megatron's own convention: a negative factor means dropless
    pad = bool(megatron_field(tc, "moe_pad_expert_input_to_capacity", False))
    if pad and capacity is None:
        raise ValueError("moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor > 0")
    fields = dict(
        hidden_size=megatron_field(tc, "hidden_size"),
        num_experts=megatron_field(tc, "num_moe_experts"),
        topk=megatron_field(tc, "moe_router_topk", 2),
        ffn_hidden_size=megatron_field(tc, "moe_ffn_hidden_size") or megatron_field(tc, "ffn_hidden_size"),
        router_dtype=megatron_field(tc, "moe_router_dtype"),
        capacity_factor=capacity,
        pad_to_capacity=pad,
        dispatcher=megatron_field(tc, "moe_token_dispatcher_type", "allgather"),
        params_dtype=megatron_field(tc, "params_dtype") or torch.float32,
    )
    if megatron_layer:
        fields.update(
            capacity_factor=capacity if pad else None,
            probs_in_experts=True,
            # Neutral: our router does not run, and pre_softmax=True is valid for any top-k.
            pre_softmax=True,
            load_balancing_type="none",
        )
    return fields


def _router_expert_fields(tc: Any) -> dict:
    """Our router's and experts' fields (``check_layer_supported`` has accepted ``tc``)."""
    return dict(
        score_function=megatron_field(tc, "moe_router_score_function", "softmax"),
        pre_softmax=bool(megatron_field(tc, "moe_router_pre_softmax", False)),
        topk_scaling_factor=megatron_field(tc, "moe_router_topk_scaling_factor"),
        num_groups=megatron_field(tc, "moe_router_num_groups"),
        group_topk=megatron_field(tc, "moe_router_group_topk"),
        enable_expert_bias=bool(megatron_field(tc, "moe_router_enable_expert_bias", False)),
        bias_update_rate=megatron_field(tc, "moe_router_bias_update_rate", 1e-3),
        load_balancing_type=one_loss(tc, "moe_router_load_balancing_type", "aux_loss"),
        aux_loss_coeff=one_loss(tc, "moe_aux_loss_coeff", 0.0),
        z_loss_coeff=megatron_field(tc, "moe_z_loss_coeff"),
        drop_policy=megatron_field(tc, "moe_token_drop_policy", "probs"),
        activation=megatron_activation(tc),
        shared_expert_ffn_hidden_size=megatron_field(tc, "moe_shared_expert_intermediate_size"),
    )


def megatron_moe_settings(config: Any) -> list[tuple[str, Any]]:
    """(name, value) of a TransformerConfig's MoE settings (``num_moe_experts`` and every
    ``moe_*`` field), which the EP ranks agree on before the router's first collective: a router
    setting that differs across ranks (the load-balancing type, a coefficient) would mismatch
    Megatron's aux-loss collectives or make a token's result depend on its rank."""
    names = ([f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config)
             else sorted(vars(config)))
    return [(n, getattr(config, n)) for n in names if n == "num_moe_experts" or n.startswith("moe_")]
