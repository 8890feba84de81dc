"""Size flags of `moe-dispatch check` against the memory of this machine, before anything allocates.

A lower bound of what one rank holds at once (the check's token tensors, the experts at EP 1 with
their gradients, one layer's expert activations); an absurd size is refused with the flag that
makes it absurd, instead of an allocator error in every rank's traceback.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

SIZE_FLAGS = ("tokens", "hidden", "ffn", "experts", "topk")  # the flags the bound grows with
_PROCESS_BYTES = 256 * 2**20  # a spawned rank with torch loaded, before it allocates anything


def memory_per_rank(backend: str, world: int) -> int:
    """Bytes one rank may use: the GPU's memory on nccl, else this host's RAM shared by the ranks
    started on it (LOCAL_WORLD_SIZE under torchrun)."""
    if backend == "nccl":
        return torch.cuda.get_device_properties(0).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)


def size_problem(args: argparse.Namespace, defaults: dict[str, int], world: int, act_bytes: int,
                 budget: int) -> Optional[str]:
    """None, or an argparse-style message (``argument --flag: ...``) if one rank needs more than
    ``budget`` bytes. ``act_bytes``: bytes per element of the activation dtype. ``defaults``: the
    parser's default of each of SIZE_FLAGS; the flag furthest above its default is the one named."""
    values = {f"--{name}": getattr(args, name) for name in SIZE_FLAGS}
    base = {f"--{name}": defaults[name] for name in SIZE_FLAGS}
    if budget < 2 * _PROCESS_BYTES:  # too many ranks for this host before any tensor
        return (f"argument --ranks: {world} ranks get {budget / 2**20:.3g} MiB each of this machine's memory, "
                f"too little to start one (a rank needs about {_PROCESS_BYTES // 2**20} MiB); lower --ranks")
    tokens, hidden, ffn = args.tokens, args.hidden, args.ffn
    terms = {  # bytes of one rank (fp32 weights and gradients), and the flags they grow with
        "the token tensors [T, H]": (3 * tokens * hidden * act_bytes, ("--tokens", "--hidden")),
        "the experts' weights and gradients at EP 1": (
            2 * 4 * args.experts * hidden * 2 * ffn, ("--experts", "--hidden", "--ffn")),
        "the expert activations [T * topk, H + ffn]": (
            act_bytes * tokens * args.topk * (hidden + ffn), ("--tokens", "--topk", "--hidden", "--ffn")),
    }
    need = _PROCESS_BYTES + sum(b for b, _ in terms.values())
    if need <= budget:
        return None
    what, (_, flags) = max(terms.items(), key=lambda item: item[1][0])
    flag = max(flags, key=lambda f: values[f] / base[f])
    sizes = ", ".join(f"{f} {values[f]}" for f in flags)
    return (f"argument {flag}: the check needs at least {need / 2**30:.3g} GiB per rank ({what}, {sizes}), "
            f"more than the {budget / 2**30:.3g} GiB each of its {world} ranks can have here; lower {flag}")
