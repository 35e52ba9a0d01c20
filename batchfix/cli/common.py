"""What every verb's entry shares: a user's mistake or a signal ends as one line on stderr, no traceback.

A UserError (bad option, input, checkpoint or output) exits with status 1; a signal (SIGTERM, SIGINT)
with 128 + its number (143, 130). Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from batchfix.errors import Interrupted, UserError


def one_line(text: str) -> str:
    """A message of several lines (Hydra's) as one."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def report(verb: str, message: str, status: int) -> None:
    """Print the one line (and log it where Hydra set up the logging of a run) and exit with `status`."""
    logger = logging.getLogger("batchfix")
    if logger.hasHandlers():
        logger.error("%s", message)
    print(f"batchfix {verb}: error: {one_line(message)}", file=sys.stderr)
    sys.exit(status)


@contextmanager
def user_errors_reported(verb: str, on_error: Callable[[], None] | None = None) -> Iterator[None]:
    """Turn a UserError (exit 1) or Interrupted (exit 128 + signal) into one line; `on_error` runs first.

    SystemExit passes through Hydra's handler; any other exception is a bug and keeps its traceback."""
    try:
        yield
    except (UserError, Interrupted) as err:
        if on_error is not None:
            on_error()
        report(verb, str(err), err.exit_status if isinstance(err, Interrupted) else 1)


def run(main: Callable[[], object], verb: str) -> None:
    """Run a verb's @hydra.main with signals raising Interrupted and Hydra's own errors as one line.

    Hydra prints a composition error (an override of the wrong type, an unknown key or group option)
    over several lines and exits; with HYDRA_FULL_ERROR it raises it instead, to be reported here.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from batchfix.config import readable
    from batchfix.signals import interrupts_raised

    os.environ["HYDRA_FULL_ERROR"] = "1"
    with interrupts_raised(), user_errors_reported(verb):
        try:
            main()
        except HydraException as err:
            cause = err.__cause__
            detail = f": {readable(cause)}" if isinstance(cause, OmegaConfBaseException) else ""
            message = str(err).split("Config search path")[0]  # Hydra's list of where it looked: noise here
            report(verb, f"{one_line(message)}{detail}", 1)
