"""The check's comparisons catch violations: a layer that depends on the dispatcher, the EP size or
the batch fails those rows (and only those)."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from moe_dispatch.tools.check.args import build_parser
from moe_dispatch.tools.check.contract import contract_checks


@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _rows(run, args: argparse.Namespace) -> dict[str, bool]:
    results = contract_checks(args, torch.device("cpu"), [1, 2], ["allgather", "alltoall"], run)
    return {r.check: r.passed for r in results}


def _stand_in(x: torch.Tensor, upstream: torch.Tensor, extra) -> tuple:
    """A row-wise 'layer' y = x * 3 + extra(x); returns (output, input grad, a weight grad)."""
    w = torch.full((x.shape[1],), 3.0, dtype=x.dtype, requires_grad=True)
    xx = x.clone().requires_grad_()
    y = xx * w + extra(xx)
    y.backward(upstream)
    return y.detach(), xx.grad, w.grad


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_check_rows_pass_for_an_invariant_layer_and_fail_for_broken_ones(one_rank, dtype):
    args = build_parser().parse_args(["--tokens", "100", "--hidden", "16", "--dtype", dtype])

    def invariant(kind, ep, x, g):
        return _stand_in(x, g, lambda t: 0 * t)

    def batch_dependent(kind, ep, x, g):  # like a non-row-stable GEMM: depends on the batch
        return _stand_in(x, g, lambda t: t.mean(0, keepdim=True) * 1e-3)

    def dispatcher_dependent(kind, ep, x, g):  # like a bf16 combine on one path only
        return _stand_in(x, g, lambda t: t * (1e-2 if kind == "alltoall" else 0))

    def ep_dependent(kind, ep, x, g):  # like partial sums reduced across EP ranks
        return _stand_in(x, g, lambda t: t * (1e-2 if ep == 2 else 0))

    assert all(_rows(invariant, args).values())
    rows = _rows(batch_dependent, args)
    assert not any(ok for name, ok in rows.items() if name.startswith("batch:"))
    assert all(ok for name, ok in rows.items() if name.startswith(("every rank", "dispatcher", "EP size")))
    rows = _rows(dispatcher_dependent, args)
    assert not rows["dispatcher: allgather vs alltoall, EP 1"]
    assert rows["EP size: EP 1 vs EP 2, allgather"]
    rows = _rows(ep_dependent, args)
    assert not rows["EP size: EP 1 vs EP 2, allgather"]
    assert rows["dispatcher: allgather vs alltoall, EP 1"]


def test_check_rows_print_by_section(one_rank):
    """Rows come in a stable order: every rank, dispatcher, EP size, batch."""
    args = build_parser().parse_args(["--tokens", "100", "--hidden", "16"])
    names = list(_rows(lambda kind, ep, x, g: _stand_in(x, g, lambda t: 0 * t), args))
    sections = ["every rank", "dispatcher", "EP size", "batch"]
    order = [next(i for i, s in enumerate(sections) if n.startswith(s)) for n in names]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}, names
