"""No project module imports one that imports it back, and every module imports in any order (issue 25).

The project's modules are the ``.py`` files of the packages pyproject.toml installs. A circle is found statically
from each module's ``import`` statements, at module level and inside functions alike (a function-level import
only hides a circle until the function runs). The orders are checked by importing every module in fresh
interpreters: sorted, reversed and shuffled, so that each circle that slipped past the first check would fail
in at least one of them.
"""

import ast
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def project_modules() -> dict[str, Path]:
    """Module name -> file, for every module of every package in pyproject's ``[tool.setuptools] packages``."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    modules = {}
    for package in packages:
        for path in sorted((ROOT / package.replace(".", "/")).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module ``name`` (file ``path``) imports anywhere in its body.

    ``from pkg import sub`` is an edge to ``pkg.sub`` when that is a module, else to ``pkg`` (a name its
    ``__init__`` defines). Relative imports are resolved against the module's package."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every one is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_the_imports_it_must():
    """The parser is not blind: a few imports the project is known to make, of each kind, are edges."""
    graph = import_graph()
    assert "train.data" in graph["train.grpo"]  # from train import data
    assert "reconstruct.schema" in graph["train.data"]  # from reconstruct import schema
    assert "eval.errors" in graph["eval.__main__"]  # from eval.errors import EvalError
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "import circles (each list imports itself back): " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["sorted", "reversed", "shuffled"])
def test_every_module_imports_in_any_order(order):
    names = sorted(project_modules())
    if order == "reversed":
        names.reverse()
    elif order == "shuffled":
        random.Random(25).shuffle(names)
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    run = subprocess.run(
        [sys.executable, "-c", script, *names], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, f"importing in {order} order failed:\n{run.stderr[-3000:]}"
