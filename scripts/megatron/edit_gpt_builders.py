"""Apply docs/megatron.md's edit to a Megatron-LM core_v0.16.x-0.18.x `gpt_builders.py`: two lines
before `model = GPTModel(` in `gpt_builder`, at that line's indentation, so that pretrain_gpt.py
builds every MoE layer as DeterministicMoELayer.

    python scripts/megatron/edit_gpt_builders.py PATH/TO/Megatron-LM/gpt_builders.py

Edits the file in place; refuses (exit 1, the file untouched) where `gpt_builder` or its
`model = GPTModel(` line is missing, and does nothing where the edit is already there.
"""
from __future__ import annotations

import argparse
import re
import sys

IMPORT = "from moe_dispatch.integrations.megatron import deterministic_moe_spec"
WRAP = "transformer_layer_spec = deterministic_moe_spec(transformer_layer_spec)"


def edit(source: str) -> str:
    """The source with the two lines added (ValueError where the place is not found)."""
    if IMPORT in source:
        return source
    lines = source.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("def gpt_builder(")), None)
    if start is None:
        raise ValueError("no `def gpt_builder(` in the file: is it Megatron-LM's gpt_builders.py (core_v0.16-0.18)?")
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("def "):
            break
        found = re.match(r"^(\s+)model = GPTModel\(", lines[i])
        if found:
            indent = found.group(1)
            return "".join(lines[:i] + [f"{indent}{IMPORT}\n", f"{indent}{WRAP}\n"] + lines[i:])
    raise ValueError("no `model = GPTModel(` line in gpt_builder")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="Megatron-LM's gpt_builders.py")
    args = parser.parse_args(argv)
    with open(args.path) as f:
        source = f.read()
    try:
        edited = edit(source)
    except ValueError as exc:
        print(f"{args.path}: {exc}", file=sys.stderr)
        return 1
    if edited != source:
        with open(args.path, "w") as f:
            f.write(edited)
    print(f"{args.path}: {'edited' if edited != source else 'already edited'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
