"""Test-only: scripts/bench_ep.py --cpu-smoke on CPU gloo ranks, Megatron's rows included.

The script's Megatron rows need CUDA (megatron-core's MoE code asks for CUDA devices and streams
even for CPU tensors); this launcher applies the test-only CPU shims (tests/megatron_cpu.py) in
each rank, then runs the script's own ``main`` with --cpu-smoke. Under torchrun, which sets the
ranks:

    torchrun --nproc-per-node 2 -m tests.bench_ep_cpu
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_ep  # noqa: E402

from tests.megatron_cpu import apply_cpu_shims  # noqa: E402

if __name__ == "__main__":
    apply_cpu_shims(prepare=False)  # the script prepares Megatron itself, on its process group
    bench_ep.main(["--cpu-smoke", *sys.argv[1:]])
