"""Single-process tests (no process group: EP size 1): accuracy against a float64 reference, the
public API's shapes and errors, and dtype handling."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.dispatcher import AllToAllDispatcher, build_dispatcher, combine, dispatch
from moe_dispatch.integrations.megatron import MegatronTokenDispatcher

from .helpers import E, G, H, K, batch, config, expert_weights, run_experts

U = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=fi.tiny)))) * fi.eps / 2


def assert_within(ours, ref, delta, dtype, what):
    """|ours - ref| <= half_ulp_dtype(|ref| + delta) + delta: one rounding to dtype of a value
    computed with error at most delta."""
    err = (ours.double() - ref).abs()
    bound = half_ulp(ref.abs() + delta, dtype) + delta
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item():.3e}"


def data_with_edge_cases(dtype):
    """Expert 7 receives nothing; token 5 is routed nowhere."""
    d = batch(dtype, seed=2, allowed=range(7))
    d["rmap"][5] = False
    d["probs"][5] = 0
    return d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("probs_in_experts", [False, True])
def test_against_float64_reference(dtype, probs_dtype, probs_in_experts):
    """The dispatcher's own arithmetic, against float64 on the same expert rows:
    - output: a K-term sum rounded once: delta = (K + 1) u * sum_e |term| (u of the accumulator:
      fp64 for fp64 probs applied in the combine, else fp32), bound half_ulp_dtype(|ref| + delta) + delta;
    - input gradient: K row gradients summed in fp32, rounded once: delta = K 2^-24 sum_e |g_e|;
    - probs gradient: in the combine, a dot over H: delta = H u sum_h |y_h r_h| (rounded to the
      probs dtype); in the experts, a pure move of the rows' prob gradients (exact)."""
    d = data_with_edge_cases(dtype)
    cfg = config(probs_in_experts=probs_in_experts, router_dtype="fp64" if probs_dtype == torch.float64 else "fp32")
    x = d["x"].clone().requires_grad_()
    p = d["probs"].to(probs_dtype).requires_grad_()
    rows, tpe, handle = dispatch(x, d["rmap"], p, cfg)
    assert tpe.device.type == "cpu" and tpe.dtype == torch.int64 and tpe[7] == 0
    rows.retain_grad()
    pp = handle.permuted_probs
    assert pp.dtype == probs_dtype and pp.requires_grad == probs_in_experts
    if probs_in_experts:
        pp.retain_grad()
    w, b = expert_weights(dtype)
    y = run_experts(rows, tpe, w, b, pp if probs_in_experts else None)
    out = combine(y, handle)
    out.backward(d["r"])

    # row of (t, e) at EP 1: expert-major, ascending token
    e_idx, t_idx = d["rmap"].t().nonzero(as_tuple=True)
    row_of = torch.full((G, E), -1, dtype=torch.int64)
    row_of[t_idx, e_idx] = torch.arange(len(t_idx))
    assert torch.equal(rows, d["x"][t_idx])
    u = U[probs_dtype] if not probs_in_experts else U[torch.float32]  # unweighted sums are fp32
    p64, y64, r64 = d["probs"].to(probs_dtype).double(), y.detach().double(), d["r"].double()
    terms = torch.zeros((G, E, H), dtype=torch.float64)
    terms[t_idx, e_idx] = y64[row_of[t_idx, e_idx]]
    if not probs_in_experts:
        terms = terms * p64[:, :, None]
    assert_within(out, terms.sum(1), (K + 1) * u * terms.abs().sum(1), dtype, "output")
    g = torch.zeros((G, E, H), dtype=torch.float64)
    g[t_idx, e_idx] = rows.grad.double()[row_of[t_idx, e_idx]]
    assert_within(x.grad, g.sum(1), K * U[torch.float32] * g.abs().sum(1), dtype, "input grad")
    if probs_in_experts:
        expected = torch.zeros((G, E), dtype=probs_dtype)
        expected[t_idx, e_idx] = pp.grad[row_of[t_idx, e_idx]]
        assert torch.equal(p.grad, expected)
    else:
        yr = torch.zeros((G, E, H), dtype=torch.float64)
        yr[t_idx, e_idx] = y64[row_of[t_idx, e_idx]] * r64[t_idx]
        assert_within(p.grad, yr.sum(2), H * U[probs_dtype] * yr.abs().sum(2), probs_dtype, "probs grad")
    assert not out[5].any() and not x.grad[5].any()


def test_three_dimensional_input_and_builder():
    d = batch(torch.bfloat16, n=48)
    cfg = config(kind="allgather")
    disp = build_dispatcher(cfg)
    assert type(disp).__name__ == "AllGatherDispatcher" and disp.local_expert_indices == list(range(E))
    x = d["x"].view(6, 8, H)
    rows, tpe, handle = disp.dispatch(x, d["rmap"], d["probs"])
    out = disp.combine(rows, handle)
    assert out.shape == (6, 8, H) and rows.shape == (int(d["rmap"].sum()), H)
    flat_rows, _, flat_handle = AllToAllDispatcher(cfg).dispatch(d["x"], d["rmap"], d["probs"])
    assert torch.equal(out.view(48, H), AllToAllDispatcher(cfg).combine(flat_rows, flat_handle))
    with pytest.raises(ValueError, match="dispatcher kind must be one of"):
        build_dispatcher(config(kind="ring"))


def test_low_precision_probs_travel_as_fp32():
    """bf16 probs are upcast exactly; the result equals passing the same values in fp32."""
    d = batch(torch.bfloat16, n=32)
    p16 = d["probs"].bfloat16().requires_grad_()
    p32 = p16.detach().float().requires_grad_()
    outs = []
    for p in (p16, p32):
        rows, _, handle = dispatch(d["x"], d["rmap"], p, config())
        assert handle.probs.dtype == torch.float32 and handle.permuted_probs.dtype == torch.float32
        out = combine(rows, handle)
        out.backward(d["r"])
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert p16.grad.dtype == torch.bfloat16 and torch.equal(p16.grad, p32.grad.bfloat16())


def test_pad_multiple_rows_are_zero_and_get_zero_gradient():
    d = batch(torch.float32, n=40)
    x = d["x"].clone().requires_grad_()
    rows, tpe, handle = dispatch(x, d["rmap"], d["probs"], config(pad_multiple=8))
    assert all(n % 8 == 0 for n in tpe.tolist()) and rows.shape[0] == int(tpe.sum())
    counts = d["rmap"].sum(0).tolist()
    start = 0
    for n, c in zip(tpe.tolist(), counts):
        assert not rows[start + c:start + n].any()  # pad rows at the end of each expert's block
        start += n
    rows.retain_grad()
    combine(rows + 1, handle).sum().backward()  # pad rows output 1, but no token uses them
    start = 0
    for n, c in zip(tpe.tolist(), counts):
        assert not rows.grad[start + c:start + n].any()
        start += n


@pytest.mark.parametrize("bad, match", [
    (lambda d: (d["x"], d["rmap"].int(), d["probs"]), r"routing_map must be a bool tensor .* got int32"),
    (lambda d: (d["x"], d["rmap"][:, :4], d["probs"]), r"routing_map .* \[16, 8\], got bool \[16, 4\] on EP rank 0"),
    (lambda d: (d["x"][0], d["rmap"], d["probs"]), r"hidden_states must be .* \[T, 64\] or \[S, B, 64\]"),
    (lambda d: (d["x"].long(), d["rmap"], d["probs"]), r"hidden_states must be .* got int64"),
    (lambda d: (d["x"], d["rmap"], d["probs"][:8]), r"probs must be a float tensor .* got float32 \[8, 8\]"),
])
def test_bad_input_names_the_argument(bad, match):
    d = batch(torch.float32, n=16)
    with pytest.raises(ValueError, match=match):
        dispatch(*bad(d), config())


def test_combine_checks_expert_output_rows():
    d = batch(torch.float32, n=16)
    rows, tpe, handle = dispatch(d["x"], d["rmap"], d["probs"], config())
    with pytest.raises(ValueError, match=r"expert_output must be \[N, H\] = \[48, 64\] .*got \[47, 64\]"):
        combine(rows[1:], handle)


def test_megatron_steps_need_preprocess_first():
    disp = MegatronTokenDispatcher(AllToAllDispatcher(config()))
    with pytest.raises(RuntimeError, match="dispatch_preprocess first"):
        disp.token_dispatch(torch.zeros(1, H), torch.zeros(1, E))


@pytest.mark.parametrize("probs_in_experts", [False, True])
def test_handle_reuse_skips_the_exchange_and_is_bitwise(monkeypatch, probs_in_experts):
    """dispatch(handle=previous) (activation recomputation): no size exchange, no new row maps,
    and rows, outputs and every gradient bitwise equal to the fresh dispatch's."""
    from moe_dispatch.dispatcher.dropless import plan as dropless

    d = data_with_edge_cases(torch.bfloat16)
    cfg = config(probs_in_experts=probs_in_experts, pad_multiple=4)
    w, b = expert_weights(torch.bfloat16)
    results = []
    handle = None
    for reuse in (False, True):
        if reuse:
            def fail(*args, **kwargs):
                raise AssertionError("a reused handle must not exchange sizes or build a plan")
            monkeypatch.setattr(dropless, "exchange_sizes", fail)
            monkeypatch.setattr(dropless, "make_plan", fail)
        x = d["x"].clone().requires_grad_()
        p = d["probs"].clone().requires_grad_()
        rows, tpe, new = dispatch(x, d["rmap"].clone(), p, cfg, handle=handle)
        y = run_experts(rows, tpe, w, b, new.permuted_probs if probs_in_experts else None)
        out = combine(y, new)
        out.backward(d["r"])
        results.append((rows.detach(), out.detach(), x.grad, p.grad))
        handle = new
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)
    assert results[0][3].abs().sum() > 0


def test_handle_reuse_with_other_routing_gives_nan_then_raises():
    """A reused handle whose routing differs: checked on the device (no host sync), the step's
    outputs are NaN, and the next size exchange raises."""
    d = batch(torch.float32, n=16)
    _, _, handle = dispatch(d["x"], d["rmap"], d["probs"], config())
    other = batch(torch.float32, n=16, seed=4)
    rows, _, h2 = dispatch(d["x"], other["rmap"], d["probs"], config(), handle=handle)
    out = combine(rows, h2)
    assert torch.isnan(out[d["rmap"].any(1)]).all()
    with pytest.raises(ValueError, match="differs from the handle's routing"):
        dispatch(d["x"], d["rmap"], d["probs"], config())
    dispatch(d["x"], d["rmap"], d["probs"], config())  # the error was raised once, then cleared


def test_handle_reuse_checks_shapes():
    d = batch(torch.float32, n=16)
    _, _, handle = dispatch(d["x"], d["rmap"], d["probs"], config())
    with pytest.raises(ValueError, match=r"must match the handle's \[T, H\] = \[16, 64\]"):
        dispatch(d["x"][:8], d["rmap"][:8], d["probs"][:8], config(), handle=handle)
