"""Processes for the tests' launches (conftest.launch_ranks, test_distributed's one-process runs),
forked from an interpreter that has imported torch, transformers, peft, matplotlib and rlvr already
(multiprocessing's forkserver with these modules preloaded), in place of a fresh `python`.

The imports cost about 5 s of CPU a process on the 2-core machine, more than a tiny run's training
(a 2-step `rlvr train` of the tiny model: 8.3 s of CPU, 5.8 s of it importing), and the suite starts
about a hundred such processes.  The forked process is a real one: its own pid and session, its
environment, argv and files, `python -m rlvr.cli ...` or a script run as __main__, atexit handlers at
its end, signals and exit codes as a fresh interpreter's.  What a fresh interpreter would read once at
import (torch's thread count, the temporary directory) is set again from the process's environment.

Only the forkserver itself is started once per pytest worker (its imports, about 6 s); it holds no
thread and has run no torch operation, so forking it is safe.  RLVR_COLD_LAUNCHES=1 starts every
process fresh instead (to compare, or if a launch behaves differently forked)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

PRELOAD = ["warm", "rlvr.run", "rlvr.loop", "rlvr.trainer", "rlvr.report", "transformers.models.llama.modeling_llama",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "peft", "matplotlib.figure",
           "matplotlib.backends.backend_agg"]
_context = None


def stop() -> None:
    """The forkserver stopped and multiprocessing's temporary directory removed now (at the end of the
    session, before the directory it is in goes), not at exit, where it would be missing."""
    from multiprocessing import forkserver, util

    if _context is None:
        return
    getattr(forkserver._forkserver, "_stop", lambda: None)()
    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:
            finalizer()


def cold() -> bool:
    return os.environ.get("RLVR_COLD_LAUNCHES") == "1"


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class Process:
    """`python argv` (argv: ["-m", module, ...] or [script, ...]) forked from the warm interpreter in a
    session of its own, stdout and stderr to the files given, with `env` as its whole environment;
    subprocess.Popen's interface as the launches use it (pid, poll, wait, returncode, send_signal, kill)."""

    def __init__(self, argv: list[str], stdout: str, stderr: str, env: dict):
        if cold():
            with open(stdout, "w") as out, open(stderr, "w") as err:
                self._popen = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, start_new_session=True, env=env)
            self.pid = self._popen.pid
            return
        self._popen = None
        self._process = _forkserver().Process(target=_main, args=(list(argv), dict(env), str(stdout), str(stderr), os.getcwd()))
        self._process.start()
        self.pid = self._process.pid
        self.args = argv

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode if self._popen is not None else self._process.exitcode

    def poll(self) -> int | None:
        return self._popen.poll() if self._popen is not None else self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        if self._popen is not None:
            return self._popen.wait(timeout)
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """As Popen's: nothing if the process has ended (here the forkserver reaps it at once)."""
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(9)

    def kill_session(self) -> None:
        """SIGKILL to the process and everything it started (its session); before it has made its
        session (just forked), to the process alone."""
        try:
            os.killpg(self.pid, 9)
        except ProcessLookupError:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def run(argv: list[str], env: dict, timeout: float, logs: str) -> subprocess.CompletedProcess:
    """`python argv` to its end (Process), as subprocess.run(capture_output=True, text=True) gives it;
    still running at `timeout`: killed, and subprocess.TimeoutExpired raised."""
    out, err = os.path.join(logs, "out"), os.path.join(logs, "err")
    proc = Process(argv, out, err, env)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill_session()
        proc.wait()
        raise
    with open(out) as o, open(err) as e:
        return subprocess.CompletedProcess([sys.executable, *argv], code, o.read(), e.read())


def _main(argv: list[str], env: dict, stdout: str, stderr: str, cwd: str) -> None:
    """In the forked process: a fresh interpreter's start, then `argv` run as __main__, then its exit."""
    os.setsid()
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read again from TMPDIR
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # the interpreter puts them first
    sys.path[:] = given + [p for p in sys.path if p not in given]
    import torch

    if env.get("OMP_NUM_THREADS"):  # else the forkserver's own default, which it never changed
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0:0] = [os.path.dirname(os.path.abspath(argv[0]))]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
