"""The sync-free step (dispatcher/static.py) across the steps of a run, on 2 gloo ranks: a step
with another T (smaller, larger, different per rank, empty) is bitwise the dropless step; a rank
under torch.no_grad() alone, a capacity overflow in the documented dispatcher example, a config
value that really differs: the same ValueError on every rank, never a hang (timeouts of 60 s)."""
from __future__ import annotations

import pytest
import torch

from tests.dispatcher import static_step_workers as workers
from tests.dispatcher.harness import run_ranks

TIMEOUT = 60


def _all_bitwise(steps: list) -> None:
    for step, same in enumerate(steps):
        assert "error" not in same, (step, same)
        assert all(same.values()), (step, [k for k, v in same.items() if not v])


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_every_rank_empty_then_full_steps(kind):
    """T = 0 on every rank at the first step and after it: empty outputs; the next steps work."""
    for steps in run_ranks(workers.token_counts_worker, 2, kind, [0, 6, 0, 6], timeout=TIMEOUT):
        _all_bitwise(steps)


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_another_token_count_later_is_bitwise_dropless(kind):
    """The first step fixes the plan at T = 6; smaller, per-rank different and larger T later
    (an eval batch, the last short batch; larger: every rank re-plans) are bitwise the dropless
    steps."""
    for steps in run_ranks(workers.token_counts_worker, 2, kind, [6, 4, [5, 2], 9, 6, [3, 12]],
                           timeout=TIMEOUT):
        _all_bitwise(steps)


@pytest.mark.parametrize("mode", ["sync_free", "strict", "dropless"])
def test_no_grad_on_one_rank_raises_everywhere(mode):
    results = run_ranks(workers.no_grad_worker, 2, mode, timeout=TIMEOUT)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is not None and "torch.is_grad_enabled() differs" in error and "no_grad" in error, error
    assert all(r["after"] for r in results), results


@pytest.mark.parametrize("skewed", [False, True])
def test_docs_example_sync_free_is_bitwise_dropless(skewed):
    for r in run_ranks(workers.docs_example_worker, 2, 2.0, skewed, timeout=TIMEOUT):
        assert r["error"] is None, r["error"]
        assert all(r["same"].values()), r["same"]


def test_docs_example_overflow_same_error_everywhere():
    results = run_ranks(workers.docs_example_worker, 2, 0.5, True, timeout=TIMEOUT)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is not None and "static-capacity overflow (ep_capacity_factor=0.5)" in error, error
    assert "an ep_capacity_factor of at least" in error, error


def test_config_values_of_other_python_types():
    """1 and 1.0 are one value (router setting and dispatcher field alike); a real difference
    names the field and both values as written."""
    cases = [[(1, 2), (1.0, 2.0)], [(1, 2), (1, 3.0)], [(1, 2), (1.5, 2)]]
    results = run_ranks(workers.config_values_worker, 2, cases, timeout=TIMEOUT)
    assert results[0] == results[1], results
    same, dispatcher, layer = results[0]
    assert same is True, same
    assert "dispatcher configuration mismatch: ep_capacity_factor differs across the EP group: [2.0, 3.0] by rank" \
        in dispatcher, dispatcher
    assert "capacity_factor differs across the EP group: [1.0, 1.5] by rank" in layer, layer


@pytest.mark.gpu
def test_gpu_another_token_count():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = run_ranks(workers.cuda_token_counts_worker, 2, timeout=300)
    assert all(all(r["same"]) and r["nan"] for r in results), results
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and "passed T = 9 tokens, more than the T = 6" in errors.pop(), results
