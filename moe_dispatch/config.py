"""`MoEConfig`: the one configuration object shared by router, dispatcher and experts.

Field semantics follow Megatron-core's ``moe_*`` TransformerConfig fields; `MoEConfig.from_megatron`
maps one onto the other. Every impossible combination raises a ValueError that names the field.
The config is frozen: ``config.replace(topk=4)`` returns a validated copy, and assigning a field
raises ``dataclasses.FrozenInstanceError``, so no value ever escapes validation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .dispatcher.exchange import KINDS

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_DROP_POLICIES = ("probs", "position")
_DISPATCHERS = tuple(sorted(KINDS))  # the dispatcher kinds' one registry
_ACTIVATIONS = ("gelu", "relu", "swiglu")
_EXPERT_IMPLS = ("grouped", "sequential")


# Seeds feed torch.Generator.manual_seed after small offsets (router, shared expert): keep the
# sum inside the range it accepts.
_SEED_LIMIT = 2**63


def _choice(field: str, value: Any, allowed: tuple) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{field}={value!r} is not one of {allowed}")


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a size is a typo, not a size.
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(field: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{field} must be an int >= 1, got {value!r}")


def _strict_bool(field: str, value: Any) -> None:
    # Truthiness would take "no", 0 or a tensor as a setting; only True and False are.
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be a bool (True or False), got {value!r}")


def _finite_number(field: str, value: Any, minimum: float, strict: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        op = ">" if strict else ">="
        raise ValueError(f"{field} must be a finite number {op} {minimum}, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Configuration of one mixture-of-experts layer.

    Shape: ``hidden_size`` H, ``num_experts`` E, ``topk`` K experts per token,
    ``ffn_hidden_size`` of each expert.

    Router: ``router_dtype`` is 'fp32', 'fp64' or None (the input dtype); it is the dtype of the
    gating GEMM, the logits and the probs. ``score_function`` 'softmax' | 'sigmoid';
    ``pre_softmax`` normalises over all experts before top-k instead of over the K chosen.
    ``num_groups``/``group_topk`` enable group-limited routing (DeepSeek-V3); ``num_groups`` alone
    is allowed and ignored, as in Megatron. ``enable_expert_bias`` (sigmoid only) adds a per-expert
    bias used for selection only, updated by ``bias_update_rate`` per step.

    Losses: ``load_balancing_type`` picks the aux loss ('aux_loss', 'seq_aux_loss',
    'global_aux_loss', 'none') scaled by ``aux_loss_coeff``; ``z_loss_coeff`` None disables z-loss.

    Capacity: ``capacity_factor`` None means dropless. Dropping depends on the whole batch, so it
    is outside the batch-invariance guarantee. ``pad_to_capacity`` gives each expert exactly its
    capacity; ``drop_policy`` 'probs' keeps the highest probs, 'position' the earliest tokens.

    Experts/dispatch: ``dispatcher``, ``activation``, ``expert_impl``, ``pad_multiple`` (pad each
    expert's permuted block to a multiple of this many rows), ``probs_in_experts`` (Megatron mode:
    experts multiply probs before fc2; default False applies probs in the fp32 combine),
    ``shared_expert_ffn_hidden_size``, ``params_dtype`` and ``init_seed`` (all weights are built
    from it on the CPU, so every rank builds the same ones; an int in [0, 2**63)).

    Sync-free step: ``ep_capacity_factor`` (None: the dropless exchange, which reads its sizes on
    the host once per step) opts EP > 1 into the static-capacity exchange: every buffer and split
    is sized from the config and T alone (T equal on every rank), no host read; results are
    bitwise those of the dropless path while every rank's traffic fits, and NaN with an error on
    every rank when it does not (dispatcher/static.py). At EP 1 the layer is sync-free anyway
    (pad_multiple=1, no pad_to_capacity); the factor is then unused.

    Types are strict: bool fields take only True/False, int fields only ints (not bools or
    floats), float fields ints or floats; the Optional fields above take None as described.
    """

    hidden_size: int
    num_experts: int
    topk: int
    ffn_hidden_size: int
    router_dtype: Optional[str] = "fp32"
    score_function: str = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: Optional[float] = None
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False
    drop_policy: str = "probs"
    dispatcher: str = "alltoall"
    activation: str = "gelu"
    init_seed: int = 1234
    params_dtype: torch.dtype = torch.float32
    probs_in_experts: bool = False
    pad_multiple: int = 1
    expert_impl: str = "grouped"
    shared_expert_ffn_hidden_size: Optional[int] = None
    ep_capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("pre_softmax", "enable_expert_bias", "pad_to_capacity", "probs_in_experts"):
            _strict_bool(name, getattr(self, name))
        for name in ("hidden_size", "num_experts", "ffn_hidden_size", "pad_multiple"):
            _positive_int(name, getattr(self, name))
        _positive_int("topk", self.topk)
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.router_dtype is not None:
            _choice("router_dtype", self.router_dtype, tuple(_ROUTER_DTYPES))
        _choice("score_function", self.score_function, _SCORE_FUNCTIONS)
        _choice("load_balancing_type", self.load_balancing_type, _LOAD_BALANCING_TYPES)
        _choice("drop_policy", self.drop_policy, _DROP_POLICIES)
        _choice("dispatcher", self.dispatcher, _DISPATCHERS)
        _choice("activation", self.activation, _ACTIVATIONS)
        _choice("expert_impl", self.expert_impl, _EXPERT_IMPLS)
        if self.score_function == "softmax" and self.topk == 1 and not self.pre_softmax:
            # A softmax over one selected logit is constant 1: the router would get no gradient.
            raise ValueError("topk=1 with score_function='softmax' needs pre_softmax=True")
        if self.topk_scaling_factor is not None:
            _finite_number("topk_scaling_factor", self.topk_scaling_factor, 0.0, strict=True)
        self._check_groups()
        if self.enable_expert_bias and self.score_function != "sigmoid":
            raise ValueError("enable_expert_bias needs score_function='sigmoid' (as in Megatron)")
        _finite_number("bias_update_rate", self.bias_update_rate, 0.0, strict=False)
        _finite_number("aux_loss_coeff", self.aux_loss_coeff, 0.0, strict=False)
        if self.z_loss_coeff is not None:
            _finite_number("z_loss_coeff", self.z_loss_coeff, 0.0, strict=False)
        if self.capacity_factor is not None:
            _finite_number("capacity_factor", self.capacity_factor, 0.0, strict=True)
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("pad_to_capacity=True needs capacity_factor to be set")
        if self.ep_capacity_factor is not None:
            _finite_number("ep_capacity_factor", self.ep_capacity_factor, 0.0, strict=True)
            if self.pad_to_capacity or self.pad_multiple != 1:
                raise ValueError("ep_capacity_factor (the static-capacity exchange) needs pad_to_capacity=False and "
                                 f"pad_multiple=1, got pad_to_capacity={self.pad_to_capacity}, "
                                 f"pad_multiple={self.pad_multiple}")
        if self.shared_expert_ffn_hidden_size is not None:
            _positive_int("shared_expert_ffn_hidden_size", self.shared_expert_ffn_hidden_size)
        if not isinstance(self.params_dtype, torch.dtype) or not self.params_dtype.is_floating_point:
            raise ValueError(f"params_dtype must be a floating torch.dtype, got {self.params_dtype!r}")
        if not _is_int(self.init_seed) or not 0 <= self.init_seed < _SEED_LIMIT:
            raise ValueError(f"init_seed must be an int in [0, 2**63), got {self.init_seed!r}")

    def _check_groups(self) -> None:
        if self.num_groups is not None:
            _positive_int("num_groups", self.num_groups)
            if self.num_experts % self.num_groups != 0:
                raise ValueError(
                    f"num_experts={self.num_experts} is not divisible by num_groups={self.num_groups}"
                )
        if self.group_topk is None:
            return
        _positive_int("group_topk", self.group_topk)
        if self.num_groups is None:
            raise ValueError("group_topk is set but num_groups is None")
        if self.group_topk > self.num_groups:
            raise ValueError(f"group_topk={self.group_topk} exceeds num_groups={self.num_groups}")
        if self.group_topk > self.topk:
            # Groups are ranked by the sum of their best topk // group_topk scores; 0 is no ranking.
            raise ValueError(f"group_topk={self.group_topk} exceeds topk={self.topk}")
        per_group = self.num_experts // self.num_groups
        if self.topk > self.group_topk * per_group:
            raise ValueError(
                f"topk={self.topk} exceeds the {self.group_topk * per_group} experts that "
                f"group_topk={self.group_topk} groups of {per_group} hold"
            )

    def probs_dtype(self, input_dtype: torch.dtype) -> torch.dtype:
        """Dtype of the router's logits and probs for a given input (activation) dtype."""
        if self.router_dtype is None:
            return input_dtype
        return _ROUTER_DTYPES[self.router_dtype]

    def field_values(self) -> list[tuple[str, Any]]:
        """(name, value) of every field, in declaration order (the EP ranks agree on them)."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def replace(self, **changes: Any) -> "MoEConfig":
        """A validated copy with some fields changed (the only way to change a frozen config)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"MoEConfig has no field {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_megatron(cls, transformer_config: Any, *, megatron_layer: bool = False, **overrides: Any) -> "MoEConfig":
        """Build from a Megatron-core ``TransformerConfig``; ``overrides`` set our own fields.

        ``megatron_layer=False``: the config of our whole MoELayer (router, dispatcher, experts).
        Megatron features we do not implement raise a ValueError naming the Megatron field, so a
        ported configuration never silently changes meaning.

        ``megatron_layer=True``: the config of our dispatcher inside Megatron's own MoELayer
        (``install``, ``dispatcher_from_megatron``). Megatron's router and experts keep running, so
        only the dispatch fields are read (experts, top-k, sizes, router dtype, capacity padding,
        dispatcher kind, params dtype); ``probs_in_experts=True`` because Megatron's experts
        multiply the probs themselves (the combine then sums unweighted: probs applied once); the
        router / expert fields keep neutral values that no Megatron setting can make invalid.
        Capacity dropping is Megatron's router's, so the dispatcher sees a capacity only when
        Megatron pads each expert to it (``moe_pad_expert_input_to_capacity``).
        """
        fields = _megatron_dispatch_fields(transformer_config, megatron_layer)
        if not megatron_layer:
            fields.update(_megatron_router_expert_fields(transformer_config))
        fields.update(overrides)
        return cls(**fields)


def _single(field: str, value: Any) -> Any:
    # Megatron accepts lists to combine several aux losses; we support exactly one.
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{field}={value!r}: combining several load-balancing losses is not supported")
        return value[0]
    return value


def _megatron_activation(tc: Any) -> str:
    import torch.nn.functional as F

    func, gated = getattr(tc, "activation_func", F.gelu), bool(getattr(tc, "gated_linear_unit", False))
    if gated and func is F.silu:
        return "swiglu"
    if not gated and func is F.gelu:
        return "gelu"
    if not gated and func is F.relu:
        return "relu"
    raise ValueError(
        f"activation_func={getattr(func, '__name__', func)!r} with gated_linear_unit={gated} "
        "has no MoEConfig.activation (supported: gelu, relu, silu+GLU=swiglu)"
    )


# Megatron fields whose non-default value changes the layer in a way we do not implement.
_MEGATRON_UNSUPPORTED = {
    "moe_input_jitter_eps": None,
    "moe_router_force_load_balancing": False,
    "moe_enable_routing_replay": False,
    "moe_shared_expert_gate": False,
    "moe_apply_probs_on_input": False,
    "moe_router_padding_for_quantization": False,
    "moe_latent_size": None,
    "add_bias_linear": False,
}


def _megatron_dispatch_fields(tc: Any, megatron_layer: bool) -> dict:
    """The fields the dispatcher needs, from a TransformerConfig (see ``MoEConfig.from_megatron``)."""
    get = lambda name, default=None: getattr(tc, name, default)  # noqa: E731  (Megatron's config, any version)
    if not get("num_moe_experts"):
        raise ValueError("num_moe_experts is not set: this TransformerConfig has no MoE layer")
    dispatcher = get("moe_token_dispatcher_type", "allgather")
    if dispatcher not in _DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher_type={dispatcher!r} is not one of {_DISPATCHERS}")
    capacity = get("moe_expert_capacity_factor")
    if capacity is not None and capacity < 0:
        capacity = None  # Megatron's own convention: a negative factor means dropless
    pad = bool(get("moe_pad_expert_input_to_capacity", False))
    if pad and capacity is None:
        raise ValueError("moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor > 0")
    fields = dict(
        hidden_size=get("hidden_size"),
        num_experts=get("num_moe_experts"),
        topk=get("moe_router_topk", 2),
        ffn_hidden_size=get("moe_ffn_hidden_size") or get("ffn_hidden_size"),
        router_dtype=get("moe_router_dtype"),
        capacity_factor=capacity,
        pad_to_capacity=pad,
        dispatcher=dispatcher,
        params_dtype=get("params_dtype") or torch.float32,
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


def _megatron_router_expert_fields(tc: Any) -> dict:
    """Our router's and experts' fields, from a TransformerConfig; raises for Megatron features we
    do not implement."""
    get = lambda name, default=None: getattr(tc, name, default)  # noqa: E731  (Megatron's config, any version)
    for name, default in _MEGATRON_UNSUPPORTED.items():
        if get(name, default) not in (default, None):
            raise ValueError(f"{name}={get(name)!r} is not supported by moe_dispatch")
    balancing = _single("moe_router_load_balancing_type", get("moe_router_load_balancing_type", "aux_loss"))
    if balancing == "sinkhorn":
        raise ValueError("moe_router_load_balancing_type='sinkhorn' is not supported")
    coeff = _single("moe_aux_loss_coeff", get("moe_aux_loss_coeff", 0.0))
    if get("calculate_per_token_loss", False) and (coeff or get("moe_z_loss_coeff")):
        # Megatron then multiplies the losses by the local token count; we keep the plain means.
        raise ValueError("calculate_per_token_loss=True with MoE losses is not supported")
    return dict(
        score_function=get("moe_router_score_function", "softmax"),
        pre_softmax=bool(get("moe_router_pre_softmax", False)),
        topk_scaling_factor=get("moe_router_topk_scaling_factor"),
        num_groups=get("moe_router_num_groups"),
        group_topk=get("moe_router_group_topk"),
        enable_expert_bias=bool(get("moe_router_enable_expert_bias", False)),
        bias_update_rate=get("moe_router_bias_update_rate", 1e-3),
        load_balancing_type=balancing,
        aux_loss_coeff=coeff,
        z_loss_coeff=get("moe_z_loss_coeff"),
        drop_policy=get("moe_token_drop_policy", "probs"),
        activation=_megatron_activation(tc),
        shared_expert_ffn_hidden_size=get("moe_shared_expert_intermediate_size"),
    )
