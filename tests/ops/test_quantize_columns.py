"""ops.quantize_group_columns: its Triton kernel (under the interpreter, and compiled on CUDA) against
its torch twin and against the eager algorithm experts/fp8.py used before the op (kept below as the
reference), bitwise, for count patterns with empty experts, single rows, counts that are not
multiples of 16 and one expert holding every row; float8_e4m3fn and e5m2; fp32 and bf16 inputs;
inf, NaN, -0.0 and tiny columns."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.numerics.rounding import round_up
from moe_dispatch.ops import quantize as Q
from moe_dispatch.ops import quantize_group_columns, set_backend
from moe_dispatch.ops import torch_twin as TW

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
PATTERNS = [[0, 0, 0], [1], [1, 0, 1], [5, 17, 0, 33], [0, 50, 0], [16, 32, 15]]
_INT_OF_SIZE = {1: torch.uint8, 4: torch.int32}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(_INT_OF_SIZE[x.element_size()])


def _same(a: tuple, b: tuple) -> bool:
    return all(u.dtype == v.dtype and u.shape == v.shape and torch.equal(_bits(u.cpu()), _bits(v.cpu()))
               for u, v in zip(a, b))


def _old_chunks(lengths, budget):
    out, e0, longest = [], 0, 0
    for e, n in enumerate(lengths):
        if e > e0 and (e - e0 + 1) * max(longest, n) > budget:
            out.append((e0, e))
            e0, longest = e, 0
        longest = max(longest, n)
    if lengths:
        out.append((e0, len(lengths)))
    return out


def _old_quantize_group_columns(x, counts, fp8_dtype, pad_to=16):
    """The eager algorithm experts/fp8.py ran before the fused op: experts grouped, zero-padded into
    a slab, one quantize_rows per group, then the padded blocks picked out."""
    n_rows, c = x.shape
    padded = [round_up(n, pad_to) for n in counts]
    qt = torch.zeros(c, sum(padded), dtype=torch.uint8, device=x.device)
    scales = torch.ones(len(counts), c, dtype=torch.float32, device=x.device)
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    pstart = 0
    for e0, e1 in _old_chunks(padded, 2 * max(n_rows, 1)):
        width, length = sum(padded[e0:e1]), max(padded[e0:e1])
        if length:
            g = e1 - e0
            slab = x.new_zeros(c, g * length)
            dest = torch.cat([torch.arange(counts[e]) + i * length for i, e in enumerate(range(e0, e1))])
            slab.index_copy_(1, dest.to(x.device), x[starts[e0] : starts[e1]].t())
            q, s = TW.quantize_rows(slab.view(c * g, length), fp8_dtype)
            scales[e0:e1] = s.view(c, g).t()
            q = q.view(torch.uint8).view(c, g * length)
            if width != g * length:
                src = torch.cat([torch.arange(padded[e]) + i * length for i, e in enumerate(range(e0, e1))])
                q = q.index_select(1, src.to(x.device))
            qt[:, pstart : pstart + width] = q
        pstart += width
    return qt.view(fp8_dtype), scales


def _starts(counts, device="cpu", dtype=torch.int64, pad_to=16):
    rows = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    padded = torch.tensor([0, *[round_up(n, pad_to) for n in counts]], dtype=torch.int64).cumsum(0)
    return rows.to(device=device, dtype=dtype), padded.to(device=device, dtype=dtype), int(padded[-1])


def _columns(n_rows, c, dtype, seed):
    """x [N, C]: columns of very different magnitudes, one with inf, one with NaN, one of -0.0 and
    zeros, one under the amax floor, and values at the format's edges once scaled."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n_rows, c), generator=gen) * torch.logspace(-3, 3, c)[None, :]
    if n_rows:
        x[n_rows // 2, 1] = float("inf")
        x[n_rows - 1, 2] = float("nan")
        x[:, 3] = 0.0
        x[::2, 3] = -0.0
        x[:, 4] *= 2.0 ** -70
        x[0, 5] = -1e30
    return x.to(dtype)


def _route(monkeypatch, K, splits):
    """Small blocks (8 columns, 16 rows) and the route: splits slices per expert, or "tiles"."""
    monkeypatch.setitem(K.LAUNCH, "group_columns_block_c", 8)
    monkeypatch.setitem(K.LAUNCH, "group_columns_block_r", 16)
    monkeypatch.setitem(K.LAUNCH, "group_columns_splits", 1 if splits == "tiles" else splits)
    monkeypatch.setitem(K.LAUNCH, "group_columns_tiles", splits == "tiles")


def _kernel(*args):
    with set_backend("triton"):
        return quantize_group_columns(*args)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's masked lanes
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [1, 3, "tiles"], ids=["one_slice", "three_slices", "tiles"])
def test_kernel_twin_and_old_algorithm_bitwise(monkeypatch, fp8, dtype, splits):
    from moe_dispatch.ops.kernels import quantize as K

    # Small blocks: several column blocks, several row steps per expert, and partial ones; with three
    # slices an expert's rows (and its padded width) are split over three programs, some empty; the
    # tiled route cuts each padded width into tiles of 16 rows, one program each.
    _route(monkeypatch, K, splits)
    for i, counts in enumerate(PATTERNS):
        x = _columns(sum(counts), 16, dtype, seed=i)
        args = (x, *_starts(counts), fp8)
        twin = quantize_group_columns(*args)
        assert _same(twin, _old_quantize_group_columns(x, counts, fp8)), counts
        assert _same(_kernel(*args), twin), counts


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("x_dtype", [*FP8, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [1, 2, "tiles"], ids=["one_slice", "two_slices", "tiles"])
def test_row_scales(monkeypatch, x_dtype, splits):
    """With row_scales the values are x.float() * row_scales[:, None] (the FP8 GEMM's dequantised
    forward rows), bitwise as if that product had been materialised first; a NaN scale or a float8
    NaN makes its columns non-finite (with two slices, also when the NaN lies in another slice than
    the column's other rows)."""
    from moe_dispatch.ops.kernels import quantize as K

    _route(monkeypatch, K, splits)
    counts = [5, 17, 0, 20]
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn((sum(counts), 16), generator=gen) * 8).to(x_dtype)
    row_scales = torch.rand(sum(counts), generator=gen) * 2.0 ** torch.randint(-20, 20, (sum(counts),), generator=gen)
    row_scales[7] = float("nan")
    row_scales[30] = 0.0
    if x_dtype in FP8:
        x.view(torch.uint8)[40, 3] = 0x7F  # NaN in both formats
    args = (x, *_starts(counts), torch.float8_e4m3fn)
    twin = quantize_group_columns(*args, row_scales)
    assert _same(twin, _old_quantize_group_columns(x.float() * row_scales[:, None], counts, torch.float8_e4m3fn))
    assert twin[1][1].isnan().all() and bool(twin[1][3, 3].isnan()) == (x_dtype in FP8)
    with set_backend("triton"):
        assert _same(quantize_group_columns(*args, row_scales), twin)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("x_dtype", FP8, ids=str)
def test_every_float8_byte_as_input(x_dtype):
    """All 256 bytes of a float8 x (NaN and e5m2's inf included), with and without row scales."""
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(x_dtype).view(16, 16)
    for row_scales in (None, torch.full((16,), 0.75)):
        args = (x, *_starts([7, 9]), torch.float8_e5m2, row_scales)
        twin = quantize_group_columns(*args)
        assert twin[1].isnan().any()
        with set_backend("triton"):
            assert _same(quantize_group_columns(*args), twin)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_strided_input_int32_starts_and_the_values():
    """A transposed view and int32 starts; the scales and bytes are quantize_rows' of each block."""
    counts = [3, 0, 21]
    x = _columns(sum(counts), 12, torch.float32, seed=9).t().contiguous().t()
    assert not x.is_contiguous()
    args = (x, *_starts(counts, dtype=torch.int32), torch.float8_e4m3fn)
    qt, scales = quantize_group_columns(*args)
    assert qt.shape == (12, 16 + 0 + 32) and scales.shape == (3, 12) and qt.is_contiguous()
    q0, s0 = TW.quantize_rows(x[:3].t(), torch.float8_e4m3fn)
    assert _same((qt[:, :3], scales[0]), (q0, s0))
    assert not qt[:, 3:16].view(torch.uint8).any() and torch.equal(scales[1], torch.ones(12))
    assert scales[2].isnan().tolist()[1:3] == [True, True] and not qt[1:3, 16:].view(torch.uint8).any()
    assert _same(_kernel(*args), (qt, scales))


@pytest.mark.parametrize("n_rows,c,counts", [(0, 8, []), (0, 8, [0, 0]), (7, 0, [7]), (0, 0, [0])])
def test_empty(n_rows, c, counts):
    x = torch.zeros(n_rows, c)
    args = (x, *_starts(counts), torch.float8_e5m2)
    twin = quantize_group_columns(*args)
    assert twin[0].shape == (c, round_up(n_rows, 16) if counts else 0) and twin[1].shape == (len(counts), c)
    assert torch.equal(twin[1], torch.ones(len(counts), c)) and not twin[0].view(torch.uint8).any()
    assert _same(_kernel(*args), twin)


def test_registered_op_and_compile():
    counts = [2, 5]
    x = _columns(7, 16, torch.float32, seed=3)[:, 6:]
    args = (x, *_starts(counts), torch.float8_e4m3fn)
    # torch's schema check compares outputs with allclose, which float8 lacks on CPU.
    torch.library.opcheck(Q._quantize_group_columns_op, args, test_utils=("test_autograd_registration",
                                                                          "test_faketensor"))
    compiled = torch.compile(lambda t: quantize_group_columns(t, *args[1:]), backend="aot_eager", fullgraph=True)
    assert _same(compiled(x), quantize_group_columns(*args))


def _good():
    return torch.zeros(5, 8), *_starts([2, 3]), torch.float8_e4m3fn


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: (a[0][0], *a[1:]), ValueError, "x must be 2-D"),
    (lambda a: (a[0].to(torch.int32), *a[1:]), TypeError, "x must be"),
    (lambda a: (a[0].tolist(), *a[1:]), TypeError, "x must be"),
    (lambda a: (a[0], a[1].float(), *a[2:]), TypeError, "row_starts"),
    (lambda a: (a[0], a[1][None], *a[2:]), ValueError, "row_starts"),
    (lambda a: (a[0], a[1][:0], *a[2:]), ValueError, "row_starts"),
    (lambda a: (a[0], a[1].tolist(), *a[2:]), TypeError, "row_starts"),
    (lambda a: (a[0], a[1], a[2][:-1], *a[3:]), ValueError, "padded_starts"),
    (lambda a: (a[0], a[1], a[2].to(torch.int16), *a[3:]), TypeError, "padded_starts"),
    (lambda a: (a[0], a[1], a[2], -1, a[4]), ValueError, "padded_rows"),
    (lambda a: (a[0], a[1], a[2], 32.0, a[4]), ValueError, "padded_rows"),
    (lambda a: (*a[:4], torch.bfloat16), TypeError, "fp8_dtype"),
    (lambda a: (*a, torch.ones(5, dtype=torch.float64)), TypeError, "row_scales"),
    (lambda a: (*a, torch.ones(4)), ValueError, "row_scales"),
    (lambda a: (*a, [1.0] * 5), TypeError, "row_scales"),
    # Values the CPU twin checks (the kernel reads none on the host).
    (lambda a: (a[0], torch.tensor([0, 3, 4]), *a[2:]), ValueError, "row_starts must rise from 0 to the 5 rows"),
    (lambda a: (a[0], torch.tensor([0, 3, 2]), *a[2:]), ValueError, "row_starts"),
    (lambda a: (a[0], a[1], torch.tensor([0, 16, 48]), *a[3:]), ValueError, "padded_starts must rise"),
    (lambda a: (a[0], a[1], torch.tensor([0, 1, 32]), *a[3:]), ValueError, "expert 0 has 2 rows and 1 padded"),
])
def test_bad_input_names_the_argument(change, exc, match):
    with pytest.raises(exc, match=match):
        quantize_group_columns(*change(_good()))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tiles", [False, True], ids=["per_expert", "tiles"])
def test_cuda_kernel_matches_twin_bitwise(monkeypatch, fp8, dtype, tiles):
    """The compiled kernel (its float8 casts are the hardware's) against the CPU twin, both routes."""
    from moe_dispatch.ops.kernels import quantize as K

    monkeypatch.setitem(K.LAUNCH, "group_columns_tiles", tiles)
    gen = torch.Generator().manual_seed(11)
    counts = torch.randint(0, 300, (64,), generator=gen).tolist()
    counts[3], counts[7], counts[9] = 0, 1, 4000
    x = _columns(sum(counts), 1000, dtype, seed=12)
    twin = quantize_group_columns(x, *_starts(counts), fp8)
    cuda = quantize_group_columns(x.cuda(), *_starts(counts, device="cuda"), fp8)
    assert _same(twin, cuda)
    strided = quantize_group_columns(x.cuda().t().contiguous().t(), *_starts(counts, device="cuda"), fp8)
    assert _same(twin, strided)
    # float8 rows with row scales (the FP8 GEMM's saved input): the hardware's widening cast.
    q, row_scales = TW.quantize_rows(x, fp8)
    q.view(torch.uint8)[5, :8] = 0x7F  # NaN
    twin = quantize_group_columns(q, *_starts(counts), fp8, row_scales)
    cuda = quantize_group_columns(q.cuda(), *_starts(counts, device="cuda"), fp8, row_scales.cuda())
    assert _same(twin, cuda)


_COMPILE = """
import sys
from tests.ops import compile_sm90 as C
from moe_dispatch.ops.kernels import quantize as K


def variants():
    for fp8, x, starts, has_scales, splits in ((C.E4M3, "*bf16", "*i64", False, 1), (C.E5M2, "*fp32", "*i32", False, 1),
                                               (C.E4M3, "*fp8e4nv", "*i64", True, 1),
                                               (C.E4M3, "*fp8e5", "*i64", True, 1), (C.E4M3, "*bf16", "*i64", False, 4),
                                               (C.E4M3, "*fp8e4nv", "*i32", True, 4)):
        common = dict(BLOCK_R=64, BLOCK_C=64, SPLITS=splits, HAS_SCALES=has_scales,
                      X_FP8_MAX=C.E4M3 if "e4" in x else C.E5M2 if "e5" in x else 0.0)
        pointers = {"x_ptr": x, "starts_ptr": starts, "pstarts_ptr": starts}
        yield K._quantize_group_columns_kernel, dict(common, FP8_MAX=fp8, AMAX_FLOOR=2.0 ** -64), pointers
        if splits > 1:
            yield K._group_columns_amax_kernel, common, pointers
        else:  # the tiled route's three kernels
            tiled = dict(common, LOG2_G=7)
            del tiled["SPLITS"]
            yield K._quantize_tiles_amax_kernel, tiled, pointers
            yield K._quantize_tiles_scales_kernel, dict(FP8_MAX=fp8, AMAX_FLOOR=2.0 ** -64, BLOCK_K=8, BLOCK_C=64), \
                pointers
            yield K._quantize_tiles_cast_kernel, dict(tiled, FP8_MAX=fp8), pointers


C.variants = variants
C.POINTERS.update(starts_ptr="*i64", pstarts_ptr="*i64", qt_ptr="*u8", row_scales_ptr="*fp32", tile_ends_ptr="*i64",
                  inv_ptr="*fp32")
sys.exit(C.main())
"""


def test_kernel_compiles_for_sm90():
    """The real compiler path (the interpreter skips it), with compile_sm90.py's settings: both
    float8 casts, bf16, fp32 and float8 rows (these with row scales), int64 and int32 starts, one
    slice per expert and four (with the slices' amax kernel), and the tiled route's three kernels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception as exc:
        pytest.skip(f"no NVIDIA backend in this Triton: {exc}")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("ok ") == 20, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("counts,n_rows", [([5, 0, 17, 1], 23), ([5, 0, 17, 1], 40), ([0, 0], 0), ([16, 32], 48)])
def test_wgrad_layout_feeds_the_op(counts, n_rows):
    """experts/fp8.py's wgrad_layout (device starts from the row ends, no host read): each expert
    round_up(max(n, 1), 16) columns, then a slack group of the trailing rows up to P = round_up(N, 16)
    + 16 E; the op on that layout gives each expert the old algorithm's bits (float8 rows with row
    scales those of the old algorithm on the dequantised rows) and zeros in its padding."""
    from moe_dispatch.experts import fp8 as F

    row_ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    row_starts, padded_starts, P = F.wgrad_layout(row_ends, n_rows)
    widths = [round_up(max(n, 1), 16) for n in counts]
    assert P == round_up(n_rows, 16) + 16 * len(counts)
    assert row_starts.tolist() == [0, *row_ends.tolist(), n_rows]
    assert padded_starts.tolist() == [0, *torch.tensor(widths).cumsum(0).tolist(), P]
    x = _columns(n_rows, 16, torch.bfloat16, seed=4)
    q, row_scales = TW.quantize_rows(x, torch.float8_e4m3fn)
    n = sum(counts)
    for rows, scales in ((x, None), (q, row_scales)):
        qt, s = quantize_group_columns(rows, row_starts, padded_starts, P, torch.float8_e4m3fn, scales)
        real = x[:n] if scales is None else q[:n].float() * row_scales[:n, None]
        old_qt, old_s = _old_quantize_group_columns(real, counts, torch.float8_e4m3fn)
        assert torch.equal(_bits(s[:-1]), _bits(old_s))
        old_start = 0
        for e, (count, start) in enumerate(zip(counts, padded_starts.tolist())):
            assert torch.equal(_bits(qt[:, start : start + count]), _bits(old_qt[:, old_start : old_start + count]))
            assert not _bits(qt[:, start + count : start + widths[e]]).any()
            old_start += round_up(count, 16)
