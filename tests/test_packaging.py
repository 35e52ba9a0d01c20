"""Every package the code and the tests import is declared where it is needed.

A test that imports a package only an optional extra installs passes on a machine where that
extra happens to be installed and fails on a fresh one. This reads every import statement
(with `ast`) and checks that the distribution providing it is a declared requirement:

- `batchfix/` (the installed package): the core dependencies;
- `tests/` and the module-level imports of `scripts/` and its subfolders (the tests run scripts): core + `test`.

Function-level imports in `scripts/` are the optional comparison baselines (the `bench` extra),
imported where used; imports inside `try: ... except ImportError` are optional by construction.
"""
from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL_MODULES = {"batchfix", "conftest", "scripts"} | {p.stem for p in (ROOT / "tests").glob("*.py")}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str | None) -> set[str]:
    """Distribution names batchfix requires, plus those of one extra."""
    names = set()
    for requirement in metadata.requires("batchfix") or []:
        name = normalized(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))
        marker = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if marker is None or marker.group(1) == extra:
            names.add(name)
    return names


def guarded_by_import_error(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
        ):
            return True
    return False


def imported_modules(path: Path, module_level_only: bool = False) -> set[str]:
    """Top-level names of the modules `path` imports (relative imports and optional ones left out)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module]
        else:
            continue
        if not guarded_by_import_error(node, parents):
            names.update(name.split(".")[0] for name in found)
    return names


def undeclared(paths: list[Path], allowed: set[str], module_level_only: bool = False) -> dict[str, list[str]]:
    """{module: [files]} for imports whose distribution is not in `allowed`."""
    providers = metadata.packages_distributions()
    problems: dict[str, list[str]] = {}
    for path in paths:
        for module in imported_modules(path, module_level_only):
            if module in sys.stdlib_module_names or module in LOCAL_MODULES or module == "__future__":
                continue
            distributions = {normalized(d) for d in providers.get(module, [module])}
            if not distributions & allowed:
                problems.setdefault(module, []).append(path.name)
    return problems


def test_the_package_imports_only_its_core_dependencies():
    problems = undeclared(sorted((ROOT / "batchfix").rglob("*.py")), declared(None))
    assert not problems, f"imported by batchfix/ but not in [project].dependencies: {problems}"


@pytest.mark.parametrize("folder, module_level_only", [("tests", False), ("scripts", True)])
def test_tests_and_scripts_import_only_core_and_test_dependencies(folder, module_level_only):
    problems = undeclared(sorted((ROOT / folder).rglob("*.py")), declared("test"), module_level_only)
    assert not problems, f"imported by {folder}/ but not in the dependencies or the 'test' extra: {problems}"


def test_the_check_sees_an_undeclared_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json\nimport numpy\ntry:\n    import scvi\nexcept ImportError:\n    scvi = None\n"
                     "def f():\n    import harmonypy\n")
    assert imported_modules(probe) == {"json", "numpy", "harmonypy"}
    assert imported_modules(probe, module_level_only=True) == {"json", "numpy"}
    assert undeclared([probe], declared("test")) == {"harmonypy": ["probe.py"]}
    assert "harmonypy" not in undeclared([probe], declared("bench"))
