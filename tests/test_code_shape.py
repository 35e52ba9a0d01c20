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
