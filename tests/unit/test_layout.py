"""The tree is the architecture: one folder per role with its `role.py`, shared pieces beside
them, no module over 800 lines, no import circle (imports inside functions count too)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from rollmesh.config.roles import ROLE_TABLE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rollmesh"
FLAT_ALLOWED = {"__init__.py", "__main__.py", "cli.py"}
MAX_LINES = 800


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names} & known.keys()
            found |= subs or ({base} & known.keys())
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & known.keys()
    return found - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_stands_flat_in_the_package():
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in FLAT_ALLOWED)
    assert not flat, f"modules outside a folder: {flat}"


def test_no_module_is_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_import_circle_between_modules_or_packages():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert not cycles(graph), cycles(graph)

    def folder(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or known[name].name == "__init__.py" else name

    folders: dict[str, set[str]] = {}
    for name, deps in graph.items():
        folders.setdefault(folder(name), set()).update(
            folder(d) for d in deps if folder(d) != folder(name) and folder(d) != "rollmesh")
    assert not cycles(folders), cycles(folders)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_each_role_process_is_one_role_py_in_its_folder():
    for role in ROLE_TABLE:
        if role.entry is None:  # the engine: an HTTP server the launcher starts itself
            continue
        module, _, function = role.entry.partition(":")
        assert module.startswith("rollmesh.") and module.endswith(".role"), role
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), role
        assert callable(getattr(importlib.import_module(module), function)), role


PUBLIC = ("rollmesh.agents", "rollmesh.rewards", "rollmesh.algorithms")


def test_the_public_api_for_a_users_package_is_there_and_the_example_uses_only_it():
    for package in PUBLIC:
        module = importlib.import_module(package)
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, (package, missing)
    example = ROOT / "tests/packages/rollmesh_example_loop"
    for path in example.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollmesh"):
                assert node.module in PUBLIC, f"{path.name} imports {node.module}"
