"""One spelling per option: every verb names an option the same way, and so do the docs and the presets."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from batchfix.cli.common import config_groups
from batchfix.config import SCHEMAS, dotted_options

ROOT = Path(__file__).resolve().parents[2]
# Different options that share a last name: {last name: their spellings}.
DISTINCT = {
    "batch_size": {"fit.batch_size", "inference.batch_size"},  # cells per training step / per forward pass
    "max_cells": {"max_cells", "evaluation.max_cells"},  # attention's cells averaged / evaluation's subsample
}
COMMAND = re.compile(r"python -m batchfix (train|correct|evaluate|attention)\b([^\n`]*)")
ARGUMENT = re.compile(r"(?:^|\s)\+?([A-Za-z_][\w.]*)=")
PROSE_OPTION = re.compile(r"`([a-z_][a-z0-9_]*)=[^`]*`")


def spellings() -> dict[str, set[str]]:
    """{an option's last name: every dotted spelling it has in the four verbs}."""
    found: dict[str, set[str]] = {}
    for schema in SCHEMAS.values():
        for dotted in dotted_options(schema):
            found.setdefault(dotted.rpartition(".")[2], set()).add(dotted)
    return found


def grouped_only() -> set[str]:
    """Last names that are only ever spelled inside a group (`data.batch_key`): written bare, they are a second
    spelling."""
    return {last for last, names in spellings().items() if all("." in name for name in names)}


def doc_texts() -> dict[str, str]:
    """The manual (README.md, docs/*.md), the tutorial's cells and the presets in conf/, by path."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "conf").rglob("*.yaml"))]
    texts = {str(path.relative_to(ROOT)): path.read_text() for path in paths}
    notebook = json.loads((ROOT / "docs" / "tutorial.ipynb").read_text())
    texts["docs/tutorial.ipynb"] = "\n".join("".join(cell["source"]) for cell in notebook["cells"])
    return texts


def test_every_option_has_one_spelling_in_every_verb():
    twice = {last: names for last, names in spellings().items() if len(names) > 1 and DISTINCT.get(last) != names}
    assert not twice, f"an option spelled two ways across the verbs: {twice}"


@pytest.mark.parametrize("path", sorted(doc_texts()))
def test_the_docs_spell_every_option_as_its_verb_does(path):
    text, groups = doc_texts()[path], config_groups()
    wrong = []
    for verb, arguments in COMMAND.findall(text):
        known = set(dotted_options(SCHEMAS[verb]))
        for key in ARGUMENT.findall(arguments.split("#")[0]):
            if key not in known and key not in groups and key.split(".")[0] not in ("hydra", "sweep"):
                wrong.append(f"{verb} {key}=")
    prose = [line for line in text.splitlines() if "batchfix." not in line and "python -m" not in line]
    wrong += [f"`{key}=`" for key in PROSE_OPTION.findall("\n".join(prose)) if key in grouped_only()]
    assert not wrong, f"{path} spells options the verbs do not know (one spelling: data.*, correction.*, " \
                      f"inference.*): {wrong}"
