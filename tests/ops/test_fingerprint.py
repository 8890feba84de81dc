"""ops.bits_fingerprint: its Triton kernel (kernels/fingerprint.py; under the interpreter, and
compiled on CUDA with -m gpu) against its torch twin (fingerprint.py), bitwise, for every element
size, tails, 3-D and strided inputs and any launch settings; and what the fingerprint catches."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.ops import bits_fingerprint, fingerprint, set_backend
from moe_dispatch.ops.fingerprint import CHUNK

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn]


def _kernel(t: torch.Tensor, **launch) -> torch.Tensor:
    from moe_dispatch.ops.kernels import fingerprint as fingerprint_kernel

    return fingerprint_kernel.bits_fingerprint(t, **launch)


def _weights(shape, dtype, seed=0, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)


# [3, 67, 301] is 60501 elements: two bf16 chunks, the second short (a tail), four fp32 chunks.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_twin_bitwise(dtype):
    t = _weights((3, 67, 301), dtype)
    twin = fingerprint.bits_fingerprint(t)
    assert torch.equal(_kernel(t), twin), dtype
    with set_backend("triton"):  # the registered entry point picks the kernel
        assert torch.equal(bits_fingerprint(t), twin)
    assert torch.equal(bits_fingerprint(t), twin)  # on CPU: the twin


def test_kernel_equals_twin_strided_and_any_launch():
    """Strided views (a transpose, steps, an offset) are read in logical order without a copy
    (the twin copies them first); the programs and block size change no value."""
    t = _weights((3, 67, 301), torch.bfloat16, seed=1)
    for view in (t.transpose(1, 2), t[:, ::2, 1:], t[1], t[..., 7], t[0].t(), t.unsqueeze(0).transpose(0, 3)):
        twin = fingerprint.bits_fingerprint(view)
        assert torch.equal(twin, fingerprint.bits_fingerprint(view.contiguous()))
        assert torch.equal(_kernel(view), twin), view.shape
    twin = fingerprint.bits_fingerprint(t)
    for programs, block in ((1, 4096), (2, 1024), (5, 8192)):
        assert torch.equal(_kernel(t, programs=programs, block=block), twin), (programs, block)
    f32 = t.float().transpose(0, 2)
    assert torch.equal(_kernel(f32, programs=3), fingerprint.bits_fingerprint(f32))


def test_small_and_empty():
    for n in (0, 1, 5, CHUNK - 1, CHUNK + 1):
        t = _weights((n,), torch.bfloat16, seed=n)
        assert torch.equal(_kernel(t), fingerprint.bits_fingerprint(t)), n
    assert fingerprint.bits_fingerprint(torch.empty(0)).tolist() == [0, 0]


def test_changes_are_caught():
    """One element changed (one bit), or two elements swapped within a chunk: both hashes move,
    on both backends."""
    t = _weights((2, 40, 500), torch.bfloat16, seed=2)
    flat = t.view(-1)
    one_bit, swap = flat.clone(), flat.clone()
    one_bit.view(torch.int16)[12345] ^= 1
    swap[100], swap[9000] = flat[9000], flat[100]
    assert not torch.equal(flat[100], flat[9000])
    base = fingerprint.bits_fingerprint(flat)
    for changed in (one_bit, swap):
        for fp in (fingerprint.bits_fingerprint(changed), _kernel(changed)):
            assert (fp != base).all(), (fp, base)


def test_registered_op():
    """The torch.library op (what torch.compile sees): its fake and real implementations agree."""
    from moe_dispatch.ops.custom_ops import _bits_fingerprint_op

    t = _weights((5, 77), torch.float16, seed=5)
    torch.library.opcheck(_bits_fingerprint_op, (t,), test_utils=("test_schema", "test_faketensor"))
    assert torch.equal(_bits_fingerprint_op(t), fingerprint.bits_fingerprint(t))


def test_refuses_other_element_sizes():
    with pytest.raises(TypeError, match="1, 2, 4 or 8 bytes"):
        bits_fingerprint(torch.zeros(3, dtype=torch.complex128))
    with pytest.raises(TypeError, match="torch.Tensor"):
        bits_fingerprint([1, 2])


@pytest.mark.gpu
def test_kernel_equals_twin_on_cuda():
    """A realistic expert weight ([8, 4096, 2048] bf16, 128 MiB), and fp32 and strided views of a
    smaller one: the compiled kernel against the twin on the same GPU, bitwise."""
    t = _weights((8, 4096, 2048), torch.bfloat16, seed=3, device="cuda")
    assert torch.equal(bits_fingerprint(t), fingerprint.bits_fingerprint(t))
    small = _weights((4, 1000, 777), torch.float32, seed=4, device="cuda")
    for view in (small, small.transpose(1, 2), small.bfloat16()[:, ::3]):
        assert torch.equal(bits_fingerprint(view), fingerprint.bits_fingerprint(view)), view.shape
    assert torch.equal(bits_fingerprint(small.cpu()), fingerprint.bits_fingerprint(small).cpu())  # any device
