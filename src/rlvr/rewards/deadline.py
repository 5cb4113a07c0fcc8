"""A time limit on one call of a reward function run in the trainer's process (`reward_timeout`
with reward_isolation=inline; reasoning-gym's scorers).  The default runs your own functions in a
worker process that is killed instead (isolation.py), which also stops what this cannot: a call
stuck in C code (a catastrophic regex), or one whose bare `except:` swallows the exception.

A watchdog timer sends SIGUSR2 to the main thread when the limit passes; its handler raises
RewardTimeout there, which also interrupts a blocking call such as time.sleep or a subprocess
wait (Python retries those after a signal only if the handler returns).  RewardTimeout derives
from BaseException, so a reward function's own `except Exception` does not swallow it.  It does
not use SIGALRM, which math-verify's default timeout uses inside reward functions.  Off the main
thread (a library user's own thread) nothing is enforced.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNAL = signal.SIGUSR2


class RewardTimeout(BaseException):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str):
    if not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    lock, armed, target = threading.Lock(), [True], threading.main_thread().ident

    def fire() -> None:
        with lock:
            if armed[0]:
                signal.pthread_kill(target, SIGNAL)

    def expire(signum, frame):
        raise RewardTimeout(f"{what} ran past {seconds:g} s")

    previous = signal.signal(SIGNAL, expire)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    try:
        timer.start()
        yield
    finally:
        try:
            with lock:
                armed[0] = False
            timer.cancel()
        finally:
            signal.signal(SIGNAL, previous)
