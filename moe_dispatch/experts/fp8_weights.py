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
  or new storage given to one (``weight.data = t``, ``module.to(...)``). The stamp holds a weak
  reference to each weight's storage (torch's StorageWeakRef: the storage's control block, not its
  memory), so a new storage can never pass for the old one, even at the old one's address, which
  the CUDA caching allocator hands out again as a rule once it is freed. A stale handle keeps no
  weights alive;
- after any other write into either weight's bits, one autograd does not count (``dist.broadcast``
  into the weights, ``weight.data.copy_``, NCCL, a custom kernel): the handle holds a fingerprint
  of each weight's bits (``ops.bits_fingerprint``: exact integer sums, no BLAS), taken when it is made
  and compared on the device at every forward that uses it. Any change of one element, or a swap
  of two in the same 64 KiB, is caught with certainty; any other change is missed with a chance
  of about 2^-62. The comparison reads nothing on the host: the layer carries it in its dispatcher's
  exchanges (``_Dispatcher.dispatch_rows(device_problem=...)``): dropless, and at a sync-free
  plan's first step, in the size exchange (every rank raises before any row moves); at a later
  sync-free step in its input words (NaN outputs on every rank, then the next call raises on CPU,
  or ``check_device_errors()`` on CUDA; EP 1 on CPU raises at once). ``LocalExperts.forward``
  called directly reads the comparison on the host (on CUDA a synchronisation);
- when either parameter was replaced, or the handle is another experts' module's.

Cost of the bits check, per forward with a handle: on CUDA one fused Triton kernel per weight
(``ops.kernels.fingerprint``) reads each weight once, 2 bytes per bf16 element (the floor), and
writes 16 bytes per program; the comparison is a few kernels on 2-element tensors. Quantising per
call reads each weight twice and writes two FP8 copies (about 6 bytes per element), so the check
moves a third of the bytes the handle saves (``scripts/measure/fingerprint.py`` times both at the
FP8 bench's shape). On CPU the torch twin (``ops.fingerprint``) computes the same value with an
int32 temporary (about 10 bytes of traffic per bf16 element); there, where the quantisation is
slow, it costs 2 to 14% of it (per bf16 weight, on a shared 2-core CPU: [8, 256, 512] 12 ms
against 0.55 s; [8, 1024, 2048] 0.24 s against 1.7 s).

A captured CUDA graph reads the handle's tensors as they were at capture, and the host checks do
not run at a replay; the bits comparison is device work, captured with a sync-free step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..config import FP8_FORMATS
from ..distributed.agreement import (
    FP8_WEIGHTS_BITS_CHANGED,
    FP8_WEIGHTS_CHANGED,
    FP8_WEIGHTS_NOT_A_HANDLE,
    FP8_WEIGHTS_NOT_FP8,
    FP8_WEIGHTS_OTHER_EXPERTS,
    FP8_WEIGHTS_STEPPED,
    DeviceProblem,
    InputProblem,
)
from ..ops import bits_fingerprint
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


class _StorageRef:
    """A weak reference to a tensor's storage (torch's StorageWeakRef): it keeps the storage's
    control block, not its memory, so while it lives no other storage can take that identity, even
    where the freed memory's address is reused (the CUDA caching allocator does so as a rule).
    Shared, never duplicated, by copies: each reference is released exactly once."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self._ref = StorageWeakRef(t.untyped_storage())

    def holds(self, t: torch.Tensor) -> bool:
        """Whether t's storage is the one referenced (alive, and the same)."""
        return not self._ref.expired() and self._ref.cdata == t.untyped_storage()._cdata

    def __copy__(self) -> "_StorageRef":
        return self

    def __deepcopy__(self, memo: dict) -> "_StorageRef":
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a WeightStamp refers to this process's storages: it cannot be pickled")


@dataclass(frozen=True)
class WeightStamp:
    """What a copy derived from some weights (their FP8 operands) is checked against: the weights
    themselves (weak references), their autograd versions, storages (weak references: ``p.data =
    t`` changes no version) and data pointers, the process's optimizer steps, and (``bits``) a
    fingerprint of each weight's bits on its device, all as they were when the copy was made."""

    parameters: Tuple[weakref.ref, ...]
    versions: Tuple[int, ...]
    storages: Tuple[_StorageRef, ...]
    data_ptrs: Tuple[int, ...]
    optimizer_steps: int
    bits: Optional[Tuple[torch.Tensor, ...]] = None  # int64 [2] each (ops.bits_fingerprint)


@torch.no_grad()
def stamp_weights(weights: Sequence[torch.Tensor], bits: bool = False) -> WeightStamp:
    """The stamp of ``weights`` now (read before deriving the copy from them). ``bits``: also
    fingerprint their bits (``weights_bits_problem`` compares them; reads each weight once)."""
    return WeightStamp(tuple(weakref.ref(w) for w in weights), tuple(w._version for w in weights),
                       tuple(_StorageRef(w) for w in weights), tuple(w.data_ptr() for w in weights),
                       _optimizer_steps(), tuple(bits_fingerprint(w) for w in weights) if bits else None)


def weights_problem(stamp: WeightStamp, weights: Sequence[torch.Tensor]) -> Optional[InputProblem]:
    """Why a copy made under ``stamp`` may no longer match ``weights`` (None: it matches), from
    host state alone: other weights, an optimizer step since, or a weight changed in place or
    given other storage (its 1-based position). A write autograd does not count is not seen here:
    ``weights_bits_problem``."""
    if len(stamp.parameters) != len(weights) or any(ref() is not w for ref, w in zip(stamp.parameters, weights)):
        return InputProblem(FP8_WEIGHTS_OTHER_EXPERTS)
    steps = _optimizer_steps()
    if steps != stamp.optimizer_steps:
        return InputProblem(FP8_WEIGHTS_STEPPED, stamp.optimizer_steps, steps)
    for which, (version, storage, ptr, w) in enumerate(zip(stamp.versions, stamp.storages, stamp.data_ptrs,
                                                           weights), 1):
        # the storage's identity first: a pointer alone can be a new storage at a freed address
        if w._version != version or not storage.holds(w) or w.data_ptr() != ptr:
            return InputProblem(FP8_WEIGHTS_CHANGED, which)
    return None


@torch.no_grad()
def weights_bits_problem(stamp: WeightStamp, weights: Sequence[torch.Tensor]) -> DeviceProblem:
    """Whether a weight's bits differ from the stamp's fingerprint (``stamp_weights(bits=True)``),
    found on the device without a host read: code FP8_WEIGHTS_BITS_CHANGED (0: none), expected
    the first such weight's 1-based position. Reads each weight once (ops.bits_fingerprint)."""
    if stamp.bits is None:
        raise ValueError("weights_bits_problem: the stamp holds no fingerprint (stamp_weights(..., bits=True))")
    which = None
    for position in range(len(weights), 0, -1):  # the first differing weight wins: taken last
        differs = (bits_fingerprint(weights[position - 1]) != stamp.bits[position - 1]).any().to(torch.int64)
        which = differs * position if which is None else torch.where(differs.bool(), differs * position, which)
    if which is None:
        raise ValueError("weights_bits_problem: no weights")
    return DeviceProblem((which > 0).to(torch.int64) * FP8_WEIGHTS_BITS_CHANGED, which, torch.zeros_like(which))


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
    stamp = stamp_weights((w1, w2), bits=True)
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


@torch.compiler.disable  # eager under torch.compile, as fp8_weights_problem
def fp8_weights_bits_problem(fp8_weights: Fp8ExpertWeights, experts: torch.nn.Module) -> DeviceProblem:
    """After ``fp8_weights_problem`` found nothing: whether ``experts``' weights' bits differ from
    those the handle was quantised from (a write autograd does not count), on the device."""
    return weights_bits_problem(fp8_weights.stamp, (experts.weight1, experts.weight2))
