"""Run a function on N gloo ranks (torch.multiprocessing, forkserver) under a wall-clock timeout.

Each rank's return value is saved with torch.save and handed back to the test process, so the
assertions run in pytest with readable messages. A rank that raises fails the test with that
rank's traceback; a hang fails it after `timeout` seconds (the ranks are killed).
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_dispatch.distributed.launch import end_spawned_rank

# The ranks are forked from a server that has imported torch once, rather than spawned as fresh
# interpreters that each import it (1-1.5 s a rank on 2 cores, a few hundred rank starts a suite).
# Nothing else is preloaded: the server runs no torch op, so a forked rank starts as a spawned one.
START_METHOD = "forkserver"
mp.set_forkserver_preload(["torch", "torch.distributed"])


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, out_dir: str, backend: str,
           environ: dict, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test process's variables now, not the server's from its start
    torch.set_num_threads(1)  # 4 ranks share 2 cores; also keeps CPU reductions single-threaded
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        path = os.path.join(out_dir, f"rank{rank}.pt")
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)  # whole, or absent: the error report below reads which exist
    finally:
        dist.destroy_process_group()
    end_spawned_rank()  # the result is on disk; an exception above still reaches spawn's handler


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 150.0, backend: str = "gloo") -> list:
    """fn(rank, world_size, *args) on `world_size` ranks; returns the list of per-rank results.
    backend 'nccl' puts rank r on CUDA device r."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(fn, world_size, init_file, tmp, backend, dict(os.environ), args),
                                 nprocs=world_size, join=False, start_method=START_METHOD)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s "
                                       f"(a hang in a collective?)")
        except mp.ProcessExitedException as exc:
            saved = [r for r in range(world_size) if os.path.exists(os.path.join(tmp, f"rank{r}.pt"))]
            raise RuntimeError(f"{fn.__name__}: rank {exc.error_index} died ({exc}); ranks that had saved their "
                               f"result: {saved} (a rank in that list died in destroy_process_group)") from exc
        finally:
            for p in ctx.processes:  # only the processes started above
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def value_error_of(fn: Callable[[], Any]) -> "str | None":
    """The message of the ValueError ``fn()`` raises, or None if it returns."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def outcome_of(fn: Callable[[], Any]) -> tuple:
    """("ok", "") or (the exception's type name, its message): what a rank reports for a test to
    compare across ranks."""
    try:
        fn()
        return ("ok", "")
    except Exception as exc:  # the test compares type and message across ranks
        return (type(exc).__name__, str(exc))


def same_value_error(outcomes: list, *words: str) -> str:
    """The one ValueError message every rank's ``outcome_of`` gave, holding each of ``words``."""
    for r, (kind, message) in enumerate(outcomes):
        assert kind == "ValueError", f"rank {r}: expected ValueError, got {kind}: {message}"
        for word in words:
            assert word in message, f"rank {r}: {word!r} not in {message!r}"
    assert len({m for _, m in outcomes}) == 1, f"messages differ across ranks: {outcomes}"
    return outcomes[0][1]
