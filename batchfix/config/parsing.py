"""A composed Hydra config made into the schemas' objects: unknown keys refused, every value checked."""
from __future__ import annotations

from dataclasses import fields, is_dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchfix.config.help_text import unknown_option_error
from batchfix.errors import ConfigError


def readable(err: OmegaConfBaseException) -> str:
    """One line from an OmegaConf error: the option and what was wrong with it."""
    message = str(getattr(err, "msg", None) or err).splitlines()[0]
    key = getattr(err, "full_key", None)
    return f"{key}: {message}" if key and not message.startswith(str(key)) else message


def unknown_options(cfg: DictConfig | dict, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of `cfg` that `schema` does not have (Hydra's own `hydra` node aside)."""
    names = {f.name: f for f in fields(schema)}
    unknown = []
    for key in cfg:
        if not prefix and key == "hydra":
            continue
        f = names.get(str(key))
        group = f.default_factory if f is not None and is_dataclass(f.default_factory) else None
        if f is None:
            unknown.append(f"{prefix}{key}")
        elif group is not None and isinstance(cfg[key], (dict, DictConfig)):
            unknown += unknown_options(cfg[key], group, f"{prefix}{key}.")
    return unknown


def validated(cfg: DictConfig | dict, schema: type):
    """The composed config as schema objects; every range and combination checked (ConfigError). A key the
    schema does not have (`+model.n_head=4`) is refused, with the option names closest to it."""
    unknown = unknown_options(cfg, schema)
    if unknown:
        raise unknown_option_error(unknown[0], schema)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(readable(err)) from None
