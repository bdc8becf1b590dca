"""The packages' import graph: no loops inside a package, and data flows one way between them (STYLE.md, section 4)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "workers", "accounting")


def module_name(path: Path) -> str:
    """The dotted name of a source file under the repository root (a package's __init__ is the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The repository modules a file imports anywhere in it (inside functions too), by the most specific name.

    ``from package import name`` counts as importing ``package.name`` when that
    is a module, else ``package``.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
    return {name for name in found if name in known}


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of the same package it imports."""
    paths = sorted((ROOT / package).rglob("*.py"))
    known = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, known) - {module_name(path)} for path in paths}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as a list of modules (first repeated at the end), or None when the graph has none."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_loop_and_passes_a_tree():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_loops_within_a_package(package):
    assert cycle_in(import_graph(package)) is None


def test_the_engines_build_on_the_shared_clip_arithmetic_which_imports_no_engine():
    graph = import_graph("workers")
    assert graph["workers.clipping"] <= {"workers.models"}
    assert {"workers.clipping", "workers.layer_rules", "workers.sequence_rules", "workers.vmap_engine"} <= \
        graph["workers.engines"]


def imports_from(package: str, forbidden: set[str]) -> dict[str, set[str]]:
    """The modules of ``package`` that import (anywhere in them) a package of ``forbidden``, and what they import."""
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                if name.split(".")[0] in forbidden:
                    offenders.setdefault(module_name(path), set()).add(name)
    return offenders


@pytest.mark.parametrize("package, forbidden", [
    ("workers", {"orchestrator", "accounting"}),
    ("accounting", {"orchestrator", "workers"}),
])
def test_data_flows_one_way_between_packages(package, forbidden):
    assert imports_from(package, forbidden) == {}


def test_the_accountants_and_the_ledger_never_import_torch_torchvision_or_ray():
    """`dpfleet eps` and the ledger server run without the deep-learning stack, in their code and in what it loads."""
    assert imports_from("accounting", {"torch", "torchvision", "ray"}) == {}
    modules = sorted(module_name(path) for path in (ROOT / "accounting").rglob("*.py"))
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys\nfor name in {modules!r}: __import__(name)\n"
         "print(' '.join(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'torchvision', 'ray'})))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert loaded.strip() == ""
