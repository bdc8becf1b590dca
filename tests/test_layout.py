"""The packages' import graph and their public faces (STYLE.md, section 4; docs/architecture.md).

No loops inside a package, data flows one way between the rooms, and code
outside a package imports from it only what its ``__init__``'s ``__all__``
names. The faces are read from the source (ast), so the check loads nothing.
It checks the source rooms and bench/, examples/ and deploy/; tests are not
checked, as they test internals.
"""

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "workers", "accounting")


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name of a source file under ``root`` (a package's __init__ is the package)."""
    parts = path.relative_to(root).with_suffix("").parts
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
    assert graph["workers.clipping"] <= {"workers.models", "workers.names"}  # names: torch-free registries
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


# Public faces: what code outside a package may import from it is what its __init__'s __all__ names.
IMPORTERS = (*PACKAGES, "bench", "examples", "deploy")
HEAVY = ("torch", "torchvision", "ray", "grpc")
# Private names that code outside their package reaches, each with its reason; keep this short.
PRIVATE_USES = {
    # The benchmark times each SQL statement of a PostgreSQL commit by wrapping the connection's execute, as a test
    # would; the class moves with the store's split.
    ("bench/ledger_commit_profile.py", "_PostgresConnection"),
}


def package_inits(root: Path = ROOT) -> dict[str, Path]:
    """Every package of the source rooms, by dotted name, with its ``__init__.py``."""
    return {module_name(path, root): path for room in PACKAGES for path in sorted((root / room).rglob("__init__.py"))}


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the source rooms, packages included, by dotted name."""
    return {module_name(path, root): path for room in PACKAGES for path in sorted((root / room).rglob("*.py"))}


def bound_names(statements: list[ast.stmt]) -> set[str]:
    """The names a module's top level binds (definitions, assignments, imports), in its if/try/with blocks too."""
    names = set()
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            handlers = [statement for handler in getattr(node, "handlers", []) for statement in handler.body]
            names |= bound_names([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                                  *handlers])
    return names


def face_of(init: Path, package: str) -> list[tuple[str, str | None]] | None:
    """The names a package's ``__init__`` declares public, each with the module it lives in; None without ``__all__``.

    Two forms are read. The lazy face, ``__getattr__, __dir__, __all__ =
    public_face(__name__, {module: names}, defined_here=names)``, gives each
    name's module. A literal ``__all__`` gives the package itself as the home
    of a name its ``__init__`` defines, the module it imports the name from,
    and None (some module of the package) for a name it only declares.
    """
    tree = ast.parse(init.read_text(), str(init))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) and node.value else []
        if "__all__" not in {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}:
            continue
        try:
            return literal_face(tree, node.value, package)
        except (ValueError, TypeError, IndexError, AttributeError):
            raise ValueError(f"{init}: __all__ must be a literal list of names or public_face(__name__, {{module: "
                             f"names}}, defined_here=names) with literal arguments, for the layout test to read it")
    return None


def literal_face(tree: ast.Module, value: ast.expr, package: str) -> list[tuple[str, str | None]]:
    """``face_of`` for the ``__all__`` assigned ``value``: a ``public_face(...)`` call or a literal list of names."""
    if isinstance(value, ast.Call):
        if (getattr(value.func, "id", None) or getattr(value.func, "attr", None)) != "public_face":
            raise ValueError(value)
        homes = ast.literal_eval(value.args[1])
        here = [ast.literal_eval(argument) for argument in value.args[2:]] + \
            [ast.literal_eval(keyword.value) for keyword in value.keywords if keyword.arg == "defined_here"]
        return [(name, f"{package}.{module}") for module, names in homes.items() for name in names] + \
            [(name, package) for names in here for name in names]
    imported_from = {(alias.asname or alias.name): absolute_module(statement, package, True)
                     for statement in tree.body if isinstance(statement, ast.ImportFrom)
                     for alias in statement.names}
    defined = bound_names(tree.body) - set(imported_from)
    return [(name, package if name in defined else imported_from.get(name)) for name in ast.literal_eval(value)]


def absolute_module(node: ast.ImportFrom, importer: str, importer_is_package: bool) -> str:
    """The module a ``from ... import`` names, relative imports resolved against the importing module."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if importer_is_package else importer.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


@dataclass(frozen=True)
class NameUse:
    """A name that a file takes from a repository module: by ``from module import name``, or as ``module.name``."""

    path: Path
    line: int
    module: str
    name: str


def name_uses(path: Path, importer: str, known: set[str]) -> set[NameUse]:
    """Every name ``path`` takes from a module of ``known``, anywhere in the file.

    A module bound to a local name (``import a.b``, ``import a.b as m``, ``from
    a import b`` where ``a.b`` is a module, ``m = LazyModule("a.b")``) is
    followed through attribute reads: ``m.name`` and ``a.b.name`` are uses.
    """
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    modules: dict[str, str] = {}
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(node, importer, is_package)
            for alias in node.names:
                if f"{module}.{alias.name}" in known:
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif module in known and alias.name != "*":
                    uses.add(NameUse(path, node.lineno, module, alias.name))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args and \
                isinstance(node.value.args[0], ast.Constant) and node.value.args[0].value in known and \
                (getattr(node.value.func, "id", None) or getattr(node.value.func, "attr", None)) == "LazyModule":
            modules.update({target.id: node.value.args[0].value for target in node.targets
                            if isinstance(target, ast.Name)})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = attribute_chain(node)
            if chain and chain[0] in modules:
                uses |= attribute_use(path, node.lineno, modules[chain[0]], chain[1:], known)
    return uses


def attribute_chain(node: ast.Attribute) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None when the chain starts at something other than a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def attribute_use(path: Path, line: int, module: str, attributes: list[str], known: set[str]) -> set[NameUse]:
    """The name an attribute chain reads from a repository module (``a.b.name``: name from ``a.b``), if any."""
    for attribute in attributes:
        if f"{module}.{attribute}" not in known:
            return {NameUse(path, line, module, attribute)} if module in known else set()
        module = f"{module}.{attribute}"
    return set()


def holding_package(module: str, packages: dict[str, Path]) -> str:
    """The innermost package that holds ``module`` (``module`` itself when it is one); "" when none does."""
    while module and module not in packages:
        module = module.rpartition(".")[0]
    return module


def inside(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its modules, at any depth."""
    return module == package or module.startswith(f"{package}.")


def public_face_violations(root: Path = ROOT) -> list[str]:
    """Each name that code outside a package takes from it but the package's ``__all__`` does not name.

    Importers are the source rooms, bench/, examples/ and deploy/. A name is
    checked against the innermost package that holds its module (an import
    from ``accounting.ledger.store`` against ``accounting.ledger``'s face), and
    must also be defined in the module it is taken from. Dunder names (a
    module's ``__file__``, ``__version__``) are module metadata, not checked.
    """
    modules = source_modules(root)
    packages = package_inits(root)
    faces = {package: {name for name, _ in face_of(init, package) or []} for package, init in packages.items()}
    defined = {module: bound_names(ast.parse(path.read_text(), str(path)).body) for module, path in modules.items()}
    found = []
    for room in IMPORTERS:
        for path in sorted((root / room).rglob("*.py")):
            importer = module_name(path, root)
            for use in sorted(name_uses(path, importer, set(modules)), key=lambda use: (use.line, use.name)):
                package = holding_package(use.module, packages)
                if not package or inside(importer, package) or (use.name.startswith("__") and use.name.endswith("__")):
                    continue
                where = f"{path.relative_to(root)}:{use.line}"
                if (str(path.relative_to(root)), use.name) in PRIVATE_USES:
                    continue
                if use.name not in faces[package]:
                    found.append(f"{where}: `{use.name}` (from {use.module}) is not in the public face of package "
                                 f"{package}: add it to __all__ in {packages[package].relative_to(root)} if code "
                                 f"outside {package} may use it, or use a public name instead")
                elif use.name not in defined[use.module] | faces.get(use.module, set()):
                    found.append(f"{where}: `{use.name}` is in the public face of package {package}, but module "
                                 f"{use.module} does not define it: import it from the module that does")
    return found


def public_face_errors(root: Path = ROOT) -> list[str]:
    """What is wrong with the packages' ``__init__`` files: no docstring or ``__all__``, or a name that lies.

    A name must live where the face says (in the module, or for a name only
    declared, in some module of the package), be listed once, and not be a
    module's name (an imported module would hide it).
    """
    modules = source_modules(root)
    packages = package_inits(root)
    defined = {module: bound_names(ast.parse(path.read_text(), str(path)).body) for module, path in modules.items()}
    for package, init in packages.items():  # a home that is a package offers its own face's names too
        try:
            defined[package] |= {name for name, _ in face_of(init, package) or []}
        except ValueError as unreadable:
            return [str(unreadable)]
    found = [f"{folder.relative_to(root)}: Python modules but no __init__.py: make it a package with a public face"
             for room in PACKAGES for folder in sorted({path.parent for path in (root / room).rglob("*.py")})
             if not (folder / "__init__.py").exists()]
    for package, init in packages.items():
        where = init.relative_to(root)
        if not ast.get_docstring(ast.parse(init.read_text(), str(init))):
            found.append(f"{where}: no docstring: one line saying what package {package} is")
        face = face_of(init, package)
        if face is None:
            found.append(f"{where}: no __all__: name what code outside {package} may import from it")
            continue
        own = {module for module in modules if module.rpartition(".")[0] == package}
        names = [name for name, _ in face]
        for name, home in face:
            holders = [home] if home else sorted(own | {package})
            if names.count(name) > 1:
                found.append(f"{where}: `{name}` is listed {names.count(name)} times in __all__: keep one")
            elif f"{package}.{name}" in modules:
                found.append(f"{where}: `{name}` in __all__ is also the name of module {package}.{name}")
            elif home and home not in modules:
                found.append(f"{where}: `{name}` in __all__ lives in {home}, which does not exist")
            elif not any(name in defined[holder] for holder in holders):
                found.append(f"{where}: `{name}` in __all__ is not defined in {' or '.join(holders)}")
    return found


def test_every_package_has_a_docstring_and_an_all_whose_names_live_where_it_says():
    assert public_face_errors() == []


def test_code_outside_a_package_imports_only_the_names_in_its_all():
    """Each entry names the file, the line, the name and the package whose ``__all__`` lacks it."""
    violations = public_face_violations()
    assert not violations, "\n".join(violations)


def test_the_face_checks_catch_a_private_name_a_missing_module_and_a_false_entry(tmp_path):
    package = tmp_path / "workers" / "engines"
    (package / "extra").mkdir(parents=True)
    (tmp_path / "workers" / "__init__.py").write_text('"""Workers."""\n__all__: list[str] = ["shared"]\nshared = 1\n')
    (package / "__init__.py").write_text(
        '"""Engines."""\nfrom workers.lazy import public_face\n'
        '__getattr__, __dir__, __all__ = public_face(__name__, {"core": ["clip", "gone"], "missing": ["x"]})\n')
    (package / "core.py").write_text("def clip(): pass\ndef _private(): pass\n")
    (package / "extra" / "rules.py").write_text("def rule(): pass\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run.py").write_text(
        "import workers.engines.core\nfrom workers.engines.core import clip, _private\n"
        "from workers import engines\nworkers.engines.core.clip()\nengines.core._private()\n"
        "from workers import shared, hidden\nfrom workers.engines.extra.rules import rule\n")
    assert public_face_errors(tmp_path) == [
        "workers/engines/extra: Python modules but no __init__.py: make it a package with a public face",
        "workers/engines/__init__.py: `gone` in __all__ is not defined in workers.engines.core",
        "workers/engines/__init__.py: `x` in __all__ lives in workers.engines.missing, which does not exist",
    ]
    violations = public_face_violations(tmp_path)
    assert [violation.split(" is ")[0] for violation in violations] == [
        "bench/run.py:2: `_private` (from workers.engines.core)",
        "bench/run.py:5: `_private` (from workers.engines.core)",
        "bench/run.py:6: `hidden` (from workers)",
        "bench/run.py:7: `rule` (from workers.engines.extra.rules)",
    ]
    assert "package workers.engines: add it to __all__ in workers/engines/__init__.py" in violations[0]


def test_a_face_the_checks_cannot_read_is_refused_with_what_to_write(tmp_path):
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "__init__.py").write_text('"""Workers."""\n__all__ = sorted(["shared"])\n')
    (errors,) = public_face_errors(tmp_path)
    assert "__all__ must be a literal list of names or public_face(__name__" in errors


def test_every_package_imports_without_torch_ray_or_grpc_and_its_all_is_what_the_face_reads():
    """The faces the checks read from the source are the ``__all__`` Python sees, and cost no heavy import."""
    packages = sorted(package_inits())
    script = (f"import importlib, json, sys\npackages = {packages!r}\n"
              "faces = {name: sorted(importlib.import_module(name).__all__) for name in packages}\n"
              "loaded = sorted({name.split('.')[0] for name in sys.modules} & " f"{set(HEAVY)!r})\n"
              "print(json.dumps({'faces': faces, 'loaded': loaded}))\n")
    report = json.loads(subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                                       check=True).stdout)
    assert report["loaded"] == []
    assert report["faces"] == {package: sorted(name for name, _ in face_of(init, package))
                               for package, init in package_inits().items()}


def test_a_face_hands_out_each_name_from_its_module_when_read_and_refuses_other_names(monkeypatch):
    import accounting
    import accounting.events
    from workers import sources

    from accounting import SampledGaussian

    assert SampledGaussian is accounting.events.SampledGaussian
    assert sources.__name__ == "workers.sources"  # a module is still imported by its name
    monkeypatch.setattr(accounting.events, "SampledGaussian", "patched")
    assert accounting.SampledGaussian == "patched"
    assert set(accounting.__all__) <= set(dir(accounting))
    with pytest.raises(AttributeError, match="module 'accounting' has no attribute 'SampledGaussians'"):
        accounting.SampledGaussians


def test_the_workers_and_the_accounting_public_face_helpers_are_the_same_code():
    """Each room holds its own (they may not import each other); this keeps the two from drifting apart."""
    helpers = [next(ast.dump(node) for node in ast.parse((ROOT / room / "lazy.py").read_text()).body
                    if isinstance(node, ast.FunctionDef) and node.name == "public_face")
               for room in ("workers", "accounting")]
    assert helpers[0] == helpers[1]


def test_a_folder_named_like_a_package_beside_a_script_does_not_shadow_the_installed_one(tmp_path):
    """A clone called dpfleet/ (or a workers/ folder) beside a user's script is no package of the install's."""
    for name in ("dpfleet", "orchestrator", "workers", "accounting"):
        (tmp_path / name).mkdir()
    script = tmp_path / "script.py"
    script.write_text("import dpfleet, workers, accounting.accountants\nprint(callable(dpfleet.train))\n")
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "True"
