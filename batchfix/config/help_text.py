"""What `--help` and the API's docstrings say of the options: each option's description, read from the
comment beside its field in the schemas' source, and the did-you-mean of an unknown option."""
from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass

from batchfix.config.verbs import SCHEMAS, TrainConfig
from batchfix.errors import ConfigError


def dotted_options(schema: type, prefix: str = "") -> list[str]:
    """Every option of a schema by its dotted name (`model.n_heads`, `seed`), groups expanded."""
    names = []
    for f in fields(schema):
        group = f.default_factory if is_dataclass(f.default_factory) else None
        names += dotted_options(group, f"{prefix}{f.name}.") if group else [f"{prefix}{f.name}"]
    return names


def closest_options(key: str, known: list[str]) -> list[str]:
    """Up to 3 of the `known` dotted options closest to `key`: the same last name first, then near spellings."""
    last = key.rpartition(".")[2]
    close = [name for name in known if name.rpartition(".")[2] == last]  # the same option, spelled otherwise
    if not close:
        by_last: dict[str, list[str]] = {}
        for name in known:
            by_last.setdefault(name.rpartition(".")[2], []).append(name)
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.7)
        close += [n for near in difflib.get_close_matches(last, by_last, n=3, cutoff=0.7) for n in by_last[near]]
    return list(dict.fromkeys(close))[:3]


def unknown_option_error(key: str, schema: type) -> ConfigError:
    """'Unknown option X; did you mean Y?', the suggestions drawn from the schema's own option names; a retired
    option says why it went."""
    from batchfix.config.choices import RETIRED_OPTIONS

    if key in RETIRED_OPTIONS:
        return ConfigError(f"`{key}`: {RETIRED_OPTIONS[key]}.")
    close = closest_options(key, dotted_options(schema))
    hint = f"; did you mean {' or '.join(f'`{name}`' for name in close)}?" if close else "."
    verb = next((v for v, s in SCHEMAS.items() if s is schema), None)
    where = f" `python -m batchfix {verb} --help` lists them." if verb else ""
    return ConfigError(f"Unknown option `{key}`{hint}{where}")


def dashed_option_error(args: list[str], schema: type) -> ConfigError | None:
    """The first `--name value` (or `--name=value`) of `args` that is no Hydra flag, as an error giving its Hydra
    spelling (`--max_epochs 2` -> `trainer.max_epochs=2`); None when there is none."""
    from batchfix.config.choices import HYDRA_FLAGS

    for position, arg in enumerate(args):
        if not arg.startswith("--") or arg.split("=", 1)[0] in HYDRA_FLAGS:
            continue
        name, _, value = arg[2:].partition("=")
        following = args[position + 1] if position + 1 < len(args) else ""
        value = value or (following if following and "=" not in following and not following.startswith("-")
                          else "VALUE")
        key = name.replace("-", "_")
        meant = closest_options(key, dotted_options(schema))
        spelling = f"`{meant[0]}={value}`" if meant else f"key=value (`{key}=...` is no option)"
        return ConfigError(f"`{arg}`: options are Hydra overrides, key=value without dashes: write {spelling}.")
    return None


def field_comments(schema: type) -> dict[str, str]:
    """{field: its comment in the schema's source} for a schema and the schemas it extends: the comment ending
    the field's line, else the comment lines just above it. These comments are the options' one description
    (--help, the API's docstrings)."""
    import inspect
    import io
    import tokenize

    comments: dict[str, str] = {}
    for cls in reversed([c for c in schema.__mro__ if is_dataclass(c)]):
        lines = inspect.getsource(cls).splitlines()
        by_line = {token.start[0] - 1: token.string.lstrip("#").strip()
                   for token in tokenize.generate_tokens(io.StringIO("\n".join(lines)).readline)
                   if token.type == tokenize.COMMENT}
        for number, line in enumerate(lines):
            name = line.strip().split(":", 1)[0]
            if not line.startswith("    ") or line.startswith("     ") or not name.isidentifier() or ":" not in line:
                continue
            above = []
            while number - len(above) - 1 in by_line and lines[number - len(above) - 1].strip().startswith("#"):
                above.insert(0, by_line[number - len(above) - 1])
            text = by_line.get(number) if number in by_line and not line.strip().startswith("#") else None
            if text or above:
                comments[name] = text or " ".join(above)
    return comments


def option_descriptions(schema: type, prefix: str = "") -> dict[str, str]:
    """{dotted option: its description} of every option of a schema (groups expanded; '' where none)."""
    comments = field_comments(schema)
    out: dict[str, str] = {}
    for f in fields(schema):
        group = f.default_factory if is_dataclass(f.default_factory) else None
        if group is not None:
            out.update(option_descriptions(group, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = comments.get(f.name, "")
    return out


def flat_option_names(schema: type = TrainConfig) -> dict[str, str]:
    """{option name: dotted key} of a schema's options, e.g. {'n_heads': 'model.n_heads', 'seed': 'seed'}: the
    API's keywords. A top-level option keeps its name over a group's option of that name; two groups' options of
    one name are a mistake."""
    names: dict[str, str] = {f.name: f.name for f in fields(schema) if not is_dataclass(f.default_factory)}
    for top in fields(schema):
        group = top.default_factory if is_dataclass(top.default_factory) else None
        for name, dotted in [(f.name, f"{top.name}.{f.name}") for f in fields(group)] if group else []:
            if "." in names.get(name, ""):
                raise AssertionError(f"option name '{name}' is ambiguous: {names[name]} and {dotted}")
            names.setdefault(name, dotted)
    return names
