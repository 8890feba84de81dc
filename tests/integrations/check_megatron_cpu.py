"""Test-only: ``moe-dispatch check --megatron`` on CPU gloo ranks.

The command itself refuses CPU ranks (megatron-core's MoE code needs CUDA); this launcher spawns
the ranks as the command does, applies the test-only CPU shims (tests/megatron_cpu.py) in each,
and then runs the command's own rank code (``moe_dispatch.tools.check.launch.main_worker``) unchanged.

    python -m tests.integrations.check_megatron_cpu --megatron --ranks 2 --dtype fp32
"""
from __future__ import annotations

from typing import Optional

from moe_dispatch.distributed.launch import end_spawned_rank, set_rank_env, spawn_ranks
from moe_dispatch.tools.check.args import build_parser
from moe_dispatch.tools.check.launch import main_worker


def _rank(local_rank: int, world: int, port: int, args) -> None:
    set_rank_env(local_rank, world, port)
    from tests.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()
    main_worker(args, "gloo")
    end_spawned_rank()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return spawn_ranks(_rank, args.ranks or 2, args, name="check --megatron (CPU)")


if __name__ == "__main__":
    raise SystemExit(main())
