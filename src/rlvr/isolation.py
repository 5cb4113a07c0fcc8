"""Running user code (reward functions, tools) in a child process that can be stopped.

A thread cannot be stopped: a reward stuck in C code (a catastrophic regex), one that swallows
every exception with a bare `except:`, or a tool that holds the GIL runs on past any deadline, and
sys.exit or os._exit in it ends the run.  A process can be killed, so `Worker` runs the calls in
one, forked from the caller:

    worker = Worker({"score": my_reward}, "reward")
    worker.call("score", {"completions": [...]}, timeout=60)  # the result, or CallTimedOut, CallFailed, WorkerDied

It is forked (the "fork" start method) at the first call, so the functions, closures and lambdas
included, need not be picklable; their arguments and results cross a pipe and must be.  It serves
calls one at a time and is reused.  It runs in a session of its own, so a call past its timeout
is stopped by SIGKILL to the whole process group, with every process it started that stayed in
the group, and the next call forks a fresh worker.  close(), garbage collection and interpreter
exit kill it and its group the same way.  The kernel kills the worker (PR_SET_PDEATHSIG) when the
thread that forked it ends, so every worker is forked by one thread that lasts as long as the
process (`_in_forker`), whatever thread calls: a multi-turn step's thread, which ends with the
step, would take the worker with it.  So the worker dies when the parent dies, even by SIGKILL,
and with it the files and locks it inherited (the run directory's lock).

In the worker Ctrl-C is ignored (it is the parent's to handle), SIGTERM has its default action,
torch uses one thread (the parent's OpenMP pool does not survive a fork), and whatever the
function raises, SystemExit and KeyboardInterrupt included, comes back as CallFailed with the
function's traceback.

Not covered: CUDA cannot be initialised in a forked child; a process that leaves the worker's
session (setsid) survives the kill, and what the worker started survives a SIGKILL of the parent;
the worker keeps the parent's memory of the moment it was forked, page by page as the parent
changes it (copy on write).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import Callable

POLL_SECONDS = 0.05  # how often a waiting caller checks that the worker is still alive
_PARENT_ENDS: set[int] = set()  # the parent's ends of every worker's pipe, closed in each new worker
_ENDS_LOCK = threading.RLock()  # RLock: a finalizer run by the garbage collector may take it again
_FORKER: dict = {}  # the pool of one thread that forks every worker, and the process it belongs to (_in_forker)
_FORKER_LOCK = threading.Lock()


class WorkerError(Exception):
    """A call that returned no result."""


class CallTimedOut(WorkerError):
    """The call ran past its timeout; the worker and its process group were killed."""


class WorkerDied(WorkerError):
    """The worker ended during the call (os._exit, a crash in C code, the out-of-memory killer);
    str() says how, e.g. "exited with code 7" or "was killed by SIGSEGV"."""


class CallFailed(WorkerError):
    """The function raised `kind` (SystemExit, KeyboardInterrupt and the like included), or its
    arguments or result could not be pickled (kind "PicklingError").  For SystemExit, `message`
    is the repr of its code ("" for none).  str() is the function's traceback."""

    def __init__(self, kind: str, message: str, trace: str = ""):
        super().__init__(trace or f"{kind}: {message}")
        self.kind, self.message = kind, message


class Worker:
    """Calls of `functions` (by key) in a forked child process, one at a time, from any thread."""

    def __init__(self, functions: dict[object, Callable], what: str):
        self.functions, self.what = functions, what  # what: "reward", "tool": the worker's process name
        self.pid: int | None = None
        self._conn = None
        self._stop = None  # weakref.finalize: kills the worker's group; runs once
        self._lock = threading.Lock()

    def call(self, key, kwargs: dict, timeout: float | None = None):
        """functions[key](**kwargs) in the worker; `timeout` seconds (None or 0: no limit)."""
        try:
            request = pickle.dumps((key, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - pickle raises TypeError, AttributeError, PicklingError
            raise CallFailed("PicklingError", f"the arguments cannot be sent to the worker process: {e}") from None
        with self._lock:
            self._running()
            try:
                self._conn.send_bytes(request)
                return self._answer(time.monotonic() + timeout if timeout else None, timeout)
            except WorkerError:
                raise
            except OSError:
                self._died()
            except BaseException:  # Ctrl-C in the caller: the worker's answer would reach the next call
                self.close()
                raise

    def start(self) -> None:
        """Fork the worker now, unless it runs (by the forker thread, whatever thread calls: `_in_forker`)."""
        with self._lock:
            self._running()

    def _running(self) -> None:
        if self.pid is None or _ended(self.pid):  # not started yet, or died between calls
            self.close()
            self._fork()

    def close(self) -> None:
        """Kill the worker and its process group (a later call forks a new one)."""
        if self._stop is not None:
            self._stop()
        self.pid, self._conn, self._stop = None, None, None

    def _fork(self) -> None:
        parent_end, child_end = multiprocessing.Pipe()
        _flush()  # else the worker would print again what the parent has buffered

        def fork() -> int:
            with _ENDS_LOCK:
                inherited, parent = [parent_end.fileno(), *_PARENT_ENDS], os.getpid()
                pid = os.fork()
                if pid == 0:
                    _child(child_end, inherited, parent, self.functions, self.what)
                _PARENT_ENDS.add(parent_end.fileno())
            return pid

        pid = _in_forker(fork)
        child_end.close()
        self.pid, self._conn = pid, parent_end
        self._stop = weakref.finalize(self, _kill, pid, parent_end, os.getpid())

    def _answer(self, deadline: float | None, timeout: float | None):
        while True:
            wait = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            if self._conn.poll(wait):
                try:
                    reply = pickle.loads(self._conn.recv_bytes())
                except EOFError:
                    self._died()
                if reply[0] == "ok":
                    return reply[1]
                raise CallFailed(*reply[1:])
            if _ended(self.pid):
                self._died()
            if deadline is not None and time.monotonic() >= deadline:
                self.close()
                raise CallTimedOut(f"ran past {timeout:g} s")

    def _died(self):
        how = _ended(self.pid, wait=True) or "closed its pipe"
        self.close()
        raise WorkerDied(how)


def _in_forker(fork: Callable[[], int]) -> int:
    """fork() run by the forker: a pool of one thread per process that lasts until the process ends, so that the
    workers it forks live as long (PR_SET_PDEATHSIG fires when the forking thread ends)."""
    from concurrent.futures import ThreadPoolExecutor

    with _FORKER_LOCK:
        if _FORKER.get("pid") != os.getpid():  # none yet, or the parent's, copied into this process by a fork
            _FORKER.update(pid=os.getpid(), pool=ThreadPoolExecutor(1, thread_name_prefix="rlvr-forker"))
        pool = _FORKER["pool"]
    return pool.submit(fork).result()


def _ended(pid: int, wait: bool = False) -> str | None:
    """How the worker ended ("exited with code 7", "was killed by SIGSEGV"), or None while it runs.
    It is not reaped here, so its pid and process group stay its own until _kill reaps it.
    `wait`: up to 1 s for it to end (its pipe may close first)."""
    for _ in range(20 if wait else 1):
        try:
            status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else
            return "ended"
        if status is not None:
            return _describe(status)
        if wait:
            time.sleep(POLL_SECONDS)
    return None


def _describe(status) -> str:
    if status.si_code == os.CLD_EXITED:
        return f"exited with code {status.si_status}"
    try:
        name = signal.Signals(status.si_status).name
    except ValueError:
        name = f"signal {status.si_status}"
    hint = " (the out-of-memory killer, or another process)" if status.si_status == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, replaced, or None
            pass


def _kill(pid: int, parent_end, owner: int) -> None:
    """SIGKILL the worker's process group, then reap the worker (in the process that forked it only)."""
    if os.getpid() != owner:
        return
    with _ENDS_LOCK:
        _PARENT_ENDS.discard(parent_end.fileno())
        parent_end.close()
    for kill in (os.killpg, os.kill):  # its group; the worker itself, in case it has no group of its own yet
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


# --- in the worker ----------------------------------------------------------------------------

def _child(conn, inherited: list[int], parent: int, functions: dict, what: str) -> None:
    """The worker's whole life; it never returns into the caller's code."""
    global _ENDS_LOCK
    try:
        os.setsid()  # before anything that could fail: the `finally` below kills our own group
    except OSError:
        os._exit(1)
    try:
        _ENDS_LOCK = threading.RLock()  # held by the parent's forking thread when we were copied
        _PARENT_ENDS.clear()
        for fd in inherited:  # the parent's ends: held by the parent alone, its exit closes our pipe
            try:
                os.close(fd)
            except OSError:
                pass
        if _prepare(what, parent):
            _serve(conn, functions)
    finally:
        try:
            os.killpg(0, signal.SIGKILL)  # the parent is gone: nothing the calls started outlives us
        finally:
            os._exit(0)


def _prepare(what: str, parent: int) -> bool:
    """Signals, process name, torch threads; False if the parent is already gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc = ctypes.CDLL(None)
    libc.prctl(15, f"rlvr-{what}".encode()[:15], 0, 0, 0)  # PR_SET_NAME: what `ps` and `top` show
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: killed when the forking thread ends
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    return os.getppid() == parent


def _serve(conn, functions: dict) -> None:
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        reply = _run(functions, request)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            data = pickle.dumps(("failed", "PicklingError", f"the result cannot be sent back from the worker process: {e}"))
        _flush()  # what the function printed, before the worker may be killed
        try:
            conn.send_bytes(data)
        except OSError:
            return


def _run(functions: dict, request: bytes) -> tuple:
    """("ok", result) or ("failed", kind, message, traceback) for whatever the call raised."""
    try:
        key, kwargs = pickle.loads(request)
        return "ok", functions[key](**kwargs)
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are the function's too
        message = ("" if e.code is None else repr(e.code)) if isinstance(e, SystemExit) else str(e)
        trace = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))  # from the function down
        return "failed", type(e).__name__, message, trace
