"""SIGTERM and SIGINT as a clean stop: an `Interrupted` exception, held back while a training step runs.

The command line installs `interrupts_raised()` around a verb: a signal then raises `Interrupted`
wherever the program is, so every `finally` and `atomic_output` cleanup runs (no partial output, no
temporary file) and the command exits with 128 + the signal number. Inside `deferred()` (around
Lightning's fit) a signal is only recorded; the training loop raises it at the next step boundary
(`batchfix.training.fitting.StopOnSignal`), after saving a checkpoint that `resume=` continues.

Python prints and ignores an exception raised inside a destructor or a weakref callback (h5py runs
many), so a signal that arrives there is raised a moment later instead (SIGALRM), and every signal
is also recorded: `raise_pending()` at safe points (each chunk of cells, before an output is moved
into place) raises one that was lost anyway.
"""
from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from batchfix.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RETRY_SECONDS = 0.01  # how soon a signal that arrived inside a destructor is raised again
_state: dict = {"deferred": False, "pending": None, "raised": False}


def in_finalizer(frame) -> bool:
    """Whether `frame` runs inside a destructor or a weakref callback, where an exception would be ignored."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            return True
        frame = frame.f_back
    return False


def _handler(signum: int, frame) -> None:
    if signum != signal.SIGALRM:
        _state["pending"] = signum
    if _state["pending"] is None or _state["deferred"] or _state["raised"]:
        return  # held back until a step ends, or a raised one is being cleaned up after
    if in_finalizer(frame):
        signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)  # comes back here as SIGALRM
        return
    _state["raised"] = True
    raise Interrupted(_state["pending"])


def pending() -> int | None:
    """The signal received and not yet handled, if any."""
    return _state["pending"]


def as_interrupt(error: BaseException) -> Interrupted | None:
    """`error` as the interruption it is: an `Interrupted` itself, or any other error raised after a signal came
    (h5py's C code turns a signal's exception into an OSError, a TypeError or a SystemError of the call it
    interrupted); None for an error no signal explains."""
    if isinstance(error, Interrupted):
        return error
    signum = _state["pending"]
    return Interrupted(signum) if signum is not None and isinstance(error, Exception) else None


@contextmanager
def interrupt_noted(detail: Callable[[], str]) -> Iterator[None]:
    """Inside: an interruption (`as_interrupt`) leaves as `Interrupted` with `detail()` (what it left behind)
    appended; any other error leaves as it is."""
    try:
        yield
    except (Interrupted, Exception) as err:
        interrupt = as_interrupt(err)
        if interrupt is None:
            raise
        raise Interrupted(interrupt.signum, detail()) from None


def raise_pending() -> None:
    """Raise a received signal as `Interrupted` (call only where the program runs normally, not in cleanup)."""
    signum = _state["pending"]
    if signum is not None:
        _state["raised"] = True
        raise Interrupted(signum)


@contextmanager
def interrupts_raised() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT raise `Interrupted` (the previous handlers are restored on leaving)."""
    previous = {signum: signal.signal(signum, _handler) for signum in (*SIGNALS, signal.SIGALRM)}
    _state.update(deferred=False, pending=None, raised=False)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _state.update(deferred=False, pending=None, raised=False)


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
