"""scripts/bench_ep.py runs end to end (gloo, tiny sizes), so GPU device time is not spent on a
script that crashes. Its timings mean nothing here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EP1_LAYERS = ["ours alltoall, grouped row-stable experts, sync-free",
              "ours alltoall, grouped row-stable experts, dropless",
              "Megatron alltoall after install() (row-stable GEMMs, stacked expert weights)",
              "Megatron alltoall stock, SequentialMLP, no TE",
              "Megatron alltoall after install(sync_free=True)"]


def test_bench_ep_cpu_smoke():
    root = Path(__file__).resolve().parent.parent
    # tests/bench_ep_cpu.py: the script's --cpu-smoke run with the test suite's CPU shims applied.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "tests.bench_ep_cpu", "--what", "dispatch,layer,profile-layer", "--ep1-layers", "installed",
                           "--profile-rows", "5"], capture_output=True, text=True, timeout=180, cwd=root,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    rows = [f"EP-1 {EP1_LAYERS[2]} | {step}" for step in ("grads reset each step", "grads accumulating")]
    rows += [f"profile: EP-1 {EP1_LAYERS[2]}, grads {mode}" for mode in ("reset", "accumulating")]
    rows += ["ours alltoall round trip", "ours allgather round trip", "Megatron alltoall round trip",
             "ours alltoall, grouped experts", "Megatron allgather, SequentialMLP, no TE, our dispatcher installed"]
    for row in rows:
        assert row in out, (row, out)
    assert "EP-1 ours" not in out and "failed" not in out, out


def test_bench_ep_cpu_smoke_ep1_layers():
    """The EP-1 part alone, every layer (ours, Megatron after install() and install(sync_free=True),
    stock), both gradient modes."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m",
                           "tests.bench_ep_cpu", "--what", "ep1",
                           "--ep1-layers", "ours,installed,stock,installed-sync-free"],
                          capture_output=True, text=True, timeout=180,
                          cwd=root, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for layer in EP1_LAYERS:
        for step in ("grads reset each step", "grads accumulating"):
            assert f"EP-1 {layer} | {step}" in proc.stdout, (layer, step, proc.stdout)
    assert proc.stdout.count("captured (CUDA graph) row: skipped, CUDA only") == 2, proc.stdout  # both sync-free
    assert "round trip" not in proc.stdout and "failed" not in proc.stdout, proc.stdout
