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
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_MODULES = {"batchfix", "conftest", "scripts"} | {p.stem for p in (ROOT / "tests").rglob("*.py")}


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


# A normal install: the wheel, installed apart from the source tree ---------------------------------------------------
# A wheel holds only the packages pyproject.toml and setup.py declare: a subpackage left out is missing from every
# install but the editable one. These build the wheel from a copy of the source (an earlier build folder's files
# cannot get in), install it into a folder of its own and run it from outside the repository.

SOURCE_FOLDERS = ("batchfix", "conf", "data")  # the package, and the folders package-dir maps into it
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
# The editable install's finder (a meta path finder that finds `batchfix`) would supply from the source tree a module
# the wheel lacks: the installed copy runs without it.
WITHOUT_EDITABLE_FINDER = (
    "import sys\nfrom importlib.machinery import PathFinder\n"
    "sys.meta_path[:] = [f for f in sys.meta_path\n"
    "                    if f is PathFinder or not hasattr(f, 'find_spec') or f.find_spec('batchfix', None) is None]\n")
RUN_VERB = WITHOUT_EDITABLE_FINDER + (
    "import runpy\nsys.argv = ['batchfix', *sys.argv[1:]]\n"
    "runpy.run_module('batchfix', run_name='__main__', alter_sys=True)\n")
IMPORT_EVERY_MODULE = WITHOUT_EDITABLE_FINDER + """
import importlib, json, pkgutil
from importlib import resources
import batchfix
modules = {"batchfix": batchfix.__file__}
for info in pkgutil.walk_packages(batchfix.__path__, "batchfix."):
    modules[info.name] = importlib.import_module(info.name).__file__
data = {"bundled": batchfix.bundled_dataset(),
        "conf": str(resources.files("batchfix.conf").joinpath("train.yaml")),
        "genes": str(resources.files("batchfix.data.genes").joinpath("GRCh38.genes.tsv.gz"))}
print(json.dumps({"modules": modules, "data": data}))
"""


def source_modules() -> set[str]:
    """Dotted names of the modules in the source tree's batchfix/."""
    names = set()
    for path in (ROOT / "batchfix").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def source_data_files() -> set[str]:
    """The data files the wheel must hold, as paths inside it: the configs, the gene tables, the bundled dataset."""
    return ({f"batchfix/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
            | {f"batchfix/data/genes/{p.name}" for p in (ROOT / "batchfix" / "data" / "genes").glob("*.tsv.gz")}
            | {f"batchfix/bundled/{p.name}" for p in (ROOT / "data").glob("*.h5ad")})


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built (no dependencies, no isolated build environment) from a fresh copy of the source."""
    source = tmp_path_factory.mktemp("source")
    for name in BUILD_FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, source / name)
    for name in SOURCE_FOLDERS:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out,
                    source], check=True, capture_output=True, cwd=source)
    [built] = out.glob("batchfix-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The folder the wheel is installed into (alone: its dependencies are the environment's)."""
    target = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target,
                    wheel], check=True, capture_output=True)
    return target


def run_installed(installed: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c code args` with the installed copy first on the path, from a folder outside the repository."""
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=installed.parent, timeout=300)


def test_the_wheel_holds_every_module_and_data_file(wheel):
    inside = set(zipfile.ZipFile(wheel).namelist())
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "batchfix").rglob("*.py")}
    assert modules - inside == set(), "modules of batchfix/ missing from the wheel"
    assert source_data_files() - inside == set(), "data files missing from the wheel"
    assert "batchfix/conf/train.yaml" in inside and "batchfix/bundled/cellbench5.h5ad" in inside


@pytest.mark.slow  # imports torch, lightning and scanpy from the wheel (~15 s): in the slow run, which CI runs too
def test_every_module_imports_from_the_installed_wheel(installed):
    done = run_installed(installed, IMPORT_EVERY_MODULE)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert source_modules() - set(found["modules"]) == set(), "modules of batchfix/ the installed copy lacks"
    outside = {name: file for name, file in {**found["modules"], **found["data"]}.items()
               if not Path(file).resolve().is_relative_to(installed.resolve())}
    assert not outside, f"found outside the installed copy: {outside}"
    assert all(Path(file).is_file() for file in found["data"].values()), found["data"]


@pytest.mark.parametrize("verb", ["train", "correct"])
def test_a_verb_runs_from_the_installed_wheel(installed, verb):
    done = run_installed(installed, RUN_VERB, verb, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"usage: python -m batchfix {verb}" in done.stdout and "data.batch_key=" in done.stdout  # from conf/*.yaml
