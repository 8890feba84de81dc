"""Count what a layer step makes the host do: on CUDA, the host synchronisations torch makes and
the host<->device copies the GPU runs (``host_waits``, shared by the GPU tests and
scripts/bench_ep.py); anywhere, the dispatcher's own host reads and table uploads
(``count_host_transfers``, the CPU stand-in)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch


def host_waits(step: Callable[[], None], steps: int = 3, warmup: int = 2) -> dict:
    """Per call of ``step``, after ``warmup`` calls: ``syncs``, the synchronisations torch makes the
    host wait for (``torch.cuda.set_sync_debug_mode`` warns once per sync), and ``copies``, the
    host<->device copies the GPU ran (torch.profiler's "Memcpy HtoD" / "Memcpy DtoH" activities;
    device-to-device copies are work of the step, not host traffic). ``detail`` breaks them down."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught
             if "called a synchronizing CUDA operation" in str(w.message)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    copies = {kind: sum(1 for n in names if n.startswith(f"Memcpy {kind}")) for kind in ("HtoD", "DtoH", "DtoD")}
    return dict(syncs=len(syncs) / steps, copies=(copies["HtoD"] + copies["DtoH"]) / steps,
                detail=dict(copies, sync_warnings=sorted(set(syncs))))


@contextlib.contextmanager
def count_host_transfers() -> Iterator[dict]:
    """Count, while the block runs, the dispatcher's host reads (``read_host``: each one host sync
    on CUDA) and host-to-device table copies (``to_device``); yields the live counts."""
    from moe_dispatch import comm
    from moe_dispatch.dispatcher import functional, layout

    counts = {"read_host": 0, "to_device": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return wrapper
    saved = layout.read_host, layout.to_device, functional.to_device
    layout.read_host = counted("read_host", comm.read_host)
    layout.to_device = functional.to_device = counted("to_device", comm.to_device)
    try:
        yield counts
    finally:
        layout.read_host, layout.to_device, functional.to_device = saved
