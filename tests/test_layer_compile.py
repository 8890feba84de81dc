"""torch.compile of MoELayer forward + backward on gloo ranks: outputs and every gradient are
bitwise equal to eager, with both dispatchers. aot_eager at EP 2 and 4, and with dynamic=True
(symbolic sizes) at EP 2; inductor (which generates and builds C++ on CPU, tens of seconds per
graph) at EP 2 only; the FP8 layer (``fp8="e4m3"``) with aot_eager at EP 2. Graph breaks are
expected around the collectives and the size exchange's one host read; the test checks that
graphs were compiled and that the results do not change. Also run under the floor torch
(scripts/test_floor_torch.sh); CI's main suite (scripts/test.sh) leaves the EP-4 and dynamic=True
cases to that step."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.config import DISPATCHER_KINDS

from .dispatcher.harness import run_ranks

DISPATCHERS = DISPATCHER_KINDS


def _step(fn, layer: MoELayer, x: torch.Tensor) -> list[torch.Tensor]:
    """[output, input grad, every parameter's grad] of one forward + backward."""
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))  # a gradient that differs per entry
    grads = [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return [out.detach(), x.grad, *grads]


def _compile_case(rank: int, world_size: int, backend: str, steps: int, dynamic: bool | None,
                  fp8: str | None) -> dict:
    import torch._dynamo

    result = {}
    H = 16 if fp8 else 8  # FP8 rows: H a multiple of 16
    for kind in DISPATCHERS:
        # probs_in_experts: the probs' gradient also travels back through the exchange
        layer = MoELayer(MoEConfig(hidden_size=H, num_experts=2 * world_size, topk=2, ffn_hidden_size=16,
                                   dispatcher=kind, probs_in_experts=kind == "alltoall", fp8=fp8), layer_index=0)
        g = torch.Generator().manual_seed(10 + rank)
        # Two steps of different batches (rank-dependent sizes): new counts, new host ints.
        batches = [torch.randn(5 + rank, H, generator=g), torch.randn(3 + 2 * rank, H, generator=g)][:steps]
        eager = [_step(layer, layer, x) for x in batches]
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # cumulative across resets and cases
        compiled = torch.compile(layer, backend=backend, dynamic=dynamic)
        got = [_step(compiled, layer, x) for x in batches]
        result[kind] = {
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - before,
            "equal": [all(torch.equal(a, b) for a, b in zip(e, c)) for e, c in zip(eager, got)],
        }
    return result


def _compile_worker(rank: int, world_size: int, cases: list) -> list:
    """_compile_case for each (backend, steps, dynamic, fp8) of one world size: one spawn for all of them."""
    import torch._inductor.config

    # Inductor's default compiles in a pool of subprocesses (each importing torch); the ranks already
    # share the 2 cores, so building in the rank's own process is faster and builds the same code.
    torch._inductor.config.compile_threads = 1
    return [_compile_case(rank, world_size, *case) for case in cases]


# (backend, ep, steps, dynamic, fp8): the FP8 layer's float8 wire rows and scaled GEMMs at EP 2 too.
CASES = [("aot_eager", 2, 2, None, None), ("aot_eager", 4, 1, None, None), ("aot_eager", 2, 2, True, None),
         ("inductor", 2, 1, None, None), ("aot_eager", 2, 1, None, "e4m3")]
CASE_IDS = ["-".join(str(v) for v in case[:4]) + (f"-fp8-{case[4]}" if case[4] else "") for case in CASES]


@pytest.fixture(scope="module")
def compiled_runs(request):
    """compiled_runs(backend, ep, steps, dynamic, fp8) -> per-rank results; the selected cases of one
    EP size share one spawn (starting the ranks and torch.compile's first import cost more than a case)."""
    selected = {tuple(item.callspec.params[k] for k in ("backend", "ep", "steps", "dynamic", "fp8"))
                for item in request.session.items
                if item.originalname == "test_compiled_layer_is_bitwise_eager" and hasattr(item, "callspec")}
    runs: dict = {}

    def get(backend: str, ep: int, steps: int, dynamic: bool | None, fp8: str | None) -> list:
        if ep not in runs:
            cases = [c for c in CASES if c[1] == ep and (c in selected or c == (backend, ep, steps, dynamic, fp8))]
            args = [(b, s, d, f) for b, _, s, d, f in cases]
            try:
                per_rank = run_ranks(_compile_worker, ep, args, timeout=850)
                runs[ep] = {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}
            except Exception as exc:  # the other cases of this EP size fail alike, without a second spawn
                runs[ep] = exc
        if isinstance(runs[ep], Exception):
            raise runs[ep]
        return runs[ep][(backend, ep, steps, dynamic, fp8)]
    return get


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend, ep, steps, dynamic, fp8", CASES, ids=CASE_IDS)
def test_compiled_layer_is_bitwise_eager(compiled_runs, backend, ep, steps, dynamic, fp8):
    """Both dispatchers on every rank; ``steps`` batches (the second one recompiles, or with
    dynamic=True runs the same graphs at other sizes)."""
    for rank, res in enumerate(compiled_runs(backend, ep, steps, dynamic, fp8)):
        for kind, r in res.items():
            assert r["graphs"] > 0, (rank, kind, r)
            assert r["equal"] == [True] * steps, (backend, ep, rank, kind, r)
