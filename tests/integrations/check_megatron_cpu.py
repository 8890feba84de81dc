"""Test-only: ``moe-dispatch check --megatron`` on CPU gloo ranks.

The command itself refuses CPU ranks (megatron-core's MoE code needs CUDA); this launcher spawns
the ranks as the command does, applies the test-only CPU shims (tests/megatron_cpu.py) in each,
and then runs the command's own rank code (``moe_dispatch.check.main_worker``) unchanged.

    python -m tests.integrations.check_megatron_cpu --megatron --ranks 2 --dtype fp32
"""
from __future__ import annotations

import os
from typing import Optional

from moe_dispatch import check


def _rank(local_rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    from tests.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()
    check.main_worker(args, "gloo")
    check.end_spawned_rank()


def main(argv: Optional[list[str]] = None) -> int:
    args = check.build_parser().parse_args(argv)
    return check.spawn_ranks(_rank, args.ranks or 2, args, name="check --megatron (CPU)")


if __name__ == "__main__":
    raise SystemExit(main())
