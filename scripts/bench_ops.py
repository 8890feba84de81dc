"""Benchmark permute / unpermute (bf16) against the memory-bandwidth floor and Megatron-core.

Run on a CUDA machine:  python scripts/bench_ops.py [--shapes T,E,H,K ...] [--no-megatron]

Each pass is timed with triton.testing.do_bench (median). The floor of a pass is the bytes it
must move (every input read once, every output written once) over the device-to-device copy
bandwidth measured in the same run (bytes read plus written).
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from moe_dispatch.ops import permute, unpermute
from moe_dispatch.ops import permutation as P

DEFAULT_SHAPES = [(8192, 16, 2048, 4), (4096, 256, 7168, 8), (16384, 128, 4096, 6), (32768, 64, 4096, 8)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench_graph(fn) -> float:
    """GPU time alone: the call replayed from a CUDA graph, so host launch cost is excluded."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    except Exception:  # a call that synchronises cannot be captured
        return float("nan")


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting read plus write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def routing(T: int, E: int, K: int):
    scores = torch.rand((T, E), device="cuda")
    idx = scores.topk(K, dim=1).indices
    routing_map = torch.zeros((T, E), dtype=torch.bool, device="cuda").scatter_(1, idx, True)
    probs = torch.softmax(scores, dim=1) * routing_map
    return routing_map, probs


def megatron_fns():
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception as exc:  # megatron-core is optional here
        print(f"# megatron-core not importable ({exc}); skipping its columns", file=sys.stderr)
        return None
    return moe_utils


def run_shape(T: int, E: int, H: int, K: int, bw: float, moe_utils) -> list[tuple]:
    dt = torch.bfloat16
    tokens = torch.randn((T, H), device="cuda", dtype=dt)
    routing_map, probs = routing(T, E, K)
    N = T * K
    counts = routing_map.sum(0).tolist()
    y = torch.randn((N, H), device="cuda", dtype=dt)
    g_out = torch.randn((T, H), device="cuda", dtype=dt)
    g_perm = torch.randn((N, H), device="cuda", dtype=dt)
    _, _, rmap = permute(tokens, routing_map, probs)
    slots = rmap.slots
    b = 2  # bytes per bf16 element
    map_bytes = T * E * (1 + 4) + N * 4  # routing map, probs, permuted probs
    floors = {
        "permute (map + rows)": (T * H + N * H) * b + map_bytes,
        "unpermute fwd, probs": (N * H + T * H) * b + T * E * 4,
        "permute bwd": (N * H + T * H) * b,
        "unpermute bwd, probs grad": (T * H + 2 * N * H) * b + 2 * T * E * 4,
    }
    ours = {
        "permute (map + rows)": lambda: permute(tokens, routing_map, probs),
        "unpermute fwd, probs": lambda: unpermute(y, rmap, probs),
        "permute bwd": lambda: P._permute_bwd_op(g_perm, slots, None, torch.float32),
        "unpermute bwd, probs grad": lambda: P._unpermute_bwd_op(g_out, y, slots, probs, False, K),
    }
    from moe_dispatch.ops import triton_kernels as KT
    extra = {"permute, counts known (no sync)":
             (lambda: permute(tokens, routing_map, probs, tokens_per_expert=counts, max_experts_per_token=K),
              floors["permute (map + rows)"]),
             "map only (make_slots)": (lambda: KT.make_slots(routing_map, 1), T * E + T * (2 * E + 1) * 4),
             "rows only (permute kernel)": (lambda: KT.permute_rows(tokens, slots, probs, N, False),
                                            floors["permute (map + rows)"] - T * E)}
    for block, warps in [(2048, 8), (4096, 16)]:  # a copy: block size is free to tune
        if block <= triton.next_power_of_2(H):
            extra[f"rows only, block {block}/{warps} warps"] = (
                lambda block=block, warps=warps: KT.permute_rows(tokens, slots, probs, N, False, block, warps),
                floors["permute (map + rows)"] - T * E)
    theirs = {}
    if moe_utils is not None:
        def mg_permute():
            return moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=N)
        mg_out, mg_probs, sorted_idx = mg_permute()
        y_p = (y * 1).requires_grad_()
        probs_r = probs.clone().requires_grad_()

        def mg_unpermute():
            return moe_utils.unpermute(y_p, sorted_idx, tokens.shape, probs=probs_r, routing_map=routing_map)
        theirs["permute (map + rows)"] = mg_permute
        theirs["unpermute fwd, probs"] = mg_unpermute
        tok_r = tokens.clone().requires_grad_()
        mg_perm_out = moe_utils.permute(tok_r, routing_map, num_out_tokens=N)[0]
        theirs["permute bwd"] = lambda: torch.autograd.grad(mg_perm_out, tok_r, g_perm, retain_graph=True)
        mg_unp_out = mg_unpermute()
        theirs["unpermute bwd, probs grad"] = lambda: torch.autograd.grad(mg_unp_out, (y_p, probs_r), g_out,
                                                                          retain_graph=True)
    rows = []
    for name, fn in ours.items():
        ms, graph_ms = bench(fn), bench_graph(fn)
        floor_ms = floors[name] / bw * 1e3
        mg = bench(theirs[name]) if name in theirs else float("nan")
        rows.append((f"{T},{E},{H},{K}", name, ms, graph_ms, floor_ms, mg))
    for name, (fn, nbytes) in extra.items():
        ms, graph_ms = bench(fn), bench_graph(fn)
        floor_ms = nbytes / bw * 1e3
        rows.append((f"{T},{E},{H},{K}", name, ms, graph_ms, floor_ms, float("nan")))
    return rows


def host_overhead() -> list[tuple[str, float]]:
    """Host microseconds per call (no synchronisation): where small shapes lose their time."""
    import time

    from moe_dispatch.ops import triton_kernels as K
    T, E, H, K_ = 1024, 16, 256, 4
    tokens = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
    routing_map, probs = routing(T, E, K_)
    _, _, rmap = permute(tokens, routing_map, probs)
    counts = rmap.tokens_per_expert.tolist()
    y = torch.randn((T * K_, H), device="cuda", dtype=torch.bfloat16)
    calls = {
        "triton launch: unpermute_rows": lambda: K.unpermute_rows(y, rmap.slots, probs),
        "custom op: unpermute_rows": lambda: P._unpermute_op(y, rmap.slots, probs, False, K_),
        "API: unpermute": lambda: unpermute(y, rmap, probs),
        "triton launches: make_slots": lambda: K.make_slots(routing_map, 1),
        "API: permute, counts known": lambda: permute(tokens, routing_map, probs, tokens_per_expert=counts),
        "API: permute (syncs)": lambda: permute(tokens, routing_map, probs),
    }
    out = []
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            fn()
        out.append((name, (time.perf_counter() - start) / 200 * 1e6))
        torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None, help="T,E,H,K tuples")
    parser.add_argument("--no-megatron", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ops.py needs a CUDA device")
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else DEFAULT_SHAPES
    moe_utils = None if args.no_megatron else megatron_fns()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# copy bandwidth (read + write): {bw / 1e12:.2f} TB/s; bf16 tokens, fp32 probs; do_bench medians")
    print("# eager: do_bench of the Python call (host launch cost included where the GPU waits for it);")
    print("# graph: the same call replayed from a CUDA graph (GPU time only; nan = it synchronises)")
    print("| T,E,H,K | pass | eager (ms) | graph (ms) | floor (ms) | eager/floor | graph/floor | Megatron (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        for tag, name, ms, graph_ms, floor_ms, mg in run_shape(*shape, bw, moe_utils):
            print(f"| {tag} | {name} | {ms:.3f} | {graph_ms:.3f} | {floor_ms:.3f} | {ms / floor_ms:.2f}x | "
                  f"{graph_ms / floor_ms:.2f}x | {mg:.3f} |")
        torch.cuda.empty_cache()
    print("\n| host overhead (T=1024, H=256) | us per call |\n|---|---|")
    for name, us in host_overhead():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
