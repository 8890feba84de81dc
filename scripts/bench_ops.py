"""Benchmark permute / unpermute (bf16) against the memory-bandwidth floor and Megatron-core.

Run on a CUDA machine:  python scripts/bench_ops.py [--shapes T,E,H,K ...] [--no-megatron]
                        python scripts/bench_ops.py --sweep bandwidth.svg   (bandwidth against size)
                        python scripts/bench_ops.py --fp8   (quantize_rows and float8 rows, E=64, K=6)

Each pass is timed with triton.testing.do_bench (median). The floor of a pass is the bytes it
must move (every input read once, every output written once) over the device-to-device copy
bandwidth measured in the same run (bytes read plus written). The alternative route of
moe_dispatch.ops.kernels.LAUNCH ("per-token route": unpermute_bwd_per_token; same
bits) is timed beside the default in the same run. The backward passes are timed through the
registered custom ops (torch.ops.moe_dispatch.*). With --fp8: quantize_rows (bf16 -> e4m3) over its
byte floor beside the twin's eager torch code on the same GPU and a sweep of its LAUNCH settings, and
permute / unpermute of e4m3 rows with their row scales, all as CUDA-graph medians.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
import triton.language as tl

from moe_dispatch.ops import permute, unpermute
from moe_dispatch.tools.benchmarks import copy_bandwidth, routing
from moe_dispatch.tools.profiling import graph_median_ms

OPS = torch.ops.moe_dispatch  # the registered custom ops (importing moe_dispatch.ops registers them)

DEFAULT_SHAPES = [(8192, 16, 2048, 4), (4096, 256, 7168, 8), (16384, 128, 4096, 6), (32768, 64, 4096, 8)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench_graph(fn) -> float:
    """graph_median_ms, or nan for a call that synchronises (it cannot be captured)."""
    try:
        return graph_median_ms(fn, rep=200)
    except Exception:
        return float("nan")


def time_host_calls(calls: dict, warmup: int = 20, iters: int = 200) -> list[tuple[str, float]]:
    """[(name, host microseconds per call)]: the loop's host time, not waiting for the GPU after
    it (at tiny sizes the GPU keeps up, so this is the launch cost)."""
    import time

    out = []
    for name, fn in calls.items():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((name, (time.perf_counter() - start) / iters * 1e6))
        torch.cuda.synchronize()
    return out


def with_launch(fn, **knobs):
    """fn with kernels.LAUNCH overridden during the call (also while a CUDA graph captures it)."""
    from moe_dispatch.ops import kernels as KT

    def call():
        with KT.launch_settings(**knobs):
            return fn()
    return call


def megatron_fns():
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception as exc:  # megatron-core is optional here
        print(f"# megatron-core not importable ({exc}); skipping its columns", file=sys.stderr)
        return None
    return moe_utils


def passes(T: int, E: int, H: int, K: int) -> tuple[dict, dict, dict, dict]:
    """({pass: our callable}, {pass: bytes it must move}, {name: (callable, bytes)} of the extra
    rows, {name: input tensor}) for one shape: bf16 tokens, fp32 probs, K experts per token."""
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
        "permute bwd": lambda: OPS.permute_rows_backward(g_perm, slots, None, torch.float32),
        "unpermute bwd, probs grad": lambda: OPS.unpermute_rows_backward(g_out, y, slots, probs, False, K),
    }
    from moe_dispatch.ops import kernels as KT
    extra = {"permute, counts known (no sync)":
             (lambda: permute(tokens, routing_map, probs, tokens_per_expert=counts, max_experts_per_token=K),
              floors["permute (map + rows)"]),
             "map only (make_slots)": (lambda: KT.make_slots(routing_map, 1), T * E + T * (2 * E + 1) * 4),
             "rows only (permute kernel)": (lambda: KT.permute_rows(tokens, slots, probs, N, False),
                                            floors["permute (map + rows)"] - T * E)}
    # The alternative route (a LAUNCH knob, same bits) beside the default above, in the same run.
    extra["unpermute bwd, probs grad, per-token route"] = (
        with_launch(lambda: OPS.unpermute_rows_backward(g_out, y, slots, probs, False, K),
                    unpermute_bwd_per_token=True),
        floors["unpermute bwd, probs grad"])
    for block, warps in [(2048, 8), (4096, 16)]:  # a copy: block size is free to tune
        if block <= triton.next_power_of_2(H):
            extra[f"rows only, block {block}/{warps} warps"] = (
                lambda block=block, warps=warps: KT.permute_rows(tokens, slots, probs, N, False, block, warps),
                floors["permute (map + rows)"] - T * E)
    data = dict(tokens=tokens, routing_map=routing_map, probs=probs, y=y, g_out=g_out, g_perm=g_perm)
    return ours, floors, extra, data


def run_shape(T: int, E: int, H: int, K: int, bw: float, moe_utils) -> list[tuple]:
    ours, floors, extra, data = passes(T, E, H, K)
    tokens, routing_map, probs, y, g_out, g_perm = (data[k] for k in ("tokens", "routing_map", "probs", "y",
                                                                      "g_out", "g_perm"))
    N = T * K
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


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


SWEEP_PASSES = {"permute, counts known (no sync)": "permute incl. map",
                "unpermute fwd, probs": "unpermute fwd", "permute bwd": "permute bwd",
                "unpermute bwd, probs grad": "unpermute bwd",
                "unpermute bwd, probs grad, per-token route": "unpermute bwd, per-token route"}


def sweep(E: int, H: int, K: int, token_counts: list[int]) -> dict[str, list[tuple[int, float]]]:
    """{series: [(bytes moved, TB/s)]}: each pass's bytes over its CUDA-graph time, and a plain
    Triton copy kernel moving the same bytes (read + write) as the reference."""
    series: dict[str, list[tuple[int, float]]] = {label: [] for label in ["copy (reference)", *SWEEP_PASSES.values()]}
    print(f"| T (E={E}, H={H}, K={K}) | " + " | ".join(series) + " |")
    print("|---" * (len(series) + 1) + "|")
    for T in token_counts:
        ours, floors, extra, _ = passes(T, E, H, K)
        calls = {**{name: (fn, floors[name]) for name, fn in ours.items()}, **extra}
        for name, label in SWEEP_PASSES.items():
            fn, nbytes = calls[name]
            series[label].append((nbytes, nbytes / (bench_graph(fn) * 1e-3) / 1e12))
        nbytes = floors["permute bwd"]  # the copy reference moves about what the passes move
        src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        grid = (triton.cdiv(src.numel(), 4096),)
        ms = bench_graph(lambda: _copy_kernel[grid](src, dst, src.numel(), BLOCK=4096, num_warps=8))
        series["copy (reference)"].append((nbytes, nbytes / (ms * 1e-3) / 1e12))
        row = [series[label][-1][1] for label in series]
        print(f"| {T} | " + " | ".join(f"{v:.2f}" for v in row) + " |", flush=True)
        torch.cuda.empty_cache()
    return series


def write_svg(path: str, series: dict[str, list[tuple[int, float]]], title: str) -> None:
    """A line chart of {label: [(bytes moved, TB/s)]}, log2 bytes on x, TB/s on y, the legend on the
    right as wide as its longest label; the data is embedded (svg_plot.replot draws it again)."""
    import math

    import svg_plot

    plot_w, plot_h, left, top, bottom = 460, 330, 70, 40, 70
    legend_w = 36 + max(svg_plot.text_width(label) for label in series) + 10
    width = max(left + plot_w + legend_w, 10 + svg_plot.text_width(title, 14) + 10)
    height = top + plot_h + bottom
    xs = [x for pts in series.values() for x, _ in pts]
    x_lo, x_hi = math.log2(min(xs)), math.log2(max(xs))
    y_hi = max(5.0, max(y for pts in series.values() for _, y in pts))

    def px(x: float) -> float:
        return left + (math.log2(x) - x_lo) / max(x_hi - x_lo, 1e-9) * plot_w

    def py(y: float) -> float:
        return top + plot_h - y / y_hi * plot_h

    colors = ["#555555", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    out = [*svg_plot.header(width, height), svg_plot.metadata("bench_ops:write_svg", series=series, title=title),
           svg_plot.text(10, 20, title, font_size=14)]
    for tick in range(int(y_hi) + 1):
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(tick):.1f}" y2="{py(tick):.1f}" stroke="#ddd"/>')
        out.append(svg_plot.text(left - 8, py(tick) + 4, str(tick), text_anchor="end"))
    # At most about 7 labels, each a power of two, slanted so that neighbours never overlap.
    exponents = list(range(math.ceil(x_lo), math.floor(x_hi) + 1))
    for e in exponents[::max(1, math.ceil(len(exponents) / 7))]:
        label = (f"{2 ** e / 2 ** 30:.0f} GiB" if e >= 30 else f"{2 ** e / 2 ** 20:.0f} MiB" if e >= 20
                 else f"{2 ** e / 2 ** 10:.0f} KiB")
        x, y = px(2 ** e), top + plot_h + 14
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" stroke="#444"/>')
        out.append(svg_plot.text(x, y, label, text_anchor="end", transform=f"rotate(-30 {x:.1f} {y})"))
    out.append(svg_plot.text(left + plot_w / 2, height - 10, "bytes moved per call (log scale)",
                             text_anchor="middle"))
    mid = top + plot_h / 2
    out.append(svg_plot.text(18, mid, "achieved TB/s (bytes / CUDA-graph time)", text_anchor="middle",
                             transform=f"rotate(-90 18 {mid})"))
    for i, (label, pts) in enumerate(series.items()):
        color = colors[i % len(colors)]
        dash = ' stroke-dasharray="5,4"' if i == 0 else ""
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        lx, ly = left + plot_w + 10, top + 10 + 18 * i
        out.append(f'<line x1="{lx}" x2="{lx + 20}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(svg_plot.text(lx + 26, ly + 4, label))
    svg_plot.write(path, out)


def host_overhead() -> list[tuple[str, float]]:
    """Host microseconds per call (no synchronisation): where small shapes lose their time."""
    from moe_dispatch.ops import kernels as K
    T, E, H, K_ = 1024, 16, 256, 4
    tokens = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
    routing_map, probs = routing(T, E, K_)
    _, _, rmap = permute(tokens, routing_map, probs)
    counts = rmap.expert_rows.tolist()
    y = torch.randn((T * K_, H), device="cuda", dtype=torch.bfloat16)
    calls = {
        "triton launch: unpermute_rows": lambda: K.unpermute_rows(y, rmap.slots, probs),
        "custom op: unpermute_rows": lambda: OPS.unpermute_rows(y, rmap.slots, probs, False, K_),
        "API: unpermute": lambda: unpermute(y, rmap, probs),
        "triton launches: make_slots": lambda: K.make_slots(routing_map, 1),
        "API: permute, counts known": lambda: permute(tokens, routing_map, probs, tokens_per_expert=counts),
        "API: permute (syncs)": lambda: permute(tokens, routing_map, probs),
    }
    return time_host_calls(calls)


FP8_SHAPES = [(8192, 4096), (49152, 4096), (16384, 7168)]


def fp8_passes(T: int, H: int, E: int = 64, K: int = 6) -> dict:
    """{name: (callable, bytes it must move)} for quantize_rows and the float8 permute / unpermute."""
    from moe_dispatch.ops import quantize_rows
    from moe_dispatch.ops import torch_twin as TW

    e4m3 = torch.float8_e4m3fn
    x = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
    quantize_bytes = T * H * 2 + T * H + 4 * T  # bf16 in, fp8 and one fp32 scale a row out
    calls = {"quantize_rows": (lambda: quantize_rows(x, e4m3), quantize_bytes),
             "quantize_rows' twin, eager torch": (lambda: TW.quantize_rows(x, e4m3), quantize_bytes)}
    for elements, warps in itertools.product([2048, 4096, 8192, 16384], [4, 8, 16]):
        calls[f"quantize_rows, {elements} elements, {warps} warps"] = (
            with_launch(lambda: quantize_rows(x, e4m3), quantize_elements=elements, quantize_warps=warps),
            quantize_bytes)
    routing_map, probs = routing(T, E, K)
    counts, N = routing_map.sum(0).tolist(), T * K
    q, scales = quantize_rows(x, e4m3)
    _, _, row_scales, rmap = permute(q, routing_map, probs, row_scales=scales)
    y = torch.randn((N, H), device="cuda").to(e4m3)
    map_bytes = T * E * (1 + 4) + N * 4  # routing map, probs, permuted probs
    calls["permute e4m3 + scales, counts known"] = (
        lambda: permute(q, routing_map, probs, tokens_per_expert=counts, max_experts_per_token=K, row_scales=scales),
        T * H + N * H + 4 * (T + N) + map_bytes)
    calls["unpermute e4m3 rows + scales -> bf16"] = (
        lambda: unpermute(y, rmap, probs, row_scales=row_scales, out_dtype=torch.bfloat16),
        N * H + 4 * N + T * H * 2 + T * E * 4)
    return calls


def run_fp8(bw: float) -> None:
    print("| T, H (E=64, K=6) | pass | graph (ms) | floor (ms) | graph/floor |\n|---|---|---|---|---|")
    for T, H in FP8_SHAPES:
        for name, (fn, nbytes) in fp8_passes(T, H).items():
            ms, floor_ms = bench_graph(fn), nbytes / bw * 1e3
            print(f"| {T}, {H} | {name} | {ms:.4f} | {floor_ms:.4f} | {ms / floor_ms:.2f}x |", flush=True)
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None, help="T,E,H,K tuples")
    parser.add_argument("--no-megatron", action="store_true")
    parser.add_argument("--sweep", metavar="SVG", help="only sweep T at E=64, H=4096, K=8 and plot bandwidth to SVG")
    parser.add_argument("--fp8", action="store_true", help="only quantize_rows and the float8 rows' passes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ops.py needs a CUDA device")
    if args.fp8:
        bw = copy_bandwidth()
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
              f"copy bandwidth (read + write) {bw / 1e12:.2f} TB/s; CUDA-graph medians")
        run_fp8(bw)
        return
    if args.sweep:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
              "achieved TB/s (bytes each pass must move / CUDA-graph median)")
        series = sweep(64, 4096, 8, [2 ** i for i in range(7, 16)])
        write_svg(args.sweep, series, f"permute / unpermute on {torch.cuda.get_device_name()}, bf16, "
                                      "E=64, H=4096, K=8, T=128..32768")
        return
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
        print(f"# measuring T,E,H,K = {','.join(map(str, shape))} ...", flush=True)
        for tag, name, ms, graph_ms, floor_ms, mg in run_shape(*shape, bw, moe_utils):
            print(f"| {tag} | {name} | {ms:.3f} | {graph_ms:.3f} | {floor_ms:.3f} | {ms / floor_ms:.2f}x | "
                  f"{graph_ms / floor_ms:.2f}x | {mg:.3f} |", flush=True)
        torch.cuda.empty_cache()
    print("\n| host overhead (T=1024, H=256) | us per call |\n|---|---|")
    for name, us in host_overhead():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
