"""Exact, deterministic permute / unpermute, registered as torch.library custom ops.

``permute`` moves each token to one row per expert it is routed to (expert-major, ascending token
within an expert). ``unpermute`` sums a token's rows back, weighted by its probabilities, in
ascending expert order in fp32 (fp64 for fp64 probabilities) and rounds once. Results are
bitwise reproducible and do not depend on other tokens. CUDA tensors run the Triton kernels, CPU
tensors the torch twin (``set_backend('triton')`` runs the kernels on CPU under TRITON_INTERPRET).

Bad input raises ValueError/TypeError naming the argument; the checks that need device data
(host-supplied sizes against the routing map, finite probs) are described in guard.py: on CPU they
raise before the op returns, on CUDA they poison the results with NaN and raise at a later call.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from ..numerics.autograd import refuse_double_backward
from . import guard, torch_twin
from .torch_twin import round_up

_BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("MOE_DISPATCH_BACKEND", "auto")


@contextlib.contextmanager
def set_backend(name: str) -> Iterator[None]:
    """Force a backend inside the block: 'auto' (CUDA -> Triton, CPU -> torch), 'torch' or 'triton'."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def _impl(x: torch.Tensor):
    use_triton = _backend == "triton" or (_backend == "auto" and x.is_cuda)
    if not use_triton:
        return torch_twin
    from . import triton_kernels  # imported lazily: CPU-only users need no Triton
    return triton_kernels


# --------------------------------------------------------------------------------------------
# Custom ops (tensors and ints only), with fake implementations for torch.compile.
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("moe_dispatch::make_slots", mutates_args=())
def _make_slots_op(routing_map: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(routing_map).make_slots(routing_map, pad_multiple)


@_make_slots_op.register_fake
def _(routing_map, pad_multiple):
    T, E = routing_map.shape
    return (routing_map.new_empty((T, 2 * E + 1), dtype=torch.int32),
            routing_map.new_empty((E + 1,), dtype=torch.int64))


@torch.library.custom_op("moe_dispatch::make_slots_checked", mutates_args=())
def _make_slots_checked_op(routing_map: torch.Tensor, pad_multiple: int, probs: Optional[torch.Tensor],
                           given_counts: Optional[list[int]],
                           given_max: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(routing_map).make_slots_checked(routing_map, pad_multiple, probs, given_counts, given_max)


@_make_slots_checked_op.register_fake
def _(routing_map, pad_multiple, probs, given_counts, given_max):
    T, E = routing_map.shape
    return (routing_map.new_empty((T, 2 * E + 1), dtype=torch.int32),
            routing_map.new_empty((E + 1 + guard.STATUS_WORDS,), dtype=torch.int64))


@torch.library.custom_op("moe_dispatch::permute_rows", mutates_args=())
def _permute_op(tokens: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor],
                num_out: int, zero_fill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(tokens).permute_rows(tokens, slots, probs, num_out, zero_fill)


@_permute_op.register_fake
def _(tokens, slots, probs, num_out, zero_fill):
    out_probs = probs.new_empty((num_out,)) if probs is not None else tokens.new_empty((0,), dtype=torch.float32)
    return tokens.new_empty((num_out, tokens.shape[1])), out_probs


@torch.library.custom_op("moe_dispatch::permute_rows_backward", mutates_args=())
def _permute_bwd_op(grad: torch.Tensor, slots: torch.Tensor, grad_probs: Optional[torch.Tensor],
                    probs_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(grad).permute_rows_backward(grad, slots, grad_probs, probs_dtype)


@_permute_bwd_op.register_fake
def _(grad, slots, grad_probs, probs_dtype):
    T, E = slots.shape[0], (slots.shape[1] - 1) // 2
    gp = grad.new_empty((T, E) if grad_probs is not None else (0,), dtype=probs_dtype)
    return grad.new_empty((T, grad.shape[1])), gp


def _permute_setup(ctx, inputs, output):
    tokens, slots, probs, _, _ = inputs
    ctx.save_for_backward(slots)
    ctx.has_probs = probs is not None
    ctx.probs_dtype = probs.dtype if probs is not None else torch.float32


def _permute_backward(ctx, grad_out, grad_out_probs):
    refuse_double_backward("moe_dispatch::permute_rows")
    (slots,) = ctx.saved_tensors
    grad_probs = None
    if ctx.has_probs:
        grad_probs = grad_out_probs if grad_out_probs is not None else torch.zeros(
            grad_out.shape[0], dtype=ctx.probs_dtype, device=grad_out.device)
    grad_tokens, grad_token_probs = _permute_bwd_op(grad_out.contiguous(), slots, grad_probs, ctx.probs_dtype)
    return grad_tokens, None, (grad_token_probs if ctx.has_probs else None), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("moe_dispatch::unpermute_rows", mutates_args=())
def _unpermute_op(rows: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor],
                  has_pad_rows: bool, max_slots: int) -> torch.Tensor:
    # has_pad_rows and max_slots only matter to the backward: pad rows get an explicit zero
    # gradient; max_slots sizes its buffer of partial probability gradients.
    return _impl(rows).unpermute_rows(rows, slots, probs)


@_unpermute_op.register_fake
def _(rows, slots, probs, has_pad_rows, max_slots):
    return rows.new_empty((slots.shape[0], rows.shape[1]))


@torch.library.custom_op("moe_dispatch::unpermute_rows_backward", mutates_args=())
def _unpermute_bwd_op(grad: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                      probs: Optional[torch.Tensor], zero_fill: bool,
                      max_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(rows).unpermute_rows_backward(grad, rows, slots, probs, zero_fill, max_slots)


@_unpermute_bwd_op.register_fake
def _(grad, rows, slots, probs, zero_fill, max_slots):
    gp = (probs.new_empty(probs.shape) if probs is not None else rows.new_empty((0,), dtype=torch.float32))
    return rows.new_empty(rows.shape), gp


def _unpermute_setup(ctx, inputs, output):
    rows, slots, probs, has_pad_rows, max_slots = inputs
    ctx.save_for_backward(rows, slots, probs)
    ctx.has_pad_rows = has_pad_rows
    ctx.max_slots = max_slots


def _unpermute_backward(ctx, grad_out):
    refuse_double_backward("moe_dispatch::unpermute_rows")
    rows, slots, probs = ctx.saved_tensors
    grad_rows, grad_probs = _unpermute_bwd_op(grad_out.contiguous(), rows, slots, probs, ctx.has_pad_rows,
                                              ctx.max_slots)
    return grad_rows, None, grad_probs if probs is not None else None, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


@torch.library.custom_op("moe_dispatch::gather_rows", mutates_args=())
def _gather_rows_op(x: torch.Tensor, index: torch.Tensor, inverse_index: torch.Tensor) -> torch.Tensor:
    return _impl(x).gather_rows(x, index)


@_gather_rows_op.register_fake
def _(x, index, inverse_index):
    return x.new_empty((index.shape[0], x.shape[1]))


def _gather_setup(ctx, inputs, output):
    _, index, inverse_index = inputs
    ctx.save_for_backward(index, inverse_index)


def _gather_backward(ctx, grad):
    refuse_double_backward("moe_dispatch::gather_rows")
    index, inverse_index = ctx.saved_tensors
    # A permutation: the gradient is the inverse gather, no sums involved.
    return _gather_rows_op(grad.contiguous(), inverse_index, index), None, None


_gather_rows_op.register_autograd(_gather_backward, setup_context=_gather_setup)


# --------------------------------------------------------------------------------------------
# Callers go through these: the registered op under torch.compile or when autograd needs its
# backward; otherwise the backend function directly (the op wrapper's host time per call is
# measurable, BENCHMARKS.md, and these run several times per dispatch). Same function, same bits.
# --------------------------------------------------------------------------------------------
def _direct(*tensors: Optional[torch.Tensor]) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def make_slots(routing_map: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots int32 [T, 2E+1], stats int64 [E+1]: per-expert counts, then the most experts of a
    token) for a contiguous bool routing_map [T, E]. Never differentiable."""
    if _direct():
        return _impl(routing_map).make_slots(routing_map, pad_multiple)
    return _make_slots_op(routing_map, pad_multiple)


def make_slots_checked(routing_map: torch.Tensor, pad_multiple: int, probs: Optional[torch.Tensor],
                       given_counts: Optional[list[int]],
                       given_max: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """make_slots with permute's device-side checks (guard.py): (slots, stats int64
    [E + 1 + STATUS_WORDS]: make_slots' stats, then the device's status words)."""
    if _direct():
        return _impl(routing_map).make_slots_checked(routing_map, pad_multiple, probs, given_counts, given_max)
    return _make_slots_checked_op(routing_map, pad_multiple, probs, given_counts, given_max)


def permute_rows(tokens: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor], num_out: int,
                 zero_fill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The permute_rows op: tokens [T, H] -> ([num_out, H], row probs [num_out] or a placeholder)."""
    if _direct(tokens, probs):
        return _impl(tokens).permute_rows(tokens, slots, probs, num_out, zero_fill)
    return _permute_op(tokens, slots, probs, num_out, zero_fill)


def unpermute_rows(rows: torch.Tensor, slots: torch.Tensor, probs: Optional[torch.Tensor], has_pad_rows: bool,
                   max_slots: int) -> torch.Tensor:
    """The unpermute_rows op: rows [N, H] -> [T, H] (has_pad_rows and max_slots serve the backward)."""
    if _direct(rows, probs):
        return _impl(rows).unpermute_rows(rows, slots, probs)
    return _unpermute_op(rows, slots, probs, has_pad_rows, max_slots)


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse_index: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation ``index`` [M] (``inverse_index`` serves the backward)."""
    if _direct(x):
        return _impl(x).gather_rows(x, index)
    return _gather_rows_op(x, index, inverse_index)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
INT32_ROWS = 2 ** 31  # slots hold rows as int32: every row index must stay below this


@dataclass(frozen=True)
class RowIdMap:
    """Where every (token, expert) pair sits in the permuted rows. Made by ``permute``.

    Attributes:
        slots: int32 [T, 2E + 1]. ``slots[t, 0]`` is n_t, the number of experts of token t;
            ``slots[t, 1 + j]`` for j < n_t is the permuted row of its j-th expert (experts in
            ascending id); ``slots[t, 1 + E + j]`` is that expert's id. Unused entries are -1.
        tokens_per_expert: int64 [E], rows each expert received (without padding), on the device.
        padded_tokens_per_expert: int64 [E], rows of each expert's block (with padding).
        num_out_tokens: N, the number of permuted rows.
        has_pad_rows: True when some permuted rows belong to no token (padding or extra rows).
        max_experts_per_token: an upper bound on n_t (None means E); sizes the backward's buffer
            of partial probability gradients.

    Construction checks the fields' types and shapes (host-side, no synchronisation) and raises
    ValueError/TypeError naming the field. The contents of ``slots`` are not checked: the kernels
    touch only rows in [0, N) and experts in [0, E), whatever they hold.
    """

    slots: torch.Tensor
    tokens_per_expert: torch.Tensor
    padded_tokens_per_expert: torch.Tensor
    num_out_tokens: int
    has_pad_rows: bool
    max_experts_per_token: Optional[int] = None

    def __post_init__(self) -> None:
        slots = self.slots
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int32 or slots.dim() != 2 \
                or slots.shape[1] < 3 or slots.shape[1] % 2 != 1:
            got = f"{slots.dtype} {list(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__
            raise ValueError(f"RowIdMap.slots must be an int32 tensor [T, 2E + 1] with E >= 1, got {got}")
        E = self.num_experts
        for name in ("tokens_per_expert", "padded_tokens_per_expert"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (E,):
                got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"RowIdMap.{name} must be a tensor [E] = [{E}], got {got}")
        N = self.num_out_tokens
        if not isinstance(N, int) or isinstance(N, bool) or not 0 <= N < INT32_ROWS:
            raise ValueError(f"RowIdMap.num_out_tokens must be an int in [0, 2^31), got {N!r}")
        if not isinstance(self.has_pad_rows, bool):
            raise TypeError(f"RowIdMap.has_pad_rows must be a bool, got {type(self.has_pad_rows).__name__}")
        most = self.max_experts_per_token
        if most is not None and (not isinstance(most, int) or isinstance(most, bool) or not 0 <= most <= E):
            raise ValueError(f"RowIdMap.max_experts_per_token must be None or an int in [0, E = {E}], got {most!r}")

    @property
    def num_tokens(self) -> int:
        return self.slots.shape[0]

    @property
    def num_experts(self) -> int:
        return (self.slots.shape[1] - 1) // 2


def _check_tokens(name: str, tokens: torch.Tensor) -> None:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, H], got shape {tuple(tokens.shape)}")
    if tokens.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {tokens.dtype}")


def _check_probs(probs: torch.Tensor, num_tokens: int, num_experts: int, device: torch.device) -> None:
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    if tuple(probs.shape) != (num_tokens, num_experts):
        raise ValueError(f"probs must have shape [T, E] = {[num_tokens, num_experts]}, got {list(probs.shape)}")
    if probs.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"probs must be float32 or float64 (never bf16: it breaks the contract), got {probs.dtype}")
    if probs.device != device:
        raise ValueError(f"probs is on {probs.device}, expected {device} like the tokens")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _host_counts(tokens_per_expert, num_experts: int) -> list[int]:
    values = (tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor)
              else list(tokens_per_expert))
    if len(values) != num_experts:
        raise ValueError(f"tokens_per_expert must have E = {num_experts} entries, got {len(values)}")
    if not all(_is_int(c) and c >= 0 for c in values):
        raise ValueError(f"tokens_per_expert must hold ints >= 0, got {values}")
    return values


def check_device_errors() -> None:
    """Raise the ValueError of a bad input that the kernels found on CUDA and that has not been
    raised yet (see permute's docstring). Waits for the GPU: call it where the host waits anyway."""
    guard.check_device_errors()


def expert_row_counts(routing_map: torch.Tensor, pad_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows per expert without and with padding: ([E] int64, [E] int64), on the map's device."""
    counts = routing_map.sum(0, dtype=torch.int64)
    return counts, round_up(counts, pad_multiple)


def _poll() -> None:
    if not torch.compiler.is_compiling():
        guard.poll()


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    *,
    num_out_tokens: Optional[int] = None,
    pad_multiple: int = 1,
    tokens_per_expert: Optional[Sequence[int]] = None,
    max_experts_per_token: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], RowIdMap]:
    """Copy each token to one row per expert it is routed to.

    Args:
        tokens: [T, H] float32, float16 or bfloat16.
        routing_map: [T, E] bool.
        probs: optional [T, E] float32 or float64; permuted with the tokens, dtype kept. Must be
            finite (NaN or inf: ValueError); negative values are accepted.
        num_out_tokens: N, the rows to allocate. Default: the (padded) number of routed pairs.
            Smaller than that raises ValueError; extra rows are zero.
        pad_multiple: pad each expert's block of rows to a multiple of this (pad rows are zero).
        tokens_per_expert: optional host-side per-expert counts (unpadded, length E) the caller
            already knows; then no device-to-host synchronisation happens here.
        max_experts_per_token: an upper bound on experts per token (e.g. top-k); with
            tokens_per_expert it sizes a backward buffer (default E). Checked in both cases.

    Errors: every argument is checked on the host first (ValueError/TypeError naming it). The
    checks that need device data (tokens_per_expert and max_experts_per_token against
    routing_map, probs finite) raise ValueError before returning on CPU, and on CUDA when the
    call synchronises anyway (no tokens_per_expert). On CUDA with tokens_per_expert the same
    ValueError is raised by the first later permute/unpermute call that finds the check's result
    on the host (never waiting for it), or by ``check_device_errors()``; meanwhile every kernel of
    these ops writes NaN, so no result of the bad call, or after it, looks valid. Rows are never
    written outside the tensors allocated, whatever the sizes given.

    Returns:
        permuted_tokens [N, H] in tokens.dtype, expert-major, ascending token within an expert;
        permuted_probs [N] in probs.dtype (None without probs); the RowIdMap for ``unpermute``.
    """
    _poll()
    _check_tokens("tokens", tokens)
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool:
        got = routing_map.dtype if isinstance(routing_map, torch.Tensor) else type(routing_map).__name__
        raise TypeError(f"routing_map must be a bool tensor, got {got}")
    if routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"routing_map must be [T, E] with T = {tokens.shape[0]}, got {list(routing_map.shape)}")
    if routing_map.device != tokens.device:
        raise ValueError(f"routing_map is on {routing_map.device}, expected {tokens.device} like the tokens")
    T, E = routing_map.shape
    if E < 1:
        raise ValueError("routing_map must have at least one expert column")
    if probs is not None:
        _check_probs(probs, T, E, tokens.device)
    if not _is_int(pad_multiple) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be an int >= 1, got {pad_multiple!r}")
    if max_experts_per_token is not None and (not _is_int(max_experts_per_token) or max_experts_per_token < 0):
        raise ValueError(f"max_experts_per_token must be None or an int >= 0, got {max_experts_per_token!r}")
    if num_out_tokens is not None and (not _is_int(num_out_tokens) or not 0 <= num_out_tokens < INT32_ROWS):
        raise ValueError(f"num_out_tokens must be None or an int in [0, 2^31), got {num_out_tokens!r}")
    given = _host_counts(tokens_per_expert, E) if tokens_per_expert is not None else None
    given_max = None if max_experts_per_token is None else min(max_experts_per_token, E)

    slots, stats = make_slots_checked(routing_map.contiguous(), pad_multiple, probs, given, given_max)
    counts = stats[:E]
    padded = counts if pad_multiple == 1 else round_up(counts, pad_multiple)  # no kernels when unpadded
    if given is not None:
        host_counts = given
        most = E if given_max is None else given_max
    else:
        host_stats = stats.tolist()  # the one host synchronisation: sizes decide allocation
        guard.check_snapshot(host_stats, E, None, given_max)
        host_counts, most = host_stats[:E], host_stats[E]
    routed = sum(host_counts)
    needed = sum(round_up(c, pad_multiple) for c in host_counts)
    if num_out_tokens is None:
        num_out_tokens = needed
    elif num_out_tokens < needed:
        raise ValueError(f"num_out_tokens={num_out_tokens} is smaller than the {needed} rows the routing map "
                         f"needs (routed pairs {routed}, pad_multiple {pad_multiple})")
    if num_out_tokens >= INT32_ROWS:
        raise ValueError(f"the routing map needs {num_out_tokens} rows, more than the 2^31 - 1 that int32 "
                         f"row ids address (split the batch)")
    has_pad_rows = num_out_tokens > routed
    permuted, permuted_probs = permute_rows(tokens, slots, probs, num_out_tokens, has_pad_rows)
    if given is not None and stats.is_cuda and not torch.compiler.is_compiling():
        guard.queue(stats, E, given, given_max)  # after the copy is queued: the check never delays it
    row_id_map = RowIdMap(slots, counts, padded, num_out_tokens, has_pad_rows, most)
    return permuted, (permuted_probs if probs is not None else None), row_id_map


def unpermute(
    permuted_tokens: torch.Tensor,
    row_id_map: RowIdMap,
    probs: Optional[torch.Tensor] = None,
    *,
    restore_shape: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """out[t] = sum over experts e of t, ascending, of (probs[t, e] or 1) * permuted_tokens[row(t, e)].

    Products and the running sum are fp32 (fp64 for fp64 probs), rounded once to
    permuted_tokens.dtype. No atomics; a token's result depends only on its own rows.

    Args:
        permuted_tokens: [N, H] float32, float16 or bfloat16 (N = row_id_map.num_out_tokens).
        row_id_map: from ``permute``.
        probs: optional [T, E] float32 or float64 (T, E of the map); must be finite (NaN or inf:
            ValueError, raised on CUDA as permute's device checks are); negative values are accepted.
        restore_shape: optional shape for the output (e.g. [S, B, H]); T*H elements.

    What is checked about the map: its type and fields (at construction), T and E against probs,
    N against permuted_tokens, T * H against restore_shape, the device. Not detectable: a map from
    another permute call with the same T, E and N (the rows carry no identity); its result is then
    wrong without an error.

    Returns:
        [T, H] (or restore_shape) in permuted_tokens.dtype. Tokens routed nowhere give zero rows.
    """
    _poll()
    _check_tokens("permuted_tokens", permuted_tokens)
    if not isinstance(row_id_map, RowIdMap):
        raise TypeError(f"row_id_map must be the RowIdMap returned by permute, got {type(row_id_map).__name__}")
    if permuted_tokens.shape[0] != row_id_map.num_out_tokens:
        raise ValueError(f"permuted_tokens has {permuted_tokens.shape[0]} rows, expected "
                         f"row_id_map.num_out_tokens = {row_id_map.num_out_tokens}")
    if row_id_map.slots.device != permuted_tokens.device:
        raise ValueError(f"permuted_tokens is on {permuted_tokens.device}, row_id_map on {row_id_map.slots.device}")
    if probs is not None:
        _check_probs(probs, row_id_map.num_tokens, row_id_map.num_experts, permuted_tokens.device)
    if restore_shape is not None:
        shape = [int(d) for d in restore_shape]
        want = row_id_map.num_tokens * permuted_tokens.shape[1]
        if math.prod(shape) != want or (shape and shape[-1] != permuted_tokens.shape[1]):
            raise ValueError(f"restore_shape {shape} must hold T * H = {row_id_map.num_tokens} * "
                             f"{permuted_tokens.shape[1]} elements with H last (T from row_id_map)")
    most = row_id_map.max_experts_per_token
    out = unpermute_rows(permuted_tokens, row_id_map.slots, probs, row_id_map.has_pad_rows,
                         row_id_map.num_experts if most is None else most)
    if restore_shape is not None:
        out = out.reshape(restore_shape)
    return out


def sort_chunks(
    tokens: torch.Tensor,
    split_sizes: Sequence[int] | torch.Tensor,
    sorted_idxs: Sequence[int] | torch.Tensor,
    probs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reorder contiguous row chunks: output chunk i is input chunk sorted_idxs[i].

    Megatron's alltoall dispatcher reorders its rows this way (source-rank-major to expert-major
    and back); this package's dispatchers do not call it. It is a pure permutation (rows are
    copied, never summed), so it is exact; its backward is the inverse permutation.

    Args:
        tokens: [N, H]; split_sizes: C chunk lengths summing to N (host list or tensor);
        sorted_idxs: a permutation of range(C); probs: optional [N] rows carried along.

    Returns:
        (tokens [N, H], probs [N] or None) in the new chunk order.
    """
    _check_tokens("tokens", tokens)
    sizes = torch.as_tensor(split_sizes, dtype=torch.int64).cpu()
    order = torch.as_tensor(sorted_idxs, dtype=torch.int64).cpu()
    if sizes.dim() != 1 or order.shape != sizes.shape:
        raise ValueError(f"split_sizes and sorted_idxs must be 1-D of equal length, got "
                         f"{tuple(sizes.shape)} and {tuple(order.shape)}")
    if int(sizes.sum()) != tokens.shape[0] or bool((sizes < 0).any()):
        raise ValueError(f"split_sizes must be >= 0 and sum to tokens.shape[0] = {tokens.shape[0]}, "
                         f"got {sizes.tolist()}")
    if not torch.equal(order.sort().values, torch.arange(len(order))):
        raise ValueError(f"sorted_idxs must be a permutation of range({len(order)}), got {order.tolist()}")
    if probs is not None and (probs.dim() != 1 or probs.shape[0] != tokens.shape[0]):
        raise ValueError(f"probs must be [N] with N = {tokens.shape[0]}, got {list(probs.shape)}")
    index = chunk_gather_index(sizes.tolist(), order.tolist(), tokens.device)
    inverse = inverse_permutation(index)
    out = gather_rows(tokens, index, inverse)
    out_probs = None
    if probs is not None:
        out_probs = gather_rows(probs[:, None], index, inverse)[:, 0]
    return out, out_probs


def chunk_gather_index(split_sizes: Sequence[int], sorted_idxs: Sequence[int], device: torch.device) -> torch.Tensor:
    """[N] int64 on ``device``: output row i of ``sort_chunks`` is input row index[i].

    Unchecked (``sort_chunks`` validates its arguments; the dispatcher derives them from its
    layout). Only the per-chunk tables (C entries) cross to the device, non_blocking; the N-row
    index is built there with a known output size, so nothing waits for the GPU.
    """
    starts, at = [], 0
    for size in split_sizes:
        starts.append(at)
        at += size
    shifts, lengths, out_at = [], [], 0
    for i in sorted_idxs:  # output chunk j is input chunk sorted_idxs[j]
        shifts.append(starts[i] - out_at)
        lengths.append(split_sizes[i])
        out_at += split_sizes[i]
    return shifted_runs(shifts, lengths, device)


def shifted_runs(shifts: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """[sum(lengths)] int64 on ``device``: i + shifts[r] for every position i of run r, the runs
    (lengths[r] positions each) laid end to end. Host tables go to the device non_blocking."""
    tables = torch.tensor([*shifts, *lengths], dtype=torch.int64).to(device, non_blocking=True).view(2, -1)
    return runs_index(tables[0], tables[1], sum(lengths))


def runs_index(shifts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``shifted_runs`` from tables already on the device: shifts, lengths [R] int64; total =
    sum(lengths), a host int (so nothing waits for the device)."""
    return torch.arange(total, device=shifts.device) + torch.repeat_interleave(shifts, lengths, output_size=total)


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """inverse[index[i]] = i for a permutation ``index`` [N] (every position written once)."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.shape[0], device=index.device)
    return inverse
