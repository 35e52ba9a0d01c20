"""`python -m batchfix VERB --help`: that verb's options, their defaults (the schema with the verb's presets)
and their descriptions (the schemas' comments in batchfix/config/), nothing of Hydra's internals or other verbs."""
from __future__ import annotations

import re
import textwrap
from dataclasses import fields, is_dataclass

from omegaconf import OmegaConf

from batchfix.config import SCHEMAS, option_descriptions

WIDTH = 110
NAME_WIDTH = 34

EXAMPLES = {
    "train": ["python -m batchfix train data.path=my.h5ad data.batch_key=sample data.label_key=cell_type",
              "python -m batchfix train -m model.n_heads=2,4   (a sweep: one run per value)"],
    "correct": ["python -m batchfix correct input=new.h5ad output=new.corrected.h5ad checkpoint=RUN/model.ckpt"],
    "evaluate": ["python -m batchfix evaluate input=new.corrected.h5ad data.batch_key=sample data.label_key=cell_type"],
    "attention": ["python -m batchfix attention input=new.h5ad checkpoint=RUN/model.ckpt group_by=cell_type"],
}


def defaults(verb: str) -> dict:
    """The verb's composed configuration (its schema and presets), without Hydra's own node."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="batchfix.conf", version_base=None):
        return OmegaConf.to_container(compose(verb), resolve=False)


def shown(value) -> str:
    """A default as it is typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    bundled = re.fullmatch(r"\$\{bundled_only:\$\{([^}]+)\},([^}]+)\}", str(value))
    if bundled:  # the bundled file's column (batchfix.config.verbs.bundled_only)
        return f"{bundled.group(2)} (for the bundled data; null when {bundled.group(1)} is set)"
    return str(value)


def groups(schema: type) -> dict[str, str]:
    """{group name: the first line of its schema's docstring} of a schema's option groups."""
    return {f.name: (f.default_factory.__doc__ or "").strip().splitlines()[0] for f in fields(schema)
            if is_dataclass(f.default_factory)}


def verb_help(verb: str, summary: str) -> str:
    schema = SCHEMAS[verb]
    values = defaults(verb)
    described = option_descriptions(schema)
    own = set(schema.__annotations__)  # the verb's own options first, then those it shares (CorrectConfig's)
    described = dict(sorted(described.items(), key=lambda item: item[0].split(".")[0] not in own))
    headers = groups(schema)
    lines = [f"usage: python -m batchfix {verb} [OPTION=VALUE ...]", "", f"{verb}: {summary}", "",
             "Options (OPTION=VALUE; null = unset):"]
    current = None
    for dotted, text in described.items():
        group = dotted.split(".")[0] if "." in dotted else None
        if group != current:
            current = group
            lines += [""] + ([f"{group}.*  {headers[group]}"] if group else [])
        value = values
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        head = f"  {dotted}={shown(value)}"
        wrapped = textwrap.wrap(text, WIDTH - NAME_WIDTH) or [""]
        if len(head) >= NAME_WIDTH:
            lines += [head, *(" " * NAME_WIDTH + line for line in wrapped)]
        else:
            lines += [head.ljust(NAME_WIDTH) + wrapped[0], *(" " * NAME_WIDTH + line for line in wrapped[1:])]
    lines += ["", "Examples:", *(f"  {example}" for example in EXAMPLES[verb])]
    if verb == "train":
        lines += ["", "Presets: model=default, trainer=default | ddp, data=cellbench5, +sweep=heads (conf/).",
                  "The composed configuration: --cfg job."]
    return "\n".join(lines)
