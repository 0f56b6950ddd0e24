"""The code's shape: no import circle among tandem's modules, every import of a name from the
repository's own modules finds it (deferred ones too, which only run on a GPU or with an optional
package), and reading a config loads no torch."""

from __future__ import annotations

import ast
import functools
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


@functools.cache
def _defined_names(path: Path) -> set[str]:
    """The names a module's top level binds: functions, classes, assignments and imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(leaf.id for target in targets for leaf in ast.walk(target) if isinstance(leaf, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def unresolved_imports(files: list[Path]) -> list[str]:
    """`from M import N` lines in files, at any depth, where M is a module of this repository whose
    file binds no N and has no submodule N: "file:line M.N" each."""
    missing = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            base = REPO / node.module.replace(".", "/")
            source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            if not source.is_file():
                continue
            defined = _defined_names(source)
            for alias in node.names:
                if alias.name not in defined and not (base / f"{alias.name}.py").is_file() and not (base / alias.name).is_dir():
                    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
                    missing.append(f"{where}:{node.lineno} {node.module}.{alias.name}")
    return missing


def test_an_import_of_a_name_its_module_no_longer_has_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from model import Transformer, lora\n\n\ndef f():\n    from tests.dist_utils import run_ranks, gone\n")
    assert unresolved_imports([planted]) == ["planted.py:5 tests.dist_utils.gone"]


def test_every_import_from_the_repository_finds_its_name():
    folders = ("grpo", "model", "tests", "bench", "scripts", "fixtures")
    files = [REPO / f"{name}.py" for name in TOP_MODULES]
    files += [path for folder in folders for path in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 100
    assert unresolved_imports(files) == []


def test_reading_a_config_imports_no_torch():
    code = (
        "import sys; from grpo.config import load_config; "
        "cfg = load_config(['--training.steps=3'], world_size=2); "
        "print(cfg.training.steps, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "False"]
