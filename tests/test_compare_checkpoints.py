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
    if bump == "model":
        weight.view(torch.int16)[0, 0] += 1
    if bump == "optimizer":
        exp_avg.view(torch.int32)[1, 2] += 1
    return {"model": {"decoder.layers.1.mlp.experts.linear_fc1.weight0": weight},
            "optimizer": {"state": {"exp_avg": {"decoder.layers.1.mlp.experts.linear_fc1.weight0": exp_avg}}}}


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
                state["optimizer"]["state"]["exp_avg"]["decoder.layers.1.mlp.experts.linear_fc1.weight0"]}
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
