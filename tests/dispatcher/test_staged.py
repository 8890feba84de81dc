"""The staged dispatch (prepare, send, finish, return_rows, owner_sum) misused: records sent in
another order or replaced on one rank (2 gloo ranks, one spawn under a timeout, each case on a
group with a 10 s timeout: the same ValueError on both ranks, never a hang or a gloo abort), and
stages given another stage's record or another dispatch's (one process); ``to_expert_rows``, the
experts' input record built from the handle."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_dispatch import GroupedMLP, MoEConfig
from moe_dispatch.dispatcher import (
    Fp8Rows,
    check_expert_output,
    combine,
    dispatch,
    finish,
    owner_sum,
    prepare,
    return_rows,
    send,
    to_expert_rows,
    unpack_rows,
)

from .harness import run_ranks, same_value_error, value_error_of
from .helpers import E, H, K, batch, config
from .staged_workers import CASES, staged_worker


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(staged_worker, 2, list(CASES), timeout=240)


@pytest.mark.parametrize("case", ["swap_capacity", "swap_capacity_strict", "swap_dropless", "swap_dropless_strict",
                                  "swap_allgather"])
def test_prepared_records_sent_in_another_order(ranks, case):
    """Issue 46 items 6 (pad_to_capacity: a silently wrong result before, strict or not) and 11
    (dropless: gloo aborted the process): the same ValueError on both ranks before any row moves,
    naming each rank's record; the group works afterwards."""
    same_value_error([rank[case]["first"] for rank in ranks], "send on the EP group pairs different prepared records",
                     "forward 0", "forward 1", "ranks [1] differ", "no row was exchanged")
    for rank in ranks:
        assert rank[case]["after"][0] == "ok", rank[case]["after"]


@pytest.mark.parametrize("case, words", [
    ("fewer_rows", ("[8, 64]", "got [7, 64] float32")),  # item 9: rank 1 raised, rank 0 hung
    ("fewer_rows_capacity", ("[8, 64]", "got [7, 64] float32")),
    ("bf16_copy", ("float32", "got [8, 64] bfloat16")),  # item 12: gloo aborted the process
])
def test_prepared_x_replaced_on_one_rank(ranks, case, words):
    same_value_error([rank[case]["first"] for rank in ranks], "send: the Prepared record's x", "on EP rank 1",
                     "no row was exchanged", *words)
    for rank in ranks:
        assert rank[case]["after"][0] == "ok", rank[case]["after"]


@pytest.mark.parametrize("case, words", [
    ("sync_free_swap", ("a sync-free dispatch paired its forwards 1 and 2", "sent",)),
    ("sync_free_fewer_rows", ("EP rank 1 passed inputs", "a Prepared record whose x or probs were replaced")),
])
def test_sync_free_record_faults_on_one_rank(ranks, case, words):
    """The sync-free plan adds no host read for the record check: its exchange has fixed sizes
    and carries each rank's call and a bad record's input word, so the step completes with NaN
    outputs on every rank and the next dispatch raises the same ValueError on every rank (CPU)."""
    for r, rank in enumerate(ranks):
        assert rank[case]["step"][0] == "ok" and rank[case]["nan"], (r, rank[case])
        assert rank[case]["after"][0] == "ok", (r, rank[case]["after"])
    same_value_error([rank[case]["next"] for rank in ranks], "invalid MoE dispatch input (sync-free)", *words)


def test_staged_send_costs_one_host_read(ranks):
    """The dropless plan's record agreement: one more host read and one small all-gather (its
    message's upload) than dispatch/combine, whose record never leaves the call and needs none.
    (The functional dispatch agrees its configuration each call: 2 reads; a layer's step, 1.)"""
    for rank in ranks:
        reads = rank["host_reads"]
        assert reads["whole"] == {"read_host": 2, "to_device": 2}, reads
        assert reads["staged"] == {"read_host": 3, "to_device": 3}, reads


DROPLESS_CASES = ["swap_capacity", "swap_capacity_strict", "swap_dropless", "swap_dropless_strict", "swap_allgather",
                  "fewer_rows", "fewer_rows_capacity", "bf16_copy", "host_reads"]


@pytest.mark.gpu
def test_record_agreement_over_nccl():
    """The dropless record agreement on 2 GPUs over NCCL (its message on the device, one host
    read): the same ValueErrors as on gloo, and the group works after each."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    gpu = run_ranks(staged_worker, 2, DROPLESS_CASES, "cuda", timeout=300, backend="nccl")
    for case in DROPLESS_CASES[:5]:
        test_prepared_records_sent_in_another_order(gpu, case)
    test_prepared_x_replaced_on_one_rank(gpu, "fewer_rows", ("got [7, 64] float32 on cuda:1",))
    test_prepared_x_replaced_on_one_rank(gpu, "bf16_copy", ("got [8, 64] bfloat16 on cuda:1",))
    test_staged_send_costs_one_host_read(gpu)


# ---- one process --------------------------------------------------------------------------------
def _step(seed: int, cfg=None):
    data = batch(torch.float32, seed=seed, n=12)
    prepared = prepare(data["x"], data["rmap"], data["probs"], cfg or config())
    sent = send(prepared)
    rows, handle = finish(sent)
    return prepared, sent, rows, handle


@pytest.mark.parametrize("sync_free", [False, True])
def test_stages_given_another_stages_record(sync_free):
    """Issue 46 item 15: each stage names the record it expects and the one it got (before: raw
    AttributeErrors, and return_rows took a Returned at EP 1)."""
    cfg = config(sync_free=sync_free) if sync_free else config()
    prepared, sent, rows, handle = _step(0, cfg)
    returned = return_rows(check_expert_output(rows, handle), handle)
    cases = {
        "send expects the Prepared from prepare(); got a Sent (from send())": lambda: send(sent),
        "send expects the Prepared from prepare(); got a Tensor": lambda: send(rows),
        "finish expects the Sent from send(); got a Prepared (from prepare())": lambda: finish(prepared),
        "return_rows expects the expert rows (a tensor [N, H], from check_expert_output()); got a Returned "
        "(from return_rows())": lambda: return_rows(returned, handle),
        "return_rows expects the DispatchHandle from finish() or dispatch(); got a Sent (from send())":
            lambda: return_rows(rows, sent),
        "owner_sum expects the Returned from return_rows(); got a Tensor": lambda: owner_sum(rows, handle),
        "owner_sum expects the DispatchHandle from finish() or dispatch(); got a Returned (from return_rows())":
            lambda: owner_sum(returned, returned),
        "check_expert_output expects the DispatchHandle from finish() or dispatch(); got a Prepared (from "
        "prepare())": lambda: check_expert_output(rows, prepared),
    }
    for expected, call in cases.items():
        assert value_error_of(call) == expected


def test_owner_sum_with_another_dispatchs_handle():
    """Issue 46 item 7: owner_sum(returned of B, handle of A) with the same row count was a
    silently wrong sum; it is a ValueError. combine(rows of B, handle of A) cannot be told from a
    right call (the experts make new tensors; docs/dispatchers.md says what is checked)."""
    _, _, rows_a, handle_a = _step(0)
    _, _, rows_b, handle_b = _step(1)
    assert rows_a.shape == rows_b.shape
    returned_b = return_rows(check_expert_output(rows_b * 2, handle_b), handle_b)
    message = value_error_of(lambda: owner_sum(returned_b, handle_a))
    assert message is not None and "owner_sum was given the Returned of another dispatch" in message, message
    right = owner_sum(returned_b, handle_b)
    # a framework's own copy of the rows, swapped in with dataclasses.replace, keeps the record's dispatch
    copy = dataclasses.replace(returned_b, rows=returned_b.rows.clone())
    assert torch.equal(owner_sum(copy, handle_b), right)
    assert torch.equal(right, combine(rows_b * 2, handle_b))


def test_staged_and_whole_dispatch_agree_at_ep1():
    """The checks change no result: the staged stages are bitwise dispatch/combine."""
    data = batch(torch.float32, seed=3, n=12)
    prepared = prepare(data["x"], data["rmap"], data["probs"], config())
    rows, handle = finish(send(prepared))
    staged = owner_sum(return_rows(check_expert_output(rows * 2, handle), handle), handle)
    rows2, _, handle2 = dispatch(data["x"], data["rmap"], data["probs"], config())
    assert torch.equal(staged, combine(rows2 * 2, handle2))


@pytest.mark.parametrize("sync_free", [False, True])
def test_to_expert_rows_carries_the_handles_split(sync_free):
    """Issue 49 item 4: the experts' input is one record built from the handle. Dropless: the
    plan's host counts and, on request, its per-source blocks; sync-free: the device counts only
    (host ones would cost a host read), the trailing rows and, on request, its blocks as the device
    tensor [El, P] (the sync-free GradientTree's per-source gradients need them)."""
    cfg = config(sync_free=sync_free) if sync_free else config()
    _, _, rows, handle = _step(0, cfg)
    record = to_expert_rows(rows, handle)
    assert record.rows is rows
    assert record.rows_per_expert is handle.rows_per_expert and record.offsets is handle.expert_offsets
    assert record.probs is handle.permuted_probs and record.trailing_rows == sync_free
    assert record.source_blocks is None
    with_blocks = to_expert_rows(rows, handle, source_blocks=True)
    if sync_free:
        assert record.host_rows_per_expert is None and record.gemm_counts is handle.rows_per_expert
        blocks = with_blocks.source_blocks
        assert isinstance(blocks, torch.Tensor) and blocks.device == rows.device
        assert torch.equal(blocks, handle.source_blocks) and blocks.shape == (E, 1)
    else:
        assert torch.equal(record.host_rows_per_expert, handle.rows_per_expert)
        assert record.gemm_counts is record.host_rows_per_expert
        assert with_blocks.source_blocks == handle.source_blocks
    assert value_error_of(lambda: to_expert_rows(rows, rows)) == (
        "to_expert_rows expects the DispatchHandle from finish() or dispatch(); got a Tensor")


def test_fp8_rows_travel_as_a_payload():
    """Issue 49 item 5: FP8 rows are a payload type that the same stages carry. Tokens with
    config.fp8 and the layer's Fp8Rows.quantize(tokens) give the same bits; finish returns Fp8Rows
    whose data and scales view the permuted wire rows and whose grad_sink takes their gradient to
    the tokens (straight-through); to_expert_rows hands them on whole, and refuses a tensor."""
    data = batch(torch.bfloat16, seed=2, n=12)
    x = data["x"].clone().requires_grad_()
    cfg = config(fp8="e4m3")
    given = Fp8Rows.quantize(x, torch.float8_e4m3fn)
    rows_t, handle_t = finish(send(prepare(data["x"], data["rmap"], data["probs"], cfg)))
    rows, handle = finish(send(prepare(given, data["rmap"], data["probs"], cfg)))
    assert isinstance(rows, Fp8Rows) and isinstance(rows_t, Fp8Rows)
    assert torch.equal(rows.wire.view(torch.int16), rows_t.wire.view(torch.int16))
    q, scales = unpack_rows(rows.wire, H, "e4m3")
    assert rows.data.dtype == torch.float8_e4m3fn and torch.equal(rows.data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.scales, scales) and rows.scales.is_contiguous()
    record = to_expert_rows(rows, handle)
    assert record.rows is rows and rows.grad_sink.shape == (rows.data.shape[0], H)
    upstream = torch.randn(rows.grad_sink.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    (rows.grad_sink * upstream).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert "Fp8Rows that finish() returned; got a Tensor" in value_error_of(lambda: to_expert_rows(rows.wire, handle))


@pytest.mark.parametrize("sync_free", [False, True])
def test_experts_on_the_record_are_bitwise_the_plain_call(sync_free):
    """The record changes no result: experts(to_expert_rows(rows, handle)) (a sync-free plan's whole
    buffer, trailing rows included) is bitwise ``dispatch()``'s rows and host counts given loose."""
    moe = MoEConfig(hidden_size=H, num_experts=E, topk=K, ffn_hidden_size=32, probs_in_experts=True)
    cfg = moe.dispatch_config().replace(sync_free=sync_free)
    experts = GroupedMLP(moe, E)
    data = batch(torch.float32, seed=4, n=12)
    x = data["x"].requires_grad_()
    rows, handle = finish(send(prepare(x, data["rmap"], data["probs"], cfg)))
    out = combine(experts(to_expert_rows(rows, handle)), handle)
    out.backward(data["r"])
    grads = [x.grad] + [p.grad for p in experts.parameters()]
    x.grad = None
    experts.zero_grad(set_to_none=True)
    rows2, counts, handle2 = dispatch(x, data["rmap"], data["probs"], cfg)
    out2 = combine(experts(rows2, counts, handle2.permuted_probs, offsets=handle2.expert_offsets), handle2)
    out2.backward(data["r"])
    assert torch.equal(out, out2)
    for a, b in zip(grads, [x.grad] + [p.grad for p in experts.parameters()]):
        assert torch.equal(a, b)
