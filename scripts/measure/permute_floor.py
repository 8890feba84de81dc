"""Why permute's row copy sits above its byte floor: the same kernel with its destinations or its
source changed, beside the GPU's write-only, read-only and copy bandwidths.

Run on a CUDA machine:  python scripts/measure/permute_floor.py [--shapes T,E,H,K ...]

Every row is a CUDA-graph replay median (GPU time only) of one Triton kernel that writes each
token's row to K destination rows, over permute's floor: (T*H read + T*K*H written) * 2 bytes
at the copy bandwidth of torch's device-to-device copy measured in the same run.
- "expert-major": permute's real destinations (rows grouped by expert, from make_slots);
- "token-major": row t*K + j, so the writes stream sequentially (the best case for DRAM);
- "zeros": the same stores with no token read (the write traffic alone).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from moe_dispatch.ops import kernels as KT
from moe_dispatch.tools.benchmarks import copy_bandwidth, routing
from moe_dispatch.tools.profiling import graph_median_ms

SHAPES = [(4096, 256, 7168, 8), (16384, 128, 4096, 6), (32768, 64, 4096, 8)]


@triton.jit
def _broadcast_rows_kernel(tokens_ptr, rows_ptr, out_ptr, H, K: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_H: tl.constexpr, READ: tl.constexpr, STORE_CM: tl.constexpr):
    """Program (t, H-chunk c): out[rows[t, j], chunk c] = tokens[t, chunk c] (or 0) for j < K."""
    pid = tl.program_id(0).to(tl.int64)
    n_chunks = tl.cdiv(H, BLOCK_H)
    t = pid // n_chunks
    offs_h = (pid % n_chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    if READ:
        x = tl.load(tokens_ptr + t * H + offs_h, mask=mask_h)
    else:
        x = tl.zeros([BLOCK_H], tokens_ptr.dtype.element_ty)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    rows = tl.load(rows_ptr + t * K + offs_k, mask=mask_k, other=0).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * H + offs_h[None, :], tl.broadcast_to(x[None, :], (BLOCK_K, BLOCK_H)),
             mask=mask_k[:, None] & mask_h[None, :], cache_modifier=STORE_CM)


@triton.jit
def _fill_kernel(out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.zeros([BLOCK], out_ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def _read_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < numel, other=0.0), axis=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None, help="T,E,H,K tuples")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    bw = copy_bandwidth()
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    block = 4096
    grid = (triton.cdiv(x.numel(), block),)
    sums = torch.empty(grid[0], dtype=torch.float32, device="cuda")
    fill_ms = graph_median_ms(lambda: _fill_kernel[grid](x, x.numel(), BLOCK=block, num_warps=8))
    read_ms = graph_median_ms(lambda: _read_kernel[grid](x, sums, x.numel(), BLOCK=block, num_warps=8))
    nbytes = x.numel() * 2
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}")
    print(f"# copy (torch, read + write) {bw / 1e12:.2f} TB/s; write-only (Triton fill) "
          f"{nbytes / fill_ms / 1e9:.2f} TB/s; read-only (Triton sum) {nbytes / read_ms / 1e9:.2f} TB/s")
    x = sums = None  # free the buffers (the lambdas above already ran)
    print("| T,E,H,K | destinations | source | stores | ms | / floor |")
    print("|---|---|---|---|---|---|")
    for T, E, H, K in shapes:
        tokens = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
        routing_map, _ = routing(T, E, K)
        slots, _ = KT.make_slots(routing_map, 1)
        N = T * K
        floor = (T * H + N * H) * 2 / bw * 1e3
        out = torch.empty((N, H), device="cuda", dtype=torch.bfloat16)
        expert_major = slots[:, 1:1 + K].contiguous()  # every token has K experts here
        token_major = torch.arange(N, device="cuda", dtype=torch.int32).view(T, K)
        cases = [("expert-major", expert_major, True, ""), ("expert-major", expert_major, True, ".cs"),
                 ("token-major", token_major, True, ".cs"), ("expert-major", expert_major, False, ".cs"),
                 ("token-major", token_major, False, ".cs")]
        shipped = graph_median_ms(lambda: KT.permute_rows(tokens, slots, None, N, False))
        print(f"| {T},{E},{H},{K} | permute_rows as shipped | tokens | "
              f"{KT.LAUNCH['permute_store_cache'] or 'write-back'} | {shipped:.4f} | {shipped / floor:.3f}x |")
        for name, rows, read, cache in cases:
            def run(rows=rows, read=read, cache=cache):
                _broadcast_rows_kernel[(T * triton.cdiv(H, 1024),)](
                    tokens, rows, out, H, K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_H=1024, READ=read,
                    STORE_CM=cache, num_warps=4)
            ms = graph_median_ms(run)
            print(f"| | {name} | {'tokens' if read else 'zeros'} | {cache or 'write-back'} | {ms:.4f} | "
                  f"{ms / floor:.3f}x |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
