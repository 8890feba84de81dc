"""Does a garbage collection during a CUDA-graph capture, one that frees an earlier graph left in a
reference cycle, invalidate the capture? Each case runs in a process of its own (a broken capture
can leave the process's CUDA state unusable):

    python scripts/measure/capture_gc.py            # both cases, one line each

- ``raw``: ``torch.cuda.graph`` as torch ships it (it no longer collects garbage before a capture),
  the dead graph made just before it, and the collector set to run at nearly every allocation of
  a tracked object;
- ``capture_step``: ``moe_dispatch.tools.capture.capture_step``, which collects before the capture
  and not during it, under the same setting.

Each line says whether the capture succeeded and how many collections ran while it was open.
"""
from __future__ import annotations

import gc
import subprocess
import sys

import torch


def _dead_graph_in_a_cycle() -> None:
    """Capture a small graph and drop it inside a reference cycle: only the collector frees it, as
    it frees the graphs that ``torch.cuda.make_graphed_callables`` leaves in its autograd classes."""
    x = torch.ones(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x * 2
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
    holder = {"graph": graph, "out": y}
    holder["self"] = holder


def _case(name: str) -> str:
    from moe_dispatch.tools.capture import capture_step

    layer = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    x = torch.randn(512, 256, device="cuda", requires_grad=True)

    def step() -> torch.Tensor:
        out = layer(x)
        out.float().square().mean().backward()
        return out

    during = []
    gc.callbacks.append(lambda phase, info: during.append(1) if phase == "start"
                        and torch.cuda.is_current_stream_capturing() else None)
    old = gc.get_threshold()
    try:
        if name == "capture_step":
            _dead_graph_in_a_cycle()
            gc.set_threshold(1, 1, 1)
            capture_step(layer, x, step)
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    layer.zero_grad(set_to_none=True)
                    step()
            torch.cuda.current_stream().wait_stream(side)
            layer.zero_grad(set_to_none=True)
            x.grad = None
            _dead_graph_in_a_cycle()  # young: the first collection inside the capture frees it
            gc.set_threshold(1, 1, 1)
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                step()
        outcome = "captured"
    except Exception as exc:  # the finding is which error, if any
        outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        gc.set_threshold(*old)
    return f"{name:13s} {outcome}; collections while capturing: {len(during)}"


def main() -> None:
    if len(sys.argv) > 1:
        print(_case(sys.argv[1]), flush=True)
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name in ("raw", "capture_step"):
        done = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=300)
        lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
        print(lines[-1] if lines else f"{name}: exit {done.returncode}, no output")


if __name__ == "__main__":
    main()
