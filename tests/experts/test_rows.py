"""`ExpertRows`, the experts' input record (issue 49 item 4): what it refuses, which counts the
GEMMs take, and the experts' forward given the record or the loose plain-call arguments."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_dispatch import MoEConfig
from moe_dispatch.experts import ExpertRows, GroupedMLP, SequentialMLP, fp8_mlp
from tests.dispatcher.harness import value_error_of
from tests.experts.reference import make_config, routed_batch

COUNTS = [3, 0, 5, 2]


def test_record_needs_counts_and_a_host_copy_on_the_host():
    x, counts, _ = routed_batch(COUNTS, 64, torch.float32)
    assert "got neither" in value_error_of(lambda: ExpertRows(x))
    meta = torch.zeros(4, dtype=torch.int64, device="meta")
    assert "host_rows_per_expert must be a CPU tensor" in value_error_of(
        lambda: ExpertRows(x, host_rows_per_expert=meta))
    assert "rows_per_expert must be an int tensor" in value_error_of(lambda: ExpertRows.of(x, COUNTS))
    assert "ExpertRows.rows must be a tensor" in value_error_of(lambda: ExpertRows(x.tolist(), counts))
    # source blocks: a dropless plan's host pairs or a sync-free plan's device rows [E, P]
    device_blocks = torch.tensor([[3], [0], [5], [2]])
    assert ExpertRows(x, counts, source_blocks=device_blocks).source_blocks is device_blocks
    assert ExpertRows(x, counts, source_blocks=((0, 3),) * 4).source_blocks == ((0, 3),) * 4
    assert "source_blocks as a tensor must be integer [E_local, P]" in value_error_of(
        lambda: ExpertRows(x, counts, source_blocks=device_blocks.float()))
    assert "source_blocks as a tensor must be integer [E_local, P]" in value_error_of(
        lambda: ExpertRows(x, counts, source_blocks=device_blocks.to("meta")))
    assert "source_blocks must be host [E_local][P]" in value_error_of(
        lambda: ExpertRows(x, counts, source_blocks={0: (0, 3)}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ExpertRows(x, counts).trailing_rows = True


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
def test_gemms_take_the_host_copy_where_it_exists(cls):
    """With both copies the experts split by the host one: a device tensor that disagrees (here
    deliberately) is not read, as the dispatcher's dropless records rely on (no device read)."""
    experts = cls(make_config(probs_in_experts=True), 4)
    x, counts, probs = routed_batch(COUNTS, 64, torch.float32)
    wrong = torch.tensor([10, 0, 0, 0])  # the same N, every row on expert 0
    both = experts(ExpertRows(x, rows_per_expert=wrong, host_rows_per_expert=counts, probs=probs))
    assert torch.equal(both, experts(x, counts, probs))
    assert not torch.equal(both, experts(ExpertRows(x, rows_per_expert=wrong, probs=probs)))


def test_record_and_loose_arguments_do_not_mix():
    experts = GroupedMLP(make_config(), 4)
    x, counts, probs = routed_batch(COUNTS, 64, torch.float32)
    message = value_error_of(lambda: experts(ExpertRows.of(x, counts), counts))
    assert message is not None and "inside it" in message, message
    assert "inside it" in value_error_of(lambda: experts(ExpertRows.of(x, counts), probs=probs))


def test_fp8_experts_need_the_scales_and_sink():
    config = MoEConfig(hidden_size=32, num_experts=4, topk=2, ffn_hidden_size=32, fp8="e4m3",
                       params_dtype=torch.bfloat16)
    experts = GroupedMLP(config, 4)
    x, counts, _ = routed_batch(COUNTS, 32, torch.bfloat16)
    q = x.to(torch.float8_e4m3fn)
    expected = "fp8 experts need Fp8Rows rows with a grad_sink [N, H]"
    assert expected in value_error_of(lambda: experts(q, counts))
    assert expected in value_error_of(lambda: fp8_mlp(ExpertRows.of(q, counts), experts.weight1, experts.weight2,
                                                      "swiglu", apply_probs=False))
