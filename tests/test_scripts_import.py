"""Every script under scripts/ imports: a name one script takes from another (``from bench_ops
import ...``) or from the package still exists. Each is loaded as ``python scripts/x.py`` would
load it (its own folder first on the path), without running its ``main``; one subprocess for all,
so that their path changes stay out of the test process. And no file under scripts/ edits
``sys.path`` or imports the tests: what a script shares with the tests or with a script in another
folder lives in the package (moe_dispatch/tools/)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").rglob("*.py"))

LOADER = """
import importlib.util, sys, traceback
failed = []
for path in sys.argv[1:]:
    folder = path.rsplit("/", 1)[0]
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location("script_under_test", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException:
        failed.append(path + ": " + traceback.format_exc(limit=1).strip().splitlines()[-1])
    finally:
        sys.path.remove(folder)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_script_imports():
    assert ROOT / "scripts" / "bench_ops.py" in SCRIPTS and ROOT / "scripts" / "measure" / "unpermute.py" in SCRIPTS
    done = subprocess.run([sys.executable, "-c", LOADER, *map(str, SCRIPTS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"scripts that do not import:\n{done.stdout}{done.stderr[-2000:]}"


def _imports_tests(tree: ast.Module) -> list[int]:
    """Lines of the imports of ``tests`` or a module under it."""
    lines = []
    for node in ast.walk(tree):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        lines += [node.lineno for name in names if name == "tests" or name.startswith("tests.")]
    return lines


def test_no_script_edits_sys_path_or_imports_tests():
    files = sorted(p for p in (ROOT / "scripts").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert ROOT / "scripts" / "setup_venv.sh" in files and ROOT / "scripts" / "measure" / "unpermute.py" in files
    found = []
    for path in files:
        text = path.read_text(errors="replace")
        name = path.relative_to(ROOT)
        found += [f"{name}:{n}: sys.path" for n, line in enumerate(text.splitlines(), 1) if "sys.path" in line]
        if path.suffix == ".py":
            found += [f"{name}:{n}: imports tests" for n in _imports_tests(ast.parse(text, filename=str(path)))]
    assert not found, "scripts that edit sys.path or import the tests:\n" + "\n".join(found)
