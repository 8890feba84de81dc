"""Sweep the launch knobs of the permute / unpermute kernels on a CUDA machine (bf16).

    python scripts/tune_ops.py [--shapes T,E,H,K ...]

Knobs (none changes a value: tests/ops/test_permutation.py::test_launch_tuning_changes_no_value):
program order (token-major or chunk-major), warps, rows per 2-D store and the cache hint of the
row stores (write-back or streaming) in the permute kernel, the slots per unrolled step of the
summing kernels, the H-block of the kernels whose sums run per element, and with --passes map,
make_slots' chunks, tokens per tile and warps; with --passes routes, the alternative route of
LAUNCH (the unpermute backward per token). One knob that does change a value is swept beside
them: the unpermute backward's block, which sets the probs gradient's chunks (default
block_h(H)). Prints
CUDA-graph replay medians (do_bench_cudagraph, GPU time only) over each pass's byte floor, and the
best setting per pass and shape. The defaults of moe_dispatch.ops.kernels.LAUNCH come from here.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton

from moe_dispatch.ops import kernels as KT
from moe_dispatch.ops import permute
from moe_dispatch.tools.benchmarks import copy_bandwidth, routing
from moe_dispatch.tools.profiling import graph_median_ms

SHAPES = [(4096, 256, 7168, 8), (16384, 128, 4096, 6), (32768, 64, 4096, 8)]


def sweep_shape(T: int, E: int, H: int, K: int, bw: float, only: list[str]) -> None:
    dt, b = torch.bfloat16, 2
    tokens = torch.randn((T, H), device="cuda", dtype=dt)
    routing_map, probs = routing(T, E, K)
    _, _, rmap = permute(tokens, routing_map, probs)
    slots, N = rmap.slots, rmap.num_out_tokens
    y = torch.randn((N, H), device="cuda", dtype=dt)
    g_out = torch.randn((T, H), device="cuda", dtype=dt)
    g_perm = torch.randn((N, H), device="cuda", dtype=dt)
    passes = {
        "permute rows": ((T * H + N * H) * b + T * E * 4 + N * 4,
                         lambda blk: (lambda: KT.permute_rows(tokens, slots, probs, N, False, blk)), True),
        "unpermute fwd, probs": ((N * H + T * H) * b + T * E * 4,
                                 lambda blk: (lambda: KT.unpermute_rows(y, slots, probs, blk)), True),
        "permute bwd": ((N * H + T * H) * b,
                        lambda blk: (lambda: KT.permute_rows_backward(g_perm, slots, None, torch.float32, blk)),
                        True),
        "unpermute bwd, probs grad": ((T * H + 2 * N * H) * b + 2 * T * E * 4,
                                      lambda blk: (lambda: KT.unpermute_rows_backward(g_out, y, slots, probs,
                                                                                      False, K, blk)),
                                      False),
    }
    defaults = dict(KT.LAUNCH)
    for name, (nbytes, make, block_free) in passes.items():
        if only and name not in only:
            continue
        floor = nbytes / bw * 1e3
        results = []
        orders = [False, True]
        blocks = [1024, 2048, 4096] if block_free else [None]
        warp_counts = [4, 8, 16]
        stores, caches = [defaults["rows_per_store"]], [defaults["permute_store_cache"]]
        per_steps = [defaults["slots_per_step"]]
        if name == "permute rows":  # two more knobs: keep the grid small
            blocks, warp_counts, stores, caches = [1024, 2048], [4, 8], [1, 4, 8], ["", ".cs"]
        elif block_free:  # the summing kernels: slots per step; chunk-major order (token-major lost every time)
            orders, blocks, warp_counts, per_steps = [False], [512, 1024, 2048], [4, 8], [1, 2, 4]
        else:  # the unpermute backward: its block sets the probs gradient's chunks (its rounding)
            orders, blocks, warp_counts, per_steps = [False], [None, 2048], [4, 8], [2, 4]
        knobs = itertools.product(orders, warp_counts, blocks, stores, caches, per_steps)
        slots_key = "unpermute_bwd_slots_per_step" if name.startswith("unpermute bwd") else "slots_per_step"
        for token_major, warps, blk, per_store, cache, per_step in knobs:
            try:
                with KT.launch_settings(token_major=token_major, warps=warps, rows_per_store=per_store,
                                        permute_store_cache=cache, **{slots_key: per_step}):
                    ms = graph_median_ms(make(blk))
            except Exception as exc:  # e.g. too many registers for a block/warps pair
                print(f"# {name} {token_major} {warps} {blk} {per_store} {per_step}: {type(exc).__name__}",
                      file=sys.stderr)
                continue
            results.append((ms / floor, ms, token_major, warps, blk, per_store, cache or "write-back", per_step))
        default = graph_median_ms(make(None))
        results.sort()
        best = results[0]
        print(f"| {T},{E},{H},{K} | {name} | {default / floor:.3f}x | {best[0]:.3f}x | "
              f"{'token' if best[2] else 'chunk'}-major, {best[3]} warps, block {best[4] or 'default'}, "
              f"{best[5]} rows per store, {best[6]} stores, {best[7]} slots per step | "
              + ", ".join(f"{r[0]:.3f} ({r[3]}w/{r[4] or '-'}/{r[7]}s)" for r in results[:5]) + " |", flush=True)


def sweep_map(T: int, E: int, K: int) -> None:
    """make_slots alone (no floor worth the name: ~T*E bytes): microseconds per launch setting."""
    routing_map, _ = routing(T, E, K)
    results = []
    for chunks, block_t, warps in itertools.product([64, 128, 256], [None, 16, 64], [None, 2, 8]):
        with KT.launch_settings(map_chunks=chunks, map_block_t=block_t, map_warps=warps):
            results.append((graph_median_ms(lambda: KT.make_slots(routing_map, 1)) * 1e3, chunks, block_t, warps))
    default = graph_median_ms(lambda: KT.make_slots(routing_map, 1)) * 1e3
    results.sort()
    best = results[0]
    print(f"| {T},{E},-,{K} | map (make_slots), us | {default:.1f} | {best[0]:.1f} | {best[1]} chunks, block_t "
          f"{best[2] or 'default'}, {best[3] or 'default'} warps | "
          + ", ".join(f"{r[0]:.1f} ({r[1]}/{r[2]}/{r[3]})" for r in results[:5]) + " |", flush=True)


def sweep_routes(T: int, E: int, H: int, K: int, bw: float) -> None:
    """The alternative route (a LAUNCH knob, same bits): the unpermute backward per token over
    warps, beside the default route, over the floor."""
    dt, b = torch.bfloat16, 2
    tokens = torch.randn((T, H), device="cuda", dtype=dt)
    routing_map, probs = routing(T, E, K)
    _, _, rmap = permute(tokens, routing_map, probs)
    N = rmap.num_out_tokens
    y = torch.randn((N, H), device="cuda", dtype=dt)
    g_out = torch.randn((T, H), device="cuda", dtype=dt)
    routes = {
        "unpermute bwd, per-token route": (
            (T * H + 2 * N * H) * b + 2 * T * E * 4,
            lambda blk: (lambda: KT.unpermute_rows_backward(g_out, y, rmap.slots, probs, False, K, blk)),
            {"unpermute_bwd_per_token": [True]}, itertools.product([None, 8], [2, 4], [None, 2048]),
            ("warps", "unpermute_bwd_slots_per_step", "block")),
    }
    for name, (nbytes, make, route, grid, keys) in routes.items():
        floor = nbytes / bw * 1e3
        default = graph_median_ms(make(None))
        results = []
        for values in grid:
            *knobs, blk = values
            try:
                with KT.launch_settings(**{k: v[0] for k, v in route.items()}, **dict(zip(keys, knobs))):
                    results.append((graph_median_ms(make(blk)) / floor, values))
            except Exception as exc:  # e.g. too many registers for a block/warps pair
                print(f"# {name} {values}: {type(exc).__name__}", file=sys.stderr)
        results.sort()
        best = results[0]
        print(f"| {T},{E},{H},{K} | {name} | {default / floor:.3f}x (default route) | {best[0]:.3f}x | "
              + ", ".join(f"{k} {v}" for k, v in zip(keys, best[1])) + " | "
              + ", ".join(f"{r[0]:.3f} {r[1]}" for r in results[:5]) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None, help="T,E,H,K tuples")
    parser.add_argument("--passes", nargs="*", default=[], help="only these passes (e.g. 'permute rows', 'map')")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| T,E,H,K | pass | default / floor | best / floor | best setting | top 5 / floor |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        if not args.passes or "map" in args.passes:
            sweep_map(shape[0], shape[1], shape[3])
        if not args.passes or set(args.passes) - {"map", "routes"}:
            sweep_shape(*shape, bw, [p for p in args.passes if p not in ("map", "routes")])
        if not args.passes or "routes" in args.passes:
            sweep_routes(*shape, bw)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
