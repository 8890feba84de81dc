"""Count the dispatcher's own host reads and table uploads while a block runs
(``count_host_transfers``: anywhere, the CPU stand-in for ``moe_dispatch.tools.profiling.host_waits``),
and the Python numbers copied into tensors (``count_scalar_copies``: on CUDA each a synchronising
host-to-device copy that CUDA-graph capture refuses)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def count_host_transfers() -> Iterator[dict]:
    """Count, while the block runs, the dispatcher's host reads (``read_host``: each one host sync
    on CUDA) and host-to-device table copies (``to_device``); yields the live counts."""
    from moe_dispatch.dispatcher import records
    from moe_dispatch.dispatcher.dropless import layout
    from moe_dispatch.dispatcher.dropless import plan as dropless
    from moe_dispatch.distributed import agreement, comm

    counts = {"read_host": 0, "to_device": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return wrapper
    saved = (layout.read_host, agreement.read_host, records.read_host, layout.to_device, dropless.to_device,
             records.to_device)
    layout.read_host = agreement.read_host = records.read_host = counted("read_host", comm.read_host)
    layout.to_device = dropless.to_device = records.to_device = counted("to_device", comm.to_device)
    try:
        yield counts
    finally:
        (layout.read_host, agreement.read_host, records.read_host, layout.to_device, dropless.to_device,
         records.to_device) = saved


@contextlib.contextmanager
def count_scalar_copies() -> Iterator[list]:
    """Record, while the block runs, every ``copy_`` whose source is a Python number lifted into
    a tensor (``t[i] = 3``: torch lifts 3 into a CPU 0-dim tensor and, the destination being
    0-dim, copies it). On CUDA that is a synchronising host-to-device copy, which CUDA-graph
    capture refuses; a scalar fill (``t[i].fill_(3)``) passes the value as a kernel argument
    instead. The CPU stand-in for the GPU tests' host-copy counts; yields the call sites."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    sites: list = []

    class _Mode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.lifted: list = []  # kept alive so that their ids stay theirs

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default and any(args[1] is t for t in self.lifted):
                sites.append("".join(traceback.format_stack(limit=6)[:-1]))
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.lift_fresh.default:
                self.lifted.append(out)
            return out

    with _Mode():
        yield sites
