"""scripts/megatron/compare_checkpoints.py on small checkpoints in both of Megatron-LM's layouts
(torch_dist: a torch.distributed checkpoint; torch: mp_rank_00/model_optim_rng.pt): equal ones
pass, a one-ulp change in a weight or in the optimizer state fails, naming the key."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "megatron" / "compare_checkpoints.py"


def _state(bump: str = "") -> dict:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, generator=gen).bfloat16()
    exp_avg = torch.randn(4, 3, generator=gen)
    rng = torch.arange(8, dtype=torch.uint8)
    if bump == "model":
        weight.view(torch.int16)[0, 0] += 1
    if bump == "optimizer":
        exp_avg.view(torch.int32)[1, 2] += 1
    if bump == "rng":
        rng[3] += 1
    return {"model": {"decoder.layers.1.mlp.experts.linear_fc1.weight0": weight},
            "optimizer": {"state": {"exp_avg": {"decoder.layers.1.mlp.experts.linear_fc1.weight0": exp_avg}}},
            "rng_state": {"torch_rng_state": rng}}


def _save(tmp: Path, name: str, fmt: str, bump: str = "") -> str:
    folder = tmp / name
    iteration = folder / "iter_0000006"
    state = _state(bump)
    if fmt == "torch":
        (iteration / "mp_rank_00").mkdir(parents=True)
        torch.save({**state, "args": None, "iteration": 6}, iteration / "mp_rank_00" / "model_optim_rng.pt")
    else:
        import torch.distributed.checkpoint as dcp

        flat = {"decoder.layers.1.mlp.experts.linear_fc1.weight0": state["model"][
            "decoder.layers.1.mlp.experts.linear_fc1.weight0"],
            "optimizer.state.exp_avg.decoder.layers.1.mlp.experts.linear_fc1.weight0":
                state["optimizer"]["state"]["exp_avg"]["decoder.layers.1.mlp.experts.linear_fc1.weight0"],
            "rng_state/shard_0.0_1.1.0.0.torch_rng_state": state["rng_state"]["torch_rng_state"]}
        dcp.save(flat, checkpoint_id=str(iteration), no_dist=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("6")
    return str(folder)


def _run(capsys, *dirs: str) -> tuple[int, str]:
    spec = importlib.util.spec_from_file_location("compare_checkpoints", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(list(dirs))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_equal_pass_and_one_ulp_fails(tmp_path, capsys, fmt):
    a, b = _save(tmp_path, "a", fmt), _save(tmp_path, "b", fmt)
    code, out = _run(capsys, a, b)
    assert code == 0 and "BITWISE EQUAL" in out, out
    assert "model: 1 tensors bitwise equal, 0 differ; optimizer: 1 tensors bitwise equal, 0 differ" in out
    for bump in ("model", "optimizer"):
        c = _save(tmp_path, f"c_{bump}", fmt, bump)
        code, out = _run(capsys, a, c)
        assert code == 1 and f"{bump}: 0 tensors bitwise equal, 1 differ" in out, out


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_rng_state_reported_beside_the_verdict(tmp_path, capsys, fmt):
    """The RNG state is the generators' position, not a trained value: a differing one is reported
    (torch_dist stores it as a byte tensor under rng_state/) but leaves the verdict on the weights and
    the optimizer state to those."""
    a, c = _save(tmp_path, "a", fmt), _save(tmp_path, "c_rng", fmt, "rng")
    code, out = _run(capsys, a, c)
    assert code == 0 and "BITWISE EQUAL (weights and optimizer state)" in out, out
    if fmt == "torch_dist":
        assert "rng state: 0 tensors bitwise equal, 1 differ" in out, out
    else:  # the legacy reader keeps the model and the optimizer only
        assert "rng state" not in out, out
