"""Float8 tokens through permute / unpermute (bitwise row copies, row scales, out_dtype, gradients
of each tensor's own dtype) and quantize_rows: against a float64 reference (tests/ops/oracle.py's
bounds), and the Triton kernels under the interpreter against the torch twin, bitwise."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.ops import (
    custom_ops,
    dequantize_rows,
    expert_row_counts,
    permute,
    quantize_rows,
    set_backend,
    unpermute,
)
from moe_dispatch.ops import torch_twin as TW
from tests.ops.oracle import U32, assert_within, expected_rows, half_ulp, random_routing, reference_unpermute

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# The kernels' float8 rounding has two routes: integer-built bytes under the interpreter, the
# hardware's saturating cast when compiled; each is checked against torch's cast on its device.
KERNEL_DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bits as integers: a bitwise comparison that float8 and NaN survive."""
    return x.contiguous().view(_INT_OF_SIZE[x.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _same_bits_but_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN equals any NaN (their payloads are not values)."""
    nan = a.isnan()
    return _same_bits(nan, b.isnan()) and _same_bits(a[~nan], b[~nan])


def _case(T, E, K, H, dtype, out_dtype, seed=0, pad_multiple=1):
    """Routing, tokens (dtype) with per-token scales, expert outputs y [N, H] (dtype) with per-row
    scales, and upstream gradients of the output (out_dtype) and of the permuted rows (dtype)."""
    gen = torch.Generator().manual_seed(seed)
    routing_map = random_routing(T, E, K, gen)
    routing_map[min(2, T - 1)] = False  # a token routed nowhere
    tokens = (torch.randn((T, H), generator=gen) * 4).to(dtype)
    scales = torch.rand(T, generator=gen) + 0.5
    probs = torch.rand((T, E), generator=gen) * routing_map
    N = int(expert_row_counts(routing_map, pad_multiple)[1].sum())
    # Distinct expert outputs with their own scales: a round trip would hide a wrong row or scale.
    y = (torch.randn((N, H), generator=gen) * 4).to(dtype)
    y_scales = torch.rand(N, generator=gen) + 0.5
    g_out = torch.randn((T, H), generator=gen).to(out_dtype)
    g_perm = torch.randn((N, H), generator=gen).to(dtype)
    return routing_map, tokens, scales, probs, y, y_scales, g_out, g_perm


def _run(routing_map, tokens, scales, probs, y, y_scales, g_out, g_perm, out_dtype, pad_multiple=1):
    tokens = tokens.clone().requires_grad_()
    probs_leaf = probs.clone().requires_grad_()
    y = y.clone().requires_grad_()
    permuted, permuted_probs, permuted_scales, rmap = permute(tokens, routing_map, probs_leaf, row_scales=scales,
                                                              pad_multiple=pad_multiple)
    out = unpermute(y, rmap, probs_leaf, row_scales=y_scales, out_dtype=out_dtype)
    ((out.double() * g_out.double()).sum() + (permuted.double() * g_perm.double()).sum()).backward()
    return {"permuted": permuted.detach(), "permuted_probs": permuted_probs.detach(),
            "permuted_scales": permuted_scales, "out": out.detach(), "grad_tokens": tokens.grad,
            "grad_rows": y.grad, "grad_probs": probs_leaf.grad, "slots": rmap.slots}


@pytest.mark.parametrize("dtype", [*FP8, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("pad_multiple", [1, 8])
def test_oracle_with_row_scales(dtype, out_dtype, pad_multiple):
    T, E, K, H = 64, 8, 3, 48
    want = out_dtype or dtype
    case = _case(T, E, K, H, dtype, want, seed=1, pad_multiple=pad_multiple)
    routing_map, tokens, scales, probs, y, y_scales, g_out, g_perm = case
    r = _run(*case, out_dtype, pad_multiple)
    row_of = expected_rows(routing_map, pad_multiple)
    t_idx, e_idx = routing_map.nonzero(as_tuple=True)
    rows = row_of[t_idx, e_idx]

    # permute: bitwise copies of the tokens' bytes, their probs and scales; pad rows zero.
    expect = torch.zeros_like(r["permuted"])
    expect[rows] = tokens[t_idx]
    assert _same_bits(r["permuted"], expect)
    expect_s = torch.zeros(r["permuted"].shape[0])
    expect_s[rows] = scales[t_idx]
    assert _same_bits(r["permuted_scales"], expect_s)
    assert not r["permuted_scales"].requires_grad

    # unpermute: sum_e p * (s_r * y_r), fp32 products and sum (K + 1 roundings a term), one rounding.
    assert r["out"].dtype == want
    ref, mag = reference_unpermute(y.double() * y_scales.double()[:, None], routing_map, probs.double(), row_of)
    assert_within(r["out"], ref, (K + 1) * U32 * mag * 1.01, want, "unpermute fwd")

    # Gradients of each tensor's own dtype, fp32 compute, one rounding to it.
    assert (r["grad_tokens"].dtype, r["grad_rows"].dtype, r["grad_probs"].dtype) == (dtype, dtype, torch.float32)
    ref, mag = reference_unpermute(g_perm.double(), routing_map, None, row_of)
    assert_within(r["grad_tokens"], ref, K * U32 * mag * 1.01, dtype, "permute bwd")
    ref_rows = torch.zeros((r["grad_rows"].shape[0], H), dtype=torch.float64)
    ref_rows[rows] = g_out.double()[t_idx] * probs.double()[t_idx, e_idx][:, None] * y_scales.double()[rows, None]
    assert_within(r["grad_rows"], ref_rows, 2 * U32 * ref_rows.abs() * 1.01, dtype, "unpermute bwd rows")
    terms = y.double()[rows] * y_scales.double()[rows, None] * g_out.double()[t_idx]
    ref_gp = torch.zeros((T, E), dtype=torch.float64)
    ref_gp[t_idx, e_idx] = terms.sum(1)
    mag_gp = torch.zeros((T, E), dtype=torch.float64)
    mag_gp[t_idx, e_idx] = terms.abs().sum(1)
    assert_within(r["grad_probs"], ref_gp, (H + 1) * U32 * mag_gp * 1.01, torch.float32, "probs grad")


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_permute_copies_every_byte(dtype):
    """Every float8 byte, NaN and negative zero included, arrives unchanged on both backends."""
    gen = torch.Generator().manual_seed(2)
    routing_map = random_routing(16, 4, 2, gen)
    tokens = torch.arange(16 * 16, dtype=torch.int64).remainder(256).to(torch.uint8).view(16, 16).view(dtype)
    results = []
    for backend in ("torch", "triton"):
        with set_backend(backend):
            permuted, _, rmap = permute(tokens, routing_map, pad_multiple=4)
        row_of = expected_rows(routing_map, 4)
        t_idx, e_idx = routing_map.nonzero(as_tuple=True)
        assert torch.equal(_bits(permuted)[row_of[t_idx, e_idx]], _bits(tokens)[t_idx])
        results.append(permuted)
    assert _same_bits(*results)


@pytest.mark.parametrize("dtype,out_dtype,per_token", [
    (torch.float8_e4m3fn, None, False), (torch.float8_e4m3fn, torch.float32, True),
    (torch.float8_e4m3fn, torch.bfloat16, False), (torch.float8_e5m2, None, True),
    (torch.float8_e5m2, torch.bfloat16, True)], ids=str)
def test_triton_interpreter_matches_torch_twin(monkeypatch, dtype, out_dtype, per_token):
    """Bitwise, float8 results included: under the interpreter the kernels build each float8 byte
    with integer arithmetic, so its truncating casts never decide a float8 value (a bf16 output:
    within one ulp, the interpreter truncates there). The probs gradient's in-chunk sum order
    differs (within rounding)."""
    from moe_dispatch.ops import kernels as K

    monkeypatch.setitem(K.LAUNCH, "unpermute_bwd_per_token", per_token)
    want = out_dtype or dtype
    case = _case(13, 6, 3, 40, dtype, want, seed=3, pad_multiple=4)
    with set_backend("torch"):
        a = _run(*case, out_dtype, 4)
    with set_backend("triton"):
        b = _run(*case, out_dtype, 4)
    for key in ["slots", "permuted", "permuted_probs", "permuted_scales", "grad_tokens", "grad_rows"]:
        assert _same_bits(a[key], b[key]), key
    if want == torch.bfloat16:
        diff = (a["out"].double() - b["out"].double()).abs()
        assert bool((diff <= 2 * half_ulp(a["out"].double(), want)).all())
    else:
        assert _same_bits(a["out"], b["out"])
    H = case[4].shape[1]
    scale = float((case[4].double() * case[5].double()[:, None]).abs().max() * case[6].double().abs().max()) * H
    assert float((a["grad_probs"] - b["grad_probs"]).abs().max()) <= 2 * H * U32 * scale


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's masked lanes
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_float8_output_saturates_and_keeps_nan(dtype, device):
    """A float8 result beyond the format's largest value, infinity included, saturates to it
    (torch's own cast would give NaN or inf); NaN (here from a NaN row scale, as quantize_rows
    gives a non-finite row) stays NaN. The kernels alike with the twin."""
    top = float(torch.finfo(dtype).max)
    routing_map = torch.tensor([[True, True], [True, True], [True, False]])
    # Rows 0-2: expert 0's tokens 0, 1, 2; rows 3-4: expert 1's tokens 0, 1.
    rows = torch.tensor([[top, -top, 1.0], [top, -top, 1.0], [top, -top, 2.0], [top, -top, 1.0],
                         [top, -top, 1.0]]).to(dtype)
    row_scales = torch.tensor([1.0, float("nan"), float("inf"), 1.0, 1.0])
    outs = []
    for backend, where in (("torch", "cpu"), ("triton", device)):
        with set_backend(backend):
            _, _, rmap = permute(torch.zeros(3, 3, dtype=dtype, device=where), routing_map.to(where))
            outs.append(unpermute(rows.to(where), rmap, row_scales=row_scales.to(where)).cpu())
    assert _same_bits(*outs)
    out = outs[0].float()
    assert out[0].tolist() == [top, -top, 2.0] and out[2].tolist() == [top, -top, top]
    assert bool(out[1].isnan().all())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_kernel_float8_rounding_equals_torch_on_random_bits(dtype, device):
    """The kernels' float8 rounding (_round_out: round to nearest even; integer-built bytes under
    the interpreter, the saturating cast on CUDA) against torch's cast, bitwise, on random fp32
    bit patterns of every exponent up to the format's largest value (subnormals and fp32
    subnormals included) and the ties: through quantize_rows on rows whose amax is that largest
    value, where inv = 1 and q = round(x)."""
    top = float(torch.finfo(dtype).max)
    step = float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps)  # the subnormal step
    gen = torch.Generator().manual_seed(10)
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 16,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = x.view(torch.float32)
    x = x[x.abs() <= top]  # NaN and larger values drop out (saturation: test_float8_output_saturates...)
    ties = torch.tensor([step / 2, 1.5 * step, 2.5 * step, step / 4, 1.0 + 1 / 16, 1.0 + 3 / 16, 1.0 + 1 / 8,
                         top * (1 - 2.0 ** -5), 0.0, -0.0])
    x = torch.cat([x, ties, -ties])
    x = torch.cat([x, x.new_zeros(-x.numel() % 511)]).view(-1, 511)
    x = torch.cat([torch.full((x.shape[0], 1), top), x], dim=1)  # amax = top: scale and inv exactly 1
    with set_backend("triton"):
        q, scales = (t.cpu() for t in quantize_rows(x.to(device), dtype))
    assert bool((scales == 1).all())
    assert torch.equal(_bits(q), _bits(x.to(dtype)))


# ---------------------------------------------------------------------------------------------
# quantize_rows
# ---------------------------------------------------------------------------------------------
def _rows_to_quantize(T: int, H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of magnitudes 1e-6 .. 1e6, a zero row, a row below the 2^-64 floor, a row with NaN,
    a row with inf, and a row holding the format's largest value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=gen) * torch.logspace(-6, 6, T)[torch.randperm(T, generator=gen)][:, None]
    x[0] = 0
    x[1] = torch.randn(H, generator=gen) * 1e-25
    x[2, 3] = float("nan")
    x[3, 5] = -float("inf")
    x[4, 7] = 448.0
    return x.to(dtype)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quantize_rows_against_float64(fp8, dtype):
    x = _rows_to_quantize(40, 72, dtype, seed=4)
    if dtype == torch.float16:
        x = x.float().clamp(-6e4, 6e4).to(dtype)  # rows of 1e6 would be inf in fp16
        x[3, 5] = -float("inf")
    q, scales = quantize_rows(x, fp8)
    assert q.dtype == fp8 and q.shape == x.shape and scales.dtype == torch.float32 and scales.shape == (40,)
    top = float(torch.finfo(fp8).max)
    x64 = x.double()
    finite = torch.isfinite(x64).all(1)
    amax = x64.abs().amax(1)
    small = finite & (amax < 2.0 ** -64)
    normal = finite & ~small
    # scale = amax / M correctly rounded to fp32; zero and tiny rows 1, non-finite rows NaN.
    assert torch.equal(scales[normal], (amax[normal] / top).float())
    assert bool((scales[small] == 1).all()) and bool(scales[~finite].isnan().all())
    assert bool(((_bits(q[~finite | small]) & 0x7F) == 0).all())  # zeros (of either sign)
    # q within half a float8 ulp (plus the two fp32 roundings, inv and x * inv) of x * M / amax.
    ideal = x64[normal] * top / amax[normal, None]
    assert_within(q[normal], ideal, 2 * U32 * ideal.abs() * 1.01, fp8, "quantize_rows")
    assert bool((q[normal].float().abs().amax(1) == top).all())  # each row reaches +-M at its amax
    # Dequantised: q * scale ~ x, relative to the row's amax.
    err = (q[normal].double() * scales[normal].double()[:, None] - x64[normal]).abs() / amax[normal, None]
    assert float(err.max()) <= float(torch.finfo(fp8).eps) / 2 * 1.01


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("elements", [8192, 512, 64], ids=["one_pass", "one_pass_blocks_of_2", "two_pass"])
@pytest.mark.parametrize("programs_per_sm", [0, 2], ids=["program_per_block", "strided"])
def test_quantize_kernel_matches_twin_bitwise(monkeypatch, fp8, elements, programs_per_sm):
    """The interpreted kernel against the twin, bitwise, on strided input; with 64 elements per
    program a row of 200 takes the kernel's two-pass route; "strided": 2 programs (the interpreter
    counts one SM) loop over the row blocks. A row's result never depends on the other rows of its
    batch."""
    from moe_dispatch.ops import kernels as K

    monkeypatch.setitem(K.LAUNCH, "quantize_elements", elements)
    monkeypatch.setitem(K.LAUNCH, "quantize_programs_per_sm", programs_per_sm)
    monkeypatch.setitem(K.LAUNCH, "quantize_stages", 2)
    x = _rows_to_quantize(11, 400, torch.bfloat16, seed=5)[:, ::2]
    assert not x.is_contiguous()
    twin = TW.quantize_rows(x, fp8)
    with set_backend("triton"):
        kernel = quantize_rows(x, fp8)
        alone = quantize_rows(x[6:9], fp8)
    for u, v in zip(twin, kernel):
        assert _same_bits(u, v)
    assert _same_bits(alone[0], kernel[0][6:9]) and _same_bits(alone[1], kernel[1][6:9])


def test_quantize_empty_and_the_registered_op():
    for shape in ((0, 16), (3, 0)):
        q, scales = quantize_rows(torch.zeros(shape), torch.float8_e4m3fn)
        assert q.shape == shape and torch.equal(scales, torch.ones(shape[0]))
    from moe_dispatch.ops import quantize as quantize_module

    x = torch.randn(5, 24)
    # torch's schema check compares outputs with allclose, which float8 lacks on CPU.
    torch.library.opcheck(quantize_module._quantize_rows_op, (x, torch.float8_e5m2),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    compiled = torch.compile(lambda t: quantize_rows(t, torch.float8_e4m3fn), backend="aot_eager", fullgraph=True)
    for u, v in zip(compiled(x), quantize_rows(x, torch.float8_e4m3fn)):
        assert _same_bits(u, v)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dequantize_rows_against_float64(fp8, out_dtype):
    """dequantize_rows: q * scale rounded once from its exact value (the fp32 product of a float8
    value and an fp32 scale is exact up to one fp32 rounding, then one to out_dtype), zero rows
    zero, a NaN scale a NaN row; and it undoes quantize_rows to the format's precision."""
    x = _rows_to_quantize(40, 72, torch.float32, seed=9)
    q, scales = quantize_rows(x, fp8)
    out = dequantize_rows(q, scales, out_dtype)
    assert out.dtype == out_dtype and out.shape == x.shape and out.is_contiguous()
    exact = q.double() * scales.double()[:, None]
    finite = torch.isfinite(scales)
    assert torch.equal(out[finite], exact[finite].float().to(out_dtype))  # fp32 product: exact here
    assert bool(out[~finite].isnan().all())
    amax = x.double().abs().amax(1)
    # rows within out_dtype's range (fp16 overflows the rows of 1e6)
    normal = finite & (amax >= 2.0 ** -64) & (amax < float(torch.finfo(out_dtype).max) / 2)
    err = (out[normal].double() - x.double()[normal]).abs() / amax[normal, None]
    bound = float(torch.finfo(fp8).eps) / 2 * 1.01 + float(torch.finfo(out_dtype).eps)
    assert float(err.max()) <= bound


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_kernel_matches_twin_bitwise(monkeypatch, fp8, out_dtype):
    """The interpreted kernel against the twin, bitwise, on rows read in place with a row stride
    above H (the FP8 wire's layout), blocks that leave ragged edges in both dimensions, float8
    NaN and inf bytes, and a NaN scale; rows alone give the bits they get in the batch."""
    from moe_dispatch.ops import kernels as K

    monkeypatch.setitem(K.LAUNCH, "dequantize_block_t", 4)
    monkeypatch.setitem(K.LAUNCH, "dequantize_block_h", 64)
    gen = torch.Generator().manual_seed(10)
    wide = (torch.randn((11, 208), generator=gen) * 100).to(fp8)
    wide.view(torch.uint8)[1, 3] = 0x7F  # NaN in both formats
    if fp8 == torch.float8_e5m2:
        wide.view(torch.uint8)[2, 4] = 0x7C  # +inf
    q = wide[:, :200]
    scales = torch.rand(11, generator=gen) + 0.25
    scales[5] = float("nan")
    twin = TW.dequantize_rows(q, scales, out_dtype)
    with set_backend("triton"):
        kernel = dequantize_rows(q, scales, out_dtype)
        alone = dequantize_rows(q[6:9], scales[6:9], out_dtype)
    # NaN payloads differ between torch's and the kernel's widening: every NaN counts as one.
    if out_dtype == torch.float32:
        assert _same_bits_but_nan(twin, kernel)
    else:  # the interpreter truncates fp32 -> bf16 (compiled, it rounds: test_cuda_dequantize_matches_twin)
        nan = twin.isnan()
        assert _same_bits(nan, kernel.isnan())
        step = (twin.float().abs() * 2.0 ** -7)[~nan]
        k, t = kernel.float()[~nan], twin.float()[~nan]
        assert bool(((k == t) | ((k - t).abs() <= step)).all())  # == for the infs
    assert _same_bits(alone, kernel[6:9])
    assert bool(kernel[1, 3].isnan()) and bool(kernel[5].isnan().all())


def test_dequantize_empty_and_the_registered_op():
    for shape in ((0, 16), (3, 0)):
        out = dequantize_rows(torch.zeros(shape).to(torch.float8_e4m3fn), torch.ones(shape[0]), torch.bfloat16)
        assert out.shape == shape and out.dtype == torch.bfloat16
    from moe_dispatch.ops import quantize as quantize_module

    q, scales = quantize_rows(torch.randn(5, 24), torch.float8_e4m3fn)
    torch.library.opcheck(quantize_module._dequantize_rows_op, (q, scales, torch.float32),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    compiled = torch.compile(lambda a, b: dequantize_rows(a, b, torch.bfloat16), backend="aot_eager", fullgraph=True)
    assert _same_bits(compiled(q, scales), dequantize_rows(q, scales, torch.bfloat16))


def test_quantize_then_permute_and_unpermute():
    """The FP8 dispatch's path: quantise the tokens, permute bytes and scales, unpermute the
    dequantised rows into bf16: within float8's precision of the bf16 path."""
    gen = torch.Generator().manual_seed(6)
    routing_map = random_routing(32, 8, 2, gen)
    probs = torch.rand((32, 8), generator=gen) * routing_map
    x = torch.randn((32, 64), generator=gen)
    q, scales = quantize_rows(x, torch.float8_e4m3fn)
    permuted, permuted_probs, permuted_scales, rmap = permute(q, routing_map, probs, row_scales=scales)
    out = unpermute(permuted, rmap, probs, row_scales=permuted_scales, out_dtype=torch.bfloat16)
    permuted_x, _, rmap_x = permute(x, routing_map, probs)
    exact = unpermute(permuted_x, rmap_x, probs, out_dtype=torch.float32)
    amax = x.abs().amax(1, keepdim=True)
    # Two experts, half an e4m3 ulp of the row's amax each (2^-4), then the bf16 rounding (2^-9).
    assert float(((out.float() - exact).abs() / amax).max()) <= 2 * 2.0 ** -4 + 2 * 2.0 ** -9


# ---------------------------------------------------------------------------------------------
# Bad input: errors naming the argument.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,exc,match", [
    (lambda t, m, s: permute(t, m, row_scales=s.double()), TypeError, "row_scales"),
    (lambda t, m, s: permute(t, m, row_scales=s[:-1]), ValueError, "row_scales"),
    (lambda t, m, s: permute(t, m, row_scales=s.tolist()), TypeError, "row_scales"),
    (lambda t, m, s: unpermute(*permute(t, m)[::2], row_scales=s), ValueError, "row_scales"),
    (lambda t, m, s: unpermute(*permute(t, m)[::2], out_dtype=torch.float64), TypeError, "out_dtype"),
    (lambda t, m, s: unpermute(*permute(t, m)[::2], out_dtype=torch.float8_e5m2), TypeError, "out_dtype"),
    (lambda t, m, s: unpermute(*permute(t, m)[::2], out_dtype="bf16"), TypeError, "out_dtype"),
    (lambda t, m, s: quantize_rows(t.float()[0], torch.float8_e4m3fn), ValueError, "x"),
    (lambda t, m, s: quantize_rows(t.to(torch.int8), torch.float8_e4m3fn), TypeError, "x"),
    (lambda t, m, s: quantize_rows(t, torch.float8_e4m3fn), TypeError, "x"),
    (lambda t, m, s: quantize_rows(t.float(), torch.bfloat16), TypeError, "fp8_dtype"),
    (lambda t, m, s: dequantize_rows(t.float(), s, torch.bfloat16), TypeError, "q"),
    (lambda t, m, s: dequantize_rows(t, s[:-1], torch.bfloat16), ValueError, "scales"),
    (lambda t, m, s: dequantize_rows(t, s.double(), torch.bfloat16), ValueError, "scales"),
    (lambda t, m, s: dequantize_rows(t, s, torch.float8_e4m3fn), TypeError, "out_dtype"),
    (lambda t, m, s: dequantize_rows(t, s, torch.float64), TypeError, "out_dtype"),
])
def test_bad_input(make, exc, match):
    gen = torch.Generator().manual_seed(7)
    routing_map = random_routing(10, 4, 2, gen)
    tokens = torch.randn((10, 8), generator=gen).to(torch.float8_e4m3fn)
    with pytest.raises(exc, match=match):
        make(tokens, routing_map, torch.rand(10, generator=gen))


def test_custom_op_schemas_keep_older_calls():
    """Arguments added for float8 (row_scales, out_dtype) come last with defaults: calls written
    against the older schemas (scripts, other packages) keep working."""
    for op, tail in ((custom_ops._permute_op, "Tensor? row_scales=None"),
                     (custom_ops._unpermute_op, "Tensor? row_scales=None, ScalarType? out_dtype=None"),
                     (custom_ops._unpermute_bwd_op, "Tensor? row_scales=None")):
        assert str(op._opoverload._schema).split(") ->")[0].endswith(tail)


# ---------------------------------------------------------------------------------------------
# GPU: the kernels on CUDA against the CPU twin, bitwise.
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_dequantize_matches_twin(fp8, out_dtype):
    """dequantize_rows' compiled kernel against the CPU twin, bitwise (any NaN equal to any NaN), on
    the FP8 wire's layout (rows read in place at a row stride above H)."""
    gen = torch.Generator().manual_seed(11)
    wide = (torch.randn((3000, 4112), generator=gen) * 100).to(fp8)
    q, scales = wide[:, :4096], torch.rand(3000, generator=gen) + 0.25
    scales[7] = float("nan")
    cuda = dequantize_rows(q.cuda(), scales.cuda(), out_dtype).cpu()
    assert _same_bits_but_nan(TW.dequantize_rows(q, scales, out_dtype), cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32], ids=str)
def test_cuda_fp8_matches_cpu_twin_bitwise(dtype, out_dtype):
    want = out_dtype or dtype
    case = _case(2048, 64, 6, 1000, dtype, want, seed=8, pad_multiple=16)
    cpu = _run(*case, out_dtype, 16)
    gpu = _run(*[a.cuda() for a in case], out_dtype, 16)
    for key in ["slots", "permuted", "permuted_probs", "permuted_scales", "out", "grad_tokens", "grad_rows"]:
        assert _same_bits(cpu[key], gpu[key].cpu()), key
    x = _rows_to_quantize(4096, 4096, torch.bfloat16, seed=9)
    for u, v in zip(TW.quantize_rows(x, dtype), quantize_rows(x.cuda(), dtype)):
        assert _same_bits(u, v.cpu())
