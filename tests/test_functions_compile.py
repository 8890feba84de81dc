"""Each autograd.Function of the package compiled alone (aot_eager, in-process): output and every
input gradient bitwise equal to eager. Quick, and run under the floor torch too
(scripts/test_floor_torch.sh): torch 2.11's dynamo traced a Function whose forward returned a
tensor that an op had returned as itself (a no-op ``.to``, an in-place op) with a zero gradient."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.experts.activations import activate, scale_rows
from moe_dispatch.experts.gemm import expert_gemm
from moe_dispatch.router import gating_linear
from moe_dispatch.router.losses import attach_loss

FLOATS = [torch.float32, torch.bfloat16]
COUNTS = torch.tensor([3, 0, 4])


def _inputs(dtype: torch.dtype, *shapes: tuple) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_(True) for s in shapes]


CASES = {
    "gelu": (lambda x: activate(x, "gelu"), [(7, 16)]),
    "swiglu": (lambda x: activate(x, "swiglu"), [(7, 16)]),
    "scale_rows": (scale_rows, [(7, 16), (7,)]),
    "gating_linear": (lambda x, w: gating_linear(x, w, torch.float32), [(7, 16), (4, 16)]),
    "expert_gemm": (lambda x, w: expert_gemm(x, w, COUNTS, "ordered"), [(7, 8), (3, 8, 16)]),
    "attach_loss": (lambda x, loss: attach_loss(x * 2, loss.sum()), [(7, 8), (3,)]),
}


def _grads(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))  # differs per entry
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", FLOATS, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_function_compiled_alone_is_bitwise_eager(name, dtype):
    import torch._dynamo

    fn, shapes = CASES[name]
    inputs = _inputs(dtype, *shapes)
    eager = _grads(fn, inputs)
    torch._dynamo.reset()
    got = _grads(torch.compile(fn, backend="aot_eager", fullgraph=False), inputs)
    for i, (e, c) in enumerate(zip(eager, got)):
        assert c is not None and torch.equal(e, c), (name, i, e, c)


def test_fixed_order_sums_are_not_recompiled_per_size():
    """The fixed-order sums run eagerly under torch.compile, whatever the sizes: no graph of
    their per-level code (which once broke the graph at every level and hit dynamo's recompile
    limit), and the same bits as eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from moe_dispatch.numerics.fixed_order import ordered_mm, tree_sum

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda a, b: (tree_sum(a, 1), ordered_mm(a, b)), backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for k in range(1, 14):  # 13 sizes of the summed dim, so 13 shapes of every tree level
        a, b = torch.randn(5, k, generator=g), torch.randn(k, 3, generator=g)
        got, want = fn(a, b), (tree_sum(a, 1), ordered_mm(a, b))
        assert all(torch.equal(x, y) for x, y in zip(got, want)), k
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_layer_steps_of_one_shape_compile_once(dispatcher):
    """From its third step a compiled layer compiles nothing more at the same shapes (the second
    recompiles once, where an int such as the layer's step count changed and dynamo makes it
    symbolic): nothing a dispatch creates (its handle's number among them) becomes a guard that
    every new step fails, which would recompile each step until dynamo's recompile limit and then
    leave that frame eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from moe_dispatch import MoEConfig, MoELayer

    torch._dynamo.reset()
    counters.clear()
    layer = MoELayer(MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=16, dispatcher=dispatcher),
                     layer_index=0)
    compiled = torch.compile(layer, backend="eager")  # dynamo's tracing and guards alone: quick
    g = torch.Generator().manual_seed(0)
    graphs = []
    for _ in range(5):
        x = torch.randn(6, 8, generator=g).requires_grad_(True)
        compiled(x).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[2:] == [graphs[1]] * 3, graphs
