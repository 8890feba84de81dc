"""Pure-torch twins of the Triton kernels: the CPU backend, and the statement of what each kernel
computes. Same ``slots`` layout, same arithmetic in the same order, so fp32 results are bitwise
equal to the kernels'. Sums over a token's experts are a fixed-order loop over slots (ascending
expert id) into an fp32 (fp64 for fp64 probabilities) accumulator, never scatter_add.

Float8 rows (float8_e4m3fn, float8_e5m2) are copied as bytes and computed on in fp32; a result
rounded to float8 is first saturated to the format's largest finite value (NaN stays NaN), then
rounded to nearest even by torch's cast (``round_to``); the kernels give the same bytes
(kernels/float8.py, round_out).
"""
from __future__ import annotations

import torch

from ..numerics.rounding import round_up
from . import guard

# Numerics choices that change values (the same on both backends, so the contract holds with
# either): "unpermute_fma": the unpermute forward's fp32 sum as acc = fma(p, y, acc), one rounding
# per term as on the GPU with FMA contraction, instead of a rounded product then an add (the twin
# emulates the fused step exactly, fma32). The fp64-probs path always multiplies then adds.
NUMERICS: dict = {"unpermute_fma": False}

# One H-block size per H, so the order of the H reduction is a function of H alone; the kernels
# (kernels/) use the same constant. Defined here so the CPU path needs no Triton.
MAX_BLOCK_H = 1024


def block_h(hidden: int) -> int:
    """The H-chunk width used by every kernel (and by the twin's H reduction) for this H."""
    return max(16, min(MAX_BLOCK_H, 1 << (max(hidden, 1) - 1).bit_length()))


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
TOKEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2); 0 for others."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (fp32) rounded once to dtype, to nearest even. For float8, values beyond the largest finite
    value saturate to it first (NaN stays NaN): torch's own cast would give NaN or inf there."""
    top = fp8_max(dtype)
    if top:
        x = torch.where(x > top, top, torch.where(x < -top, -top, x))
    return x.to(dtype)


def _num_experts(slots: torch.Tensor) -> int:
    return (slots.shape[1] - 1) // 2


def _counts(slots: torch.Tensor) -> torch.Tensor:
    """[T] int64 n_t clamped to [0, E], as the kernels read it."""
    return slots[:, 0].to(torch.int64).clamp(0, _num_experts(slots))


def _max_slots(slots: torch.Tensor) -> int:
    return int(_counts(slots).max()) if slots.shape[0] else 0


def max_slots_bound(max_slots: int, num_experts: int) -> int:
    """The slots per token the unpermute backward keeps partial probability gradients for."""
    return max(1, min(max_slots, num_experts))


def make_slots(routing_map: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """routing_map [T, E] bool -> (slots [T, 2E+1] int32, stats int64 [E + 1]): tokens per expert,
    then the most experts any token is routed to."""
    T, E = routing_map.shape
    routed = routing_map.to(torch.int64)
    tokens_per_expert = routed.sum(0)
    padded = round_up(tokens_per_expert, pad_multiple)
    expert_start = padded.cumsum(0) - padded
    rows = expert_start[None, :] + routed.cumsum(0) - routed  # row of (t, e) if routed
    slot = routed.cumsum(1) - 1
    slots = torch.full((T, 2 * E + 1), -1, dtype=torch.int32, device=routing_map.device)
    slots[:, 0] = routed.sum(1).to(torch.int32)
    t_idx, e_idx = routing_map.nonzero(as_tuple=True)
    j = slot[t_idx, e_idx]
    slots[t_idx, 1 + j] = rows[t_idx, e_idx].to(torch.int32)
    slots[t_idx, 1 + E + j] = e_idx.to(torch.int32)
    most = slots[:, 0].max().to(torch.int64).reshape(1) if T else torch.zeros(1, dtype=torch.int64)
    return slots, torch.cat([tokens_per_expert, most])


def make_slots_checked(routing_map: torch.Tensor, pad_multiple: int, probs: torch.Tensor | None,
                       given_counts: list[int] | None,
                       given_max: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_slots, then permute's checks (guard.py), raising at once: probs [T, E] finite, and the
    caller's tokens_per_expert / max_experts_per_token (when given) against the routing map.
    Returns (slots, stats int64 [E + 1 + STATUS_WORDS]: make_slots' stats, then status words)."""
    E = routing_map.shape[1]
    slots, stats = make_slots(routing_map, pad_multiple)
    words = [0] * guard.STATUS_WORDS
    if probs is not None and not bool(torch.isfinite(probs).all()):
        words[guard.PROBS_PERMUTE] = 1
    host = stats.tolist()
    guard.fail(guard.problems(host[:E], host[E], words, given_counts, given_max))
    return slots, torch.cat([stats, torch.tensor(words, dtype=torch.int64, device=stats.device)])


def _slot(slots: torch.Tensor, j: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [T] bool, row [T] int64 clamped into [0, num_rows), expert_valid [T] bool, expert [T]
    int64 clamped into [0, E)) of slot j: exactly what the kernels touch. A slot is valid for
    j < n_t with its row in [0, num_rows); its probability is used when its expert is in [0, E)."""
    E = _num_experts(slots)
    row = slots[:, 1 + j].to(torch.int64)
    expert = slots[:, 1 + E + j].to(torch.int64)
    valid = (j < _counts(slots)) & (row >= 0) & (row < num_rows)
    expert_valid = valid & (expert >= 0) & (expert < E)
    return valid, row.clamp(0, max(num_rows - 1, 0)), expert_valid, expert.clamp(0, E - 1)


def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


def permute_rows(tokens: torch.Tensor, slots: torch.Tensor, probs: torch.Tensor | None,
                 num_out: int, zero_fill: bool,
                 row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out[row(t, e)] = tokens[t] (bytes copied); out_probs[row(t, e)] = probs[t, e];
    out_scales[row(t, e)] = row_scales[t] (fp32 [T] -> [num_out]). Other rows are zero. Absent
    probs or row_scales give a [0] fp32 placeholder."""
    H = tokens.shape[1]
    out = tokens.new_zeros((num_out, H))
    out_probs = probs.new_zeros((num_out,)) if probs is not None else _placeholder(tokens.device)
    out_scales = row_scales.new_zeros((num_out,)) if row_scales is not None else _placeholder(tokens.device)
    arange_t = torch.arange(slots.shape[0], device=tokens.device)
    for j in range(_max_slots(slots)):
        valid, row, expert_valid, expert = _slot(slots, j, num_out)
        out[row[valid]] = tokens[valid]
        if probs is not None:
            out_probs[row[expert_valid]] = probs[arange_t[expert_valid], expert[expert_valid]]
        if row_scales is not None:
            out_scales[row[valid]] = row_scales[valid]
    return out, out_probs, out_scales


def permute_rows_backward(grad: torch.Tensor, slots: torch.Tensor, grad_probs: torch.Tensor | None,
                          probs_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_tokens[t] = sum over slots j (in order) of grad[row_j], fp32, rounded once."""
    T = slots.shape[0]
    E = _num_experts(slots)
    acc = torch.zeros((T, grad.shape[1]), dtype=torch.float32, device=grad.device)
    grad_token_probs = (torch.zeros((T, E), dtype=probs_dtype, device=grad.device) if grad_probs is not None
                        else torch.empty(0, dtype=probs_dtype, device=grad.device))
    arange_t = torch.arange(T, device=grad.device)
    for j in range(_max_slots(slots)):
        valid, row, expert_valid, expert = _slot(slots, j, grad.shape[0])
        acc = acc + torch.where(valid[:, None], grad[row].to(torch.float32), 0.0)
        if grad_probs is not None:
            picked = expert_valid
            grad_token_probs[arange_t[picked], expert[picked]] = grad_probs[row[picked]].to(probs_dtype)
    return round_to(acc, grad.dtype), grad_token_probs


def _acc_dtype(probs: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if probs is not None and probs.dtype == torch.float64 else torch.float32


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c for fp32 tensors (broadcasting), rounded once to fp32: what the GPU's fma computes.

    The product is exact in fp64 and the sum is rounded once in fp64; rounding that to fp32 is the
    correct rounding of a * b + c except where the fp64 sum lands exactly on a midpoint between
    two fp32 numbers (or in fp32's subnormal range) while being inexact. Only there the sum is
    rounded to odd instead (TwoSum gives its exact error; Boldo and Melquiond, "Emulation of FMA
    and correctly rounded sums": round-to-odd at p >= q + 2 bits, then to nearest at q bits, is
    the correct rounding at q bits)."""
    x = a.double() * b.double()
    z = c.double()
    s = x + z
    low = s.view(torch.int64) & 0x1FFFFFFF  # the 29 fp64 mantissa bits below fp32's last
    suspect = (low == 0x10000000) | (s.abs() < 2.0 ** -125)
    if bool(suspect.any()):
        xs, zs, ss = (v.expand_as(s)[suspect] for v in (x, z, s))
        bb = ss - xs
        err = (xs - (ss - bb)) + (zs - bb)
        even = (ss.view(torch.int64) & 1) == 0
        bump = (err != 0) & even & torch.isfinite(ss)
        toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
        s = s.clone()
        s[suspect] = torch.where(bump, torch.nextafter(ss, toward), ss)
    return s.float()


def check_probs_finite(probs: torch.Tensor, op: str) -> None:
    """Raise guard's ValueError when probs hold a NaN or inf (CPU: no synchronisation involved)."""
    if not bool(torch.isfinite(probs).all()):
        guard.fail([guard.probs_message(op)])


def _row_values(rows: torch.Tensor, row: torch.Tensor, row_scales: torch.Tensor | None,
                acc_dtype: torch.dtype) -> torch.Tensor:
    """rows[row] in fp32, times row_scales[row] (fp32) when given, then in the accumulator dtype."""
    y = rows[row].to(torch.float32)
    if row_scales is not None:
        y = y * row_scales[row][:, None]
    return y.to(acc_dtype)


def unpermute_rows(rows: torch.Tensor, slots: torch.Tensor, probs: torch.Tensor | None,
                   row_scales: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[t] = sum over slots j (ascending expert) of probs[t, e_j] * (row_scales[row_j] * rows[row_j]),
    fp32, rounded once to out_dtype (default rows.dtype). rows [N, H], row_scales [N] fp32.
    Raises ValueError for NaN or inf in probs."""
    if probs is not None:
        check_probs_finite(probs, "unpermute")
    T = slots.shape[0]
    acc_dtype = _acc_dtype(probs)
    acc = torch.zeros((T, rows.shape[1]), dtype=acc_dtype, device=rows.device)
    arange_t = torch.arange(T, device=rows.device)
    fma = probs is not None and acc_dtype == torch.float32 and NUMERICS["unpermute_fma"]
    for j in range(_max_slots(slots)):
        valid, row, expert_valid, expert = _slot(slots, j, rows.shape[0])
        term = _row_values(rows, row, row_scales, acc_dtype)
        if probs is not None:
            p = torch.where(expert_valid, probs[arange_t, expert].to(acc_dtype), 0.0)
            if fma:
                acc = torch.where(valid[:, None], fma32(p[:, None], term, acc), acc)
                continue
            term = p[:, None] * term
        acc = acc + torch.where(valid[:, None], term, 0.0)
    return round_to(acc.to(torch.float32), out_dtype or rows.dtype)


def halving_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dim (a power of two) as x[..., :half] + x[..., half:], repeatedly."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def blocked_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot [M, H] x [M, H] -> [M]: a halving sum inside each chunk of block_h(H)
    elements, then the chunk sums added in chunk order (the kernel sums inside a chunk with
    tl.sum, whose order differs: equal within rounding, not bitwise)."""
    M, H = a.shape
    bh = block_h(H)
    acc = torch.zeros((M,), dtype=a.dtype, device=a.device)
    for h0 in range(0, H, bh):
        prod = a[:, h0:h0 + bh] * b[:, h0:h0 + bh]
        acc = acc + halving_sum(torch.nn.functional.pad(prod, (0, bh - prod.shape[1])))
    return acc


def unpermute_rows_backward(grad: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                            probs: torch.Tensor | None, zero_fill: bool, max_slots: int,
                            row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """grad [T, H] (any token dtype) -> grad_rows [N, H] in rows.dtype: grad[t] * p_j, then times
    row_scales[row_j] (fp32), rounded once; grad_probs[t, e_j] = <rows[row_j] * row_scales[row_j],
    grad[t]>. A token with more than max_slots_bound(max_slots, E) experts gets a NaN
    probs-gradient row (the kernel keeps partial sums for that many slots only)."""
    T = slots.shape[0]
    E = _num_experts(slots)
    acc_dtype = _acc_dtype(probs)
    grad_rows = rows.new_zeros(rows.shape)
    grad_probs = (torch.zeros((T, E), dtype=probs.dtype, device=rows.device) if probs is not None
                  else torch.empty(0, dtype=torch.float32, device=rows.device))
    arange_t = torch.arange(T, device=rows.device)
    for j in range(_max_slots(slots)):
        valid, row, expert_valid, expert = _slot(slots, j, rows.shape[0])
        t, row_v = arange_t[valid], row[valid]
        scale = row_scales[row_v][:, None] if row_scales is not None else None
        if probs is None:
            g32 = grad[t].to(torch.float32)
            grad_rows[row_v] = round_to(g32 if scale is None else g32 * scale, rows.dtype)
            continue
        g = grad[t].to(torch.float32).to(acc_dtype)
        p = torch.where(expert_valid, probs[arange_t, expert].to(acc_dtype), 0.0)[valid]
        g_row = (g * p[:, None]).to(torch.float32)
        grad_rows[row_v] = round_to(g_row if scale is None else g_row * scale, rows.dtype)
        picked = expert_valid[valid]
        dots = blocked_dot(_row_values(rows, row_v, row_scales, acc_dtype), g).to(probs.dtype)
        grad_probs[t[picked], expert[valid][picked]] = dots[picked]
    if probs is not None:
        grad_probs[_counts(slots) > max_slots_bound(max_slots, E)] = float("nan")
    return grad_rows, grad_probs


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [N, H], index [M] -> x[index] [M, H]."""
    return x.index_select(0, index)


# Row-wise float8 quantisation (ops/quantize.py). The kernel computes the same fp32 operations.
AMAX_FLOOR = 2.0 ** -64  # rows with a smaller amax (zero rows included) get scale 1


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] fp32/bf16/fp16 -> (q [T, H] fp8_dtype, scales [T] fp32), q * scale ~ x, per row:
    amax = max |x| (exact), scale = amax / M and inv = M / amax (two correctly rounded fp32
    divisions, M = fp8_max), q = round_to(x * inv) (one fp32 multiply; saturate, nearest even).
    amax < AMAX_FLOOR: scale = inv = 1. A row holding inf or NaN: scale NaN, q zeros."""
    T, H = x.shape
    x32 = x.to(torch.float32)
    if H == 0:
        return torch.empty((T, 0), dtype=fp8_dtype, device=x.device), torch.ones(T, device=x.device)
    amax = x32.abs().amax(1)
    finite = torch.isfinite(x32).all(1)
    small = amax < AMAX_FLOOR
    top = torch.full_like(amax, fp8_max(fp8_dtype))
    # Tensor / tensor: torch may turn a division by a scalar into a multiply by its reciprocal.
    scale = torch.where(small, 1.0, torch.div(amax, top))
    inv = torch.where(small, 1.0, torch.div(top, amax))
    q = torch.where(finite[:, None], x32 * inv[:, None], 0.0)
    return round_to(q, fp8_dtype), torch.where(finite, scale, float("nan"))


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q [T, H] float8 (any row stride), scales [T] fp32 -> [T, H] out_dtype: ``q[t, h] * scales[t]``,
    one fp32 multiply (q widens exactly), then one rounding to out_dtype. A NaN scale gives a NaN row."""
    return (q.to(torch.float32) * scales[:, None]).to(out_dtype)


def group_starts_problem(starts: list, pads: list, num_rows: int, padded_rows: int) -> str | None:
    """What is wrong with quantize_group_columns' row_starts / padded_starts values, or None."""
    if starts[0] != 0 or starts[-1] != num_rows or any(b < a for a, b in zip(starts, starts[1:])):
        return f"row_starts must rise from 0 to the {num_rows} rows of x, got {starts}"
    if pads[0] != 0 or pads[-1] != padded_rows:
        return f"padded_starts must rise from 0 to padded_rows {padded_rows}, got {pads}"
    for e in range(len(starts) - 1):
        if pads[e + 1] - pads[e] < starts[e + 1] - starts[e]:
            return (f"padded_starts must leave each expert at least its rows: expert {e} has "
                    f"{starts[e + 1] - starts[e]} rows and {pads[e + 1] - pads[e]} padded columns")
    return None


def quantize_group_columns(x: torch.Tensor, row_starts: torch.Tensor, padded_starts: torch.Tensor,
                           padded_rows: int, fp8_dtype: torch.dtype,
                           row_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, C] (fp32/bf16/fp16/float8), rows grouped by expert, row_starts and padded_starts [E + 1]
    int, row_scales [N] fp32 or None -> (qt [C, P] fp8_dtype, scales [E, C] fp32), P = padded_rows.
    The values are v = x in fp32, times row_scales[:, None] when given (one fp32 multiply). Expert
    e's rows v_e = v[s_e : s_{e+1}] are quantised per column, ``(q_e, scales[e]) = quantize_rows(v_e.T)``,
    so each (expert, column) has quantize_rows' arithmetic over that expert's rows (an expert of no
    rows: scales 1); q_e [C, n_e] fills qt's columns [p_e, p_e + n_e) and qt[:, p_e + n_e : p_{e+1}]
    is zero (+0.0 bytes). Raises ValueError unless s rises from 0 to N, p from 0 to P, and
    p_{e+1} - p_e >= n_e."""
    n_rows, c = x.shape
    starts, pads = row_starts.tolist(), padded_starts.tolist()
    problem = group_starts_problem(starts, pads, n_rows, padded_rows)
    if problem:
        raise ValueError(problem)
    v = x.to(torch.float32)
    if row_scales is not None:
        v = v * row_scales[:, None]
    qt = torch.zeros((c, padded_rows), dtype=torch.uint8, device=x.device)  # uint8: float8 lacks index ops
    scales = torch.empty((len(starts) - 1, c), dtype=torch.float32, device=x.device)
    for e in range(len(starts) - 1):
        q, scales[e] = quantize_rows(v[starts[e] : starts[e + 1]].t(), fp8_dtype)
        qt[:, pads[e] : pads[e] + q.shape[1]] = q.view(torch.uint8)
    return qt.view(fp8_dtype), scales
