"""`moe-dispatch check` and `ops-demo` refuse every bad flag before spawning anything: status 2, one
message naming the flag. Spawning and process-group creation are replaced by tripwires here."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_dispatch.tools import cli

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture()
def spawned(monkeypatch):
    """Records each mp.spawn call instead of running it; a process group is a test failure."""
    calls: list[int] = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(mp, "spawn", lambda fn, args=(), nprocs=1, **kw: calls.append(nprocs))

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was started")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    return calls


def _refused(capsys, argv: list[str], flag: str, says: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err  # printed once
    assert f"argument {flag}:" in errors[0] and says in errors[0], errors[0]
    return errors[0]


# (flags, the flag named, words the message must hold), one row per class of bad flag.
CHECK_BAD = [
    # counts below their minimum
    (["--ranks", "0"], "--ranks", "must be >= 1"),
    (["--ranks", "-2"], "--ranks", "must be >= 1"),
    # a check that compares nothing: the truncation test needs tokens on both sides of the cut
    (["--tokens", "0"], "--tokens", "must be >= 2"),
    (["--tokens", "1"], "--tokens", "must be >= 2"),
    (["--truncate-at", "0"], "--truncate-at", "must be >= 1"),
    (["--tokens", "100", "--truncate-at", "100"], "--truncate-at", "below --tokens 100"),
    # MoEConfig's validation, reported under the flag that set the field
    (["--hidden", "0"], "--hidden", "must be an int >= 1"),
    (["--ffn", "-3"], "--ffn", "must be an int >= 1"),
    (["--experts", "0"], "--experts", "must be an int >= 1"),
    (["--topk", "9"], "--topk", "--topk=9 exceeds --experts=8"),
    (["--topk", "1"], "--topk", "must be >= 2"),
    (["--seed", "-1"], "--seed", "[0, 2**63)"),
    # the world: EP sizes and the expert split
    (["--experts", "6"], "--experts", "do not split over the 4 ranks"),
    (["--ep-sizes", "3"], "--ep-sizes", "3 does not divide the 4 ranks"),
    (["--ep-sizes", "8"], "--ep-sizes", "8 does not divide the 4 ranks"),
    (["--ranks", "2", "--ep-sizes", "1,4"], "--ep-sizes", "4 does not divide the 2 ranks"),
    (["--ranks", "8", "--ep-sizes", "0,8"], "--ep-sizes", "0 does not divide the 8 ranks"),
    (["--ep-sizes", "x"], "--ep-sizes", "comma-separated ints"),
    (["--ep-sizes", ""], "--ep-sizes", "comma-separated ints"),
    (["--ep-sizes", "2,2"], "--ep-sizes", "twice"),
    # sizes this machine cannot hold: refused before any rank allocates (not an allocator error per rank)
    (["--tokens", str(10**12)], "--tokens", "GiB per rank (the expert activations"),
    (["--tokens", str(2**70)], "--tokens", "lower --tokens"),  # beyond int64: no overflow error either
    (["--hidden", str(10**7)], "--hidden", "GiB per rank (the experts' weights"),
    (["--experts", str(2**40)], "--experts", "GiB per rank (the experts' weights"),
    (["--ranks", str(10**6)], "--ranks", "too little to start one"),
    # argparse's own type and choice errors
    (["--tokens", "many"], "--tokens", "invalid int value"),
    (["--dtype", "fp8"], "--dtype", "invalid choice"),
    (["--dispatcher", "flex"], "--dispatcher", "invalid choice"),
    (["--no-fp8-wgrad"], "--no-fp8-wgrad", "needs --fp8"),
]


@pytest.mark.parametrize("argv,flag,says", CHECK_BAD, ids=[" ".join(a) for a, _, _ in CHECK_BAD])
def test_check_refuses_a_bad_flag_before_spawning(spawned, capsys, argv, flag, says):
    _refused(capsys, ["check", *argv, "--backend", "gloo"], flag, says)
    assert spawned == []


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_nccl_without_cuda_is_refused(spawned, capsys):
    _refused(capsys, ["check", "--backend", "nccl"], "--backend", "needs CUDA")
    assert spawned == []


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_more_nccl_ranks_than_gpus_is_refused(spawned, capsys):
    too_many = torch.cuda.device_count() + 1
    _refused(capsys, ["check", "--backend", "nccl", "--ranks", str(too_many), "--experts", str(8 * too_many)],
             "--ranks", f"need {too_many} GPUs")
    assert spawned == []


def test_megatron_missing_is_a_flag_error(spawned, capsys, monkeypatch):
    from moe_dispatch.integrations.megatron import check as megatron_check

    monkeypatch.setattr(megatron_check, "megatron_unavailable", lambda: "--megatron needs megatron-core")
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--backend", "gloo", "--megatron"])
    assert exc.value.code == 2 and capsys.readouterr().err.count("--megatron needs megatron-core") == 1
    assert spawned == []


@pytest.mark.parametrize("argv,nprocs", [
    ([], 4),
    (["--ranks", "2", "--tokens", "2"], 2),  # keeps 1 token (half of 2), zeroes the other
    (["--tokens", "64"], 4),  # the default --truncate-at 90 falls to 32, as the help says
    (["--ranks", "1", "--dispatcher", "alltoall", "--ep-sizes", "1"], 1),
    (["--fp8", "--no-fp8-wgrad"], 4),
    (["--ranks", "8", "--ep-sizes", "1,2,8", "--truncate-at", "127", "--seed", str(2**63 - 1000)], 8),
])
def test_good_flags_reach_spawn(spawned, capsys, argv, nprocs):
    # The refusals above must come from the flags: the same parser lets these through to spawn.
    assert cli.main(["check", "--backend", "gloo", *argv]) == 0
    assert spawned == [nprocs]
    assert "error" not in capsys.readouterr().err


def test_under_torchrun_ranks_must_match_and_only_rank_0_speaks(spawned, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    _refused(capsys, ["check", "--backend", "gloo", "--ranks", "4"], "--ranks", "WORLD_SIZE=2")
    _refused(capsys, ["check", "--backend", "gloo", "--tokens", "0"], "--tokens", "must be >= 2")
    monkeypatch.setenv("RANK", "1")  # every rank exits 2, only rank 0 prints: once in all
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--backend", "gloo", "--tokens", "0"])
    assert exc.value.code == 2 and capsys.readouterr().err == ""


OPS_DEMO_BAD = [
    (["--tokens", "0"], "--tokens", "must be >= 1"),
    (["--experts", "0"], "--experts", "must be >= 1"),
    (["--topk", "0"], "--topk", "must be >= 1"),
    (["--hidden", "-1"], "--hidden", "must be >= 1"),
    (["--topk", "9", "--experts", "8"], "--topk", "exceeds --experts 8"),
    (["--device", "gpu"], "--device", ""),
    (["--device", "meta"], "--device", "expected cpu or cuda"),
    (["--hidden", "1.5"], "--hidden", "invalid int value"),
]


@pytest.mark.parametrize("argv,flag,says", OPS_DEMO_BAD, ids=[" ".join(a) for a, _, _ in OPS_DEMO_BAD])
def test_ops_demo_refuses_a_bad_flag_before_any_work(capsys, monkeypatch, argv, flag, says):
    from moe_dispatch.tools import ops_demo as demo

    def no_work(*args, **kwargs):
        raise AssertionError("the demo started")

    monkeypatch.setattr(demo, "_error_table", no_work)
    _refused(capsys, ["ops-demo", "--device", "cpu", *argv], flag, says)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_ops_demo_cuda_without_cuda(capsys):
    _refused(capsys, ["ops-demo", "--device", "cuda"], "--device", "needs CUDA")


def test_no_command_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "moe-dispatch check" in out.err
    assert cli.main(["--help"]) == 0 and "moe-dispatch check" in capsys.readouterr().out
    assert cli.main(["chekc"]) == 2 and "'chekc'" in capsys.readouterr().err


def test_console_script_exits_2_once():
    # The real entry point in a fresh interpreter: status 2, one message, no rank output.
    proc = subprocess.run([sys.executable, "-m", "moe_dispatch.tools.cli", "check", "--tokens", "0", "--backend",
                           "gloo"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("error: argument --tokens:") == 1 and proc.stdout == ""


def test_version(capsys):
    # One source: the wheel's metadata reads the same attribute (tests/test_packaging.py).
    from packaging.version import Version

    import moe_dispatch

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"moe-dispatch {moe_dispatch.__version__}\n"
    assert str(Version(moe_dispatch.__version__)) == moe_dispatch.__version__  # a normalised PEP 440 version


# A fresh interpreter runs the console script's main on argv and says on stderr whether torch was loaded.
_NO_TORCH_PROBE = """\
import sys
from moe_dispatch.tools import cli
try:
    code = cli.main(sys.argv[1:])
finally:
    print("torch loaded" if "torch" in sys.modules else "torch not loaded", file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [
    ["check", "--tokens", "1"], ["check", "--no-such-flag"], ["check", "--ranks", "0"], ["check", "--dtype", "fp8"],
    ["check", "--ep-sizes", "2,2"], ["ops-demo", "--tokens", "0"], ["ops-demo", "--bogus"],
], ids=" ".join)
def test_a_bad_flag_is_refused_before_torch_loads(argv):
    # Importing torch takes seconds: the flags the parser alone can judge are refused before it.
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE, *argv], capture_output=True, text=True,
                          timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("error:") == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.rstrip().endswith("torch not loaded"), proc.stderr
    assert seconds < 5, f"{seconds:.1f} s to refuse {argv}"


def test_the_parser_lists_the_config_dispatchers():
    # args.py writes the dispatcher kinds out (so it loads without torch): the same list as MoEConfig's.
    from moe_dispatch import config
    from moe_dispatch.tools.check import args

    assert args.DISPATCHER_KINDS == config.DISPATCHER_KINDS
    assert {name: args.torch_dtype(name) for name in args.DTYPE_NAMES} == args.DTYPES
    assert args.DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def test_check_says_it_is_starting_the_ranks(spawned, capsys):
    assert cli.main(["check", "--backend", "gloo", "--ranks", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("moe-dispatch check: importing torch") and len(out) == 2, out
    assert out[1].startswith("moe-dispatch check: starting 2 ranks on gloo; each imports torch"), out


def test_ops_demo_prints_each_stage_before_the_table(capsys):
    assert cli.main(["ops-demo", "--device", "cpu", "--tokens", "16", "--experts", "4", "--topk", "2",
                     "--hidden", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.lstrip().startswith("dtype |"))
    stages = [line.split(" s  ", 1)[1] for line in out[:header] if line.startswith("  ... ")]
    expected = ["importing torch (a few seconds)"]
    for dtype in ("float32", "bfloat16", "float16"):
        expected += [f"{dtype}: routing 16 tokens to 4 experts, top-2, and the [T * K, H] expert rows",
                     f"{dtype}: permute + unpermute, forward and backward",
                     f"{dtype}: the same again, for the bitwise repeatability", f"{dtype}: the float64 reference"]
    assert stages == expected, out
    assert out[-1] == "PASS" and not any(line.startswith("  ... ") for line in out[header:]), out
