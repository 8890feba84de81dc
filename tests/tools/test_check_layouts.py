"""The check's layouts rows (tools/check/layouts.py): a short GradientTree training run compared
bitwise across layouts with the same L, dropless and with the sync-free step at EP > 1. On 4 gloo
ranks: every row PASSes with the tree as it is, in bf16 and in FP8 with FP8 wgrad (--no-fp8-wgrad:
the six-layout FP8 test of tests/parallel/test_gradient_tree.py, to keep this spawn short), and
FAILs when the tree's cross-rank steps run in the other order (pairs two ranks apart first: a
different reduction order, so the ranks' subtrees no longer nest with each rank's own micro-batches).
One rank gives a SKIP row with its reason and no number."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_dispatch.tools.check.args import build_parser
from moe_dispatch.tools.check.contract import Result
from moe_dispatch.tools.check.layouts import LABEL, layout_rows
from moe_dispatch.tools.check.report import print_report
from tests.dispatcher.harness import run_ranks

ROWS = ["layouts: 3 training steps, (world 4, EP 4, A 1) vs (world 4, EP 1, A 1), alltoall",
        "layouts: 3 training steps, (world 2, EP 2, A 2) on ranks 0-1 vs (world 4, EP 1, A 1), alltoall",
        "layouts: 3 training steps, (world 4, EP 4, A 1) sync-free vs (world 4, EP 1, A 1), alltoall",
        "layouts: 3 training steps, (world 2, EP 2, A 2) sync-free on ranks 0-1 vs (world 4, EP 1, A 1), alltoall"]
FP8 = ["--fp8"]


def _reversed_levels(self, flat: torch.Tensor, prefix) -> None:
    """In place of TreeExchange's two ways to sum the levels: in the other order (level
    log2(W)-1 first), each by both partners adding the whole joined prefix."""
    for k in reversed(range(self.steps)):
        if prefix[k]:
            flat[:prefix[k]].add_(self._swap(flat, [(0, prefix[k])], [(0, prefix[k])], k))


def _worker(rank: int, world: int) -> dict:
    from moe_dispatch.parallel.tree_exchange import TreeExchange

    cpu = torch.device("cpu")
    args = build_parser().parse_args([])  # the check's defaults: bf16, 128 tokens per micro-batch
    out = {"tree": layout_rows(args, cpu)}
    out["fp8"] = layout_rows(build_parser().parse_args(FP8), cpu)
    TreeExchange._halving_then_gather = TreeExchange._doubling = _reversed_levels  # this spawned rank's class only
    out["reversed"] = layout_rows(args, cpu)
    out["fp8 reversed"] = layout_rows(build_parser().parse_args(FP8), cpu)
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_worker, 4, timeout=300)


def _by_row(rows: list[Result]) -> dict[str, Result]:
    return {r.check: r for r in rows}


def test_layouts_rows_pass_bitwise(four_ranks, capsys):
    for rank, out in enumerate(four_ranks):
        rows = _by_row(out["tree"])
        assert list(rows) == ROWS, (rank, [r.check for r in out["tree"]])
        for r in rows.values():
            assert r.status == "PASS" and r.max_diff == 0.0 and not r.informational, (rank, r)
    print_report(build_parser().parse_args([]), four_ranks[0]["tree"], "throughput line")
    out = capsys.readouterr().out.splitlines()
    assert [line.rsplit("|", 1)[-1].strip() for line in out if line.startswith(LABEL)] == ["PASS"] * 4, out
    assert any(line.startswith("The layouts rows: a small model") for line in out), out  # the legend


def test_layouts_rows_fail_for_another_reduction_order(four_ranks):
    for rank, out in enumerate(four_ranks):
        rows = _by_row(out["reversed"])
        assert list(rows) == ROWS, rank
        for r in rows.values():  # a FAIL on any rank is a FAIL on every rank (gathered)
            assert r.status == "FAIL" and r.failed and 0 < r.max_diff < 1e-2, (rank, r)


def test_layouts_rows_pass_bitwise_fp8(four_ranks):
    """--fp8 (issue 50, item 5: a SKIP before, FP8 wgrad giving no per-source weight gradients):
    every row, the sync-free ones too, passes bitwise, and fails when the tree pairs in another order."""
    for rank, out in enumerate(four_ranks):
        rows = _by_row(out["fp8"])
        assert list(rows) == ROWS, (rank, [r.check for r in out["fp8"]])
        for r in rows.values():
            assert r.status == "PASS" and r.max_diff == 0.0 and not r.informational, (rank, r)
        assert all(r.status == "FAIL" and r.max_diff > 0 for r in out["fp8 reversed"]), rank


def test_one_rank_skips_and_prints_no_number(tmp_path, capsys):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        args = build_parser().parse_args([])
        rows = layout_rows(args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert len(rows) == 1 and rows[0].status == "SKIP (one rank: L = 1 micro-batch has only one layout)", rows
    print_report(args, rows, "throughput line")
    out = capsys.readouterr().out.splitlines()
    cells = [line.split("|")[1].strip() for line in out if line.startswith(LABEL)]
    assert cells == ["-"], out
    assert not any(line.startswith("The layouts rows") for line in out)  # no legend for rows that did not run
    assert out[-1] == "ALL PASS"
