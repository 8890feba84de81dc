"""The Triton kernel of ``bits_fingerprint``, beside its launcher; its torch twin is fingerprint.py.

One pass over the tensor: each program takes whole chunks (chunk c, c + P, c + 2P, ... of the
definition's chunks of CHUNK 16-bit words), reads each element once, splits it into its words
(an element of 4 or 8 bytes into 2 or 4 words, low word first, as the twin's int16 view of the
little-endian bytes; a 1-byte element is one word 0..255), and forms the chunk's exact sum
S_c = sum_j u_j * w_j (int32 products, int64 lanes). The chunk's terms (S_c mod p) * b_k^(c+1)
mod p are added into the program's two int64 partials; the launcher adds the P partials and takes
them mod p. Every step is exact integer arithmetic (no sum leaves int64: a program's partial is
below (chunks + 1) * p), so the result is the twin's to the bit whatever P or the block size.

Bounds: the only masked access is the element load (index < numel); the position weights are read
at j < CHUNK and the chunk table at c < chunks, both in bounds by construction. Offsets are int64.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fingerprint import CHUNK, PRIME, chunk_weights, position_weights

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BLOCK = 4096  # elements per load step (a launch setting: no value depends on it)
PROGRAMS_PER_SM = 4  # programs per streaming multiprocessor on CUDA (a launch setting)
INTERPRETER_PROGRAMS = 4  # programs under TRITON_INTERPRET (each costs host time there)


@triton.jit
def _fingerprint_kernel(x_ptr, weights_ptr, table_ptr, partial_ptr, numel, chunks, size1, size2, stride0,
                        stride1, stride2, WORDS: tl.constexpr, ELEMENT_BITS: tl.constexpr,
                        CONTIGUOUS: tl.constexpr, CHUNK_ELEMENTS: tl.constexpr, BLOCK: tl.constexpr,
                        PRIME: tl.constexpr):
    """Program pid: partial[pid, k] = sum over its chunks c of (S_c mod p) * table[c, k] mod p.
    x is read as integers of its element size; [size0, size1, size2] with strides (elements) when
    not CONTIGUOUS, the element order being the tensor's logical (row-major) order."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    hash0 = tl.zeros([], tl.int64)
    hash1 = tl.zeros([], tl.int64)
    for c32 in range(pid, chunks, programs):
        c = c32 + tl.zeros([], tl.int64)  # int64 (a plain int under the interpreter)
        first = c * CHUNK_ELEMENTS
        acc = tl.zeros([BLOCK], tl.int64)
        for start in range(0, CHUNK_ELEMENTS, BLOCK):
            local = start + tl.arange(0, BLOCK)  # element within the chunk
            index = first + local
            mask = index < numel
            if CONTIGUOUS:
                offset = index
            else:
                i2 = index % size2
                rest = index // size2
                offset = (rest // size1) * stride0 + (rest % size1) * stride1 + i2 * stride2
            x = tl.load(x_ptr + offset, mask=mask, other=0)
            for k in tl.static_range(WORDS):
                if ELEMENT_BITS == 8:
                    word = x.to(tl.int32)  # a byte is a word 0..255
                else:
                    # word k, sign-extended: shift it to the top, then arithmetically back down
                    word = ((x << (ELEMENT_BITS - 16 - 16 * k)) >> (ELEMENT_BITS - 16)).to(tl.int32)
                weight = tl.load(weights_ptr + local * WORDS + k)  # w_j, j < CHUNK: in bounds
                acc += (word * weight).to(tl.int64)  # |u * w| <= 2^31: exact in int32
        total = tl.sum(acc, axis=0)  # S_c, exact: |S_c| < 2^15 * 2^31
        residue = total % PRIME
        residue = tl.where(residue < 0, residue + PRIME, residue)  # the non-negative residue
        hash0 += residue * tl.load(table_ptr + 2 * c) % PRIME  # < 2^62 before the mod
        hash1 += residue * tl.load(table_ptr + 2 * c + 1) % PRIME
    tl.store(partial_ptr + 2 * pid, hash0)
    tl.store(partial_ptr + 2 * pid + 1, hash1)


def _programs(chunks: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(chunks, sms * PROGRAMS_PER_SM))
    return max(1, min(chunks, INTERPRETER_PROGRAMS))


def bits_fingerprint(t: torch.Tensor, programs: Optional[int] = None, block: int = BLOCK) -> torch.Tensor:
    """int64 [2] on t's device: fingerprint.bits_fingerprint's value, reading t once (any strides
    up to 3-D; a non-contiguous t of more dimensions is copied first). ``programs`` and ``block``
    (a power of two dividing the chunk's elements) are launch settings: no value depends on them."""
    size = t.element_size()
    if size not in _INT_OF_SIZE:
        raise TypeError(f"bits_fingerprint: t's elements must take 1, 2, 4 or 8 bytes, got {t.dtype}")
    t = t.detach()
    if not t.is_contiguous() and t.dim() > 3:
        t = t.contiguous()
    numel = t.numel()
    if numel == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    words = max(1, size // 2)
    chunk_elements = CHUNK // words
    if block < 1 or block & (block - 1) or chunk_elements % block:
        raise ValueError(f"bits_fingerprint: block must be a power of two dividing {chunk_elements}, got {block}")
    chunks = -(-numel // chunk_elements)
    grid = programs if programs is not None else _programs(chunks, t.device)
    if grid < 1:
        raise ValueError(f"bits_fingerprint: programs must be at least 1, got {grid}")
    x = t.view(_INT_OF_SIZE[size])  # same element size: a view, whatever the strides
    contiguous = x.is_contiguous()
    if contiguous:
        x = x.view(-1)
        sizes, strides = (1, 1), (0, 0, 0)
    else:
        shape = (1,) * (3 - x.dim()) + tuple(x.shape)
        stride = (0,) * (3 - x.dim()) + tuple(x.stride())
        sizes, strides = shape[1:], stride
    partial = torch.empty((grid, 2), dtype=torch.int64, device=t.device)
    _fingerprint_kernel[(grid,)](x, position_weights(t.device), chunk_weights(chunks, t.device), partial, numel,
                                 chunks, *sizes, *strides, WORDS=words, ELEMENT_BITS=8 * size,
                                 CONTIGUOUS=contiguous, CHUNK_ELEMENTS=chunk_elements, BLOCK=block, PRIME=PRIME,
                                 num_warps=8)
    return partial.sum(0).remainder(PRIME)
