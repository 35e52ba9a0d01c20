"""Shape rules of the package that review asked for and that are easy to lose again."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "batchfix"
# Why each cap: a function is one step a reader follows without scrolling (one screen); a class is one concept whose
# state and methods a reader holds at once (its methods moved into free functions over an untyped object to meet the
# file cap would hide it, so the class is capped itself); a file is one step of the data flow (docs/architecture.md).
MAX_FUNCTION_LINES = 50  # body lines, the docstring not counted
MAX_CLASS_LINES = 150  # lines of a class, its docstring and methods included
MAX_FILE_LINES = 400  # lines of a package file


def function_lengths() -> dict[str, int]:
    """'module.py:function' -> lines from its signature to its last line, without its docstring."""
    lengths = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                        and isinstance(first.value.value, str):
                    lines -= first.end_lineno - first.lineno + 1
                lengths[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    return lengths


def test_no_function_in_the_package_is_longer_than_the_limit():
    lengths = function_lengths()
    assert len(lengths) > 100  # the walk found the package's functions
    too_long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not too_long, f"split these into steps of one job each: {too_long}"


def test_no_class_in_the_package_is_longer_than_the_limit():
    lengths = {f"{path.relative_to(PACKAGE)}:{node.name}": node.end_lineno - node.lineno + 1
               for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef)}
    assert len(lengths) > 50  # the walk found the package's classes
    too_long = {name: n for name, n in lengths.items() if n > MAX_CLASS_LINES}
    assert not too_long, f"split these into concepts of their own: {too_long}"


def test_no_file_in_the_package_is_longer_than_the_limit():
    lengths = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
               for path in sorted(PACKAGE.rglob("*.py"))}
    too_long = {name: n for name, n in lengths.items() if n > MAX_FILE_LINES}
    assert not too_long, f"split these into modules of one job each: {too_long}"


def choice_lists() -> dict[str, frozenset]:
    """batchfix.config's lists of accepted values (GENOMES, ATTENTION_BACKENDS, ...), by name."""
    from batchfix import config

    return {name: frozenset(value) for name, value in vars(config).items()
            if name.isupper() and isinstance(value, tuple) and len(value) > 1
            and all(isinstance(item, str) for item in value)}


def test_every_choice_list_has_one_home():
    """A list of accepted values is written once, in batchfix.config; other modules import it."""
    lists = choice_lists()
    assert {"GENOMES", "ATTENTION_BACKENDS", "POSITION_ENCODINGS", "OUTPUT_MODES", "NEIGHBOR_METHODS"} <= set(lists)
    written_again = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "config" / "choices.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 \
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                written_again += [f"{path.relative_to(PACKAGE)}:{node.lineno} repeats config.{name}"
                                  for name, choices in lists.items() if values == choices]
    assert not written_again, written_again


# The layers, bottom up (docs/architecture.md): a module imports from its own layer or the ones below.
LAYERS = {"config": 0, "errors": 0, "signals": 0, "console": 0, "data": 1, "runfolder": 1, "nn": 2, "training": 3,
          "correction": 4, "eval": 5, "tasks": 6, "api": 6, "cli": 7, "__main__": 7}


def layer_of(dotted: str) -> int | None:
    """The layer of batchfix.<first part>... (None for the package itself and what is not batchfix's)."""
    parts = dotted.split(".")
    return LAYERS.get(parts[1]) if parts[0] == "batchfix" and len(parts) > 1 else None


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every batchfix import, at the top or inside a function."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchfix"):
            found += [(node.lineno, node.module if node.module != "batchfix" else f"batchfix.{alias.name}")
                      for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("batchfix.")]
    return found


def test_imports_point_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("batchfix", *path.relative_to(PACKAGE).with_suffix("").parts))
        own = layer_of(module)
        if own is None:
            continue
        for line, target in imported_modules(ast.parse(path.read_text())):
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not upward, upward


def test_the_scores_import_nothing_of_the_method():
    """eval/ scores arrays and what a correction stored (issue 54): it never imports the network, the training or the
    correction, so `evaluate` cannot rerun a correction, and a score sees batchfix's matrix as any other method's."""
    method = {"nn", "training", "correction"}
    found = [f"{path.relative_to(PACKAGE)}:{line} imports {target}"
             for path in sorted((PACKAGE / "eval").rglob("*.py"))
             for line, target in imported_modules(ast.parse(path.read_text()))
             if target.split(".")[1:2] and target.split(".")[1] in method]
    assert not found, found


def test_the_api_functions_survive_importing_every_subpackage():
    """batchfix.train / batchfix.correct are functions; a subpackage of that name would replace them."""
    import importlib
    import pkgutil

    import batchfix

    for info in pkgutil.walk_packages(batchfix.__path__, "batchfix."):
        if not info.name.startswith("batchfix.cli.") and info.name != "batchfix.__main__":
            importlib.import_module(info.name)
    assert callable(batchfix.train) and callable(batchfix.correct)
    assert batchfix.train.__module__ == batchfix.correct.__module__ == "batchfix.api"


def test_correct_imports_neither_lightning_nor_scanpy():
    """The correct verb's modules, and the API's (batchfix.correct), load without the training stack (about 2 s of a
    correction's start-up)."""
    import subprocess
    import sys

    code = ("import sys, batchfix.tasks as t, batchfix.api; t.correct; t.attention; "
            "print(sorted(m for m in ('pytorch_lightning', 'lightning_fabric', 'scanpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
