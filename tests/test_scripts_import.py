"""Every script under scripts/ imports: a name one script takes from another (``from bench_ops
import ...``) or from the package still exists. Each is loaded as ``python scripts/x.py`` would
load it (its own folder first on the path), without running its ``main``; one subprocess for all,
so that their path changes stay out of the test process."""
from __future__ import annotations

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
