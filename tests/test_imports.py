"""The package's modules import each other without a circle, and its leaves load nothing above them.

The import graph is read from the source (ast): an edge for every import of a package module,
also those inside functions and those under ``if TYPE_CHECKING:`` (a lazy or type-only import
that closes a circle only hides it: the two modules still depend on each other). Importing
``a.b.c`` also runs the packages ``a.b``'s ``__init__``, so an edge goes to every package on the
way that the importer is not inside.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_dispatch"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement may load (a ``from x import y`` may load x.y)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (packages: their ``__init__``)."""
    files = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # a.b.c runs a, a.b and a.b.c
                    target = ".".join(parts[:i])
                    if target in files and target != module and not module.startswith(target + "."):
                        graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle [a, b, ..., a] of the graph, or [] if it has none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        done.add(path.pop())
        return []

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles as sets of modules that all reach each other (strongly connected
    components of more than one module), each sorted; [] if it has none."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            node = todo.pop()
            if node not in reach[start]:
                reach[start].add(node)
                todo.extend(graph[node])
    found = {tuple(sorted(m for m in graph if m == start or (m in reach[start] and start in reach[m])))
             for start in graph}
    return sorted(list(c) for c in found if len(c) > 1)


def test_graph_sees_the_package():
    graph = import_graph()
    assert "moe_dispatch.dispatcher.functional" in graph["moe_dispatch.dispatcher.dispatchers"]
    assert "moe_dispatch.config" in graph["moe_dispatch.distributed.agreement"]
    # a package import runs its __init__; imports within one's own package do not loop back
    assert "moe_dispatch.dispatcher" in graph["moe_dispatch.layer"]
    assert "moe_dispatch.dispatcher" not in graph["moe_dispatch.dispatcher.functional"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert circles({"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}) == [["a", "b"], ["c", "d"]]


def test_graph_counts_type_only_and_in_function_imports(tmp_path):
    """A circle closed only by an ``if TYPE_CHECKING:`` import or an import inside a function
    is still a circle (the hidden circles of issue 49 were of these kinds)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (package / "c.py").write_text("from . import d\n")
    (package / "d.py").write_text("def f():\n    from .c import C\n")
    assert circles(import_graph(package)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_no_import_circle():
    graph = import_graph()
    found = circles(graph)
    shown = [", ".join(c) + "\n  e.g. " + " -> ".join(find_cycle({m: graph[m] & set(c) for m in c})) for c in found]
    assert not found, ("import circles (modules that import each other, type-only and in-function imports "
                       "included):\n" + "\n".join(shown))


MAX_MODULE_LINES = 500  # a module past this is read in parts: split it by concern


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("lower, higher", [
    ("moe_dispatch.distributed", "moe_dispatch.dispatcher"),
    ("moe_dispatch.ops", "moe_dispatch.dispatcher"),
    ("moe_dispatch.ops", "moe_dispatch.distributed"),
    ("moe_dispatch.numerics", "moe_dispatch.ops"),
    # GradientTree once lived in distributed and reached up into the experts and the router
    ("moe_dispatch.distributed", "moe_dispatch.experts"),
    ("moe_dispatch.distributed", "moe_dispatch.router"),
    ("moe_dispatch.distributed", "moe_dispatch.layer"),
    ("moe_dispatch.distributed", "moe_dispatch.parallel"),
    ("moe_dispatch.experts", "moe_dispatch.parallel"),
    ("moe_dispatch.router", "moe_dispatch.parallel"),
    # the layer's data-parallel guards live with the experts; parallel/ (GradientTree) is above the layer
    ("moe_dispatch.layer", "moe_dispatch.parallel"),
])
def test_lower_concerns_import_nothing_above(lower, higher):
    """No import, type-only and in-function ones included, from a lower concern up into a higher
    one (the registry once named the sync-free plan's record for its type)."""
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    graph = import_graph()
    up = [f"{m} -> {t}" for m, targets in sorted(graph.items()) if inside(m, lower)
          for t in sorted(targets) if inside(t, higher)]
    assert up == []


@pytest.mark.parametrize("module, not_loaded", [
    ("moe_dispatch.config", ["moe_dispatch.dispatcher", "moe_dispatch.router", "moe_dispatch.ops"]),
    ("moe_dispatch.distributed.comm", ["moe_dispatch.config", "moe_dispatch.dispatcher"]),
    ("moe_dispatch.distributed.identity", ["moe_dispatch.config", "moe_dispatch.dispatcher"]),
    ("moe_dispatch.distributed.agreement", ["moe_dispatch.dispatcher", "moe_dispatch.router", "moe_dispatch.ops"]),
    ("moe_dispatch.numerics.autograd", ["moe_dispatch.dispatcher", "moe_dispatch.router", "moe_dispatch.ops",
                               "moe_dispatch.experts"]),
])
def test_leaf_modules_load_nothing_above_them(module, not_loaded):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('moe_dispatch')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert module in loaded
    assert not [m for m in loaded if any(m == n or m.startswith(n + ".") for n in not_loaded)], loaded


# The packages whose public face (their __init__) a framework integration may import from.
FACES = {"moe_dispatch.config", "moe_dispatch.dispatcher", "moe_dispatch.experts", "moe_dispatch.router",
         "moe_dispatch.numerics", "moe_dispatch.distributed", "moe_dispatch.ops", "moe_dispatch.layer",
         "moe_dispatch.parallel", "moe_dispatch"}


def _below_the_faces(package: Path, root: Path = PACKAGE) -> list[str]:
    """Imports in ``package``'s modules of moe_dispatch modules that are not a public face
    (imports within the package itself are its own business)."""
    own = _module_name(package / "__init__.py", root)
    found = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            target = _imported(node, module, path.name == "__init__.py")[0]
            if target.startswith("moe_dispatch") and not target.startswith(own) and target not in FACES:
                found.append(f"{module}:{node.lineno} imports {target}")
    return found


def test_integrations_use_only_public_faces(tmp_path):
    """The Megatron adapter (and any second framework's) reaches the core through the packages'
    faces only: the staged dispatch, the experts, the router, the numerics."""
    assert _below_the_faces(PACKAGE / "integrations") == []
    # the check finds an import from below a face (as the adapter had before the staged API)
    fake = tmp_path / "moe_dispatch" / "integrations" / "other"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("from ...dispatcher.functional import dispatch\n"
                                      "from ...experts import expert_gemm\n")
    assert _below_the_faces(fake, tmp_path / "moe_dispatch") == [
        "moe_dispatch.integrations.other:1 imports moe_dispatch.dispatcher.functional"]
