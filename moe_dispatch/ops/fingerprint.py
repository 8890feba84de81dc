"""A fingerprint of a tensor's bits, computed on its device without a host read.

``bits_fingerprint(t)`` -> int64 [2]: two hashes, each in [0, 2^31 - 1), of t's bytes read as
16-bit words u_i (signed; a 1-byte dtype's bytes as 0..255). Integer arithmetic only, every sum
exact or taken modulo a prime, so the result depends on nothing but the bits (not on a BLAS, a
reduction order or the device):

- words are cut into chunks of L = 2^15; chunk c's sum is S_c = sum_j u_{cL+j} * w_j, with
  w_j = mix(j) + 1 for a bijection ``mix`` of the 16-bit integers: the weights are distinct and in
  [1, 2^16], so |u * w| < 2^31 (an int32 product) and S_c is exact in int64;
- hash k is sum_c (S_c mod p) * b_k^(c+1) mod p, p = 2^31 - 1 prime, b_k a primitive root.

What it catches: any change of a single word, and any swap of two words within a chunk, changes
both hashes with certainty (each difference is a nonzero multiple of numbers below p, p prime).
Any other change leaves a hash as it was only if the change satisfies a modular equation of the
positions, about 2^-31 for each hash for changes unrelated to the positions, about 2^-62 for both.
It is not a cryptographic hash: it guards against accidents, not an adversary.

This module is the torch twin: the definition in torch ops, run on CPU. On CUDA the Triton
kernel (kernels/fingerprint.py) computes the same value, bitwise, reading t once (2 bytes per
16-bit word, the floor). Callers use ``moe_dispatch.ops.bits_fingerprint`` (custom_ops.py), which
picks between the two as the other ops do. The twin's cost: t is read once; the product runs in
blocks of at most 2^24 words into an int32 temporary (64 MB), written and read once: about
2 + 4 + 4 = 10 bytes of memory traffic per 16-bit word. The per-chunk tail works on n / 2^15
values. Both are capture-safe (no host read, no host-to-device copy) once the tables of a size
exist.
"""
from __future__ import annotations

import functools

import torch

CHUNK = 1 << 15  # 16-bit words per chunk: S_c stays exact in int64 (< 2^15 * 2^31)
PRIME = (1 << 31) - 1
BASES = (16807, 48271)  # primitive roots modulo 2^31 - 1
_BLOCK_WORDS = 1 << 24  # words per int32 temporary (64 MB)


@functools.lru_cache(maxsize=8)
def position_weights(device: torch.device) -> torch.Tensor:
    """w_j = mix(j) + 1 for j < CHUNK: int32 [CHUNK], distinct, in [1, 2^16]. ``mix`` is a
    bijection of [0, 2^16) (multiplications by odd numbers and xor-shifts, modulo 2^16), so the
    weights are not linear in j: a change whose moments vanish (+1, -2, +1) still shows."""
    h = torch.arange(CHUNK, dtype=torch.int64, device=device)
    h = (h * 0x9E37) & 0xFFFF
    h = h ^ (h >> 7)
    h = (h * 0x5BD1) & 0xFFFF
    h = h ^ (h >> 9)
    return (h + 1).to(torch.int32)


@functools.lru_cache(maxsize=16)
def chunk_weights(chunks: int, device: torch.device) -> torch.Tensor:
    """int64 [chunks, 2]: b_k^(c+1) mod p for each chunk c and base b_k (never 0 mod p)."""
    exponent = torch.arange(1, chunks + 1, dtype=torch.int64, device=device)
    out = []
    for base in BASES:
        result = torch.ones(chunks, dtype=torch.int64, device=device)
        power = base
        for bit in range(max(chunks, 1).bit_length()):
            take = ((exponent >> bit) & 1).bool()
            result = torch.where(take, result * power % PRIME, result)  # < 2^62: exact
            power = power * power % PRIME
        out.append(result)
    return torch.stack(out, dim=1)


def words_of(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a 1-D tensor of words: int16 for element sizes >= 2, uint8 for 1 (a view of
    a contiguous t; a non-contiguous t is copied first)."""
    flat = t.detach().contiguous().view(-1)
    return flat.view(torch.int16 if flat.element_size() >= 2 else torch.uint8)


def chunk_sums(words: torch.Tensor) -> torch.Tensor:
    """S_c = sum_j words[c * CHUNK + j] * w_j for each chunk c (the last may be short): int64 [C]."""
    n = words.numel()
    full = n // CHUNK
    sums = torch.empty(-(-n // CHUNK), dtype=torch.int64, device=words.device)
    weights = position_weights(words.device)
    step = max(1, _BLOCK_WORDS // CHUNK)
    for start in range(0, full, step):
        stop = min(full, start + step)
        block = words[start * CHUNK:stop * CHUNK].view(stop - start, CHUNK)
        torch.sum(block * weights, dim=1, dtype=torch.int64, out=sums[start:stop])  # int32 products
    if n > full * CHUNK:
        tail = words[full * CHUNK:]
        sums[full:] = (tail * weights[:tail.numel()]).sum(dtype=torch.int64)
    return sums


def bits_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] on t's device: the two hashes of t's bits (module docstring). Equal tensors
    (bitwise, same dtype and element count) give equal fingerprints on any device."""
    sums = chunk_sums(words_of(t))
    table = chunk_weights(sums.numel(), sums.device)
    return (sums.remainder(PRIME)[:, None] * table).remainder(PRIME).sum(0).remainder(PRIME)
