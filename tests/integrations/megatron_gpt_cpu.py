"""Test-only: examples/megatron_gpt.py on CPU gloo ranks.

The example is a torchrun script for GPUs; megatron-core's MoE code needs CUDA. This launcher
spawns the ranks itself and runs the example's own ``main`` unchanged in each, with the test-only
CPU shims (tests/megatron_cpu.py) applied first.

    python -m tests.integrations.megatron_gpt_cpu --ranks 2 -- --ep 2 --save /tmp/ckpt
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Optional

from moe_dispatch.distributed.launch import end_spawned_rank, set_rank_env, spawn_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py"


def _rank(local_rank: int, world: int, port: int, argv: list[str]) -> None:
    from tests.megatron_cpu import apply_cpu_rng, apply_cpu_shims

    set_rank_env(local_rank, world, port)
    apply_cpu_shims(prepare=False)  # the example's initialize_model_parallel allocates Megatron's buffer
    apply_cpu_rng()
    spec = importlib.util.spec_from_file_location("megatron_gpt", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(argv)
    end_spawned_rank()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("example_args", nargs="*", help="the example's flags (after --)")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU shims refuse a process that sees a GPU
    return spawn_ranks(_rank, args.ranks, args.example_args, name="megatron_gpt example")


if __name__ == "__main__":
    raise SystemExit(main())
