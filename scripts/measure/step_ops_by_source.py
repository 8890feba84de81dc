"""Which lines of the layer launch the GPU time that is neither a GEMM nor one of our kernels.

Run:  python scripts/measure/step_ops_by_source.py [--fp8] [--tokens 8192 ...] [--device cpu]

Profiles 5 forward + backward steps of the EP-1 layer (torch.profiler with Python stacks) and
prints, per step, the aten operators whose own kernels took the most time, with their input shapes
and the moe_dispatch frames around them (innermost first), from the profiler's Python events.
The copies, casts, adds and fills of the profile's "other" category have no line of ours to point
at; this names it. On CUDA (torch 2.11, one H200, 2026-12-05) the profiler did not link those Python events
to the aten ops (every row read "(autograd engine)"), so the GPU run gives the operators and shapes,
and the same command with ``--device cpu`` at small sizes (ranked by CPU time) the lines behind a
shape.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moe_dispatch import MoEConfig
from moe_dispatch.tools.benchmarks import add_shape_args, layer_inputs, layer_step

STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--fp8", action="store_true", help="the FP8 layer (fp8='e4m3'), weights quantised once")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run, ranked by CPU time")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                       params_dtype=torch.bfloat16, fp8="e4m3" if args.fp8 else None)
    x, upstream = layer_inputs(args.tokens, args.hidden, device)
    step = layer_step(config, x, upstream, once=args.fp8)[1]
    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        torch.cuda.synchronize()
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True,
                 with_stack=True) as prof:
        for _ in range(STEPS):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    totals: dict = {}
    for event in prof.events():
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us <= 0 or not event.name.startswith("aten::"):
            continue
        frames, parent = [], event.cpu_parent
        while parent is not None and len(frames) < 4:  # the Python frames around the op, innermost first
            if "moe_dispatch/" in parent.name or "torch/autograd/" in parent.name:
                frames.append(parent.name.split("moe_dispatch/")[-1])
            parent = parent.cpu_parent
        key = (event.name, str(event.input_shapes)[:60], " <- ".join(frames) or "(autograd engine)")
        totals[key] = totals.get(key, 0.0) + us
    rows = [(us / STEPS / 1e3, *key) for key, us in totals.items()]
    rows.sort(key=lambda r: -r[0])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: CPU time)"
    print(f"# {name}, {'FP8 (weights once)' if args.fp8 else 'bf16'} layer, per step\n")
    print("| ms | operator | input shapes | called from |\n|---|---|---|---|")
    for ms, name, shapes, frames in rows[:args.top]:
        print(f"| {ms:.3f} | {name} | {shapes} | {frames} |")


if __name__ == "__main__":
    main()
