"""One 4-rank gloo spawn shared by test_bad_input.py and test_contract.py (starting 4 ranks on 2
cores costs more than all their checks). A hang fails it after the timeout."""
import pytest

from .harness import run_ranks
from .workers import gloo_worker


@pytest.fixture(scope="session")
def gloo_ranks():
    return run_ranks(gloo_worker, 4, timeout=300)
