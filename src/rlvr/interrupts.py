"""Ctrl-C (SIGINT) and SIGTERM during training: the run stops where it can resume exactly.

`handling()` (loop.py, around a whole run) turns both signals into KeyboardInterrupt (its
subclass `Terminated` for SIGTERM).  Inside `deferred(reason)` the
exception is held back until the section ends: the trainer opens one from the update to the
end of the step's bookkeeping (weights, optimizer, step counter, metrics row and alerts change
together), and the run one around every checkpoint save.  A signal there prints what is being
finished, and further signals print that they are refused; the run then stops and saves a
checkpoint of the step just completed.  Elsewhere (sampling, scoring) the exception is raised at
once: those stages leave the state as it was before them (trainer.py rewinds the prompts and the
generator), so the checkpoint is of the last completed step.

Without `handling()` (a library user driving the Trainer), Python's own KeyboardInterrupt applies
and `deferred` does nothing.  Signals are handled only on the main thread of the main interpreter.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM: a scheduler or `kill` asked the run to stop."""


class _State:
    def __init__(self):
        self.installed = False
        self.sections: list[str] = []  # reasons of the open deferred sections, innermost last
        self.pending: int | None = None  # the first signal held back
        self.say = print


_state = _State()
_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def _exception(signum: int) -> KeyboardInterrupt:
    return Terminated("SIGTERM") if signum == signal.SIGTERM else KeyboardInterrupt()


def _handle(signum, frame) -> None:
    if not _state.sections:
        raise _exception(signum)
    name = _NAMES.get(signum, f"signal {signum}")
    if _state.pending is None:
        _state.pending = signum
        _state.say(f"{name}: finishing first: {_state.sections[-1]}; then the run saves and stops")
    else:
        _state.say(f"{name} again: refused while {_state.sections[-1]} (kill -9 stops at once; the last checkpoint stays)")


@contextlib.contextmanager
def handling(say=print):
    """SIGINT and SIGTERM become `Stopped` exceptions, held back inside `deferred` sections."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in _NAMES}
    _state.installed, _state.pending, _state.say = True, None, say
    for s in _NAMES:
        signal.signal(s, _handle)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state.installed, _state.sections, _state.pending = False, [], None


@contextlib.contextmanager
def deferred(reason: str):
    """A section no signal interrupts: one that arrives is raised when the outermost section ends
    (unless an error already ends it)."""
    if not _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.sections.append(reason)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        _state.sections.pop()
        if not _state.sections and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            if not failed:
                raise _exception(signum)
