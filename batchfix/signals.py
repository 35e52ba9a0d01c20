"""SIGTERM and SIGINT as a clean stop: an `Interrupted` exception, held back while a training step runs.

The command line installs `interrupts_raised()` around a verb: a signal then raises `Interrupted`
wherever the program is, so every `finally` and `atomic_output` cleanup runs (no partial output, no
temporary file) and the command exits with 128 + the signal number. Inside `deferred()` (around
Lightning's fit) a signal is only recorded; the training loop raises it at the next step boundary
(`batchfix.training.StopOnSignal`), after saving a checkpoint that `resume=` continues.

A signal is also recorded, so that `raise_pending()` at safe points (each chunk of cells, before an
output is moved into place) raises it again if the first raise was lost: a handler's exception that
fires inside a destructor or a weakref callback is printed and ignored by Python.
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from batchfix.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state: dict = {"deferred": False, "pending": None, "raised": False}


def _handler(signum: int, frame) -> None:
    _state["pending"] = signum
    if _state["deferred"] or _state["raised"]:
        return  # held back until a step ends, or a raised one is being cleaned up after
    _state["raised"] = True
    raise Interrupted(signum)


def raise_pending() -> None:
    """Raise a received signal as `Interrupted` (call only where the program runs normally, not in cleanup)."""
    signum = _state["pending"]
    if signum is not None:
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
    """Inside: a signal is only recorded; one recorded is raised on leaving (if nothing raised it before)."""
    was = _state["deferred"]
    _state["deferred"] = True
    try:
        yield
    finally:
        _state["deferred"] = was
    raise_pending()
