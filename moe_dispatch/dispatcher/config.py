"""DispatchConfig: what the dispatchers read from a configuration, and nothing else."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from ..ops.torch_twin import round_up
from .exchange import KINDS


@dataclass(frozen=True)
class DispatchConfig:
    """The dispatcher's settings (typed, immutable). Build it with ``from_moe(MoEConfig)``.

    Attributes:
        kind: a registered dispatcher kind (``exchange.KINDS``: 'alltoall', 'allgather').
        num_experts: E, global experts, split contiguously over the EP ranks.
        topk: K (sizes the capacity in pad-to-capacity mode).
        hidden_size: H of every token.
        router_dtype: 'fp32', 'fp64' or None (the probs' own dtype); fp64 makes probs travel in fp64.
        probs_in_experts: True: the experts multiply the probs (Megatron); False: the combine does.
        pad_multiple: dropless mode pads every local expert's block to a multiple of this.
        capacity_factor: with pad_to_capacity, every (expert, source rank) block has exactly
            ceil(T * topk / E * capacity_factor) rows (rounded up to pad_multiple).
        pad_to_capacity: fixed-size blocks (see capacity_factor).
        sync_free: the static (sync-free) dispatch: sizes from the config and T alone, no host
            read (dispatcher/static.py); at EP > 1 it needs ep_capacity_factor.
        ep_capacity_factor: receive capacity of the static exchange at EP > 1, in units of the
            balanced load (T * topk rows per rank); see static.StaticSizes.
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
    sync_free: bool = False
    ep_capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"dispatcher kind must be one of {tuple(KINDS)}, got {self.kind!r}")
        for name in ("num_experts", "topk", "hidden_size", "pad_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"router_dtype must be None, 'fp32' or 'fp64', got {self.router_dtype!r}")
        for name in ("probs_in_experts", "pad_to_capacity", "sync_free"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf)
                               or cf <= 0):
            raise ValueError(f"capacity_factor must be None or a finite number > 0, got {cf!r}")
        if self.pad_to_capacity and cf is None:
            raise ValueError("pad_to_capacity=True needs capacity_factor to be set")
        ecf = self.ep_capacity_factor
        if ecf is not None and (isinstance(ecf, bool) or not isinstance(ecf, (int, float)) or not math.isfinite(ecf)
                                or ecf <= 0):
            raise ValueError(f"ep_capacity_factor must be None or a finite number > 0, got {ecf!r}")
        if self.sync_free and (self.pad_to_capacity or self.pad_multiple != 1):
            raise ValueError("sync_free=True (the static dispatch) needs pad_to_capacity=False and pad_multiple=1")

    @classmethod
    def from_moe(cls, config: Any, kind: Optional[str] = None) -> "DispatchConfig":
        """From a ``moe_dispatch.MoEConfig``; ``kind`` overrides ``config.dispatcher``."""
        from ..config import MoEConfig

        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig or a DispatchConfig, got {type(config).__name__}")
        return cls(kind=kind or config.dispatcher, num_experts=config.num_experts, topk=config.topk,
                   hidden_size=config.hidden_size, router_dtype=config.router_dtype,
                   probs_in_experts=bool(config.probs_in_experts), pad_multiple=config.pad_multiple,
                   capacity_factor=config.capacity_factor if config.pad_to_capacity else None,
                   pad_to_capacity=bool(config.pad_to_capacity),
                   sync_free=config.ep_capacity_factor is not None, ep_capacity_factor=config.ep_capacity_factor)

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

    def replace(self, **changes: Any) -> "DispatchConfig":
        """A validated copy with some fields changed."""
        return DispatchConfig(**{**dict(self.field_values()), **changes})

    def field_values(self) -> list[tuple[str, Any]]:
        """(name, value) of every field, in declaration order (the fingerprint compares them)."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


def as_dispatch_config(config: Any, kind: Optional[str] = None) -> DispatchConfig:
    """config itself if it is a DispatchConfig (``kind`` must then match or be None), else
    ``DispatchConfig.from_moe(config, kind)``."""
    if isinstance(config, DispatchConfig):
        if kind is not None and kind != config.kind:
            return DispatchConfig(**{**dict(config.field_values()), "kind": kind})
        return config
    return DispatchConfig.from_moe(config, kind)
