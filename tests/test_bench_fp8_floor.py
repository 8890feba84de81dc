"""scripts/bench_fp8_layer.py's byte-floor table of the FP8 step's quantisations runs without a GPU
(``--floor-only``), and its rows are the operands the FP8 step quantises."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_fp8_layer.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fp8_layer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_floor_rows_are_the_steps_operands():
    T, H, F, E, K = 16, 64, 32, 4, 2
    parts = dict(_bench().quantisation_floor(T, H, F, E, K))
    N = T * K
    assert parts["tokens, before the dispatch"] == T * H * 3 + 4 * T  # bf16 in, fp8 out, a scale per row
    weights = [what for what in parts if "weight" in what]
    assert len(weights) == 4 and all(parts[w] >= 3 * E * H * F for w in weights)  # bf16 read, fp8 written
    wgrad = [what for what in parts if what.startswith("wgrad")]
    saved_rows = parts["wgrad fc1 x (the saved float8 rows and their scales)"]
    assert len(wgrad) == 4 and saved_rows == N * H * 2 + 4 * N + 4 * E * H  # fp8 and scales in, fp8 out


def test_floor_only_needs_no_gpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--floor-only", "4", "--tokens", "16", "--hidden", "64",
                           "--ffn", "32", "--experts", "4", "--topk", "2"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 12 + 1, proc.stdout  # header, one row per quantisation, the total
    total = sum(float(r.split("|")[2]) for r in rows[1:-1])
    assert abs(float(rows[-1].split("|")[2]) - total) < 0.2, proc.stdout  # MB, rounded per row
