"""The table of scripts/megatron/pretrain_routes.sh: one row per run of Megatron-LM's pretrain_gpt.py,
then the bitwise comparisons between runs.

    python scripts/megatron/routes_report.py LOG_DIR

LOG_DIR holds ``routes.tsv`` (one line per run: name, exit status, seconds, command) and
``<name>.log`` per run. A run is named ``<group>.<variant>``: variants ``stock``, ``ours-a2a``,
``ours-ag``, ``ours-a2a-again`` (a repeat, the run-to-run control). Per row: ms per step (median
over the steps after the first ``--warmup``, from Megatron's "elapsed time per iteration"), the
steps whose exact losses run_pretrain.py printed, the first and last lm loss, whether install()'s
log line appeared (and the fusion line), the exit status. Per group: ours alltoall vs allgather
(bitwise equal expected), ours vs stock (different expected: other numerics), and the repeat.
Then ``checkpoint.txt`` (compare_checkpoints.py's output), if present.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

_STEP = re.compile(r"^moe_dispatch_step (\d+) (.*)$", re.M)
_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")
_INSTALL = "moe_dispatch: install() on Megatron's MoELayer"
_FUSION = "moe_dispatch: accepted moe_permute_fusion=True"
_TE_FP8 = "(TransformerEngine, recipe"


def parse_log(text: str, warmup: int) -> dict:
    """Steps {iteration: lm loss as a float}, ms per step, the plug-in's log lines, a last error."""
    losses = {}
    for it, fields in _STEP.findall(text):
        for field in fields.split():
            key, _, value = field.partition("=")
            if key == "lm_loss":
                losses[int(it)] = float.fromhex(value.split("/")[0])
    ms = [float(v) for v in _MS.findall(text)]
    timed = ms[warmup:] if len(ms) > warmup else []
    errors = [line for line in text.splitlines() if re.search(r"(Error|error:|Traceback|refuse)", line)]
    return dict(losses=losses, ms=statistics.median(timed) if timed else None, install=_INSTALL in text,
                fusion=_FUSION in text, te_fp8=_TE_FP8 in text, error=errors[-1][:160] if errors else "")


def read_runs(log_dir: str, warmup: int) -> list:
    runs = []
    with open(os.path.join(log_dir, "routes.tsv")) as f:
        for line in f:
            name, status, seconds, command = line.rstrip("\n").split("\t", 3)
            path = os.path.join(log_dir, f"{name}.log")
            text = open(path, errors="replace").read() if os.path.exists(path) else ""
            runs.append(dict(name=name, status=int(status), seconds=int(seconds), command=command,
                             **parse_log(text, warmup)))
    return runs


def _trajectory_diff(a: dict, b: dict) -> tuple:
    """(steps compared, bitwise equal, largest |a - b| / |a|)."""
    steps = sorted(set(a) & set(b))
    if not steps:
        return 0, False, None
    worst = max(abs(a[s] - b[s]) / max(abs(a[s]), 1e-30) for s in steps)
    return len(steps), all(a[s] == b[s] for s in steps), worst


def comparisons(runs: list) -> list:
    by_name = {r["name"]: r for r in runs}
    groups = sorted({r["name"].rsplit(".", 1)[0] for r in runs})
    rows = []
    for group in groups:
        pairs = [("ours-a2a", "ours-ag", "ours alltoall vs allgather", True),
                 ("ours-a2a", "ours-a2a-again", "ours alltoall, run twice", True),
                 ("stock", "stock-again", "stock, run twice", None),
                 ("ours-a2a", "stock", "ours vs stock Megatron", False)]
        for left, right, what, expect_equal in pairs:
            a, b = by_name.get(f"{group}.{left}"), by_name.get(f"{group}.{right}")
            if a is None or b is None:
                continue
            n, equal, worst = _trajectory_diff(a["losses"], b["losses"])
            if n == 0:
                verdict = "NO DATA"
            elif expect_equal is None:
                verdict = "equal" if equal else "differ"
            elif equal == expect_equal:
                verdict = "PASS"
            else:
                verdict = "FAIL"
            expected = {True: "bitwise equal", False: "different", None: "(shown)"}[expect_equal]
            shown = "bitwise equal" if equal else f"differ, max rel {worst:.2e}" if worst is not None else "-"
            rows.append(f"{group:<22} {what:<30} {n:>3} steps: {shown:<28} expected {expected:<14} {verdict}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the ms/step median")
    args = parser.parse_args(argv)
    runs = read_runs(args.log_dir, args.warmup)
    print(f"{'route':<30} {'rc':>3} {'s':>4} {'ms/step':>8} {'steps':>5} {'loss step 1':>12} {'last loss':>12} "
          f"{'install()':>9} {'fusion':>6} {'TE fp8':>6}")
    for r in runs:
        steps = sorted(r["losses"])
        first = f"{r['losses'][steps[0]]:.7f}" if steps else "-"
        last = f"{r['losses'][steps[-1]]:.7f}" if steps else "-"
        ms = f"{r['ms']:.1f}" if r["ms"] is not None else "-"
        yes = {True: "yes", False: "no"}
        print(f"{r['name']:<30} {r['status']:>3} {r['seconds']:>4} {ms:>8} {len(steps):>5} {first:>12} {last:>12} "
              f"{yes[r['install']]:>9} {yes[r['fusion']]:>6} {yes[r['te_fp8']]:>6}")
        if r["status"] != 0 and r["error"]:
            print(f"    last error line: {r['error']}")
    print("\nlosses per step (lm loss, 7 digits; comparisons below use the exact values):")
    for r in runs:
        if r["losses"]:
            print(f"  {r['name']:<28} " + " ".join(f"{r['losses'][s]:.5f}" for s in sorted(r["losses"])))
    print("\ncomparisons of the exact loss trajectories:")
    rows = comparisons(runs)
    print("\n".join(rows) if rows else "  (none: no group has two of its variants)")
    checkpoint = os.path.join(args.log_dir, "checkpoint.txt")
    if os.path.exists(checkpoint):
        print("\ncheckpoint round trip (stock TE saves, ours loads and saves, stock loads and saves):")
        print(open(checkpoint).read().rstrip())
    failed = any(row.endswith("FAIL") for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
