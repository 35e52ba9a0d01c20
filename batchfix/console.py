"""What a user sees: batchfix's progress lines in a notebook and quiet third-party noise (the end-of-run
summary: batchfix.cli.summary).

    import batchfix
    batchfix.settings.verbosity = "info"     # progress lines in a notebook ("warning": warnings only)

Light on purpose (logging and warnings only): `import batchfix` and `--help` import it without torch.
"""
from __future__ import annotations

import logging
import sys
import warnings

LOGGER = "batchfix"
LEVELS = ("debug", "info", "warning", "error")

# Known lines of other libraries that say nothing a batchfix user can act on (DDP's banner stays).
QUIET_LINES = {
    "lightning.pytorch.utilities.rank_zero": ("GPU available", "TPU available", "HPU available", "💡 Tip",
                                              "`Trainer.fit` stopped", "LOCAL_RANK:"),
    "pytorch_lightning.utilities.rank_zero": ("GPU available", "TPU available", "HPU available", "💡 Tip",
                                              "`Trainer.fit` stopped", "LOCAL_RANK:"),
    "lightning.fabric.utilities.seed": ("Seed set to",),
    "lightning_fabric.utilities.seed": ("Seed set to",),
    "jax._src.xla_bridge": ("Unable to initialize backend",),
    "": ("isolated labels:",),  # scib-metrics' notes, logged on the root logger
}
QUIET_WARNINGS = (
    r".*does not have many workers.*",  # the loaders run in the training process on purpose (batchfix.data)
    r".*`IterableDataset` has `__len__` defined.*",
    r".*GPU available but not used.*",
    r".*smaller than the logging interval.*",  # tiny files: fewer steps per epoch than log_every_n_steps
    r".*LightningDeprecationWarning.*",
    r".*pkg_resources is deprecated.*",
    r".*is deprecated.*",
    # 16-mixed on a GPU: the loss scaler starts high and skips the first few steps whose fp16 gradients overflow,
    # while the learning-rate schedule still steps (5-8 of ~500 steps: docs/scale.md#gpu)
    r".*lr_scheduler.step\(\)` before `optimizer.step\(\)`.*",
)


class Settings:
    """`batchfix.settings.verbosity`: the least severe level of batchfix's own lines that are shown
    ("debug", "info", "warning", "error"); in a notebook or script they go to stderr."""

    def __init__(self) -> None:
        self._handler: logging.Handler | None = None

    @property
    def verbosity(self) -> str:
        return logging.getLevelName(logging.getLogger(LOGGER).getEffectiveLevel()).lower()

    @verbosity.setter
    def verbosity(self, level: str) -> None:
        if str(level).lower() not in LEVELS:
            from batchfix.errors import ConfigError

            raise ConfigError(f"batchfix.settings.verbosity must be one of {list(LEVELS)}, got {level!r}.")
        logger = logging.getLogger(LOGGER)
        logger.setLevel(str(level).upper())
        if self._handler is None and not any(isinstance(h, logging.StreamHandler) for h in logger.handlers):
            self._handler = logging.StreamHandler(sys.stderr)
            self._handler.setFormatter(logging.Formatter("batchfix: %(message)s"))
            logger.addHandler(self._handler)
            logger.propagate = False  # shown once, even where another library gave the root logger a handler


settings = Settings()


def quiet_third_parties() -> None:
    """Silence Lightning's tips and the known warnings of other libraries (the command line's whole run)."""
    quiet_lightning_logs()
    quiet_warnings()


def quiet_lightning_logs() -> None:
    """Lightning's tips and info lines of QUIET_LINES (GPU available, litmodels, seed set) are not shown; its
    other lines, warnings and errors are."""
    for name, starts in QUIET_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietLines) for f in logger.filters):
            logger.addFilter(QuietLines(starts))


class QuietLines(logging.Filter):
    """Drops a logger's records whose message starts with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).lstrip().startswith(self.starts)


def quiet_warnings() -> None:
    """Known warnings that ask nothing of a batchfix user (inside warnings.catch_warnings() to scope them)."""
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
