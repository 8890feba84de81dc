"""Input checks made on the device, and how their errors reach the host without a new host sync.

Two kinds of input can only be checked against device data:
- the host-supplied sizes of ``permute(..., tokens_per_expert=, max_experts_per_token=)``, which
  must match the routing map;
- NaN or inf in ``probs`` (permute and unpermute, every [T, E] entry, as the dispatchers check).
Negative (finite) probabilities are accepted: the ops are weighted sums, valid for any finite weight.

What happens on a bad input:
- CPU (the torch twin, or the Triton kernels under TRITON_INTERPRET): the op raises the ValueError
  before it returns. Reading a CPU tensor costs no synchronisation.
- CUDA: the kernels make the check and set a status word of the device (``status``, sticky). Every
  kernel of this package reads it at start and, once it is set, writes NaN instead of its result:
  nothing computed after a bad input looks valid. The same ValueError (same text as on CPU) is
  raised on the host
    * at once where the op synchronises anyway (``permute`` without ``tokens_per_expert``);
    * otherwise at the first later ``permute`` / ``unpermute`` call that finds the status copy
      complete (``permute(tokens_per_expert=...)`` queues a copy of the status to pinned memory;
      polling it never waits), or at ``check_device_errors()``, which waits.
  Under CUDA-graph capture nothing is queued (results are still poisoned); call
  ``check_device_errors()`` after a replay. Raising clears the status and every queued copy.

The split of ``tokens_per_expert`` is compared on the device through a 64-bit hash of the counts
(their sum and the bound on experts per token exactly): it decides only the poisoning. The error
itself compares the exact counts on the host, so a wrong split is always reported.
"""
from __future__ import annotations

import collections
from typing import Optional, Sequence

import torch

# Status words (int32 each, 0 = fine); the kernels load all four at once.
STATUS_WORDS = 4
SIZES, PROBS_PERMUTE, PROBS_UNPERMUTE, STEP = 0, 1, 2, 3  # STEP: a sync-free dispatch's checks

_MASK64 = (1 << 64) - 1
HASH_MUL1, HASH_MUL2 = 0x1E3779B97F4A7C15, 0x3F58476D1CE4E5B9

_status: dict[torch.device, torch.Tensor] = {}
# (event, pinned snapshot, given counts, given max): permute calls whose check is still in flight.
_pending: collections.deque = collections.deque()
_free_pinned: dict[int, list[torch.Tensor]] = {}  # pinned snapshot buffers whose copy has arrived
# Other modules' deferred checks (the sync-free dispatch's): (messages(), clear()) pairs that
# check_device_errors reads first (they name more than a status word can) and fail() clears.
_checks: list = []


def register_check(messages, clear) -> None:
    """Add a deferred check: ``messages()`` -> list[str] (may wait for the GPU), ``clear()``."""
    _checks.append((messages, clear))


def status(device: torch.device) -> torch.Tensor:
    """int32 [STATUS_WORDS], this device's sticky status (allocated once, zero = no error seen)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    word = _status.get(device)
    if word is None:
        word = _status[device] = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)
    return word


def _s64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def expert_weight(e: int) -> int:
    """The hash weight of expert e (int64 arithmetic, wrapping; the kernel computes the same)."""
    w = _s64((e + 1) * HASH_MUL1)
    w = _s64(w ^ (w >> 29))
    w = _s64(w * HASH_MUL2)
    return _s64(w ^ (w >> 32))


def counts_hash(counts: Sequence[int]) -> int:
    """sum_e counts[e] * expert_weight(e), wrapping int64: equal counts give equal hashes."""
    return _s64(sum(c * expert_weight(e) for e, c in enumerate(counts)))


def problems(counts: Sequence[int], most: int, words: Sequence[int], given_counts: Optional[Sequence[int]],
             given_max: Optional[int]) -> list[str]:
    """The messages for one check: the routing map's counts and most experts of a token (exact), the
    status words, and what the caller claimed. Same text on every backend."""
    out = []
    if given_counts is not None and list(given_counts) != list(counts):
        diff = [e for e, (g, c) in enumerate(zip(given_counts, counts)) if g != c]
        e = diff[0]
        out.append(f"tokens_per_expert does not match routing_map: expert {e} is given {given_counts[e]} tokens, "
                   f"routing_map routes {counts[e]} (counts differ for {len(diff)} of {len(counts)} experts; "
                   f"totals {sum(given_counts)} given, {sum(counts)} routed)")
    if given_max is not None and most > given_max:
        out.append(f"max_experts_per_token={given_max} is below {most}, the most experts routing_map routes "
                   f"one token to")
    if words[SIZES] and not out:
        out.append("tokens_per_expert or max_experts_per_token of an earlier permute call did not match its "
                   "routing_map")
    for word, op in ((PROBS_PERMUTE, "permute"), (PROBS_UNPERMUTE, "unpermute")):
        if words[word]:
            out.append(probs_message(op))
    return out


def probs_message(op: str) -> str:
    return (f"probs passed to {op} contain NaN or inf; probabilities must be finite "
            f"(negative values are accepted)")


def fail(found: list[str]) -> None:
    """Raise the ValueError for ``found`` (if any), after clearing the status and queued checks."""
    if not found:
        return
    for word in _status.values():  # every device: the error ends the step everywhere
        word.zero_()
    _pending.clear()
    for _, clear in _checks:
        clear()
    raise ValueError("; ".join(found))


def check_snapshot(snapshot: Sequence[int], num_experts: int, given_counts: Optional[Sequence[int]],
                   given_max: Optional[int]) -> None:
    """Raise for a host copy of make_slots' stats buffer: [E] counts, the most experts of a token,
    then the STATUS_WORDS status words."""
    E = num_experts
    fail(problems(snapshot[:E], snapshot[E], snapshot[E + 1:E + 1 + STATUS_WORDS], given_counts, given_max))


def queue(stats: torch.Tensor, num_experts: int, given_counts: Optional[Sequence[int]],
          given_max: Optional[int]) -> None:
    """CUDA: copy ``stats`` (make_slots' stats buffer) to pinned memory without waiting, to be
    checked by a later ``poll``. Nothing is queued under graph capture. Called after the op's
    kernels are queued, so the copy does not hold them back."""
    if torch.cuda.is_current_stream_capturing():
        return
    free = _free_pinned.setdefault(stats.numel(), [])
    pinned = free.pop() if free else torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
    pinned.copy_(stats, non_blocking=True)  # on the current stream of stats' device
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(stats.device))
    _pending.append((event, pinned, num_experts, None if given_counts is None else list(given_counts), given_max))


def poll() -> None:
    """Raise for the queued checks whose copy has arrived; never waits for the GPU."""
    while _pending:
        if torch.cuda.is_current_stream_capturing():
            return
        event, pinned, E, given_counts, given_max = _pending[0]
        if not event.query():
            return
        _pending.popleft()
        values = pinned.tolist()
        _free_pinned.setdefault(pinned.numel(), []).append(pinned)  # its copy is done: reusable
        check_snapshot(values, E, given_counts, given_max)


def check_device_errors() -> None:
    """Wait for the queued checks and read every device's status; raise the ValueError of the first
    bad input seen (a synchronisation: call it where the host waits anyway, e.g. after loss.item())."""
    while _pending:
        _pending[0][0].synchronize()
        poll()
    for messages, _ in list(_checks):
        fail(messages())
    for word in list(_status.values()):
        words = word.tolist()
        found = problems([], 0, words, None, None)
        if words[STEP] and not found:
            found = ["a sync-free dispatch found a bad input or a capacity overflow (its outputs were NaN)"]
        fail(found)

