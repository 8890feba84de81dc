"""install()'s sync-free dispatch at EP 1 (megatron-core's MoELayer, SequentialMLP, no TE; see
megatron_capture_worker.py): bitwise the dropless dispatch's results with no host read (CPU), and
the installed layer captured in a CUDA graph, replayed bitwise like eager steps (GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_dispatch.config import DISPATCHER_KINDS  # noqa: E402
from tests.dispatcher.harness import run_ranks  # noqa: E402

from .megatron_capture_worker import capture_worker, sync_free_worker  # noqa: E402
from .megatron_worker import DTYPES, assert_steps_equal  # noqa: E402

DTYPE_NAMES = tuple(DTYPES)  # the dtypes the worker ran


@pytest.fixture(scope="module")
def cpu_rank():
    return run_ranks(sync_free_worker, 1, timeout=300)[0]



@pytest.mark.parametrize("kind", DISPATCHER_KINDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_sync_free_install_is_bitwise_dropless(cpu_rank, dtype, kind):
    """Output, input gradient, router and every expert weight gradient: the same bits as the same
    layer on the dropless dispatcher, at two batch sizes."""
    rec = cpu_rank[(dtype, kind)]
    assert rec["sync_free"] == (True, False)  # install(sync_free=True) at EP 1; the default is dropless
    assert_steps_equal(rec["ours"], rec["dropless"], "sync-free vs dropless")
    assert_steps_equal(rec["ours_again"], rec["dropless_again"], "sync-free vs dropless, T = 64")


@pytest.mark.parametrize("kind", DISPATCHER_KINDS)
def test_sync_free_install_reads_nothing_on_the_host(cpu_rank, kind):
    """The experts get the handle's device counts; the dispatch reads and copies nothing (the
    dropless dispatch reads its sizes once per step)."""
    rec = cpu_rank[("bf16", kind)]
    assert rec["device_counts"] == (True, False)
    # scalar_copies: Python numbers copied into tensors, on CUDA each a synchronising copy
    assert rec["ours_reads"] == {"read_host": 0, "to_device": 0, "scalar_copies": 0}, rec["ours_reads"]
    assert rec["dropless_reads"]["read_host"] == 1, rec["dropless_reads"]


def test_megatron_experts_keep_the_dropless_dispatch(cpu_rank):
    assert cpu_rank["plain_sync_free"] is False  # row_stable_gemms=False: Megatron's experts read host counts
    refused = cpu_rank["refused"]  # and sync_free=True says why it cannot be
    assert refused is not None and "install(sync_free=True)" in refused and "row_stable_gemms=False" in refused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_installed_layer_is_bitwise_eager():
    """The installed layer (EP 1, bf16, Megatron's router with its aux loss) captured with
    torch.cuda.graph, forward + backward: replays on new tokens equal eager steps bitwise (output,
    input gradient, router and expert weight gradients); the eager sync-free step equals the
    dropless one bitwise and makes no host synchronisation and no host<->device copy."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the row-stable grouped expert GEMM (bf16 grouped_mm) needs sm90+")
    results = run_ranks(capture_worker, 1, timeout=300, backend="nccl")[0]
    for kind, rec in results.items():
        assert rec["sync_free"], kind
        for i, rows in enumerate(rec["replays"]):
            bad = [(name, diff) for name, same, diff in rows if not same]
            assert not bad, (kind, "replay", i, bad)
        bad = [(name, diff) for name, same, diff in rec["vs_dropless"] if not same]
        assert not bad, (kind, "sync-free vs dropless", bad)
        waits = rec["host_waits"]
        print(f"\n{kind}: installed EP-1 step {waits['syncs']:g} host syncs, {waits['copies']:g} copies; "
              f"{waits['detail']}; dropless: {rec['dropless_host_waits']['syncs']:g} syncs")
        # a sync here names its op in detail['sync_warnings'] (ours, or Megatron's router / layer)
        assert waits["syncs"] == 0 and waits["copies"] == 0, (kind, waits)
