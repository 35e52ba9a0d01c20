"""The `correction` config group: named combinations of the correction options (conf/correction/*.yaml), and
which correction a command applies: a preset or option it was given, else the one its checkpoint remembers."""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from importlib import resources

from batchfix.config.parsing import validated
from batchfix.config.verbs import CorrectionOptions
from batchfix.errors import ConfigError

GROUP = "correction"
DEFAULT_PRESET = "default"


def preset_names() -> list[str]:
    """The entries of conf/correction/, by name."""
    folder = resources.files("batchfix.conf").joinpath(GROUP)
    return sorted(entry.name[:-len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def preset_options(name: str) -> dict:
    """The options a named entry of conf/correction/ sets (the others keep the schema's defaults)."""
    import yaml

    names = preset_names()
    if name not in names:
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else "."
        raise ConfigError(f"Unknown correction preset `{name}`{hint} The entries of conf/correction/: {names}.")
    text = resources.files("batchfix.conf").joinpath(GROUP, f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


@dataclass
class CorrectionChoice:
    """What a command was told of the correction: a preset named (`correction=NAME`) and options set one by one
    (`correction.KEY=VALUE`, or the API's keywords); what it was not told comes from the checkpoint."""

    preset: str | None = None
    options: dict = field(default_factory=dict)

    def resolve(self, remembered: dict | None = None) -> tuple[str, CorrectionOptions]:
        """(preset name, options): the named preset, else the checkpoint's `remembered` correction (see
        `remembered_correction`), else the default preset; the options set one by one on top."""
        if self.preset is None and remembered:
            name, base = remembered["preset"], remembered["options"]
        else:
            name = self.preset or DEFAULT_PRESET
            base = preset_options(name)
        return name, validated({**base, **self.options}, CorrectionOptions)


def remembered_correction(preset: str, options: CorrectionOptions) -> dict:
    """What a checkpoint keeps of the correction it was trained with: the preset's name and every option."""
    return {"preset": preset, "options": asdict(options)}
