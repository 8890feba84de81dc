"""What the check's table prints: a skipped row shows no number, and the float64 row comes with
its legend (the bound, and why the worst output prints at it)."""
from __future__ import annotations

from moe_dispatch.tools.check.args import build_parser
from moe_dispatch.tools.check.contract import Result
from moe_dispatch.tools.check.reference import FLOAT64_LABEL
from moe_dispatch.tools.check.report import print_report

ROWS = [
    Result("every rank, same tokens: alltoall, EP 1", 0.0, True),
    Result(f"{FLOAT64_LABEL}0.50 ulp of bf16 past the fp32 sum's error (bound 0.50)", 7.665e-3, True),
    Result("CUDA-graph replay vs eager step: EP 1, sync-free", 0.0, True, skipped="CUDA only"),
]


def _table(capsys, flags: list[str], rows: list[Result]) -> list[str]:
    print_report(build_parser().parse_args(flags), rows, "throughput line")
    return capsys.readouterr().out.splitlines()


def test_a_skipped_row_shows_no_number(capsys):
    out = _table(capsys, [], ROWS)
    cells = {line.split("|")[0].strip(): line.split("|")[1].strip() for line in out if line.count("|") == 2}
    assert cells["every rank, same tokens: alltoall, EP 1"] == "0.000e+00"
    assert cells["CUDA-graph replay vs eager step: EP 1, sync-free"] == "-"
    assert out[-1] == "ALL PASS"


def test_the_float64_row_says_its_bound(capsys):
    text = "\n".join(_table(capsys, ["--tokens", "96"], ROWS))
    assert "at most half an ulp, so the bound is 0.50" in text
    assert "The worst of the 6,144 outputs (96 tokens x H=64 x 1 ranks) prints 0.50" in text
    assert "0.4999 with the default flags" in text
    fp32 = "\n".join(_table(capsys, ["--dtype", "fp32"], [Result(f"{FLOAT64_LABEL}0.01 of ...", 1e-8, True)]))
    assert "anything up to 1 passes" in fp32 and "0.50" not in fp32
    assert "The float64 row" not in "\n".join(_table(capsys, [], ROWS[:1]))
