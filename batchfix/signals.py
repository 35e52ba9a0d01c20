"""SIGTERM and SIGINT as a clean stop: an `Interrupted` exception, held back while a training step runs.

The command line installs `interrupts_raised()` around a verb: a signal then raises `Interrupted`
wherever the program is, so every `finally` and `atomic_output` cleanup runs (no partial output, no
temporary file) and the command exits with 128 + the signal number. Inside `deferred()` (around
Lightning's fit) a signal is only recorded; the training loop raises it at the next step boundary
(`batchfix.training.StopOnSignal`), after saving a checkpoint that `resume=` continues.
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from batchfix.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state: dict = {"deferred": False, "pending": None, "raised": False}


def _handler(signum: int, frame) -> None:
    if _state["raised"]:
        return  # the first signal is being handled: let its cleanup finish
    if _state["deferred"]:
        _state["pending"] = signum
        return
    _state["raised"] = True
    raise Interrupted(signum)


def pending() -> int | None:
    """The signal recorded inside `deferred()` and not yet raised, if any."""
    return _state["pending"]


def raise_pending() -> None:
    """Raise the recorded signal as `Interrupted` (once)."""
    signum = _state["pending"]
    if signum is not None and not _state["raised"]:
        _state["raised"] = True
        raise Interrupted(signum)


@contextmanager
def interrupts_raised() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT raise `Interrupted` (the previous handlers are restored on leaving)."""
    previous = {signum: signal.signal(signum, _handler) for signum in SIGNALS}
    _state.update(deferred=False, pending=None, raised=False)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Inside: a signal is only recorded (`pending()`); one still pending on leaving is raised then."""
    was = _state["deferred"]
    _state["deferred"] = True
    try:
        yield
    finally:
        _state["deferred"] = was
    raise_pending()
