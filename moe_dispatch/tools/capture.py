"""``capture_step``: one training step (forward + backward) of a module in a CUDA graph, with the
gradients reset, as ``moe-dispatch check``, the benchmarks and the GPU tests capture the sync-free
MoE step."""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch

__all__ = ["capture_step"]


def capture_step(module: torch.nn.Module, x: torch.Tensor, step: Callable[[], Any],
                 warmup: int = 3) -> tuple["torch.cuda.CUDAGraph", Any]:
    """Capture ``step()`` (a forward + backward of ``module`` reading the static input ``x``) in a
    CUDA graph; returns (graph, what ``step`` returned while captured: its static outputs).

    Before each run, ``module``'s gradients and ``x.grad`` are set to None, so the captured step
    writes fresh ``.grad`` tensors, which every replay overwrites (as after
    ``zero_grad(set_to_none=True)``). The ``warmup`` runs go on a side stream first: Triton compiles
    its kernels and the allocator fills its pools there, off the capture stream. Python's garbage
    collector runs just before the capture and not during it. To replay on new
    inputs, copy them into ``x`` (and any other static input) and call ``graph.replay()``."""
    def reset() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            reset()
            step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    # torch.cuda.graph no longer collects garbage before it captures (torch >= 2.9). A collection
    # inside the capture runs arbitrary finalizers, and one that calls CUDA (TransformerEngine met
    # a graph's destruction doing so) invalidates the capture. So collect now, and not during it.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            result = step()
    finally:
        if collecting:
            gc.enable()
    return graph, result
