"""Launch settings shared by every Triton kernel family (permutation, quantisation).

Each family adds its own entries to ``LAUNCH`` when it is imported; ``launch_settings`` overrides
any of them for a ``with`` block. None of them changes a value.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

# Filled by the family modules (slot_rows.py, quantize.py) with their settings and defaults.
LAUNCH: dict = {}


@contextlib.contextmanager
def launch_settings(**settings) -> Iterator[None]:
    """Overrides ``LAUNCH`` entries inside the ``with`` block and restores all of ``LAUNCH`` on exit
    (also when the block raises), so benchmarks and sweeps cannot leak a setting into what follows.
    A name that is not a launch setting raises KeyError before anything changes."""
    unknown = sorted(set(settings) - set(LAUNCH))
    if unknown:
        raise KeyError(f"launch_settings: {unknown} are not launch settings; expected names from {sorted(LAUNCH)}")
    saved = dict(LAUNCH)
    LAUNCH.update(settings)
    try:
        yield
    finally:
        LAUNCH.clear()
        LAUNCH.update(saved)


def launch_opts() -> dict:
    """Compiler options of every launch: no FMA contraction, so ``acc + p * y`` rounds as the twin's."""
    return {"enable_fp_fusion": False}
