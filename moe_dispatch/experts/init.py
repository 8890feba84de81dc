"""Seeded expert weights: a global expert's weights depend only on (init_seed, expert id).

A layer of a model seeds with `layer_seed` (init_seed, layer index): layer 0 with init_seed
itself, so layers of one model differ and a one-layer model keeps the seed it was given.

Each (expert, weight) pair draws from its own CPU ``torch.Generator``, so building experts 2..3
alone (EP rank 1 of 2) gives bitwise the slices of a 4-expert build, on any device.
"""

from __future__ import annotations

from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1

WEIGHT1, WEIGHT2 = 1, 2  # the ``which`` tags of fc1 and fc2


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def expert_seed(init_seed: int, expert_id: int, which: int) -> int:
    """A 63-bit generator seed that mixes all three integers (a hash, not a sum: no collisions
    between e.g. (seed, expert 1) and (seed + 1, expert 0))."""
    h = _splitmix64(init_seed & _MASK64)
    h = _splitmix64(h ^ (expert_id & _MASK64))
    h = _splitmix64(h ^ (which & _MASK64))
    return h >> 1


def layer_seed(init_seed: int, layer_index: int) -> int:
    """The init seed of layer ``layer_index`` of a model seeded with ``init_seed``: init_seed
    itself for layer 0, else a 62-bit hash of both (below 2**62, so the router's and shared
    expert's small offsets stay inside a valid seed)."""
    if layer_index == 0:
        return init_seed
    h = _splitmix64(_splitmix64(init_seed & _MASK64) ^ (layer_index & _MASK64))
    return h >> 2


def init_expert_weights(
    shape: Sequence[int],
    init_seed: int,
    global_expert_ids: Sequence[int],
    which: int,
    std: float,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[len(global_expert_ids), *shape] normal(0, std) weights, drawn in float32 on the CPU.

    Drawing on the CPU and casting afterwards keeps the bits independent of device and dtype
    of the module (CUDA generators produce other numbers).
    """
    out = torch.empty(len(global_expert_ids), *shape, dtype=torch.float32)
    for i, expert_id in enumerate(global_expert_ids):
        gen = torch.Generator(device="cpu").manual_seed(expert_seed(init_seed, expert_id, which))
        out[i] = torch.randn(*shape, generator=gen, dtype=torch.float32) * std
    return out.to(device=device, dtype=dtype)
