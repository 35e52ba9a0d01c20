"""The `correction` config group: named combinations of the correction options (conf/correction/*.yaml), and
which correction a command applies: a preset or option it was given, else the one its checkpoint remembers."""
from __future__ import annotations

import difflib
import logging
from dataclasses import asdict, dataclass, field, fields
from importlib import resources

from batchfix.config.parsing import validated
from batchfix.config.verbs import CorrectionAblations, CorrectionOptions
from batchfix.errors import ConfigError

log = logging.getLogger(__name__)

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


def current_options(options: dict, ablations: bool = True) -> dict:
    """Correction options as a checkpoint or a corrected file of an earlier release recorded them, in this release's
    terms: regional_shift=keep_all is keep_input (the same corrected counts; a log-scale output keeps a batch-wide
    regional shift whole now), normal_key with regional_shift=keep is reference_cells. Without `ablations`, the
    ablations are left out (a checkpoint remembered them once; each command now takes its own)."""
    options = dict(options)
    if options.get("regional_shift") == "keep_all":
        log.warning("The correction recorded regional_shift=keep_all, which this release names keep_input (the same "
                    "corrected counts; on a log-scale output each cell now keeps its input's regional profile).")
        options["regional_shift"] = "keep_input"
    if options.get("normal_key") is not None and options.get("regional_shift") == "keep":
        options["regional_shift"] = "reference_cells"
    if not ablations:
        for name in (f.name for f in fields(CorrectionAblations)):
            options.pop(name, None)
    return options
