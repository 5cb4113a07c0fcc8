"""Calls that must run on the training loop's own thread, asked for from another thread.

With max_staleness=1 the next batch is sampled in a background thread while the current step
trains.  The reward functions of that batch do not run in the background thread: they run where
they run on-policy, on the thread of the training loop (the main thread under `rlvr train`), so a
reward that relies on signals behaves the same in both modes.  math-verify's default timeout is
one (SIGALRM, main thread only): the guide's `accuracy_reward` wraps it in `try/except` and
would score every correct answer -1 off the main thread.

The background thread posts the call and waits for it; the loop runs posted calls between the
micro-batches of its update (`serve`) and while it waits for the background thread
(`serve_until`).  When the loop stops with an error, `refuse` fails every posted call, so the
background thread ends instead of waiting forever.

With async_mode=free a producer samples all the time, and its reward calls run on a scoring thread
of their own (`ScoringThread`) where no function needs the main thread's signals, so scoring does
not hold the training loop; with reward_isolation=inline they stay on the loop's thread.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class CallRefused(RuntimeError):
    """The training loop stopped; a call posted to it will not run."""


class _Call:
    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.value, self.error = None, None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except Exception as e:  # the caller's error: raised in the thread that asked
            self.error = e
        except BaseException as e:  # Ctrl-C or exit on the home thread: the caller fails, the loop stops
            self.error = CallRefused(f"the training loop stopped ({type(e).__name__})")
            raise
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def result(self):
        """Wait for the call to run; its value, or its error raised here."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class HomeThread:
    def __init__(self):
        self.thread = threading.current_thread()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._refusing = False

    def bind(self) -> None:
        """Make the calling thread the home thread (the one that runs the training loop)."""
        self.thread = threading.current_thread()

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the home thread: at once from it, else posted and waited for."""
        if threading.current_thread() is self.thread:
            return fn(*args, **kwargs)
        call = _Call(fn, args, kwargs)
        with self._lock:
            if self._refusing:
                raise CallRefused("the training loop stopped")
            self._calls.put(call)
        return call.result()

    def serve(self) -> None:
        """Run the calls posted so far (on the home thread)."""
        for call in self._posted():
            call.run()

    def serve_until(self, future: Future) -> None:
        """Run posted calls until `future` is done."""
        future.add_done_callback(lambda _: self._calls.put(None))  # wakes the wait below
        while not future.done():
            call = self._calls.get()
            if call is not None:
                call.run()
        self.serve()

    def refuse(self) -> None:
        """Fail every posted call, and every call posted until `accept`."""
        with self._lock:
            self._refusing = True
            for call in self._posted():
                call.fail(CallRefused("the training loop stopped"))

    def accept(self) -> None:
        self._refusing = False

    def _posted(self):
        """The calls posted so far, each taken off the queue (the wake-ups of serve_until skipped)."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            if call is not None:
                yield call


class ScoringThread:
    """async_mode=free: where the producer's reward calls run when they need no signal of the main
    thread (reward_isolation=process: your functions run in a worker process; the built-ins grade in
    worker processes of their own), so that scoring never stops the training loop.  One long-lived
    thread, not the producer's: the worker processes end with the thread that started them
    (isolation.py), and the producer's thread ends at every checkpoint."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="rlvr-scoring", daemon=True)
        self.thread.start()

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the scoring thread, waited for."""
        call = _Call(fn, args, kwargs)
        self._calls.put(call)
        return call.result()

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            call.run()

    def close(self) -> None:
        self._calls.put(None)
