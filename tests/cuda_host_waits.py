"""Count the dispatcher's own host reads and table uploads while a block runs
(``count_host_transfers``: anywhere, the CPU stand-in for ``moe_dispatch.profiling.host_waits``)."""
from __future__ import annotations

import contextlib
from typing import Iterator


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
