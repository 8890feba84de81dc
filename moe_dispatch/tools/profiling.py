"""What a step makes the host wait for on CUDA: ``host_waits`` counts the synchronisations torch
makes and the host<->device copies the GPU runs per call (scripts/bench_ep.py's "host waits"
column; the GPU tests assert a layer step makes none it does not need). ``gpu_idle`` says, from
a torch.profiler trace, how long the GPU sat idle and which part of the step the host was in
when it finally launched the next kernel (scripts/bench_ep.py's profile tables). ``median_ms`` is
the benchmarks' timer of a call as the host makes it; ``graph_median_ms`` times a kernel alone."""
from __future__ import annotations

import bisect
import statistics
import time
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["gpu_idle", "graph_median_ms", "host_waits", "median_ms"]

# CPU events that name a part of the step: record_function ranges and autograd's backward nodes.
_PHASE_PREFIXES = ("autograd::engine::evaluate_function: ",)


def median_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3,
              device: torch.device | str = "cuda", before: Optional[Callable[[], None]] = None) -> float:
    """The median time of ``iters`` calls of ``fn``, in ms, after ``warmup`` untimed calls. On a CUDA
    ``device`` each call is timed by CUDA events around it (the GPU time of what it launched, the
    host's launch gaps included) and followed by a synchronisation; elsewhere by the host clock.
    ``before`` runs once between the warm-up and the timed calls (a barrier, for instance)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    if before is not None:
        before()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_median_ms(fn: Callable[[], object], rep: int = 100) -> float:
    """The median GPU time of ``fn`` in ms, replayed from a CUDA graph (triton's do_bench_cudagraph):
    its kernels alone, without the host's launch gaps that ``median_ms`` counts. A single small
    kernel timed eagerly reads its Python launcher's tens of microseconds; a captured step does not
    pay them. ``fn`` must not synchronise (capture refuses it)."""
    import triton.testing  # lazily, as the ops import triton: CPU-only users need none

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


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


def _is_phase(event: Any) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith(_PHASE_PREFIXES)


def _phase_name(event: Any) -> str:
    name = event.name
    for prefix in _PHASE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _is_runtime(event: Any) -> bool:
    """A CUDA runtime / driver call (cudaLaunchKernel, cuLaunchKernelEx, ...), not a torch op."""
    return event.name.startswith("cu")


def _innermost_op(spans: list, when: float) -> Optional[str]:
    """The innermost torch op (not a runtime call) running at ``when`` in ``spans`` (one thread's
    (start, end, event) of ops, sorted by start; the last 2000 that started before are searched)."""
    hi = bisect.bisect_right(spans, (when, float("inf")), key=lambda span: span[:2])
    for start, end, event in reversed(spans[max(0, hi - 2000):hi]):
        if end >= when and not _is_runtime(event):
            return event.name
    return None


def gpu_idle(events: Iterable[Any], steps: int, min_gap_us: float = 1.0, depth: int = 2) -> dict:
    """GPU idle time of a profiled run, attributed to what the host was doing.

    Args:
        events: ``prof.events()`` of a torch.profiler run with CPU and CUDA activities. Read:
            ``name``, ``device_type``, ``time_range`` (.start, .end in us), ``thread``, ``id``,
            ``linked_correlation_id`` (a kernel's: the id of the CPU runtime call that launched
            it) and ``is_user_annotation``.
        steps: the steps the run made (figures are per step).
        min_gap_us: shorter gaps between kernels are left out of ``idle_us`` (launch jitter).
        depth: the innermost ``depth`` phases named in a row's key.
    Returns:
        ``busy_us`` / ``idle_us``: per step, the union of kernel intervals and the gaps between
        them (first kernel to last); ``rows``: [(phase, idle_us per step, gaps per step)],
        largest first. A gap's phase is where the host was when it launched the kernel that ended
        the gap: the record_function ranges and backward nodes enclosing that launch (innermost
        ``depth``, outer first) and the torch op that launched it. The GPU waited on the host there.
    """
    events = list(events)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    phase_names = {e.name for e in cpu if _is_phase(e)}
    # record_function ranges also appear on the GPU timeline: they are not kernels
    kernels = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CPU
                      and not getattr(e, "is_user_annotation", False) and e.name not in phase_names),
                     key=lambda e: e.time_range.start)
    by_id = {e.id: e for e in cpu}
    threads = (defaultdict(list), defaultdict(list))  # (ops, phases): thread -> [(start, end, event)] by start
    for e in cpu:
        threads[_is_phase(e)][e.thread].append((e.time_range.start, e.time_range.end, e))
    for spans in (*threads[0].values(), *threads[1].values()):
        spans.sort(key=lambda span: span[:2])
    busy = idle = 0.0
    rows: dict = defaultdict(lambda: [0.0, 0])
    end = None
    for k in kernels:
        start, stop = k.time_range.start, k.time_range.end
        if end is not None and start - end > min_gap_us:
            idle += start - end
            row = rows[_gap_key(k, by_id, threads, depth)]
            row[0] += start - end
            row[1] += 1
        if end is None or stop > end:
            busy += stop - (start if end is None else max(start, end))
            end = stop
    table = sorted(((key, total / steps, count / steps) for key, (total, count) in rows.items()),
                   key=lambda row: -row[1])
    return dict(busy_us=busy / steps, idle_us=idle / steps, rows=table)


def _gap_key(kernel: Any, by_id: dict, threads: dict, depth: int) -> str:
    """'phase / ... / op' of the host when it launched ``kernel`` (see ``gpu_idle``)."""
    launch = by_id.get(getattr(kernel, "linked_correlation_id", 0))
    if launch is None:
        return f"(launch not traced) -> {kernel.name[:40]}"
    when = launch.time_range.start
    ops, phases = threads[0][launch.thread], threads[1][launch.thread]
    op = _innermost_op(ops, when) if _is_runtime(launch) else launch.name
    hi = bisect.bisect_right(phases, (when, float("inf")), key=lambda span: span[:2])
    enclosing = [_phase_name(e) for s0, s1, e in phases[:hi] if s1 >= when]
    return " / ".join(enclosing[-depth:] + [op or "(no torch op)"])
