"""The experts' weights quantised to FP8 once, for every micro-batch between two optimizer steps.

An FP8 layer (``MoEConfig(fp8=...)``) quantises each expert weight twice per forward + backward:
the forward's operand per (expert, output column) and the dgrad's per (expert, input column). With
several micro-batches per optimizer step (gradient accumulation), or forward-only passes, the same
weights are quantised again at each call. ``quantize_fp8_weights(experts)`` does it once and
returns a frozen handle that a forward takes (``MoELayer.forward(x, fp8_weights=...)``,
``LocalExperts.forward(..., fp8_weights=...)``). The results are bitwise those of per-call
quantisation (the same function makes the same operands), and the weights' gradients still
accumulate in their bf16/fp32 ``.grad``.

A handle is for the weights as they were when it was made. A forward refuses it with a ValueError
(on every EP rank, in the layer) once it may be stale:

- after any optimizer step since then: every ``torch.optim.Optimizer`` subclass, fused or not, runs
  torch's global step hooks. Whether the step updated these weights is not asked, so a wrapper
  such as Megatron's, which steps fp32 copies and then writes the model's weights through
  ``.data``, is covered;
- after an in-place change of either weight that autograd counts (``copy_``, ``load_state_dict``),
  or new storage given to one (``weight.data = t``, ``module.to(...)``);
- when either parameter was replaced, or the handle is another experts' module's.

A write into the weights' storage through ``.data`` outside any optimizer step is not seen (autograd does not see it
either): quantise again after one. A captured CUDA graph reads the handle's tensors as they were at
capture, and no check runs at a replay.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..config import FP8_FORMATS
from ..distributed.agreement import (
    FP8_WEIGHTS_CHANGED,
    FP8_WEIGHTS_NOT_A_HANDLE,
    FP8_WEIGHTS_NOT_FP8,
    FP8_WEIGHTS_OTHER_EXPERTS,
    FP8_WEIGHTS_STEPPED,
    InputProblem,
)
from .fp8 import quantize_weight

_steps = 0  # optimizer steps begun in this process since the first handle was made
_hook: Optional[Any] = None


def _count_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    global _steps
    _steps += 1  # before the step: one that raises half-way has still changed weights


def _optimizer_steps() -> int:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_count_step)
    return _steps


@dataclass(frozen=True)
class WeightStamp:
    """What a copy derived from some weights (their FP8 operands) is checked against: the weights
    themselves (weak references), their autograd versions and data pointers (``p.data = t`` changes
    no version), and the process's optimizer steps, all as they were when the copy was made."""

    parameters: Tuple[weakref.ref, ...]
    versions: Tuple[int, ...]
    storages: Tuple[int, ...]
    optimizer_steps: int


def stamp_weights(weights: Sequence[torch.Tensor]) -> WeightStamp:
    """The stamp of ``weights`` now (read before deriving the copy from them)."""
    return WeightStamp(tuple(weakref.ref(w) for w in weights), tuple(w._version for w in weights),
                       tuple(w.data_ptr() for w in weights), _optimizer_steps())


def weights_problem(stamp: WeightStamp, weights: Sequence[torch.Tensor]) -> Optional[InputProblem]:
    """Why a copy made under ``stamp`` may no longer match ``weights`` (None: it matches): other
    weights, an optimizer step since, or a weight changed (its 1-based position)."""
    if len(stamp.parameters) != len(weights) or any(ref() is not w for ref, w in zip(stamp.parameters, weights)):
        return InputProblem(FP8_WEIGHTS_OTHER_EXPERTS)
    steps = _optimizer_steps()
    if steps != stamp.optimizer_steps:
        return InputProblem(FP8_WEIGHTS_STEPPED, stamp.optimizer_steps, steps)
    for which, (version, storage, w) in enumerate(zip(stamp.versions, stamp.storages, weights), 1):
        if w._version != version or w.data_ptr() != storage:
            return InputProblem(FP8_WEIGHTS_CHANGED, which)
    return None


@dataclass(frozen=True)
class Fp8ExpertWeights:
    """weight1 and weight2 of one ``LocalExperts`` quantised: each ``quantize_weight``'s four tensors
    (forward q [E, M, K] fp8, its scales [E, M] fp32, dgrad q [E, K, M] fp8, its scales [E, K] fp32),
    and what a forward checks them against."""

    weight1: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    weight2: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    experts: weakref.ref  # the LocalExperts quantised
    stamp: WeightStamp  # of its weight1 and weight2


@torch.no_grad()
def quantize_fp8_weights(experts: torch.nn.Module) -> Fp8ExpertWeights:
    """The FP8 operands of ``experts``' (a ``LocalExperts`` with ``config.fp8``) weight1 [E, H, F']
    and weight2 [E, F, H], for its forwards until the next optimizer step or weight change."""
    if experts.fp8 is None:
        raise ValueError("quantize_fp8_weights: these experts are not FP8 (their config's fp8 is None)")
    fp8_dtype = FP8_FORMATS[experts.fp8]
    w1, w2 = experts.weight1, experts.weight2
    stamp = stamp_weights((w1, w2))
    return Fp8ExpertWeights(quantize_weight(w1, fp8_dtype), quantize_weight(w2, fp8_dtype), weakref.ref(experts),
                            stamp)


@torch.compiler.disable  # reads host state (versions, data pointers, a counter): eager under torch.compile
def fp8_weights_problem(fp8_weights: Any, experts: torch.nn.Module) -> Optional[InputProblem]:
    """Why ``fp8_weights`` cannot serve a forward of ``experts`` now (None: it can), as an InputProblem
    for the size exchange to raise on every rank (``moe_dispatch.distributed.agreement``)."""
    if experts.fp8 is None:
        return InputProblem(FP8_WEIGHTS_NOT_FP8)
    if not isinstance(fp8_weights, Fp8ExpertWeights):
        return InputProblem(FP8_WEIGHTS_NOT_A_HANDLE)
    if fp8_weights.experts() is not experts:
        return InputProblem(FP8_WEIGHTS_OTHER_EXPERTS)
    return weights_problem(fp8_weights.stamp, (experts.weight1, experts.weight2))
