"""What a step makes the host wait for on CUDA: ``host_waits`` counts the synchronisations torch
makes and the host<->device copies the GPU runs per call (scripts/bench_ep.py's "host waits"
column; the GPU tests assert a layer step makes none it does not need)."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

__all__ = ["host_waits"]


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
