"""Run megatron-core 0.16.1's MoELayer on CPU / gloo (tests, ``moe-dispatch check --megatron``).

Megatron's MoE code asks for CUDA devices, streams and events even when every tensor is on the
CPU. :func:`apply_cpu_shims` patches exactly those calls, process-wide, and is meant for CPU
processes only (tests, demos): never call it in a process that trains on GPUs.

What it patches (all idempotent):

- ``torch.cuda.current_device()`` returns ``"cpu"`` (the router and the experts place tensors on it);
- ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``stream()`` become no-ops (Megatron's
  alltoall dispatcher copies split sizes on a side stream);
- ``moe_utils.maybe_move_tensor_to_cpu`` (also imported into ``token_dispatcher``) returns numpy
  arrays for CPU split sizes too, as it already does for CUDA tensors;
- Megatron's global memory buffer is allocated (its allgather dispatcher gathers into it);
- :func:`disable_te_router_gemm` (below);
- if megatron.core is not imported yet, it is imported with ``torch.compile`` replaced by a no-op
  decorator, so Megatron's ``jit_fuser`` functions run eagerly: this skips importing torch's
  compiler stack (about 4 s of CPU per process) and compiling C++ kernels on the first call.

Not patched: the CUDA RNG tracker. Build the modules with ``use_cpu_initialization=True`` and do
not call ``model_parallel_cuda_manual_seed`` or Megatron's activation checkpointing on the CPU.

Without TransformerEngine, megatron-core 0.16.1 with ``moe_router_dtype='fp32'`` raises
``NameError: te_general_gemm`` in the router (seen on CUDA and on CPU);
:func:`disable_te_router_gemm` defines it as None, which selects Megatron's plain torch GEMM. It is
safe on GPUs too, and a no-op when TransformerEngine provides the name.
"""
from __future__ import annotations

import contextlib
import sys

import torch

_APPLIED = {"cpu": False}


class _NoStream:
    """Stands in for torch.cuda.Stream and torch.cuda.Event on the CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs) -> "_NoStream":
        return _NoStream()

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _import_megatron_without_compile() -> None:
    if "megatron.core" in sys.modules:
        return

    def no_compile(model=None, *args, **kwargs):
        return model if model is not None else (lambda fn: fn)

    original, torch.compile = torch.compile, no_compile
    try:
        import megatron.core  # noqa: F401  (megatron.core.jit binds jit_fuser = torch.compile here)
    finally:
        torch.compile = original


def apply_cpu_shims() -> None:
    """Patch torch.cuda and megatron-core so that MoELayer runs on CPU tensors (see module doc).

    Call it before building any Megatron module; it imports megatron.core."""
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() is for CPU-only processes; this one sees a CUDA device")
    if not _APPLIED["cpu"]:
        _import_megatron_without_compile()
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.Stream = torch.cuda.Event = _NoStream
        torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
        torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()

        from megatron.core.transformer.moe import moe_utils, token_dispatcher

        original = moe_utils.maybe_move_tensor_to_cpu

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
                return tensor.numpy()
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
        _APPLIED["cpu"] = True
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    disable_te_router_gemm()


def disable_te_router_gemm() -> None:
    """Let megatron-core 0.16.1 run an fp32 router without TransformerEngine (it raises NameError
    on te_general_gemm otherwise): its router then uses the plain torch GEMM."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm") or moe_utils.te_general_gemm is None:
        moe_utils.te_general_gemm = None
