"""scripts/megatron/routes_report.py, whose verdicts BENCHMARKS.md cites for Megatron-LM's own
pretrain_gpt.py: loss trajectories compared exactly (the hex floats run_pretrain.py prints), a
one-ulp difference between our dispatchers fails, ours equal to stock fails, install()'s line and
the step time are read from the logs."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "megatron" / "routes_report.py"


def _script():
    spec = importlib.util.spec_from_file_location("routes_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _log(losses: list[float], ms: float, installed: bool) -> str:
    lines = ["INFO:moe_dispatch.integrations.megatron:moe_dispatch: install() on Megatron's MoELayer: ..."
             if installed else "building GPT model ..."]
    for step, loss in enumerate(losses, 1):
        lines.append(f" iteration {step}/ {len(losses)} | elapsed time per iteration (ms): {ms + step:.1f} |")
        lines.append(f"moe_dispatch_step {step} lm_loss={loss.hex()}/{loss:.9g}")
    return "\n".join(lines) + "\n"


def _write(tmp: Path, runs: dict) -> str:
    with open(tmp / "routes.tsv", "w") as tsv:
        for name, (losses, ms, installed) in runs.items():
            (tmp / f"{name}.log").write_text(_log(losses, ms, installed))
            tsv.write(f"{name}\t0\t30\thead --flags\n")
    return str(tmp)


def test_verdicts_are_exact(tmp_path, capsys):
    ours = [8.5223131, 8.36301, 8.21855]
    stock = [8.5223875, 8.36174, 8.21942]
    one_ulp = ours[:2] + [math.nextafter(ours[2], math.inf)]
    report = _script()
    (tmp_path / "good").mkdir()
    good = _write(tmp_path / "good", {"g.stock": (stock, 300.0, False), "g.ours-a2a": (ours, 280.0, True),
                                      "g.ours-ag": (list(ours), 281.0, True)})
    assert report.main([good, "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("g ")]
    assert [row[-1] for row in rows] == ["PASS", "PASS"], out
    assert "allgather 3 steps: bitwise equal" in " ".join(rows[0]), out
    runs = {r["name"]: r for r in report.read_runs(good, warmup=1)}
    assert runs["g.ours-a2a"]["install"] and not runs["g.stock"]["install"]
    assert runs["g.ours-a2a"]["ms"] == 282.5  # the median of steps 2 and 3 (282.0, 283.0)
    (tmp_path / "ulp").mkdir()
    bad = _write(tmp_path / "ulp", {"g.ours-a2a": (ours, 280.0, True), "g.ours-ag": (one_ulp, 280.0, True)})
    assert report.main([bad]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")
    (tmp_path / "same").mkdir()
    same = _write(tmp_path / "same", {"g.ours-a2a": (ours, 280.0, True), "g.stock": (list(ours), 280.0, False)})
    assert report.main([same]) == 1  # ours equal to stock: our layer was not the one in use
