"""Shared test set-up. Without CUDA, Triton kernels run under the interpreter; the variable must be
set before any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _patch_triton_interpreter_once_per_launch() -> None:
    """Under TRITON_INTERPRET=1, Triton 3.x patches triton.language again (inspect.getmembers over
    the module, tl.tensor and tl.math) at every call of a @triton.jit function from inside a
    kernel (tl.sum and our helpers among them), once per program instance: about half of
    tests/ops/test_permutation.py's time. Those nested patches are never undone and bind the same
    builder, so within one launch a repeat for the same modules changes nothing; this skips the
    repeats. The first of each, and the launch's own patch and its restore, are Triton's. A
    repeat wrongly skipped would fail loudly (an unpatched builtin raises in the kernel)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    executor = getattr(interpreter, "GridExecutor", None)
    original = getattr(interpreter, "_patch_lang", None)
    if executor is None or original is None or getattr(original, "_once_per_launch", False):
        return
    launches: list = []  # per launch in progress: the module sets patched in it

    class _Repeat:
        def restore(self) -> None:  # a device call never restores its patch; nothing to undo
            pass

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core}
        if launches and any(langs <= done for done in launches[-1]):
            return _Repeat()
        scope = original(fn)
        if launches:
            launches[-1].append(langs)
        return scope

    run = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append([])
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang._once_per_launch = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
