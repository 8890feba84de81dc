"""Spawning ranks on one machine: what `moe-dispatch check`, the test suite's launchers and the
scripts share.

``spawn_ranks`` runs a worker on N processes (torch.multiprocessing), each handed its local rank,
the world size and a free port; the worker calls ``set_rank_env`` before
``init_process_group``, picks its device with ``rank_device`` and leaves with
``end_spawned_rank``.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable, NoReturn

import torch

__all__ = ["end_spawned_rank", "free_port", "rank_device", "set_rank_env", "spawn_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(local_rank: int, world: int, port: int) -> None:
    """The environment that ``init_process_group``'s env:// rendezvous reads, for one rank that
    ``spawn_ranks`` started on this machine."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank))


def spawn_ranks(worker: Callable, world: int, *args: Any, name: str = "moe-dispatch check") -> int:
    """Run worker(local_rank, world, port, *args) on ``world`` spawned ranks; 0, or 1 (with one
    line on stderr naming ``name``) if a rank failed."""
    import torch.multiprocessing as mp
    try:
        mp.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)
    except mp.ProcessExitedException as exc:
        print(f"{name}: a rank failed ({exc})", file=sys.stderr)
        return 1
    return 0


def end_spawned_rank() -> NoReturn:
    """Exit a spawned rank whose work succeeded and whose process group is destroyed, skipping
    interpreter finalization: there gloo's C++ threads can still abort the process (SIGABRT,
    "terminate called without an active exception") after a passing run, which spawn would
    report as a failed rank. Torch does so when a destroyed group's object is still alive at exit;
    the package's own objects hold their groups weakly (comm.WeakGroup, registry's tables), but a
    rank's code may keep one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The rank's device: NCCL, one GPU per rank; gloo, the GPUs too where CUDA is present (ranks
    share them, local_rank modulo the GPU count: gloo's collectives take CUDA tensors, so one GPU
    can check EP 2 to 8), else the CPU."""
    if backend == "nccl" or (backend == "gloo" and torch.cuda.is_available()):
        index = local_rank if backend == "nccl" else local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
