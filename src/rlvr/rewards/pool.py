"""A hard bound on grading calls: worker processes that are killed when they overrun.

math-verify's own timeout uses SIGALRM, which works only on the main thread of
the main interpreter: called from a data-loader thread it either raises or is
silently switched off, and one pathological answer (`10^{10^{10}}`) then hangs
training.  Here every slow grading call runs in a separate worker process; the
caller waits on a pipe and watches it, so the bound holds from any thread and
any process.  A worker that overruns (or dies) is killed and replaced, and the
call reports TIMEOUT (or ERROR) instead of a result.

The bound counts the work a call did, not the time it waited: `timeout` is seconds of CPU time
of its worker (user + system, read from /proc), so a check gets the same verdict on a machine
busy with other processes as on an idle one, where a wall-clock bound scored correct answers 0
under load.  A call that waits without working (a sleep, a lock) is stopped once WALL_FACTOR
times `timeout` has passed on the clock; without /proc (not Linux) the bound is wall time.

    pool = WorkerPool(workers=2)
    pool.map(fn, [(a, b), (c, d)], timeout=5.0)  # -> [result | TIMEOUT | ERROR, ...]

`fn` must be a module-level function (it is sent to the worker by reference).
Workers are started with "spawn", so they never inherit the parent's threads
or locks, and get a memory limit so a runaway computation fails inside the
worker rather than taking the machine down.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from multiprocessing.connection import wait

TIMEOUT = "timeout"
ERROR = "error"
WORKER_MEMORY_BYTES = 4 << 30  # address space per worker
WALL_FACTOR = 10  # a call is stopped at this many times its CPU bound on the clock, working or not
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (/proc/<pid>/stat), or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime and stime: the stat fields 14 and 15
    except (OSError, IndexError, ValueError):
        return None


STARTUP_SECONDS = 120  # a worker's imports are not part of any call's time budget


class _Worker:
    """One worker process; it says "ready" once its imports are done."""

    def __init__(self, ctx, preload: tuple[str, ...]):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, preload), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.start_deadline = time.monotonic() + STARTUP_SECONDS

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def _serve(conn, preload: tuple[str, ...]) -> None:
    import importlib
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ValueError, OSError):
        pass
    for module in preload:
        importlib.import_module(module)
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        fn, args = job
        try:
            result = fn(*args)
        except BaseException:  # noqa: BLE001 - anything inside grading is "not equal", never a crash
            result = ERROR
        try:
            conn.send(result)
        except (BrokenPipeError, OSError):
            return


class _Call:
    """A job on a worker: its index, the worker's CPU seconds and the clock when it was sent, its bound."""

    def __init__(self, index: int, cpu_start: float | None, wall_start: float, timeout: float):
        self.index, self.cpu_start, self.wall_start, self.timeout = index, cpu_start, wall_start, timeout

    def left(self, worker: _Worker) -> float:
        """Seconds of its CPU bound the call has left (of wall time without /proc), or of its wall bound if fewer."""
        waited = time.monotonic() - self.wall_start
        used = cpu_seconds(worker.proc.pid) if self.cpu_start is not None else None
        worked = waited if used is None else used - self.cpu_start
        return min(self.timeout - worked, WALL_FACTOR * self.timeout - waited)


class WorkerPool:
    def __init__(self, workers: int | None = None, preload: tuple[str, ...] = ()):
        self.size = max(1, workers or min(4, os.cpu_count() or 1))
        self.preload = tuple(preload)  # modules each worker imports before taking jobs
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # one map at a time; callers from several threads queue here
        self.timeouts = 0  # calls killed at their deadline, since the pool was made
        self.started = 0  # worker processes started (replacements included)

    def map(self, fn, jobs: list[tuple], timeout: float) -> list:
        """fn(*job) for every job, in parallel; TIMEOUT for a job whose worker used more than
        `timeout` CPU seconds on it (or waited WALL_FACTOR times that), ERROR for one whose worker
        raised or died."""
        if not jobs:
            return []
        with self._lock:
            return self._map(fn, jobs, timeout)

    def warm(self) -> "WorkerPool":
        """Start the workers and wait until every one is ready (e.g. before timing)."""
        with self._lock:
            self._fill()
            for worker in self._workers:
                if not worker.ready:
                    if not worker.conn.poll(max(0.0, worker.start_deadline - time.monotonic())):
                        raise RuntimeError(f"a grading worker did not start within {STARTUP_SECONDS} s")
                    worker.ready = worker.conn.recv() == "ready"
        return self

    def _fill(self) -> None:
        self._workers = [w for w in self._workers if w.proc.is_alive()]
        while len(self._workers) < self.size:
            self._workers.append(self._start())

    def _map(self, fn, jobs, timeout):
        self._fill()
        results: list = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        busy: dict[_Worker, _Call] = {}
        while pending or busy:
            for worker in [w for w in self._workers if w.ready and w not in busy]:
                if not pending:
                    break
                index = pending.popleft()
                try:
                    started = cpu_seconds(worker.proc.pid)
                    worker.conn.send((fn, jobs[index]))
                    busy[worker] = _Call(index, started, time.monotonic(), timeout)
                except (BrokenPipeError, OSError):
                    results[index] = ERROR
                    self._replace(worker)
            starting = [w for w in self._workers if not w.ready]
            if not busy and not starting:
                continue
            # The CPU clock runs no faster than the wall clock: no call can overrun before the
            # least budget left has passed (a worker on several threads may, by a little; the bound is rechecked then)
            waits = [call.left(worker) for worker, call in busy.items()] + [w.start_deadline - time.monotonic() for w in starting]
            ready = wait([w.conn for w in [*busy, *starting]], timeout=max(0.0, min(waits)))
            for worker in [w for w in starting if w.conn in ready]:
                try:
                    worker.ready = worker.conn.recv() == "ready"
                except (EOFError, OSError):
                    worker.ready = False
                if not worker.ready:
                    raise RuntimeError("a grading worker failed to start (see its error above)")
            for worker in [w for w in busy if w.conn in ready]:
                call = busy.pop(worker)
                try:
                    results[call.index] = worker.conn.recv()
                except (EOFError, OSError):  # the worker died (segfault, out of memory)
                    results[call.index] = ERROR
                    self._replace(worker)
            for worker in [w for w, call in busy.items() if call.left(w) <= 0]:
                results[busy.pop(worker).index] = TIMEOUT
                self.timeouts += 1
                self._replace(worker)
            now = time.monotonic()
            if any(w.start_deadline <= now for w in self._workers if not w.ready):
                raise RuntimeError(f"a grading worker did not start within {STARTUP_SECONDS} s")
        return results

    def _start(self) -> _Worker:
        self.started += 1
        return _Worker(self._ctx, self.preload)

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start another in its place; it takes jobs once it says it is ready."""
        worker.kill()
        fresh = self._start()
        self._workers = [fresh if w is worker else w for w in self._workers]

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []


_shared: WorkerPool | None = None
_shared_pid: int | None = None
_shared_lock = threading.Lock()


def shared_pool() -> WorkerPool:
    """The process-wide grading pool (made on first use; a forked child makes its own)."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid():
            _shared, _shared_pid = WorkerPool(preload=("rlvr.rewards.equivalence", "math_verify")), os.getpid()
            atexit.register(_shared.close)
        return _shared
