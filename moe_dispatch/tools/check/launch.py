"""The rank launcher: ``main`` checks the flags, then spawns the ranks (or runs as one under
torchrun); each rank's ``main_worker`` (in ``ranks``) joins the process group, runs every row, and
rank 0 prints the report. The exit status is 1 if any row that counts FAILs on any rank.

This module loads no torch: the flags the parser alone can judge are refused before the seconds
that importing torch takes, and each step that takes long says so before it starts.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from .args import build_parser, default_backend, under_torchrun, validate_flags, validate_with_torch


def __getattr__(name: str) -> Any:
    # The rank code, importable from here as it always was (it loads torch).
    if name in ("main_worker", "run_checks"):
        from . import ranks

        return getattr(ranks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _say(text: str) -> None:
    """A line of the launcher (rank 0 only under torchrun, where every rank runs ``main``)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"moe-dispatch check: {text}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """`moe-dispatch check` with these arguments: 0 when every row that counts passes."""
    parser = build_parser()
    args: argparse.Namespace = parser.parse_args(argv)
    validate_flags(parser, args, argv)
    _say("importing torch to check the other flags (a few seconds)")
    world = validate_with_torch(parser, args)
    if args.megatron:
        from ...integrations.megatron.check import megatron_unavailable

        if why := megatron_unavailable():
            parser.error(why)
    backend = default_backend(args)
    from .ranks import _worker, main_worker

    if under_torchrun():
        return main_worker(args, backend)
    from ...distributed.launch import spawn_ranks

    _say(f"starting {world} ranks on {backend}; each imports torch and this package before the first row "
         "(tens of seconds on a few CPU cores)")
    return spawn_ranks(_worker, world, backend, args)
