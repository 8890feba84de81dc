"""Where the unpermute passes' time goes over their byte floors, by differences. Backward: the
shipped pass (two launches), each of its launches alone, and the same traffic without the
probability gradient's dot products. Forward: the shipped pass with and without probs, and the
permute backward (the same rows summed, no probs).

Run on a CUDA machine:  python scripts/measure/unpermute.py [--shapes T,E,H,K ...]

Every row is a CUDA-graph replay median (GPU time only) over the pass's floor: (T*H read + N*H
read + N*H written) * 2 bytes + the probs and their gradient (T*E*4 each), at the copy bandwidth
of torch's device-to-device copy measured in the same run.
- "rows kernel alone": `_unpermute_bwd_kernel` (rows' gradient and the per-chunk dots);
- "probs-gradient kernel alone": `_probs_grad_kernel` (sums the dots, writes dense [T, E] rows), at
  1, 2 and 4 warps (LAUNCH["probs_grad_warps"]);
- "same traffic, no dots": a kernel that loads g and each routed row and stores g*p + y into the
  rows' gradient (the rows kernel's loads and stores, without the reductions and their stores);
- "copy of the same bytes": torch's copy moving the pass's bytes (half read, half written).
The forward's floor is (N*H read + T*H written) * 2 bytes + the probs (T*E*4).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from moe_dispatch.ops import guard, kernels, permute
from moe_dispatch.ops.kernels import unpermute as KT
from moe_dispatch.ops.kernels.slot_rows import _num_warps
from moe_dispatch.ops.torch_twin import block_h
from moe_dispatch.tools.benchmarks import copy_bandwidth, routing
from moe_dispatch.tools.profiling import graph_median_ms

SHAPES = [(8192, 16, 2048, 4), (16384, 128, 4096, 6), (4096, 256, 7168, 8), (32768, 64, 4096, 8)]


@triton.jit
def _same_traffic_kernel(grad_ptr, rows_ptr, slots_ptr, probs_ptr, out_ptr, H, E,
                         BLOCK_H: tl.constexpr, SLOTS_PER_STEP: tl.constexpr):
    """Program (t, H-chunk c): out[row_j, chunk c] = g[t, chunk c] * p_j + y[row_j, chunk c]."""
    pid = tl.program_id(0).to(tl.int64)
    n_chunks = tl.cdiv(H, BLOCK_H)
    t = pid // n_chunks
    offs_h = (pid % n_chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    slot_row = slots_ptr + t * (2 * E + 1)
    n = tl.load(slot_row)
    g = tl.load(grad_ptr + t * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    for j0 in range(0, n, SLOTS_PER_STEP):
        for step in tl.static_range(SLOTS_PER_STEP):
            j = j0 + step
            live = j < n
            row = tl.load(slot_row + 1 + j, mask=live, other=0).to(tl.int64)
            e = tl.load(slot_row + 1 + E + j, mask=live, other=0)
            p = tl.load(probs_ptr + t * E + e, mask=live, other=0.0)
            y = tl.load(rows_ptr + row * H + offs_h, mask=mask_h & live, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + offs_h, (g * p + y).to(out_ptr.dtype.element_ty), mask=mask_h & live)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None, help="T,E,H,K tuples")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"slots per step {kernels.LAUNCH['unpermute_bwd_slots_per_step']}, "
          f"probs-gradient warps {kernels.LAUNCH['probs_grad_warps']}")
    print("| T,E,H,K | what | ms | / floor |")
    print("|---|---|---|---|")
    for T, E, H, K in shapes:
        dt = torch.bfloat16
        tokens = torch.randn((T, H), device="cuda", dtype=dt)
        routing_map, probs = routing(T, E, K)
        slots = permute(tokens, routing_map, probs)[2].slots
        N = T * K
        y = torch.randn((N, H), device="cuda", dtype=dt)
        g = torch.randn((T, H), device="cuda", dtype=dt)
        nbytes = (T * H + 2 * N * H) * 2 + 2 * T * E * 4
        floor = nbytes / bw * 1e3
        bh = block_h(H)
        chunks = triton.cdiv(H, bh)
        grad_rows = torch.empty((N, H), device="cuda", dtype=dt)
        grad_probs = torch.empty((T, E), device="cuda", dtype=torch.float32)
        partial = torch.empty((T, K, chunks), device="cuda", dtype=torch.float32)
        status = guard.status(y.device)
        per_step = kernels.LAUNCH["unpermute_bwd_slots_per_step"]

        def rows_kernel():
            KT._unpermute_bwd_kernel[(T * chunks,)](
                g, y, slots, probs, grad_rows, partial, status, T, H, E, N, K, chunks, g.stride(0), g.stride(1),
                y.stride(0), y.stride(1), probs.stride(0), probs.stride(1), HAS_PROBS=True, ACC_FP64=False,
                BLOCK_H=bh, TOKEN_MAJOR=False, SLOTS_PER_STEP=per_step, num_warps=_num_warps(bh),
                enable_fp_fusion=False)

        def probs_kernel(warps):
            KT._probs_grad_kernel[(T,)](partial, slots, grad_probs, status, E, K, chunks,
                                        BLOCK_J=triton.next_power_of_2(K), BLOCK_E=min(256, triton.next_power_of_2(E)),
                                        num_warps=warps, enable_fp_fusion=False)

        def same_traffic():
            _same_traffic_kernel[(T * chunks,)](g, y, slots, probs, grad_rows, H, E, BLOCK_H=bh,
                                                SLOTS_PER_STEP=per_step, num_warps=_num_warps(bh))

        half = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        half_dst = torch.empty_like(half)
        cases = [("shipped (both launches)", lambda: KT.unpermute_rows_backward(g, y, slots, probs, False, K)),
                 ("rows kernel alone", rows_kernel)]
        cases += [(f"probs-gradient kernel alone, {w} warps", lambda w=w: probs_kernel(w)) for w in (1, 2, 4)]
        cases += [("same traffic, no dots", same_traffic), ("copy of the same bytes", lambda: half_dst.copy_(half))]
        for i, (name, fn) in enumerate(cases):
            ms = graph_median_ms(fn)
            print(f"| {f'{T},{E},{H},{K}' if i == 0 else ''} | {name} | {ms:.4f} | {ms / floor:.3f}x |", flush=True)
        fwd_bytes = (N * H + T * H) * 2 + T * E * 4
        fwd_floor = fwd_bytes / bw * 1e3
        half = torch.empty(fwd_bytes // 2, dtype=torch.uint8, device="cuda")
        half_dst = torch.empty_like(half)
        forward = [("forward, shipped (probs)", lambda: KT.unpermute_rows(y, slots, probs)),
                   ("forward without probs", lambda: KT.unpermute_rows(y, slots, None)),
                   ("permute backward (the same rows summed)",
                    lambda: kernels.permute_rows_backward(y, slots, None, torch.float32)),
                   ("copy of the forward's bytes", lambda: half_dst.copy_(half))]
        for name, fn in forward:
            ms = graph_median_ms(fn)
            print(f"| | {name} | {ms:.4f} | {ms / fwd_floor:.3f}x |", flush=True)
        half = half_dst = None  # free the buffers (the lambdas above already ran)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
