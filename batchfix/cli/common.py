"""What every verb's entry shares: a user's mistake ends as one line on stderr and exit status 1."""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from batchfix.errors import UserError


@contextmanager
def user_errors_reported(verb: str) -> Iterator[None]:
    """Turn a UserError into one clear line, no traceback (SystemExit passes through Hydra's handler).

    Any other exception is a bug and keeps its traceback."""
    try:
        yield
    except UserError as err:
        logging.getLogger("batchfix").error("%s", err)
        print(f"batchfix {verb}: error: {err}", file=sys.stderr)
        sys.exit(1)
