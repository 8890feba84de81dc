"""Run Megatron-LM's own ``pretrain_gpt.py`` unchanged, as ``python pretrain_gpt.py ARGS`` would, and
print every training step's reduced losses exactly (one line per step, the float's hex beside its
decimal), so that two runs' loss trajectories can be compared bitwise. Megatron's own log prints
them rounded to 7 digits only.

    python scripts/megatron/run_pretrain.py .mlm/head/pretrain_gpt.py --mock-data ...

The folder holding pretrain_gpt.py (with gpt_builders.py and model_provider.py, and megatron/)
must be on PYTHONPATH, as Python would put it first for the script itself. The only change to
Megatron-LM's run: ``megatron.training.training.train_step`` is wrapped to read its returned loss
dict (what Megatron itself logs) after each step; nothing in the step is touched.
Lines: ``moe_dispatch_step <iteration> <key>=<float.hex()>/<decimal> ...``.
"""
from __future__ import annotations

import runpy
import sys


def _exact(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu().reshape(-1)
        value = value[0] / value[1] if value.numel() == 2 else value[0]
        value = float(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        value = float(value[0]) / float(value[1])
    value = float(value)
    return f"{value.hex()}/{value:.9g}"


def main(argv: list[str]) -> None:
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: run_pretrain.py PATH/pretrain_gpt.py [Megatron-LM flags]")
    from megatron.training import training

    original = training.train_step
    steps = [0]

    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        steps[0] += 1
        losses = result[0] if isinstance(result, tuple) and isinstance(result[0], dict) else {}
        if losses:
            fields = " ".join(f"{k.replace(' ', '_')}={_exact(v)}" for k, v in sorted(losses.items()))
            done = kwargs.get("iteration")  # the steps done before this one (a loaded checkpoint's count)
            print(f"moe_dispatch_step {done + 1 if isinstance(done, int) else steps[0]} {fields}", flush=True)
        return result

    training.train_step = train_step
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
