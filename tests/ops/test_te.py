"""moe_dispatch.ops.te (TransformerEngine 2.20's permutation functions over our kernels) against a
PyTorch reference (TE's test formulas) and a float64 oracle; bad input; torch.compile;
ops.te_v1; examples/te_report.py at its quick size."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_dispatch.ops import te, te_v1
from tests.ops.oracle import U32, assert_within, random_routing

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mask_case(T=24, E=6, K=2, H=16, dtype=torch.bfloat16, probs_dtype=torch.float32, seed=0):
    g = _gen(seed)
    routing_map = random_routing(T, E, K, g) if T else torch.zeros((0, E), dtype=torch.bool)
    x = torch.randn((T, H), generator=g).to(dtype)
    probs = (torch.rand((T, E), generator=g) * routing_map).to(probs_dtype)
    return routing_map, x, probs


def _ref_order(routing_map: torch.Tensor) -> torch.Tensor:
    """TE's test reference: [N] source token of each permuted row (expert-major, ascending token)."""
    T, E = routing_map.shape
    tokens = torch.arange(T)[None, :].expand(E, T)
    return tokens.masked_select(routing_map.T.contiguous())


def _ref_probs(routing_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return probs.T.contiguous().masked_select(routing_map.T.contiguous())


def _f64_unpermute(rows: torch.Tensor, token_of_row: torch.Tensor, weights: torch.Tensor | None, T: int):
    """float64 oracle: (out [T, H], sum of |terms| [T, H]) of rows summed into their tokens."""
    terms = rows.double() * (1.0 if weights is None else weights.double()[:, None])
    out = torch.zeros((T, rows.shape[1]), dtype=torch.float64).index_add_(0, token_of_row, terms)
    mag = torch.zeros_like(out).index_add_(0, token_of_row, terms.abs())
    return out, mag


# ---------------------------------------------------------------------------------------------
# Mask maps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_row_order_and_gradients_against_reference_and_float64(dtype):
    routing_map, x, probs = _mask_case(dtype=dtype)
    T, E = routing_map.shape
    N = int(routing_map.sum())
    order = _ref_order(routing_map)
    x_leaf, p_leaf = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, permuted_probs, row_id_map = te.moe_permute_with_probs(x_leaf, p_leaf, routing_map, N)
    assert row_id_map.dtype == torch.int32 and list(row_id_map.shape) == [T, 2 * E + 1]
    assert torch.equal(out, x[order]) and torch.equal(permuted_probs, _ref_probs(routing_map, probs))
    g = torch.randn((N, H := x.shape[1]), generator=_gen(1)).to(dtype)
    gp = torch.randn((N,), generator=_gen(2))
    torch.autograd.backward([out, permuted_probs], [g, gp])
    # The reference's gradient (index_select's backward, the same fixed order here) and float64.
    ref_leaf = x.clone().requires_grad_()
    ref_leaf[order].backward(g)
    assert torch.equal(x_leaf.grad, ref_leaf.grad)
    exact, mag = _f64_unpermute(g, order, None, T)
    assert_within(x_leaf.grad, exact, 3 * U32 * mag, dtype, "permute grad")
    expect_gp = torch.zeros(T, E)
    expect_gp[order, routing_map.T.nonzero()[:, 0]] = gp
    assert torch.equal(p_leaf.grad, expect_gp)

    # unpermute with merging probs: forward and both gradients against float64.
    y = torch.randn((N, H), generator=_gen(3)).to(dtype).requires_grad_()
    p2 = probs.clone().requires_grad_()
    res = te.moe_unpermute(y, row_id_map, p2, restore_shape=x.shape)
    w = _ref_probs(routing_map, probs)
    exact, mag = _f64_unpermute(y.detach(), order, w, T)
    assert_within(res.detach(), exact, 3 * U32 * mag, dtype, "unpermute")
    ref_y = y.detach().clone().requires_grad_()
    ref_p = probs.clone().requires_grad_()
    ref = torch.zeros((T, H), dtype=dtype).index_add(0, order, (ref_y * _ref_probs(routing_map, ref_p)[:, None])
                                                      .to(dtype))
    go = torch.randn((T, H), generator=_gen(4)).to(dtype)
    res.backward(go)
    ref.backward(go)
    assert torch.equal(y.grad, ref_y.grad)  # g * p, one rounding on both sides
    exact_gp = torch.zeros(T, E, dtype=torch.float64)
    exact_gp[order, routing_map.T.nonzero()[:, 0]] = (y.detach().double() * go.double()[order]).sum(1)
    mag_gp = torch.zeros(T, E, dtype=torch.float64)
    mag_gp[order, routing_map.T.nonzero()[:, 0]] = (y.detach().double() * go.double()[order]).abs().sum(1)
    assert_within(p2.grad, exact_gp, H * U32 * mag_gp, torch.float32, "probs grad")


@pytest.mark.parametrize("probs_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_probs_of_any_float_dtype_keep_their_dtype(probs_dtype):
    routing_map, x, probs = _mask_case(probs_dtype=probs_dtype)
    N = int(routing_map.sum())
    p = probs.clone().requires_grad_()
    out, permuted_probs, row_id_map = te.moe_permute_with_probs(x, p, routing_map, N)
    assert permuted_probs.dtype == probs_dtype
    assert torch.equal(permuted_probs, _ref_probs(routing_map, probs))
    res = te.moe_unpermute(out, row_id_map, p)
    exact, mag = _f64_unpermute(out, _ref_order(routing_map), _ref_probs(routing_map, probs), x.shape[0])
    assert_within(res.detach(), exact, 3 * U32 * mag, x.dtype, "unpermute")
    (res.float().sum() + permuted_probs.float().sum()).backward()
    assert p.grad.dtype == probs_dtype


def test_mask_dropping_keeps_the_first_rows_of_the_expert_major_order():
    routing_map, x, probs = _mask_case(T=20, E=5, K=3)
    order = _ref_order(routing_map)
    N = int(routing_map.sum()) - 7
    out, permuted_probs, row_id_map = te.moe_permute_with_probs(x, probs, routing_map, N)
    assert torch.equal(out, x[order[:N]])
    assert torch.equal(permuted_probs, _ref_probs(routing_map, probs)[:N])
    y = torch.randn((N, x.shape[1]), generator=_gen(5)).to(x.dtype)
    res = te.moe_unpermute(y, row_id_map, probs)
    exact, mag = _f64_unpermute(y, order[:N], _ref_probs(routing_map, probs)[:N], x.shape[0])
    assert_within(res.detach(), exact, 3 * U32 * mag, x.dtype, "unpermute after dropping")


def test_restore_shape_and_default_shape():
    routing_map, x, _ = _mask_case(T=12, H=8, dtype=torch.float32)
    N = int(routing_map.sum())
    out, row_id_map = te.moe_permute(x, routing_map, N)
    flat = te.moe_unpermute(out, row_id_map)
    assert list(flat.shape) == [12, 8]
    exact, _ = _f64_unpermute(out, _ref_order(routing_map), None, 12)
    assert torch.equal(flat, exact.float())  # two fp32 rows of one token: one rounding
    shaped = te.moe_unpermute(out, row_id_map, restore_shape=torch.Size([3, 4, 8]))
    assert torch.equal(shaped, flat.view(3, 4, 8))
    with pytest.raises(ValueError, match="restore_shape"):
        te.moe_unpermute(out, row_id_map, restore_shape=[12, 4])


def test_padding_with_pad_offsets_matches_unpadded_path():
    routing_map, x, probs = _mask_case(T=30, E=5, K=2)
    counts = routing_map.sum(0)
    x_leaf, p_leaf = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, permuted_probs, row_id_map, pad_offsets, target = te.moe_permute_and_pad_with_probs(
        x_leaf, p_leaf, routing_map, counts, 8)
    assert torch.equal(target, (counts + 7) // 8 * 8) and int(target.sum()) == out.shape[0]
    assert torch.equal(pad_offsets, (target - counts).cumsum(0) - (target - counts))
    # Reference: the unpadded rows, each expert's block followed by zero rows.
    order, ref_probs = _ref_order(routing_map), _ref_probs(routing_map, probs)
    blocks, pblocks, at = [], [], 0
    for e in range(5):
        c, t = int(counts[e]), int(target[e])
        blocks += [x[order[at:at + c]], torch.zeros((t - c, x.shape[1]), dtype=x.dtype)]
        pblocks += [ref_probs[at:at + c], torch.zeros(t - c)]
        at += c
    assert torch.equal(out, torch.cat(blocks)) and torch.equal(permuted_probs, torch.cat(pblocks))
    # Padded unpermute with merging probs: the unpadded rows' result, bitwise.
    y = torch.randn(out.shape, generator=_gen(6)).to(x.dtype)
    real = torch.cat(blocks).ne(0).any(1) | torch.cat(pblocks).ne(0)
    padded = te.moe_unpermute(y, row_id_map, probs, restore_shape=x.shape, pad_offsets=pad_offsets)
    unpadded = te.moe_unpermute(y[real], row_id_map, probs, restore_shape=x.shape)
    assert torch.equal(padded, unpadded)
    exact, mag = _f64_unpermute(y[real], order, ref_probs, x.shape[0])
    assert_within(padded.detach(), exact, 3 * U32 * mag, x.dtype, "padded unpermute")
    out.float().sum().backward()
    assert torch.equal(x_leaf.grad, routing_map.sum(1, keepdim=True).expand_as(x).to(x.dtype))


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_empty_input(map_type):
    x = torch.zeros((0, 16), dtype=torch.bfloat16, requires_grad=True)
    routing = torch.zeros((0, 8), dtype=torch.bool) if map_type == "mask" else torch.zeros((0, 2), dtype=torch.int32)
    out, row_id_map = te.moe_permute(x, routing, 0, map_type=map_type)
    probs = torch.zeros((0, 8 if map_type == "mask" else 2), requires_grad=True)
    res = te.moe_unpermute(out, row_id_map, probs, map_type=map_type)
    assert list(out.shape) == [0, 16] and list(res.shape) == [0, 16]
    (out.float().sum() + res.float().sum()).backward()
    assert list(x.grad.shape) == [0, 16] and list(probs.grad.shape) == list(probs.shape)


# ---------------------------------------------------------------------------------------------
# Index maps
# ---------------------------------------------------------------------------------------------
def _index_case(T=24, E=7, K=3, H=16, dtype=torch.bfloat16, seed=0):
    g = _gen(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    x = torch.randn((T, H), generator=g).to(dtype)
    probs = torch.rand((T, K), generator=g)
    return indices, x, probs


@pytest.mark.parametrize("num_out", [None, 50])
def test_index_map_against_reference_and_float64(num_out):
    indices, x, probs = _index_case()
    T, K = indices.shape
    N = num_out or T * K
    sorted_indices = torch.argsort(indices.view(-1), stable=True)  # TE's test reference
    x_leaf = x.clone().requires_grad_()
    out, row_id_map = te.moe_permute(x_leaf, indices, num_out or 0, map_type="index")
    assert torch.equal(out, x[sorted_indices[:N] // K])
    # TE's layout: entry k * T + t is the row of (t, k), -1 if dropped.
    expect_map = torch.full((T * K,), -1, dtype=torch.int32)
    flat_pos = sorted_indices[:N]
    expect_map[(flat_pos % K) * T + flat_pos // K] = torch.arange(N, dtype=torch.int32)
    assert torch.equal(row_id_map, expect_map)
    y = torch.randn((N, x.shape[1]), generator=_gen(7)).to(x.dtype).requires_grad_()
    p = probs.clone().requires_grad_()
    res = te.moe_unpermute(y, row_id_map, p, map_type="index")
    w = probs.view(-1)[flat_pos]
    exact, mag = _f64_unpermute(y.detach(), flat_pos // K, w, T)
    assert_within(res.detach(), exact, 3 * U32 * mag, x.dtype, "index unpermute")
    # Reference (TE's test): rows back to (t, k) order, zero where dropped, weighted, summed.
    ref_y, ref_p = y.detach().clone().requires_grad_(), probs.clone().requires_grad_()
    back = torch.zeros((T * K, x.shape[1]), dtype=x.dtype).index_copy(0, flat_pos, ref_y)
    ref = (back.view(T, K, -1) * ref_p[:, :, None]).sum(1)
    go = torch.randn(res.shape, generator=_gen(8)).to(x.dtype)
    res.backward(go)
    ref.backward(go.float())
    assert torch.equal(y.grad, ref_y.grad.to(x.dtype))
    assert_within(p.grad, ref_p.grad.double(), 2 * x.shape[1] * U32 * ref_p.grad.double().abs() + 1e-6,
                  torch.float32, "index probs grad")
    out.float().sum().backward()
    kept = torch.zeros(T * K).index_fill_(0, flat_pos, 1).view(T, K).sum(1)
    assert torch.equal(x_leaf.grad, kept[:, None].expand_as(x).to(x.dtype))


def test_index_map_top1_without_probs():
    indices, x, _ = _index_case(K=1)
    out, row_id_map = te.moe_permute(x, indices, 0, map_type="index")
    res = te.moe_unpermute(out, row_id_map, map_type="index")
    assert torch.equal(res, x)
    # TE 1.x's empty-tensor default for probs means the same.
    assert torch.equal(te_v1.moe_unpermute(out, row_id_map, torch.empty(0)), x)


def test_te_v1_runs_index_code_unchanged():
    indices, x, probs = _index_case()
    out, row_id_map = te_v1.moe_permute(x, indices)  # num_out_tokens=-1: every row
    ref_out, ref_map = te.moe_permute(x, indices, 0, map_type="index")
    assert torch.equal(out, ref_out) and torch.equal(row_id_map, ref_map)
    assert torch.equal(te_v1.moe_unpermute(out, row_id_map, probs),
                       te.moe_unpermute(out, row_id_map, probs, map_type="index"))


# ---------------------------------------------------------------------------------------------
# Chunk sort
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_probs", [False, True])
def test_chunk_sort_against_reference(with_probs):
    g = _gen(9)
    sizes = torch.tensor([3, 0, 5, 2, 4, 1], dtype=torch.int32)
    order = torch.arange(6, dtype=torch.int32).view(2, 3).T.reshape(-1)  # TE's test: tp-major to expert-major
    x = torch.randn((16, 8), generator=g).to(torch.bfloat16)  # rows 15.. past the chunks stay put
    probs = torch.rand(16, generator=g).to(torch.bfloat16)
    chunks = torch.split(torch.arange(15), sizes.tolist())
    ref_index = torch.cat([chunks[i] for i in order.tolist()] + [torch.tensor([15])])
    x_leaf, p_leaf = x.clone().requires_grad_(), probs.clone().requires_grad_()
    if with_probs:
        out, out_probs = te.moe_sort_chunks_by_index_with_probs(x_leaf, p_leaf, sizes, order)
        assert out_probs.dtype == torch.bfloat16 and torch.equal(out_probs, probs[ref_index])
    else:
        out, out_probs = te.moe_sort_chunks_by_index(x_leaf, sizes, order), None
    assert torch.equal(out, x[ref_index])
    go = torch.randn(out.shape, generator=g).to(out.dtype)
    (out.float() * go.float()).sum().backward() if out_probs is None else torch.autograd.backward(
        [out, out_probs], [go, torch.ones_like(out_probs)])
    expect = torch.empty_like(go)
    expect[ref_index] = go  # a permutation: the gradient is exact
    assert torch.equal(x_leaf.grad, expect)
    if with_probs:
        assert torch.equal(p_leaf.grad, torch.ones_like(probs))


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors naming the argument
# ---------------------------------------------------------------------------------------------
def _bad_calls():
    routing_map, x, probs = _mask_case(T=8, E=4, K=2, H=8)
    N = int(routing_map.sum())
    g = _gen(1)
    indices = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)]).to(torch.int32)
    assert int(indices.min()) == 0 and int(indices.max()) >= 2  # so indices - 1 and indices * 3 are bad
    out, rmap = te.moe_permute(x, routing_map, N)
    iout, imap = te.moe_permute(x, indices, 0, map_type="index")
    sizes, order = torch.tensor([3, 5]), torch.tensor([1, 0])
    return [
        ("index as mask", lambda: te.moe_permute(x, indices, 16), ValueError, "routing_map.*map_type='index'"),
        ("mask as index", lambda: te.moe_permute(x, routing_map, 16, map_type="index"), TypeError, "routing_map"),
        ("negative id", lambda: te.moe_permute(x, indices - 1, 0, map_type="index"), ValueError, "routing_map"),
        ("rows disagree", lambda: te.moe_permute(x[:-1], routing_map, N), ValueError, "routing_map"),
        ("too many out", lambda: te.moe_permute(x, routing_map, N + 1), ValueError, "num_out_tokens"),
        ("too many out (index)", lambda: te.moe_permute(x, indices, 17, map_type="index"), ValueError,
         "num_out_tokens"),
        ("negative out", lambda: te.moe_permute(x, routing_map, -1), ValueError, "num_out_tokens"),
        ("map_type", lambda: te.moe_permute(x, routing_map, N, map_type="sparse"), ValueError, "map_type"),
        ("int tokens", lambda: te.moe_permute(x.int(), routing_map, N), TypeError, "inp"),
        ("probs shape", lambda: te.moe_permute_with_probs(x, probs[:, :3], routing_map, N), ValueError, "probs"),
        ("int probs", lambda: te.moe_permute_with_probs(x, probs.int(), routing_map, N), TypeError, "probs"),
        ("tokens_per_expert", lambda: te.moe_permute_and_pad_with_probs(x, probs, routing_map,
                                                                        routing_map.sum(0) + 1, 4),
         ValueError, "tokens_per_expert"),
        ("align_size", lambda: te.moe_permute_and_pad_with_probs(x, probs, routing_map, routing_map.sum(0), 0),
         ValueError, "align_size"),
        ("unpermute rows", lambda: te.moe_unpermute(out[:-1], rmap), ValueError, "inp"),
        ("unpermute probs", lambda: te.moe_unpermute(out, rmap, probs[:-1]), ValueError, "merging_probs"),
        ("index map as mask", lambda: te.moe_unpermute(iout, imap), ValueError, "map_type='index'"),
        ("mask map as index", lambda: te.moe_unpermute(out, rmap, map_type="index"), ValueError, "map_type='mask'"),
        ("index probs", lambda: te.moe_unpermute(iout, imap, probs, map_type="index"), ValueError, "merging_probs"),
        ("pad_offsets", lambda: te.moe_unpermute(out, rmap, pad_offsets=torch.zeros(3, dtype=torch.int64)),
         ValueError, "pad_offsets"),
        ("both probs", lambda: te.moe_unpermute(out, rmap, probs, probs=probs), ValueError, "probs"),
        ("row_id_map dtype", lambda: te.moe_unpermute(out, rmap.long()), TypeError, "row_id_map"),
        ("split sum", lambda: te.moe_sort_chunks_by_index(x, torch.tensor([3, 6]), order), ValueError,
         "split_sizes"),
        ("negative split", lambda: te.moe_sort_chunks_by_index(x, torch.tensor([-1, 5]), order), ValueError,
         "split_sizes"),
        ("not a permutation", lambda: te.moe_sort_chunks_by_index(x, sizes, torch.tensor([1, 1])), ValueError,
         "sorted_index"),
        ("chunk tables disagree", lambda: te.moe_sort_chunks_by_index(x, sizes, torch.tensor([0, 1, 2])),
         ValueError, "split_sizes and sorted_index"),
        ("chunk probs", lambda: te.moe_sort_chunks_by_index_with_probs(x, probs, sizes, order), ValueError,
         "probs"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_bad_input_is_a_clear_error(index):
    _, call, exc, match = _bad_calls()[index]
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_is_bitwise_eager():
    import torch._dynamo

    routing_map, x, probs = _mask_case(T=16, E=4, K=2, H=8, dtype=torch.float32)
    N = int(routing_map.sum())
    sizes, order = torch.tensor([10, N - 10]), torch.tensor([1, 0])

    def step(x, probs):
        out, pp, rmap = te.moe_permute_with_probs(x, probs, routing_map, N)
        out, pp = te.moe_sort_chunks_by_index_with_probs(out * 2, pp, sizes, order)
        out, pp = te.moe_sort_chunks_by_index_with_probs(out, pp, sizes[order], order)
        return te.moe_unpermute(out * pp[:, None], rmap, probs, restore_shape=x.shape)

    def run(fn):
        leaves = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
        res = fn(*leaves)
        res.backward(torch.linspace(-1, 1, res.numel()).view_as(res))
        return [res.detach()] + [t.grad for t in leaves]

    eager = run(step)
    torch._dynamo.reset()
    compiled = run(torch.compile(step, backend="aot_eager", fullgraph=True))
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


# ---------------------------------------------------------------------------------------------
# GPU: the Triton kernels against the CPU twin, bitwise; bad input leaves the context usable
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_matches_cpu_bitwise(dtype):
    routing_map, x, probs = _mask_case(T=64, E=8, K=3, H=96, dtype=torch.float32)
    x = x.to(dtype)
    N = int(routing_map.sum()) - 5

    def run(device):
        # detach: on CPU .to() returns the tensor itself, and the CUDA run's copy would not be a leaf
        xl = x.to(device).detach().requires_grad_(dtype != torch.float8_e4m3fn)
        pl = probs.to(device).detach().requires_grad_()
        out, pp, rmap = te.moe_permute_with_probs(xl, pl, routing_map.to(device), N)
        res = te.moe_unpermute(out, rmap, pl)
        if xl.requires_grad:
            (res.float().sum() + pp.sum()).backward()
        return [t.cpu() for t in (out, pp, res, pl.grad) if t is not None]

    cpu, gpu = run("cpu"), run("cuda")
    for c, g in zip(cpu[:3], gpu[:3]):  # rows, probs and sums: bitwise (float8 compared as bytes)
        assert torch.equal(c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c,
                           g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g)
    assert len(cpu) == len(gpu) == (3 if dtype == torch.float8_e4m3fn else 4)  # the probs gradient, both runs
    if len(cpu) > 3:  # the probs gradient's in-chunk dot order differs between twin and kernel
        torch.testing.assert_close(cpu[3], gpu[3], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_index_tensor_as_mask_is_an_error_not_a_crash():
    indices = torch.stack([torch.randperm(16)[:4] for _ in range(256)]).to(torch.int32).cuda()
    x = torch.rand(256, 64, device="cuda")
    with pytest.raises(ValueError, match="map_type='index'"):
        te.moe_permute(x, indices, 1024)
    out, _ = te.moe_permute(x, indices, 1024, map_type="index")  # the context still works
    torch.cuda.synchronize()
    assert out.shape == (1024, 64)


# ---------------------------------------------------------------------------------------------
# examples/te_report.py at its quick size
# ---------------------------------------------------------------------------------------------
def test_te_report_example_runs_quick_on_cpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "te_report.py"), "--size", "quick",
                           "--device", "cpu"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "11 of 11 cases" in lines[-1]
    # One shared upstream gradient: every permute and unpermute row gradient equals the
    # reference's in fp32/fp16/bf16; the report's own draws differ by O(1).
    for header_at in [i for i, line in enumerate(lines) if line.startswith("torch.")]:
        if "float8" in lines[header_at] or "token:0" in lines[header_at]:
            continue
        permute_bwd, unpermute_bwd = lines[header_at + 3], lines[header_at + 5]
        assert permute_bwd.startswith("[permute bwd]") and permute_bwd.split()[3] == "equal", permute_bwd
        assert unpermute_bwd.startswith("[unpermute bwd]") and unpermute_bwd.split()[3] == "equal", unpermute_bwd
        assert float(permute_bwd.split()[2]) > 0.1
