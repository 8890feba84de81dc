"""State dicts under Megatron-core's names, and our experts beside Megatron's SequentialMLP."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_dispatch.distributed.launch import free_port
from moe_dispatch.experts import GroupedMLP, SequentialMLP
from moe_dispatch.integrations.megatron import (
    from_megatron_grouped,
    load_megatron_state_dict,
    megatron_state_dict,
    to_megatron_grouped,
)
from tests.experts.reference import make_config, reference_forward, routed_batch
from tests.experts.test_reference import TOL

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_sequential_layout_round_trip(activation):
    cfg = make_config(activation, num_experts=8)
    src = GroupedMLP(cfg, 4, local_expert_offset=4)  # EP rank 1 of 2: local indices 0..3
    sd = megatron_state_dict(src, "sequential", prefix="mlp.experts.")
    fc1_out = 2 * cfg.ffn_hidden_size if activation == "swiglu" else cfg.ffn_hidden_size
    assert sorted(sd) == sorted(
        f"mlp.experts.local_experts.{i}.linear_fc{j}.weight" for i in range(4) for j in (1, 2)
    )
    assert sd["mlp.experts.local_experts.0.linear_fc1.weight"].shape == (fc1_out, cfg.hidden_size)
    assert sd["mlp.experts.local_experts.0.linear_fc2.weight"].shape == (cfg.hidden_size, cfg.ffn_hidden_size)
    # Linear layout: y = x @ W^T, so Megatron's fc1 weight is our expert slice transposed.
    assert torch.equal(sd["mlp.experts.local_experts.2.linear_fc1.weight"], src.weight1[2].t())
    dst = SequentialMLP(make_config(activation, seed=99, num_experts=8), 4)
    load_megatron_state_dict(dst, sd, "sequential", prefix="mlp.experts.")
    assert torch.equal(dst.weight1, src.weight1) and torch.equal(dst.weight2, src.weight2)


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_grouped_layout_matches_megatrons_view(activation):
    """Megatron's GroupedMLP reads weight1 [H, E*fc1_out] as .view(E, H, -1) and weight2
    [E*ffn, H] as .view(E, -1, H); a forward that reads it that way must equal ours."""
    cfg = make_config(activation)
    src = GroupedMLP(cfg, 4)
    sd = to_megatron_grouped(src.weight1.detach(), src.weight2.detach())
    fc1_out = src.weight1.shape[2]
    assert sd["weight1"].shape == (cfg.hidden_size, 4 * fc1_out)
    assert sd["weight2"].shape == (4 * cfg.ffn_hidden_size, cfg.hidden_size)
    w1_view = sd["weight1"].view(4, cfg.hidden_size, -1)
    w2_view = sd["weight2"].view(4, -1, cfg.hidden_size)
    x, tpe, _ = routed_batch([3, 0, 5, 2], cfg.hidden_size, torch.float32)
    theirs = reference_forward(x.double(), w1_view.double(), w2_view.double(), [3, 0, 5, 2], activation, None)
    ours = src(x, tpe)
    assert ((ours.double() - theirs).abs().max() <= TOL[torch.float32] * theirs.abs().max())
    w1, w2 = from_megatron_grouped(sd, 4, cfg.hidden_size)
    assert torch.equal(w1, src.weight1) and torch.equal(w2, src.weight2)
    dst = GroupedMLP(make_config(activation, seed=7), 4)
    load_megatron_state_dict(dst, sd, "grouped")
    assert torch.equal(dst.weight1, src.weight1)


def test_load_rejects_wrong_shapes():
    sd = megatron_state_dict(GroupedMLP(make_config("gelu", ffn=48), 4), "grouped")
    with pytest.raises(ValueError, match="weight"):
        load_megatron_state_dict(GroupedMLP(make_config("gelu", ffn=40), 4), sd, "grouped")
    sd = megatron_state_dict(GroupedMLP(make_config("gelu", ffn=48), 4), "sequential")
    with pytest.raises(ValueError, match="weight"):
        load_megatron_state_dict(GroupedMLP(make_config("gelu", ffn=96), 4), sd, "sequential")
    with pytest.raises(ValueError, match="layout"):
        megatron_state_dict(GroupedMLP(make_config("gelu"), 4), "flat")


@pytest.mark.slow
def test_against_megatron_sequential_mlp():
    """Megatron-core's SequentialMLP on CPU with our weights (sequential layout) and the
    same tokens and probs: outputs and all gradients within twice our reference bound (each is
    within one bound of the exact result). On CPU bf16 outputs and input gradients have come out
    bitwise equal; the probs gradient differs (we sum with a fixed tree)."""
    pytest.importorskip("megatron.core")
    # One thread: the worker is small, and it then does not compete with a parallel test run.
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",  # CPU shims: no GPU in the worker
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.megatron_state_worker", str(free_port())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 6
    for r in reports:
        tol = 2 * TOL[torch.float32 if r["dtype"] == "torch.float32" else torch.bfloat16]
        for key in ("out", "dx", "dw", "dprobs"):
            assert r[key] <= tol, r
