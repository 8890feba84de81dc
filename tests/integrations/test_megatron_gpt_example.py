"""examples/megatron_gpt.py on 2 CPU gloo ranks at EP 1 and EP 2 (through the test-only launcher
megatron_gpt_cpu.py, which applies the CPU shims): it trains, the loss falls, and it writes one
checkpoint per rank that loads back into Megatron's state dict, with our MoE layer's experts."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ep,dispatcher", [(1, "alltoall"), (2, "allgather"), (2, "alltoall")])
def test_example_trains_and_saves(tmp_path, ep, dispatcher):
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "tests.integrations.megatron_gpt_cpu", "--ranks", "2", "--",
           "--ep", str(ep), "--dispatcher", dispatcher, "--steps", "8", "--save", str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"^step \d+: loss ([\d.]+)$", proc.stdout, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0], proc.stdout
    states = [torch.load(save / f"rank{r}.pt", weights_only=True) for r in range(2)]
    experts = [k for k in states[0] if "experts" in k and k.endswith("weight")]
    # 2 layers x 8 experts / EP x (fc1, fc2) on each rank
    assert len(experts) == 2 * 8 // ep * 2, sorted(states[0])
    if ep == 2:  # each rank holds its own experts: different weights under the same local names
        assert any(not torch.equal(states[0][k], states[1][k]) for k in experts)
