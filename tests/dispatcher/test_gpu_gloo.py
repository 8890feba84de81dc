"""The contract matrix of test_contract.py on one GPU: 4 gloo ranks sharing GPU 0 (gloo's
collectives take CUDA tensors), EP 1, 2 and 4, the Triton kernels; the same assertions, bitwise."""
from __future__ import annotations

import pytest
import torch

from .harness import run_ranks
from .test_contract import (  # noqa: F401  (collected here, with this module's `results`)
    assemble,
    test_a_every_rank_holding_a_token_agrees,
    test_b_allgather_equals_alltoall,
    test_c_ep_sizes_agree,
    test_capacity_mode_without_drops_equals_dropless,
    test_d_other_tokens_do_not_matter,
    test_runs_cover_the_matrix,
)
from .workers import contract_worker

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def results():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return assemble(run_ranks(contract_worker, 4, "cuda", timeout=600))
