"""Test-only: scripts/train_moe_gpt.py on CPU gloo ranks.

The script itself refuses CPU ranks (megatron-core's MoE code needs CUDA); this launcher runs the
script's own ``main`` and rank code unchanged, with the test-only CPU shims (tests/megatron_cpu.py)
applied in each rank first.

    python -m tests.integrations.train_moe_gpt_cpu --stock --svg BENCHMARKS_train_loss.svg
    python -m tests.integrations.train_moe_gpt_cpu --ep-sizes 1 --compare-fp8 --fp8-svg fp8.svg   # FP8 vs bf16
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import train_moe_gpt  # noqa: E402


def _rank(*args) -> None:
    from tests.megatron_cpu import apply_cpu_rng, apply_cpu_shims

    apply_cpu_shims(prepare=False)  # the script prepares Megatron after initialize_model_parallel
    apply_cpu_rng()
    train_moe_gpt.rank_main(*args)


def main(argv: Optional[list[str]] = None) -> int:
    return train_moe_gpt.main(["--cpu", *(sys.argv[1:] if argv is None else argv)], rank_fn=_rank)


if __name__ == "__main__":
    raise SystemExit(main())
