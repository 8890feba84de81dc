"""Test-only: run megatron-core's MoELayer (0.16.1 through 0.19.2) on CPU / gloo.

The one copy of these shims, for the test suite's spawned ranks and its launchers of the scripts'
CPU runs (tests/integrations/train_moe_gpt_cpu.py, tests/bench_ep_cpu.py). Not part of the moe_dispatch package:
they patch torch.cuda process-wide, so a process that calls :func:`apply_cpu_shims` must never use
a GPU (it raises where CUDA is visible).

Megatron's MoE code asks for CUDA devices, streams and events even when every tensor is on the
CPU. :func:`apply_cpu_shims` patches exactly those calls (all idempotent):

- ``torch.cuda.current_device()`` returns ``"cpu"`` (the router and the experts place tensors on it);
- ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``stream()`` become no-ops (Megatron's
  alltoall dispatcher copies split sizes on a side stream);
- ``moe_utils.maybe_move_tensor_to_cpu`` (also imported into ``token_dispatcher``) returns numpy
  arrays for CPU split sizes too, as it already does for CUDA tensors;
- then ``moe_dispatch.integrations.megatron.build.prepare_megatron`` (Megatron's global memory
  buffer, the TE-less fp32 router);
- if megatron.core is not imported yet, it is imported with ``torch.compile`` replaced by a no-op
  decorator, so Megatron's ``jit_fuser`` functions run eagerly: this skips importing torch's
  compiler stack (about 4 s of CPU per process) and compiling C++ kernels on the first call.

:func:`apply_cpu_rng` (for whole models: dropout and initialisation under Megatron's CUDA RNG
tracker) maps the CUDA RNG state calls onto the CPU generator; the MoE layer alone needs none of it
with ``use_cpu_initialization=True``.
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


def apply_cpu_shims(prepare: bool = True) -> None:
    """Patch torch.cuda and megatron-core so that MoELayer runs on CPU tensors (see module doc).

    Call it before building any Megatron module; it imports megatron.core. ``prepare=False`` skips
    ``prepare_megatron`` (call it after ``initialize_model_parallel``, which allocates Megatron's
    global memory buffer itself and refuses one that exists)."""
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
    if prepare:
        from moe_dispatch.integrations.megatron.build import prepare_megatron

        prepare_megatron(torch.device("cpu"))


def apply_cpu_rng() -> None:
    """Map the CUDA RNG state calls of Megatron's RNG tracker onto the CPU generator, so that
    ``model_parallel_cuda_manual_seed`` and dropout under ``get_cuda_rng_tracker().fork()`` run on a
    CPU process. Call after :func:`apply_cpu_shims`."""
    if not _APPLIED["cpu"]:
        raise RuntimeError("apply_cpu_rng() needs apply_cpu_shims() first")
    if _APPLIED.get("rng"):
        return
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    _APPLIED["rng"] = True


def apply_typing_override() -> None:
    """Give Python 3.11's ``typing`` the ``override`` decorator of 3.12 (``typing_extensions``'), which
    Megatron-LM's training package (core_v0.19.0 and later) imports, so that its source tree imports
    in the test suite's 3.11 venv. A no-op on 3.12+."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
