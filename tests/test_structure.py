"""The code's shape: no import circle among tandem's modules, and reading a config loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("grpo", "model")
TOP_MODULES = ("rewards", "train_grpo")


def _modules() -> dict[str, Path]:
    """Every module of the project: dotted name -> file (a package is its __init__.py)."""
    found = {name: REPO / f"{name}.py" for name in TOP_MODULES}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_imports(tree: ast.Module) -> list[str]:
    """Modules imported at module level when the file runs (not under `if TYPE_CHECKING:`; imports
    inside functions are deliberate deferrals, e.g. of optional packages, and run later)."""
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.Import):
                names += [alias.name for alias in sub.names]
            elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                names += [sub.module] + [f"{sub.module}.{alias.name}" for alias in sub.names]
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules its execution imports, packages' __init__ included (importing
    a.b.c runs a and a.b first), except the packages the importer itself belongs to."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for imported in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_projects_modules():
    graph = import_graph()
    assert "grpo.run.loop" in graph and "grpo.config.sections" in graph["grpo.train.loss"]
    assert cycles(graph) == []


def test_reading_a_config_imports_no_torch():
    code = (
        "import sys; from grpo.config import load_config; "
        "cfg = load_config(['--training.steps=3'], world_size=2); "
        "print(cfg.training.steps, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "False"]
