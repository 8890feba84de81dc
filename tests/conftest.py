"""Shared test set-up. Without CUDA, Triton kernels run under the interpreter; the variable must be
set before any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _slow_files_first(items: list) -> None:
    """Files with a test marked ``slow`` first, then the rest by their number of tests (stable).

    Why: ``pytest -n 2 --dist loadfile --no-loadscope-reorder`` (scripts/test.sh) hands whole
    files to the two workers in this order. A two-minute file handed out last leaves one worker
    idle while the other finishes it; handed out first, the short files fill in beside it."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    tests_per_file: dict = {}
    for item in items:
        tests_per_file[item.path] = tests_per_file.get(item.path, 0) + 1
    items.sort(key=lambda item: (item.path not in slow_files, -tests_per_file[item.path]))
