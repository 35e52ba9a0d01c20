"""Shape rules of the package that review asked for and that are easy to lose again."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "batchfix"
MAX_FUNCTION_LINES = 50  # body lines, the docstring not counted


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


def test_no_environment_variable_carries_the_verb():
    sources = {p.name: p.read_text() for p in PACKAGE.rglob("*.py")}
    assert not [name for name, text in sources.items() if "BATCHFIX_VERB" in text]


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
        if path.name == "config.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 \
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                written_again += [f"{path.relative_to(PACKAGE)}:{node.lineno} repeats config.{name}"
                                  for name, choices in lists.items() if values == choices]
    assert not written_again, written_again
