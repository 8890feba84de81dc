"""scripts/bench_ep.py runs end to end (gloo, tiny sizes), so GPU device time is not spent on a
script that crashes. Its timings mean nothing here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_bench_ep_cpu_smoke():
    root = Path(__file__).resolve().parent.parent
    # tests/bench_ep_cpu.py: the script's --cpu-smoke run with the test suite's CPU shims applied.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "tests.bench_ep_cpu"], capture_output=True, text=True, timeout=180, cwd=root,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for row in ["EP-1 ours alltoall, dropless, grads reset each step",
                "EP-1 ours alltoall, sync-free, grads reset each step",
                "EP-1 ours alltoall, sync-free, grads accumulating", "captured (CUDA graph) row: skipped, CUDA only",
                "ours alltoall round trip", "ours allgather round trip", "Megatron alltoall round trip",
                "ours alltoall, grouped experts", "Megatron allgather, SequentialMLP, no TE, our dispatcher installed"]:
        assert row in out, out
    assert "failed" not in out, out
