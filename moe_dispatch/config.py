"""`MoEConfig`: the one configuration object shared by router, dispatcher and experts.

Field semantics follow Megatron-core's ``moe_*`` TransformerConfig fields (``integrations.megatron``
translates one into the other). Every impossible combination raises a ValueError that names the field.
The config is frozen: ``config.replace(topk=4)`` returns a validated copy, and assigning a field
raises ``dataclasses.FrozenInstanceError``, so no value ever escapes validation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .numerics.rounding import is_int, round_up

# The dispatcher kinds' names, the one list (dispatcher/dropless/exchange.py maps each to its implementation).
DISPATCHER_KINDS: tuple[str, ...] = ("allgather", "alltoall")

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_DROP_POLICIES = ("probs", "position")
_ACTIVATIONS = ("gelu", "relu", "swiglu")
_EXPERT_IMPLS = ("grouped", "sequential")
# The FP8 formats of ``fp8`` -> their torch dtypes. e4m3 only: the float8 torch._scaled_grouped_mm
# takes on sm90 (MXFP8's block scales need Blackwell; docs/ops.md).
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn}


# Seeds feed torch.Generator.manual_seed after small offsets (router, shared expert): keep the
# sum inside the range it accepts.
_SEED_LIMIT = 2**63


def _choice(field: str, value: Any, allowed: tuple) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{field}={value!r} is not one of {allowed}")


def _positive_int(field: str, value: Any) -> None:
    if not is_int(value) or value < 1:
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


def _optional_positive_number(field: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{field} must be None or a finite number > 0, got {value!r}")


def _fp8_format(fp8: Any, hidden_size: int, ffn_hidden_size: Optional[int]) -> None:
    if fp8 is None:
        return
    _choice("fp8", fp8, tuple(FP8_FORMATS))
    # FP8 GEMMs take 16-byte rows (K and N multiples of 16)
    for name, size in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
        if size is not None and size % 16:
            raise ValueError(f"fp8={fp8!r} needs {name} a multiple of 16 (FP8 GEMM rows of 16 bytes), got {size}")


def _dispatcher_kind(kind: Any) -> None:
    if kind not in DISPATCHER_KINDS:
        raise ValueError(f"dispatcher kind must be one of {DISPATCHER_KINDS}, got {kind!r}")


@dataclass(frozen=True)
class DispatchConfig:
    """The dispatcher's settings (typed, immutable): what the dispatchers read, and nothing else.
    Build it with ``MoEConfig.dispatch_config()``, which takes the values as that config
    validated them; built directly (or by ``replace``) it validates its own fields.

    Attributes:
        kind: one of ``DISPATCHER_KINDS`` ('allgather', 'alltoall').
        num_experts: E, global experts, split contiguously over the EP ranks.
        topk: K (sizes the capacity in pad-to-capacity mode).
        hidden_size: H of every token.
        router_dtype: 'fp32', 'fp64' or None (the probs' own dtype); fp64 makes probs travel in fp64.
        probs_in_experts: True: the experts multiply the probs (Megatron); False: the combine does.
        pad_multiple: dropless mode pads every local expert's block to a multiple of this.
        capacity_factor: with pad_to_capacity, every (expert, source rank) block has exactly
            ceil(T * topk / E * capacity_factor) rows (rounded up to pad_multiple).
        pad_to_capacity: fixed-size blocks (see capacity_factor).
        strict_call_order: before each return exchange (the combine, and the backward's), compare
            the handle's call across the group on the host (one 8-byte all-gather and one host
            synchronisation each) and raise at once if ranks combine different calls. Default
            False: the same comparison without a synchronisation, which poisons (NaN) and raises
            at the next dispatch, but only if the calls' split sizes agree (README). Sync-free at
            EP > 1 the default compares the calls in the exchanges' status rows instead; strict
            mode adds the host-side check (and its synchronisation) there too.
        sync_free: the sync-free dispatch: sizes from the config and T alone, no host read
            (dispatcher/sync_free/); at EP > 1 it needs ep_capacity_factor.
        ep_capacity_factor: receive capacity of the static-capacity exchange at EP > 1, in units of the
            balanced load (T * topk rows per rank); see dispatcher.sync_free.sizes.SyncFreeSizes.
        fp8: None, or a key of ``FP8_FORMATS``: each token's row travels quantised, with its own
            fp32 scale (the ``Fp8Rows`` payload, ops/fp8_rows.py); the combine is unchanged.
    """

    kind: str
    num_experts: int
    topk: int
    hidden_size: int
    router_dtype: Optional[str] = "fp32"
    probs_in_experts: bool = False
    pad_multiple: int = 1
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False
    strict_call_order: bool = False
    sync_free: bool = False
    ep_capacity_factor: Optional[float] = None
    fp8: Optional[str] = None

    def __post_init__(self) -> None:
        _dispatcher_kind(self.kind)
        for name in ("num_experts", "topk", "hidden_size", "pad_multiple"):
            _positive_int(name, getattr(self, name))
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"router_dtype must be None, 'fp32' or 'fp64', got {self.router_dtype!r}")
        for name in ("probs_in_experts", "pad_to_capacity", "strict_call_order", "sync_free"):
            _strict_bool(name, getattr(self, name))
        _optional_positive_number("capacity_factor", self.capacity_factor)
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("pad_to_capacity=True needs capacity_factor to be set")
        _optional_positive_number("ep_capacity_factor", self.ep_capacity_factor)
        if self.sync_free and (self.pad_to_capacity or self.pad_multiple != 1):
            raise ValueError("sync_free=True (the sync-free dispatch) needs pad_to_capacity=False and pad_multiple=1")
        _fp8_format(self.fp8, self.hidden_size, None)

    @classmethod
    def _of_valid(cls, **values: Any) -> "DispatchConfig":
        """One with every field given, from values a MoEConfig already validated (whose rules
        include all of the checks above): built without running them a second time."""
        names = [f.name for f in dataclasses.fields(cls)]
        if sorted(values) != sorted(names):
            raise TypeError(f"DispatchConfig._of_valid needs exactly the fields {names}, got {sorted(values)}")
        config = object.__new__(cls)
        for name in names:
            object.__setattr__(config, name, values[name])  # frozen: the dataclass sets fields this way too
        return config

    def replace(self, **changes: Any) -> "DispatchConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def wire_probs_dtype(self, probs_dtype: torch.dtype) -> torch.dtype:
        """Probabilities travel and are applied in fp32, or fp64 when the router works in fp64.
        bf16/fp16 probs are upcast (exactly) to fp32; they are never sent in 16 bits."""
        if self.router_dtype == "fp64" or probs_dtype == torch.float64:
            return torch.float64
        return torch.float32

    def capacity(self, num_tokens: int) -> int:
        """Megatron's expert capacity ceil(T * topk / E * capacity_factor), rounded up to pad_multiple."""
        cap = math.ceil(num_tokens * self.topk / self.num_experts * self.capacity_factor)
        return round_up(cap, self.pad_multiple)

    def field_values(self) -> list[tuple[str, Any]]:
        """(name, value) of every field, in declaration order (the fingerprint compares them)."""
        return _field_values(self)


def _field_values(config: Any) -> list[tuple[str, Any]]:
    """(name, value) of a config's fields; an int in a float field as that float: 1 and 1.0 are
    one setting, so ranks that wrote either agree (and messages show the same value)."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("float", "Optional[float]") and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out.append((f.name, value))
    return out


def as_dispatch_config(config: "MoEConfig | DispatchConfig", kind: Optional[str] = None) -> DispatchConfig:
    """A DispatchConfig from a MoEConfig (``config.dispatch_config(kind)``) or a DispatchConfig
    (itself, with ``kind`` replaced if given)."""
    if isinstance(config, DispatchConfig):
        return config if kind is None or kind == config.kind else dataclasses.replace(config, kind=kind)
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig or a DispatchConfig, got {type(config).__name__}")
    return config.dispatch_config(kind)


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
    ``strict_call_order``: check on the host, before each combine and backward exchange, that every
    EP rank combines the same call (micro-batch); see ``DispatchConfig.strict_call_order``.

    Sync-free step: ``ep_capacity_factor`` (None: the dropless exchange, which reads its sizes on
    the host once per step) opts EP > 1 into the static-capacity exchange: every buffer and split
    is sized from the config and T alone (T equal on every rank), no host read; results are
    bitwise those of the dropless path while every rank's traffic fits, and NaN with an error on
    every rank when it does not (dispatcher/sync_free/). At EP 1 the layer is sync-free anyway
    (pad_multiple=1, no pad_to_capacity); the factor is then unused.

    FP8: ``fp8`` None (default) or 'e4m3': each token's row is quantised once, before the dispatch,
    with its own fp32 scale (a per-token scale: a token's result depends on the token alone); fp8
    rows, their scales and the fp32 probs travel (about half the bytes of bf16 rows); the expert
    GEMMs run in FP8 (forward, dgrad, wgrad; `moe_dispatch.experts.fp8`), their outputs in the
    tokens' dtype (bf16 on CUDA); the combine stays the fp32 weighted sum. The router sees the
    unquantised tokens. Needs hidden_size and ffn_hidden_size multiples of 16. ``fp8_wgrad``
    (Megatron's field of that name; default True) runs the expert weight gradients in FP8 too; False
    runs them in the tokens' dtype from the saved FP8 rows widened by their scales (TransformerEngine's
    ``override_linear_precision`` wgrad), with no column quantisation. Only with ``fp8`` set.

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
    strict_call_order: bool = False
    ep_capacity_factor: Optional[float] = None
    fp8: Optional[str] = None
    fp8_wgrad: bool = True

    def __post_init__(self) -> None:
        for name in ("pre_softmax", "enable_expert_bias", "pad_to_capacity", "probs_in_experts", "strict_call_order",
                     "fp8_wgrad"):
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
        _choice("dispatcher", self.dispatcher, DISPATCHER_KINDS)
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
        if not is_int(self.init_seed) or not 0 <= self.init_seed < _SEED_LIMIT:
            raise ValueError(f"init_seed must be an int in [0, 2**63), got {self.init_seed!r}")
        _fp8_format(self.fp8, self.hidden_size, self.ffn_hidden_size)
        if not self.fp8_wgrad and self.fp8 is None:
            raise ValueError("fp8_wgrad=False (the expert weight gradients in the tokens' dtype) needs fp8 set, "
                             "got fp8=None")

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
        return _field_values(self)

    def dispatch_config(self, kind: Optional[str] = None) -> "DispatchConfig":
        """The dispatcher's part of this config; ``kind`` overrides ``dispatcher``. This config's
        validation covers every field but an overriding ``kind``, so only that is checked again."""
        if kind:  # an empty kind is no override
            _dispatcher_kind(kind)
        return DispatchConfig._of_valid(kind=kind or self.dispatcher, num_experts=self.num_experts, topk=self.topk,
                                        hidden_size=self.hidden_size, router_dtype=self.router_dtype,
                                        probs_in_experts=self.probs_in_experts, pad_multiple=self.pad_multiple,
                                        capacity_factor=self.capacity_factor if self.pad_to_capacity else None,
                                        pad_to_capacity=self.pad_to_capacity, strict_call_order=self.strict_call_order,
                                        sync_free=self.ep_capacity_factor is not None,
                                        ep_capacity_factor=self.ep_capacity_factor, fp8=self.fp8)

    def replace(self, **changes: Any) -> "MoEConfig":
        """A validated copy with some fields changed (the only way to change a frozen config)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"MoEConfig has no field {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)
