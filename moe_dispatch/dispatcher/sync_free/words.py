"""The sync-free step's check words: the status rows of its exchanges, the call identity they
carry, the messages of a bad step, and the latch that raises them (plan.py runs the exchanges).

Checks that need device data cannot raise without a host read. They become int32 words (``W_*``):
probs finite, at most K experts per token, and the three capacities' needed sizes. The words
travel in the exchanges' status rows: the dispatch carries the senders' words to every rank, the
combine carries every expert rank's words (with what it received) to every owner, so after the
combine every rank holds the same maximum of every rank's words. A bad step:
- its outputs are NaN on every rank (CUDA: the ops' sticky status word, see ops/guard.py, so every
  later kernel of ours writes NaN too; CPU: the combine's output is multiplied by NaN);
- the ValueError (the same on every rank: same words) is raised by ``check_device_errors()`` and,
  on CPU, by the next sync-free dispatch on the group (reading a CPU tensor costs no sync). On
  CUDA the next dispatch does not read the words: that would be the per-step host sync this mode
  removes, and a read that does not wait could find them ready on one rank and not on another
  (raising at different calls, a hang). At EP 1 on CPU the dispatch raises at once.
Call identity (``identity.CallId``, the dropless path's size exchange carries it): every exchange's
status rows carry the sender's call (the dispatch's, or for the combine and both backward
exchanges the handle's) as min/max-encoded words (``W_CALL``). A receiver sees every rank's (the
chunks come from every rank), so calls that differ (layers called in another order, a skipped
forward, micro-batches combined out of order) set the ``W_ORDER`` words: NaN and the same error
everywhere, like any bad word. ``strict_call_order`` adds the host-side ``agreement.check_call``
before each return exchange (a synchronisation per exchange; it raises before rows move). Unlike
the size exchange, the mismatched step has run (deferred error), so the ranks' forward counts
stay apart afterwards: rebuild the layers. Under CUDA-graph replay the calls are those of the
capture (no Python runs): only the captured order is checked.
Inputs whose dtypes or devices differ from the first step's (EP > 1: the first step runs the
dropless size exchange once, which validates every rank and fixes the plan's T) take part with
zeros and set ``W_INPUT`` and their own rank's word (``W_INPUT_RANKS``: the message names every
rank at fault), so no rank waits alone; so does a problem the caller found on the device
(``plan.flag_input``: a stale FP8 weights handle). A rank with more tokens than the plan's T sets
``W_TOKENS`` (``SyncFreePlan.send`` re-plans on CPU); one whose grad mode differs from another's sets
``W_GRAD_ON`` / ``W_GRAD_OFF`` (on CPU every rank raises at once, before a backward could wait).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...distributed.agreement import COMBINE_BACKWARD_CALL, COMBINE_CALL, DISPATCH_BACKWARD_CALL, RETURN_CHECKS
from ...distributed.comm import ProcessGroup
from ...distributed.identity import CallId, layer_name
from ...distributed.registry import SYNC_FREE_WORDS
from ...ops import guard
from ..status_rows import status_rows
from .sizes import SyncFreeSizes

# Check words (int32, combined across ranks by max). W_CALL: 4 words, the sender's call of one
# exchange (_call_words); W_ORDER: which exchange found different calls (an _ORDER_WHAT key), then
# the 4 call words of that exchange (max/min over the ranks). W_TOKENS: T of a rank over the plan's;
# W_GRAD_ON / W_GRAD_OFF: 1 + the rank of a sender with grad mode on / off (both set: they differ).
W_NONFINITE, W_MAX_K, W_SEND, W_RECV, W_RETURN, W_INPUT, W_CALL, W_ORDER = 0, 1, 2, 3, 4, 5, 6, 10
W_TOKENS, W_GRAD_ON, W_GRAD_OFF = 15, 16, 17
NUM_WORDS = 18
# Then one word per EP rank (W_INPUT_RANKS + r: 1 when rank r's input was bad), so that a message
# names every rank at fault: a max over ranks keeps each rank's own word (W_INPUT keeps only the
# largest rank + 1).
W_INPUT_RANKS = NUM_WORDS
_CALL_RANGE = 1 << 30  # call words: v (max over ranks: the largest) and _CALL_RANGE - v (the smallest)
# W_ORDER codes, larger for earlier exchanges of a step: the max names the first that found it.
DISPATCH_CODE = 4
_ORDER_WHAT = {DISPATCH_CODE: "dispatch", 3: RETURN_CHECKS[COMBINE_CALL], 2: RETURN_CHECKS[COMBINE_BACKWARD_CALL],
               1: RETURN_CHECKS[DISPATCH_BACKWARD_CALL]}
ORDER_CODE = {COMBINE_CALL: 3, COMBINE_BACKWARD_CALL: 2, DISPATCH_BACKWARD_CALL: 1}


def num_words(ep_size: int) -> int:
    """The check words of a step at this EP size: NUM_WORDS, then one per rank (W_INPUT_RANKS)."""
    return NUM_WORDS + ep_size


def words_rows(row_bytes: int, ep_size: int) -> int:
    """Rows that hold the check words at this EP size in a buffer of ``row_bytes``-byte rows."""
    return status_rows(row_bytes, 4 * num_words(ep_size))


# ---- call identity ------------------------------------------------------------------------------
def set_call_words(words: torch.Tensor, call: CallId) -> None:
    """Write ``call`` into words' W_CALL slots with scalar fills (kernels that take the value as an
    argument: no host-to-device copy, capture-safe). ``words[i] = v`` would not be: a 0-dim
    destination makes torch copy a CPU scalar tensor, a synchronising copy that capture refuses."""
    for i, v in enumerate((call.layer + 1, call.step % _CALL_RANGE)):
        words[W_CALL + 2 * i].fill_(v)
        words[W_CALL + 2 * i + 1].fill_(_CALL_RANGE - v)


def fold_call(words: torch.Tensor, what: int) -> torch.Tensor:
    """Words received in an exchange (max over the senders) -> a copy whose W_ORDER words record
    that the senders' calls differ (``what``: an _ORDER_WHAT key), and whose W_CALL slots are 0."""
    c = words[W_CALL:W_CALL + 4].to(torch.int64)
    differs = ((c[0] + c[1] > _CALL_RANGE) | (c[2] + c[3] > _CALL_RANGE)).to(torch.int32)
    out = words.clone()
    out[W_ORDER] = torch.maximum(out[W_ORDER], differs * what)
    out[W_ORDER + 1:W_ORDER + 5] = torch.maximum(out[W_ORDER + 1:W_ORDER + 5], words[W_CALL:W_CALL + 4] * differs)
    out[W_CALL:W_CALL + 4] = 0
    return out


def _order_message(words: list[int]) -> str:
    what = _ORDER_WHAT[words[W_ORDER]]
    lo_layer, hi_layer = _CALL_RANGE - words[W_ORDER + 2] - 1, words[W_ORDER + 1] - 1
    lo_step, hi_step = _CALL_RANGE - words[W_ORDER + 4], words[W_ORDER + 3]
    if lo_layer != hi_layer:
        return (f"MoE layers called in a different order across the EP group: a sync-free {what} paired "
                f"{layer_name(lo_layer)} with {layer_name(hi_layer)} (every rank must build its MoE layers on an EP "
                f"group in the same order, which numbers them, and call them in the same order)")
    return (f"{layer_name(hi_layer)} is at different forwards across the EP group: a sync-free {what} paired its "
            f"forwards {lo_step} and {hi_step} (a rank skipped or repeated a forward, or sent, combined or "
            f"backpropagated micro-batches in another order)")


# ---- errors -----------------------------------------------------------------------------------
def bad_words(words: torch.Tensor, sizes: SyncFreeSizes) -> torch.Tensor:
    """A 0-dim bool on the device: the words record a problem (scalar compares: no copies). The
    W_CALL slots are an exchange's raw calls: only their folded W_ORDER words count."""
    w = words.to(torch.int64)
    return ((w[W_NONFINITE] > 0) | (w[W_MAX_K] > sizes.topk) | (w[W_SEND] > sizes.send_capacity)
            | (w[W_RECV] > sizes.recv_rows) | (w[W_RETURN] > sizes.return_capacity) | (w[W_INPUT] > 0)
            | (w[W_ORDER] > 0) | (w[W_TOKENS] > sizes.T) | ((w[W_GRAD_ON] > 0) & (w[W_GRAD_OFF] > 0)))


def grad_modes_differ(words: list[int]) -> bool:
    return words[W_GRAD_ON] > 0 and words[W_GRAD_OFF] > 0


def messages(words: list[int], sizes: SyncFreeSizes, deferred: bool = True) -> list[str]:
    """The ValueError's parts for host words (the same on every rank: the same words)."""
    T, K, P, f = sizes.T, sizes.topk, sizes.ep_size, sizes.factor
    load = T * K
    out = []
    if words[W_ORDER]:  # the ranks were in different calls: name that first, it explains the rest
        out.append(_order_message(words))
    if grad_modes_differ(words):
        out.append(f"torch.is_grad_enabled() differs across the EP group: EP rank {words[W_GRAD_OFF] - 1} ran the step "
                   f"under torch.no_grad() (or inference_mode), EP rank {words[W_GRAD_ON] - 1} with grad (every rank "
                   f"must run the layer in the same grad mode: a rank under no_grad would skip the backward "
                   f"exchanges the others wait in)")
    if words[W_INPUT]:
        ranks = [r for r, flag in enumerate(words[W_INPUT_RANKS:]) if flag] or [words[W_INPUT] - 1]
        who = f"EP rank {ranks[0]}" if len(ranks) == 1 else f"EP ranks {', '.join(map(str, ranks))}"
        out.append(f"{who} passed inputs whose dtypes, devices or shapes differ from the first "
                   f"sync-free step's (planned for up to T = {T} tokens per rank), a Prepared record whose x or "
                   f"probs were replaced with another shape, dtype or device before send, a wrong expert_output / "
                   f"routing_map to reuse, or fp8_weights the layer refused (stale, or another layer's)")
    if words[W_TOKENS] > T:
        out.append(f"an EP rank passed T = {words[W_TOKENS]} tokens, more than the T = {T} the sync-free exchange was "
                   f"planned for (the largest T of its first step on this EP group and configuration); on CUDA the "
                   f"plan is not re-made without a host read: run the largest batch first")
    if words[W_NONFINITE]:
        out.append("probs contain NaN or inf (are the router's logits finite?)")
    if words[W_MAX_K] > K:
        out.append(f"a token is routed to {words[W_MAX_K]} experts, more than topk={K} (the sync-free dispatch sizes "
                   f"its buffers for at most topk experts per token)")

    def over(what: str, need: int, cap: int, formula: str, per: float) -> None:
        out.append(f"static-capacity overflow (ep_capacity_factor={f}): {what} needed {need}, more than its capacity "
                   f"{cap} = {formula}; an ep_capacity_factor of at least {need / per:.4g} fits this step")

    if words[W_SEND] > sizes.send_capacity:
        over("the tokens one EP rank sends to one EP rank", words[W_SEND], sizes.send_capacity,
             "min(T, ceil(f * T * topk / P))", load / P)
    if words[W_RECV] > sizes.recv_rows:
        over("the (token, expert) rows one EP rank's experts receive", words[W_RECV], sizes.recv_rows,
             "ceil(f * T * topk)", load)
    if words[W_RETURN] > sizes.return_capacity:
        over("the rows one EP rank's experts return to one EP rank", words[W_RETURN], sizes.return_capacity,
             "ceil(f * T * topk / P)", load / P)
    if out and deferred:
        out[-1] += " (that step's outputs were NaN)"
    return out


def raise_words(words: list[int], sizes: SyncFreeSizes, deferred: bool = True) -> None:
    found = messages(words, sizes, deferred)
    if found:
        guard.fail(["invalid MoE dispatch input (sync-free): " + "; ".join(found)])


def latch_words(group: ProcessGroup, words: torch.Tensor, sizes: SyncFreeSizes) -> None:
    """Keep a bad step's words (max with earlier ones, in place: capture-safe) and poison on CUDA.
    A good step's words count for nothing: its sizes may be another plan's (another T or config)."""
    entry = SYNC_FREE_WORDS.get(group)  # [words (device int32 [num_words(P)], max of the bad steps'), sizes]
    if entry is None or entry[0].device != words.device or entry[0].shape != words.shape:
        entry = SYNC_FREE_WORDS.set(group, [torch.zeros_like(words, dtype=torch.int32), sizes])
    bad = bad_words(words, sizes)
    entry[0].copy_(torch.maximum(entry[0], torch.where(bad, words, torch.zeros_like(words))))
    if words.is_cuda or bool(bad):  # CPU: the bad step's sizes (reading costs no sync); CUDA: the last
        entry[1] = sizes
    if words.is_cuda:  # every later kernel of ours writes NaN (ops/guard.py)
        word = guard.status(words.device)[guard.STEP:guard.STEP + 1]
        word.copy_(torch.maximum(word, bad.to(torch.int32).view(1)))


def raise_latched(group: ProcessGroup) -> None:
    """At a sync-free dispatch: raise an earlier step's problem on CPU (no sync there)."""
    entry = SYNC_FREE_WORDS.get(group)
    if entry is not None and entry[0].device.type == "cpu":
        raise_words(entry[0].tolist(), entry[1])


def _pending_messages() -> list[str]:
    found = []
    for buf, sizes in SYNC_FREE_WORDS.values():
        found += messages(buf.tolist(), sizes)
    return ["invalid MoE dispatch input (sync-free): " + "; ".join(found)] if found else []


def _clear() -> None:
    for buf, _ in SYNC_FREE_WORDS.values():
        buf.zero_()


guard.register_check(_pending_messages, _clear)


def poison(out: torch.Tensor, words: Optional[torch.Tensor], sizes: SyncFreeSizes) -> torch.Tensor:
    """CPU at EP > 1: NaN outputs (and gradients) for a bad step; CUDA poisons through the status."""
    if words is None or out.is_cuda:
        return out
    return out * torch.where(bad_words(words, sizes), float("nan"), 1.0).to(out.dtype)
