"""Code for the 2-rank gloo spawn of test_staged.py: the staged dispatch misused on one rank
(prepared micro-batches sent in another order, a Prepared whose x was replaced by another shape or
dtype). Each case runs on a fresh group with a short timeout, so that a hang on the old code
fails the case (a gloo RuntimeError) instead of the spawn; a gloo abort fails the spawn."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_dispatch.dispatcher import (
    check_expert_output,
    combine,
    dispatch,
    finish,
    owner_sum,
    prepare,
    return_rows,
    send,
)

from .harness import outcome_of
from .helpers import batch, config

CASE_TIMEOUT = timedelta(seconds=10)
T = 8
_DEVICE = {"device": torch.device("cpu")}  # this rank's (staged_worker sets it)


def _batch(seed: int) -> dict:
    return {k: v.to(_DEVICE["device"]) for k, v in batch(torch.float32, seed=seed, n=T).items()}


def _round_trip(cfg, group, rank: int) -> torch.Tensor:
    data = _batch(rank)
    rows, _, handle = dispatch(data["x"], data["rmap"], data["probs"], cfg, group)
    return combine(rows * 2, handle).detach()


def _swapped_sends(cfg, group, rank: int, same_routing: bool = False) -> dict:
    """Micro-batches A and B prepared in order on both ranks; rank 1 sends B first. With
    ``same_routing`` A and B differ in their tokens only: every split size agrees (no abort)."""
    records = []
    for mb in range(2):
        data = _batch(10 * mb + rank)
        routed = _batch(rank) if same_routing else data
        records.append(prepare(data["x"], routed["rmap"], routed["probs"], cfg, group))
    order = (0, 1) if rank == 0 else (1, 0)
    first = outcome_of(lambda: finish(send(records[order[0]])))
    return dict(first=first, after=outcome_of(lambda: _round_trip(cfg, group, rank)))


def _replaced_x(cfg, group, rank: int, replace) -> dict:
    """A Prepared whose x rank 1 replaced (dataclasses.replace, the docs' route for a copy)."""
    data = _batch(rank)
    prepared = prepare(data["x"], data["rmap"], data["probs"], cfg, group)
    if rank == 1:
        prepared = dataclasses.replace(prepared, x=replace(prepared.x))
    sent = outcome_of(lambda: finish(send(prepared)))
    return dict(first=sent, after=outcome_of(lambda: _round_trip(cfg, group, rank)))


def _sync_free(group, rank: int, fault: str) -> dict:
    """The sync-free plan at EP 2 (fixed-size exchanges, no host read): rank 1 sends micro-batch B
    first, or replaces x by fewer rows. The step runs on every rank with NaN outputs, and the next
    dispatch raises on every rank (CPU: the words are read there)."""
    cfg = config(sync_free=True, ep_capacity_factor=2.0)
    _round_trip(cfg, group, rank)  # the first step: the plan's T agreed
    records = []
    for mb in range(2):
        data = _batch(10 * mb + rank)
        records.append(prepare(data["x"], data["rmap"], data["probs"], cfg, group))
    first = records[1 if rank == 1 and fault == "swap" else 0]
    if rank == 1 and fault == "fewer_rows":
        first = dataclasses.replace(first, x=first.x[:-1])

    def step():
        rows, handle = finish(send(first))
        return owner_sum(return_rows(check_expert_output(rows * 2, handle), handle), handle)
    result = {}
    try:
        result["nan"] = bool(torch.isnan(step()).all())
        result["step"] = ("ok", "")
    except Exception as exc:
        result["step"] = (type(exc).__name__, str(exc))
    result["next"] = outcome_of(lambda: _round_trip(cfg, group, rank))
    result["after"] = outcome_of(lambda: _round_trip(cfg, group, rank))
    return result


def _host_reads(group, rank: int) -> dict:
    """Host reads of one dropless EP-2 step after the first: dispatch/combine, and the stages."""
    from tests.cuda_host_waits import count_host_transfers

    cfg = config()
    data = _batch(rank)
    _round_trip(cfg, group, rank)
    out = {}
    with count_host_transfers() as out["whole"]:
        _round_trip(cfg, group, rank)
    with count_host_transfers() as out["staged"]:
        rows, handle = finish(send(prepare(data["x"], data["rmap"], data["probs"], cfg, group)))
        owner_sum(return_rows(check_expert_output(rows * 2, handle), handle), handle)
    return {k: dict(v) for k, v in out.items()}


CASES = {
    # the same routing: before, a silently wrong result on both ranks
    "swap_capacity": lambda g, r: _swapped_sends(config(capacity_factor=4.0, pad_to_capacity=True), g, r, True),
    "swap_capacity_strict": lambda g, r: _swapped_sends(
        config(capacity_factor=4.0, pad_to_capacity=True, strict_call_order=True), g, r, True),
    "swap_dropless": lambda g, r: _swapped_sends(config(), g, r),
    "swap_dropless_strict": lambda g, r: _swapped_sends(config(strict_call_order=True), g, r),
    "swap_allgather": lambda g, r: _swapped_sends(config(kind="allgather"), g, r),
    "fewer_rows": lambda g, r: _replaced_x(config(), g, r, lambda x: x[:-1]),
    "bf16_copy": lambda g, r: _replaced_x(config(), g, r, lambda x: x.to(torch.bfloat16)),
    "fewer_rows_capacity": lambda g, r: _replaced_x(config(capacity_factor=4.0, pad_to_capacity=True), g, r,
                                                    lambda x: x[:-1]),
    "sync_free_swap": lambda g, r: _sync_free(g, r, "swap"),
    "sync_free_fewer_rows": lambda g, r: _sync_free(g, r, "fewer_rows"),
    "host_reads": _host_reads,
}


def staged_worker(rank: int, world_size: int, names: list, device: str = "cpu") -> dict:
    assert world_size == 2
    _DEVICE["device"] = torch.device(device, rank) if device == "cuda" else torch.device(device)
    out = {}
    for name in names:
        group = dist.new_group([0, 1], timeout=CASE_TIMEOUT)
        out[name] = CASES[name](group, rank)
        dist.barrier()  # the default group: the next case starts together even after a timeout
    return out
