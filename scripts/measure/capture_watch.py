"""A pytest plugin that reports what happens on the host while a ``torch.cuda.graph`` capture is
open: the calls that may wait for the GPU or touch CUDA outside the captured stream (event and
stream queries, syncs, waits and records; ``.tolist()``, ``.item()`` and ``.cpu()`` of CUDA
tensors; pinned-memory allocations), garbage collections, Triton compiles, warnings, and any
thread other than the main one. Each is printed with its Python stack (the first 20 per capture).

Why: a capture that fails with "operation failed due to a previous error during capture" names
the first launch after the offending call, not the call. On the GPU machine:

    PYTHONPATH=$PWD:$PWD/scripts/measure python -m pytest -q -s -p capture_watch -m gpu \\
        tests/router tests/tools/test_capture.py

The hooks are Python wrappers: a call made from C++ alone (an allocator's own event query) does
not show; the capture's own ``torch.cuda.synchronize`` before it begins is not reported.
"""
from __future__ import annotations

import gc
import threading
import traceback
import warnings

import torch

_STATE = {"open": False, "reports": 0}
_LIMIT = 20


def _report(what: str, stack: bool = True) -> None:
    if not _STATE["open"] or _STATE["reports"] >= _LIMIT:
        return
    _STATE["reports"] += 1
    print(f"\ncapture_watch: {what} during capture, thread {threading.current_thread().name}", flush=True)
    if stack:
        traceback.print_stack(limit=14)


class _WatchedGraph(torch.cuda.graph):
    def __enter__(self):
        entered = super().__enter__()
        _STATE["open"], _STATE["reports"] = True, 0
        names = [t.name for t in threading.enumerate()]
        if names != ["MainThread"]:
            print(f"\ncapture_watch: threads at capture start: {names}", flush=True)
        return entered

    def __exit__(self, *exc):
        _STATE["open"] = False
        return super().__exit__(*exc)


def _wrap_method(cls, name: str, label: str, cuda_only: bool = False) -> None:
    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        if not cuda_only or self.is_cuda:
            _report(label)
        return original(self, *args, **kwargs)

    setattr(cls, name, wrapped)


def _install() -> None:
    torch.cuda.graph = _WatchedGraph
    for name in ("query", "synchronize", "elapsed_time", "record", "wait"):
        _wrap_method(torch.cuda.Event, name, f"Event.{name}")
    for name in ("query", "synchronize", "wait_stream", "wait_event", "record_event"):
        _wrap_method(torch.cuda.Stream, name, f"Stream.{name}")
    for name in ("tolist", "item", "cpu"):
        _wrap_method(torch.Tensor, name, f"Tensor.{name} of a CUDA tensor", cuda_only=True)
    synchronize = torch.cuda.synchronize

    def watched_synchronize(*args, **kwargs):
        _report("torch.cuda.synchronize")
        return synchronize(*args, **kwargs)

    torch.cuda.synchronize = watched_synchronize
    for name in ("empty", "zeros", "tensor"):
        factory = getattr(torch, name)

        def watched_factory(*args, _factory=factory, _name=name, **kwargs):
            if kwargs.get("pin_memory"):
                _report(f"torch.{_name}(pin_memory=True)")
            return _factory(*args, **kwargs)

        setattr(torch, name, watched_factory)
    gc.callbacks.append(lambda phase, info: _report(f"garbage collection (generation {info.get('generation')})",
                                                    stack=False) if phase == "start" else None)
    try:
        from triton.runtime import jit
    except ImportError:
        pass
    else:
        do_compile = jit.JITFunction._do_compile

        def watched_compile(self, *args, **kwargs):
            _report(f"Triton compile of {self.fn.__name__}")
            return do_compile(self, *args, **kwargs)

        jit.JITFunction._do_compile = watched_compile
    showwarning = warnings.showwarning

    def watched_showwarning(message, category, filename, lineno, file=None, line=None):
        _report(f"warning {category.__name__}: {str(message)[:160]}")
        return showwarning(message, category, filename, lineno, file, line)

    warnings.showwarning = watched_showwarning


_install()
