"""scripts/megatron/edit_gpt_builders.py: docs/megatron.md's two-line edit of Megatron-LM's
gpt_builders.py (core_v0.16-0.18), at the indentation of `model = GPTModel(`; refused, the file
untouched, where that line is missing; idempotent."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron" / "edit_gpt_builders.py"

BUILDER = '''def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    if args.use_legacy_models:
        model = megatron.legacy.model.GPTModel(config)
    else:  # using core models
        transformer_layer_spec = import_module(args.spec)
        model = GPTModel(
            config=config,
        )
    return model


def other():
    model = GPTModel()
'''


def _run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60)


def test_edit_adds_two_lines_at_the_indentation(tmp_path):
    path = tmp_path / "gpt_builders.py"
    path.write_text(BUILDER)
    assert _run(path).returncode == 0
    lines = path.read_text().splitlines()
    i = lines.index("        model = GPTModel(")
    assert lines[i - 2:i] == ["        from moe_dispatch.integrations.megatron import deterministic_moe_spec",
                              "        transformer_layer_spec = deterministic_moe_spec(transformer_layer_spec)"]
    assert path.read_text().count("deterministic_moe_spec(") == 1  # only inside gpt_builder
    edited = path.read_text()
    result = _run(path)
    assert result.returncode == 0 and "already edited" in result.stdout and path.read_text() == edited


def test_refused_without_the_model_line(tmp_path):
    path = tmp_path / "gpt_builders.py"
    source = BUILDER.replace("        model = GPTModel(\n            config=config,\n        )\n", "        pass\n")
    path.write_text(source)
    result = _run(path)
    assert result.returncode == 1 and "no `model = GPTModel(` line in gpt_builder" in result.stderr
    assert path.read_text() == source
