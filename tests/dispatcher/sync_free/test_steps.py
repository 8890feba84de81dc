"""The sync-free step (dispatcher/sync_free/) across the steps of a run, on 2 gloo ranks: a step
with another T (smaller, larger, different per rank, empty) is bitwise the dropless step; a rank
under torch.no_grad() alone, a capacity overflow in the documented dispatcher example, a config
value that really differs: the same ValueError on every rank, never a hang (timeouts of 60 s)."""
from __future__ import annotations

import pytest
import torch

from tests.dispatcher.harness import run_ranks
from tests.dispatcher.sync_free import step_workers as workers

TIMEOUT = 60


def _all_bitwise(steps: list) -> None:
    for step, same in enumerate(steps):
        assert "error" not in same, (step, same)
        assert all(same.values()), (step, [k for k, v in same.items() if not v])


KINDS = ["alltoall", "allgather"]
EMPTY = [0, 6, 0, 6]
# the plan is made at T = 6: smaller, per-rank different, larger (every rank re-plans), then both
OTHER_T = [6, 4, [5, 2], 9, 6, [3, 12]]
NO_GRAD_MODES = ["sync_free", "strict", "dropless"]
DOCS_CASES = [(2.0, False), (2.0, True), (0.5, True)]  # (ep_capacity_factor, skewed routing)


@pytest.fixture(scope="module")
def token_counts():
    """One spawn: per rank, the steps of every (kind, counts) run."""
    runs = [(kind, counts) for counts in (EMPTY, OTHER_T) for kind in KINDS]
    results = run_ranks(workers.token_counts_worker, 2, runs, timeout=2 * TIMEOUT)
    return {run: [r[i] for r in results] for i, run in enumerate((kind, str(c)) for kind, c in runs)}


@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_empty_then_full_steps(token_counts, kind):
    """T = 0 on every rank at the first step and after it: empty outputs; the next steps work."""
    for steps in token_counts[kind, str(EMPTY)]:
        _all_bitwise(steps)


@pytest.mark.parametrize("kind", KINDS)
def test_another_token_count_later_is_bitwise_dropless(token_counts, kind):
    """Another T later (an eval batch, the last short batch) is bitwise the dropless step."""
    for steps in token_counts[kind, str(OTHER_T)]:
        _all_bitwise(steps)


@pytest.fixture(scope="module")
def no_grad():
    return run_ranks(workers.no_grad_worker, 2, NO_GRAD_MODES, timeout=TIMEOUT)


@pytest.mark.parametrize("mode", NO_GRAD_MODES)
def test_no_grad_on_one_rank_raises_everywhere(no_grad, mode):
    results = [r[mode] for r in no_grad]
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is not None and "torch.is_grad_enabled() differs" in error and "no_grad" in error, error
    assert all(r["after"] for r in results), results


@pytest.fixture(scope="module")
def docs_example():
    results = run_ranks(workers.docs_example_worker, 2, DOCS_CASES, timeout=TIMEOUT)
    return {case: [r[i] for r in results] for i, case in enumerate(DOCS_CASES)}


@pytest.mark.parametrize("skewed", [False, True])
def test_docs_example_sync_free_is_bitwise_dropless(docs_example, skewed):
    for r in docs_example[2.0, skewed]:
        assert r["error"] is None, r["error"]
        assert all(r["same"].values()), r["same"]


def test_docs_example_overflow_same_error_everywhere(docs_example):
    errors = {r["error"] for r in docs_example[0.5, True]}
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
