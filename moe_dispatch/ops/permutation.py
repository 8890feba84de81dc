"""Exact, deterministic permute / unpermute, registered as torch.library custom ops.

``permute`` moves each token to one row per expert it is routed to (expert-major, ascending token
within an expert). ``unpermute`` sums a token's rows back, weighted by its probabilities, in
ascending expert order in fp32 (fp64 for fp64 probabilities) and rounds once. Tokens may be
float32, float16, bfloat16, float8_e4m3fn or float8_e5m2 (float8 rows carry an optional fp32
scale per row, ``row_scales``). Results are bitwise reproducible and do not depend on other
tokens. CUDA tensors run the Triton kernels, CPU tensors the torch twin (``set_backend('triton')``
runs the kernels on CPU under TRITON_INTERPRET).

Bad input raises ValueError/TypeError naming the argument; the checks that need device data
(host-supplied sizes against the routing map, finite probs) are described in guard.py: on CPU they
raise before the op returns, on CUDA they poison the results with NaN and raise at a later call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..numerics.rounding import is_int, round_up
from . import guard

# make_slots: dispatcher/ imports it from here.
from .custom_ops import gather_rows, make_slots, make_slots_checked, permute_rows, unpermute_rows  # noqa: F401
from .torch_twin import TOKEN_DTYPES

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
        expert_rows: int64 [E], the routed (token, expert) rows of each expert, without padding,
            on the device (what ``permute``'s ``tokens_per_expert=`` keyword gives on the host).
        padded_expert_rows: int64 [E], the rows of each expert's block, padding included (equal
            to expert_rows when pad_multiple is 1); the row blocks' sizes a grouped GEMM takes.
        num_out_tokens: N, the number of permuted rows.
        has_pad_rows: True when some permuted rows belong to no token (padding or extra rows).
        max_experts_per_token: an upper bound on n_t (None means E); sizes the backward's buffer
            of partial probability gradients.

    Construction checks the fields' types and shapes (host-side, no synchronisation) and raises
    ValueError/TypeError naming the field. The contents of ``slots`` are not checked: the kernels
    touch only rows in [0, N) and experts in [0, E), whatever they hold.
    """

    slots: torch.Tensor
    expert_rows: torch.Tensor
    padded_expert_rows: torch.Tensor
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
        for name in ("expert_rows", "padded_expert_rows"):
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
    if tokens.dtype not in TOKEN_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, "
                        f"got {tokens.dtype}")


def _check_row_scales(row_scales: torch.Tensor, rows: int, what: str, device: torch.device) -> torch.Tensor:
    """row_scales as a contiguous fp32 [rows] tensor, or ValueError/TypeError naming it."""
    if not isinstance(row_scales, torch.Tensor):
        raise TypeError(f"row_scales must be a torch.Tensor, got {type(row_scales).__name__}")
    if row_scales.dtype != torch.float32:
        raise TypeError(f"row_scales must be float32, got {row_scales.dtype}")
    if tuple(row_scales.shape) != (rows,):
        raise ValueError(f"row_scales must have shape [{what}] = [{rows}], got {list(row_scales.shape)}")
    if row_scales.device != device:
        raise ValueError(f"row_scales is on {row_scales.device}, expected {device} like the tokens")
    return row_scales.detach().contiguous()


OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_probs(probs: torch.Tensor, num_tokens: int, num_experts: int, device: torch.device) -> None:
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    if tuple(probs.shape) != (num_tokens, num_experts):
        raise ValueError(f"probs must have shape [T, E] = {[num_tokens, num_experts]}, got {list(probs.shape)}")
    if probs.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"probs must be float32 or float64 (never bf16: it breaks the contract), got {probs.dtype}")
    if probs.device != device:
        raise ValueError(f"probs is on {probs.device}, expected {device} like the tokens")


def _host_expert_rows(tokens_per_expert, num_experts: int) -> list[int]:
    values = (tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor)
              else list(tokens_per_expert))
    if len(values) != num_experts:
        raise ValueError(f"tokens_per_expert must have E = {num_experts} entries, got {len(values)}")
    if not all(is_int(c) and c >= 0 for c in values):
        raise ValueError(f"tokens_per_expert must hold ints >= 0, got {values}")
    return values


def check_device_errors() -> None:
    """Raise the ValueError of a bad input that the kernels found on CUDA and that has not been
    raised yet (see permute's docstring). Waits for the GPU: call it where the host waits anyway."""
    guard.check_device_errors()


def expert_row_counts(routing_map: torch.Tensor, pad_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert_rows, padded_expert_rows), each [E] int64 on the map's device: the rows ``permute``
    gives each expert without and with padding (RowIdMap's fields of those names)."""
    expert_rows = routing_map.sum(0, dtype=torch.int64)
    return expert_rows, round_up(expert_rows, pad_multiple)


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
    row_scales: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], RowIdMap] | tuple[torch.Tensor, Optional[torch.Tensor],
                                                                   torch.Tensor, RowIdMap]:
    """Copy each token to one row per expert it is routed to.

    Args:
        tokens: [T, H] float32, float16, bfloat16, float8_e4m3fn or float8_e5m2; rows are bitwise
            copies (float8 bytes are moved as they are).
        routing_map: [T, E] bool.
        probs: optional [T, E] float32 or float64; permuted with the tokens, dtype kept. Must be
            finite (NaN or inf: ValueError); negative values are accepted.
        num_out_tokens: N, the rows to allocate. Default: the (padded) number of routed pairs.
            Smaller than that raises ValueError; extra rows are zero.
        pad_multiple: pad each expert's block of rows to a multiple of this (pad rows are zero).
        tokens_per_expert: optional host-side rows per expert (unpadded, length E: the map's
            ``expert_rows``) the caller already knows; then no device-to-host synchronisation
            happens here.
        max_experts_per_token: an upper bound on experts per token (e.g. top-k); with
            tokens_per_expert it sizes a backward buffer (default E). Checked in both cases.
        row_scales: optional [T] float32, one dequantisation factor per token (e.g. from
            ``quantize_rows``); copied to each of the token's rows. No gradient flows to it.

    Errors: every argument is checked on the host first (ValueError/TypeError naming it). The
    checks that need device data (tokens_per_expert and max_experts_per_token against
    routing_map, probs finite) raise ValueError before returning on CPU, and on CUDA when the
    call synchronises anyway (no tokens_per_expert). On CUDA with tokens_per_expert the same
    ValueError is raised by the first later permute/unpermute call that finds the check's result
    on the host (never waiting for it), or by ``check_device_errors()``; meanwhile every kernel of
    these ops writes NaN, so no result of the bad call, or after it, looks valid. Rows are never
    written outside the tensors allocated, whatever the sizes given.

    Returns:
        (permuted_tokens, permuted_probs, row_id_map), and with row_scales
        (permuted_tokens, permuted_probs, permuted_row_scales, row_id_map):
        permuted_tokens [N, H] in tokens.dtype, expert-major, ascending token within an expert;
        permuted_probs [N] in probs.dtype (None without probs); permuted_row_scales [N] float32
        (pad and extra rows 0); the RowIdMap for ``unpermute``.
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
    if not is_int(pad_multiple) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be an int >= 1, got {pad_multiple!r}")
    if max_experts_per_token is not None and (not is_int(max_experts_per_token) or max_experts_per_token < 0):
        raise ValueError(f"max_experts_per_token must be None or an int >= 0, got {max_experts_per_token!r}")
    if num_out_tokens is not None and (not is_int(num_out_tokens) or not 0 <= num_out_tokens < INT32_ROWS):
        raise ValueError(f"num_out_tokens must be None or an int in [0, 2^31), got {num_out_tokens!r}")
    if row_scales is not None:
        row_scales = _check_row_scales(row_scales, T, "T", tokens.device)
    given = _host_expert_rows(tokens_per_expert, E) if tokens_per_expert is not None else None
    given_max = None if max_experts_per_token is None else min(max_experts_per_token, E)

    slots, stats = make_slots_checked(routing_map.contiguous(), pad_multiple, probs, given, given_max)
    expert_rows = stats[:E]
    # No kernels when unpadded.
    padded_expert_rows = expert_rows if pad_multiple == 1 else round_up(expert_rows, pad_multiple)
    if given is not None:
        host_expert_rows = given
        most = E if given_max is None else given_max
    else:
        host_stats = stats.tolist()  # the one host synchronisation: sizes decide allocation
        guard.check_snapshot(host_stats, E, None, given_max)
        host_expert_rows, most = host_stats[:E], host_stats[E]
    routed = sum(host_expert_rows)
    needed = sum(round_up(c, pad_multiple) for c in host_expert_rows)
    if num_out_tokens is None:
        num_out_tokens = needed
    elif num_out_tokens < needed:
        raise ValueError(f"num_out_tokens={num_out_tokens} is smaller than the {needed} rows the routing map "
                         f"needs (routed pairs {routed}, pad_multiple {pad_multiple})")
    if num_out_tokens >= INT32_ROWS:
        raise ValueError(f"the routing map needs {num_out_tokens} rows, more than the 2^31 - 1 that int32 "
                         f"row ids address (split the batch)")
    has_pad_rows = num_out_tokens > routed
    permuted, permuted_probs, *permuted_scales = permute_rows(tokens, slots, probs, num_out_tokens, has_pad_rows,
                                                              row_scales)
    if given is not None and stats.is_cuda and not torch.compiler.is_compiling():
        guard.queue(stats, E, given, given_max)  # after the copy is queued: the check never delays it
    row_id_map = RowIdMap(slots, expert_rows, padded_expert_rows, num_out_tokens, has_pad_rows, most)
    return (permuted, (permuted_probs if probs is not None else None), *permuted_scales, row_id_map)


def unpermute(
    permuted_tokens: torch.Tensor,
    row_id_map: RowIdMap,
    probs: Optional[torch.Tensor] = None,
    *,
    restore_shape: Optional[Sequence[int]] = None,
    row_scales: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """out[t] = sum over experts e of t, ascending, of (probs[t, e] or 1) * (s_r * permuted_tokens[r]),
    r = row(t, e), s_r = row_scales[r] (1 without row_scales).

    Rows are widened to fp32 and multiplied by their scale in fp32; products and the running sum
    are fp32 (fp64 for fp64 probs), rounded once to out_dtype (a float8 output saturates to its
    largest finite value first). No atomics; a token's result depends only on its own rows. The
    backward gives gradients of each tensor's own dtype (rows: permuted_tokens.dtype), computed
    in fp32 and rounded once.

    Args:
        permuted_tokens: [N, H] float32, float16, bfloat16, float8_e4m3fn or float8_e5m2
            (N = row_id_map.num_out_tokens).
        row_id_map: from ``permute``.
        probs: optional [T, E] float32 or float64 (T, E of the map); must be finite (NaN or inf:
            ValueError, raised on CUDA as permute's device checks are); negative values are accepted.
        restore_shape: optional shape for the output (e.g. [S, B, H]); T*H elements.
        row_scales: optional [N] float32, the dequantisation factor of each permuted row (e.g. the
            ``permuted_row_scales`` of ``permute``). No gradient flows to it.
        out_dtype: the output dtype: permuted_tokens.dtype (the default, as TransformerEngine
            does), float32, bfloat16 or float16.

    What is checked about the map: its type and fields (at construction), T and E against probs,
    N against permuted_tokens, T * H against restore_shape, the device. Not detectable: a map from
    another permute call with the same T, E and N (the rows carry no identity); its result is then
    wrong without an error.

    Returns:
        [T, H] (or restore_shape) in out_dtype. Tokens routed nowhere give zero rows.
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
    if row_scales is not None:
        row_scales = _check_row_scales(row_scales, permuted_tokens.shape[0], "N", permuted_tokens.device)
    if out_dtype is not None and out_dtype != permuted_tokens.dtype and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be permuted_tokens.dtype ({permuted_tokens.dtype}), float32, bfloat16 or "
                        f"float16, got {out_dtype}")
    if restore_shape is not None:
        shape = [int(d) for d in restore_shape]
        want = row_id_map.num_tokens * permuted_tokens.shape[1]
        if math.prod(shape) != want or (shape and shape[-1] != permuted_tokens.shape[1]):
            raise ValueError(f"restore_shape {shape} must hold T * H = {row_id_map.num_tokens} * "
                             f"{permuted_tokens.shape[1]} elements with H last (T from row_id_map)")
    most = row_id_map.max_experts_per_token
    out = unpermute_rows(permuted_tokens, row_id_map.slots, probs, row_id_map.has_pad_rows,
                         row_id_map.num_experts if most is None else most, row_scales, out_dtype)
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
