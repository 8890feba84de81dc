"""`moe-dispatch check --megatron` end to end on 2 gloo ranks (through the test-only CPU launcher,
check_megatron_cpu.py: the command itself needs CUDA), and its errors without megatron-core and,
on CPU, without CUDA.

Megatron's layer with our dispatcher installed (and its router / expert GEMMs made row-stable, the
install default) must pass every check bitwise, in bf16 and in fp32. The stock-Megatron rows are
reference rows: PASS or DIFF, never part of the exit code; in fp32 its "one token alone" row is a
DIFF on CPU (fp32 mm is not row-stable below 8 rows), the case the row-stable swap fixes.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_dispatch.tools.check import main as check_main
from moe_dispatch.tools.check.contract import Result
from moe_dispatch.tools.check.reference import REFERENCE_LABEL

ROOT = Path(__file__).resolve().parents[2]
HAVE_MEGATRON = (importlib.util.find_spec("megatron") is not None
                 and importlib.util.find_spec("megatron.core") is not None)


def _status(line: str) -> str:
    return line.rsplit("|", 1)[-1].strip()


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core")
# fp32 under the main venv's release only: the dtypes differ in our code, not in Megatron's API
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp32", marks=pytest.mark.one_megatron_release)])
def test_check_megatron_end_to_end(dtype):
    cmd = [sys.executable, "-m", "tests.integrations.check_megatron_cpu", "--megatron", "--ranks", "2",
           "--ep-sizes", "1,2", "--tokens", "96", "--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = [line for line in out.splitlines() if line.count("|") == 2 and not line.startswith("check ")]
    ours = [r for r in rows if r.startswith("megatron + moe-dispatch: ")]
    stock = [r for r in rows if r.startswith("megatron stock: ")]
    captured = [r for r in rows if r.startswith("CUDA-graph replay")]
    plain = [r for r in rows if not r.startswith("megatron") and r not in captured]
    assert [_status(r) for r in captured] == ["SKIP (CUDA only)"], out  # the capture row: CUDA only
    # every rank: 2 dispatchers x 2 EP sizes; dispatcher + EP size: 3 comparisons; batch: 2 x 2;
    # 11 rows per kind of layer, and ours has the float64 row and a reference row besides
    reference = [r for r in plain if r.startswith(REFERENCE_LABEL)]
    # our layer trained on other layouts (GradientTree): two dropless rows and two sync-free ones
    layouts = [r for r in plain if r.startswith("layouts: ")]
    plain = [r for r in plain if r not in reference + layouts]
    assert len(layouts) == 4 and sum("sync-free" in r for r in layouts) == 2, out
    assert all(_status(r) == "PASS" for r in layouts), out
    assert len(plain) == len(ours) + 1 and len(ours) == len(stock) == 11, out
    assert len(reference) == 1 and all(_status(r) in ("PASS", "DIFF") for r in reference), out
    assert all(_status(r) == "PASS" for r in plain + ours), out
    assert all(_status(r) in ("PASS", "DIFF") for r in stock), out
    for check_name in ("every rank, same tokens", "dispatcher: allgather vs alltoall", "EP size", "zeroed",
                       "token 0 alone"):
        assert any(check_name in r for r in ours) and any(check_name in r for r in stock), check_name
    if dtype == "fp32":
        assert all(_status(r) == "DIFF" for r in stock if "token 0 alone" in r), out
    assert "ALL PASS" in out and "throughput (" in out


def test_result_informational_rows_never_fail():
    ref = Result("megatron stock: x", 1e-3, passed=False, informational=True)
    ours = Result("megatron + moe-dispatch: x", 1e-3, passed=False)
    assert (ref.status, ref.failed) == ("DIFF", False)
    assert (ours.status, ours.failed) == ("FAIL", True)
    assert Result("y", 0.0, passed=True, informational=True).status == "PASS"


def test_check_megatron_without_megatron_core(monkeypatch, capsys):
    """--megatron stops before spawning any rank, with a message naming the missing package."""
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(SystemExit) as exc:
        check_main(["--megatron", "--ranks", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--megatron needs megatron-core" in err and "pip install megatron-core" in err


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core")
def test_check_megatron_needs_cuda(monkeypatch, capsys):
    """On a machine without CUDA the command stops before spawning any rank and says why."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        check_main(["--megatron", "--ranks", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--megatron needs CUDA" in err and "test" in err


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core")
def test_check_megatron_on_gpus():
    """On CUDA (one rank per GPU, NCCL): ours and Megatron with install() pass every row bitwise,
    while stock Megatron's cuBLAS router and experts show DIFF rows (informational)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cmd = [sys.executable, "-m", "moe_dispatch.tools.check", "--megatron", "--tokens", "512", "--hidden", "1024",
           "--ffn", "512", "--experts", "16", "--topk", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL PASS" in proc.stdout, proc.stdout
