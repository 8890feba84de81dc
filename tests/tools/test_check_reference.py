"""The check's float64 row and reference rows on one CPU rank: our layer's output is within one
final rounding of the float64 sum of its own expert outputs, and the reference combine (each EP
rank rounds its partial sum to bf16) really differs between EP 1 and EP 2, 4, while at EP 1 it is
our combine bit for bit. Across ranks, dispatchers and EP sizes: tests/test_layer.py."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from moe_dispatch.config import MoEConfig
from moe_dispatch.layer import MoELayer
from moe_dispatch.tools.check.args import build_parser
from moe_dispatch.tools.check.reference import combine_rows, expert_outputs, reduce_scatter_combine


@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _shown_ulps(row) -> float:
    """The figure the float64 row prints: the worst error past the fp32 sum's share, in ulps."""
    return float(re.search(r": ([0-9.]+) ulp of bf16 past the fp32 sum's error \(bound 0\.50\)", row.check).group(1))


def _layer(args) -> MoELayer:
    config = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk,
                       ffn_hidden_size=args.ffn, init_seed=args.seed)
    return MoELayer(config, layer_index=0)


def test_reference_rows_differ_and_ours_is_within_one_rounding(one_rank):
    args = build_parser().parse_args(["--tokens", "64"])
    rows = combine_rows(args, torch.device("cpu"), _layer(args), [1, 2, 4])
    ours, *reference = rows
    assert ours.passed and not ours.informational and "float64" in ours.check, ours
    assert 0 < ours.max_diff  # bf16 output: a real rounding, within the bound
    assert 0 < _shown_ulps(ours) <= 0.5, ours.check
    assert [r.check for r in reference] == ["reference, not ours: reduce-scatter combine, EP 1 vs EP 2",
                                            "reference, not ours: reduce-scatter combine, EP 1 vs EP 4"]
    for r in reference:
        assert r.informational and not r.passed and r.max_diff > 0 and r.status == "DIFF" and not r.failed, r


def test_reference_combine_at_ep1_is_ours_and_differs_at_ep2(one_rank):
    args = build_parser().parse_args(["--tokens", "64"])
    layer = _layer(args)
    x = torch.randn(64, args.hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        ours = layer(x)
        probs, y = expert_outputs(layer, x)
    assert torch.equal(reduce_scatter_combine(probs, y, 1), ours)
    assert not torch.equal(reduce_scatter_combine(probs, y, 2), ours)


def test_fp32_reference_rows_match(one_rank):
    """fp32 activations and fp32 probs: the partials need no rounding, the reference rows match."""
    args = build_parser().parse_args(["--tokens", "32", "--dtype", "fp32"])
    ours, *reference = combine_rows(args, torch.device("cpu"), _layer(args), [1, 2])
    assert ours.passed and all(r.passed and r.max_diff == 0 for r in reference)


def test_float64_row_fails_for_a_wrong_combine(one_rank, monkeypatch):
    """The float64 row can fail: a combine off by one bf16 ulp on some element is outside the bound."""
    args = build_parser().parse_args(["--tokens", "32"])
    layer = _layer(args)
    forward = layer.forward
    monkeypatch.setattr(layer, "forward", lambda x: forward(x) * (1 + 2 ** -6))
    ours, *_ = combine_rows(args, torch.device("cpu"), layer, [1, 2])
    assert not ours.passed and ours.failed
    assert _shown_ulps(ours) > 0.5, ours.check
