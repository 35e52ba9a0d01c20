"""The errors a user can cause and fix: the command line prints their message as one line, no traceback.

Anything else that escapes is a bug in batchfix and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem with the input, the options, a checkpoint or the output path; the message says what to do."""


class InputError(UserError, ValueError):
    """Bad input data: the message names the problem and what exists instead."""


class ConfigError(UserError, ValueError):
    """An option outside what it accepts: the message names the option and the accepted values."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, truncated, tampered with, or not a batchfix checkpoint."""


class OutputExistsError(UserError, FileExistsError):
    """An output that exists already and was not to be replaced."""
