"""The errors a user can cause and fix: the command line prints their message as one line, no traceback.

`Interrupted` (a signal stopped the command) is printed the same way, with exit status 128 + the signal
number. Anything else that escapes is a bug in batchfix and keeps its traceback.
"""
from __future__ import annotations

import signal


class UserError(Exception):
    """A problem with the input, the options, a checkpoint or the output path; the message says what to do."""


class InputError(UserError, ValueError):
    """Bad input data: the message names the problem and what exists instead."""


class ConfigError(UserError, ValueError):
    """An option outside what it accepts: the message names the option and the accepted values."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, truncated, tampered with, or not a batchfix checkpoint."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint written by an earlier batchfix in a format this version cannot use."""


class OutputExistsError(UserError, FileExistsError):
    """An output that exists already and was not to be replaced."""


class FolderInUseError(OutputExistsError):
    """A run or output folder that another batchfix command, still running, is writing into."""


class OutputError(UserError, OSError):
    """An output that cannot be written (read-only or missing folder, disk full, not a file)."""


class TrainingError(UserError):
    """Training that cannot go on (the loss became NaN or infinite): the message names the options to change."""


class Interrupted(BaseException):
    """A signal (SIGTERM, SIGINT) stopped the command: the command line exits with status 128 + its number.

    A BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}{detail}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum
