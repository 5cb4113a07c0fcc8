"""Run untrusted Python, such as model-written code, in a sandbox.

    from rlvr.sandbox import SandboxLimits, run_python, run_many, isolation_method

    run_python("print(input()[::-1])", stdin="abc")
    # RunResult(returncode=0, stdout='cba\\n', stderr='', timed_out=False, duration=0.05, truncated=False)
    run_many(["print(1)", "while True: pass"], limits=SandboxLimits(timeout=2))  # in parallel
    isolation_method()  # "bwrap", "unshare" or None

Isolation: the first of these that works, found by running a probe program once per process.

  bwrap    bubblewrap (`apt-get install bubblewrap`), preferred.
  unshare  util-linux's unshare creates the namespaces; rlvr/_sandbox_init.py builds the same root.

Either way the program runs in its own PID, network, mount, IPC and UTS namespaces and sees a
minimal read-only root: /usr, the Python installation, /dev/{null,zero,full,random,urandom}, its
own /proc, and a tmpfs of `disk` bytes at /tmp, its working directory, gone when it ends.  Nothing
else of the host exists in it: not the project, /root, /home or your data.  The network namespace
has only a loopback interface.  The program runs as an unprivileged uid without capabilities and
with no_new_privs; when rlvr runs as root, a fresh uid above 2^30 per run, because the kernel
never enforces RLIMIT_NPROC for uid 0 and so that parallel sandboxes do not share the count.
The interpreter is the real base interpreter (not a virtualenv's link), started with -I -S; the
program, at /sandbox/main.py (read-only), can import the standard library and the packages of
the base installation's site-packages (not a virtualenv's, nor those only a .pth file provides).

Limits (SandboxLimits): wall-clock timeout, CPU seconds, address space, file size and open files
per process (rlimits); processes + threads (RLIMIT_NPROC, counted per sandbox); bytes of /tmp
(the tmpfs size); bytes of stdout and of stderr kept (more stops the program).  Memory is
limited per process, so a sandbox may use up to `processes` x `memory` in all.

At the end, when the program exits, is stopped at the wall-clock limit or floods its output, the
namespace's init process is killed, and the kernel kills every process left in the namespace,
including those that called setsid or double-forked; run_python returns after they are gone, and
leaves no zombie behind, also when the trainer is PID 1 of a container or a subreaper.

A seccomp filter (rlvr/_sandbox_init.py) refuses the kernel keyrings (the program would share the
trainer's session keyring) and the memory that escapes RLIMIT_AS by belonging to no process
(memfd_create, SysV shared memory and message queues); /tmp is a size-capped tmpfs.

Not covered: the seccomp filter refuses only those calls, so the rest reach the kernel (a kernel
bug is an escape); memory is bounded per process (RLIMIT_AS, so up to `processes` x `memory`),
not by a cgroup for the whole sandbox; /proc shows system-wide information (CPU, memory, uptime);
when rlvr runs as root, a program may create user namespaces of its own (they contain nothing;
rootless bwrap forbids them).

Fail closed: when no method works, run_python raises SandboxUnavailable saying what to install,
unless the caller passes allow_unisolated=True: then the program runs as a plain subprocess with
the rlimits except the process limit, in a new session, killed by process group at the end, in a
temporary working directory; it can read your files and use the network, and a process that
leaves the session survives.  A warning is logged (once).
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

METHODS = ("bwrap", "unshare")
_INIT = Path(__file__).with_name("_sandbox_init.py")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 10.0  # wall-clock seconds for the whole run
    cpu_time: int = 10  # CPU seconds, per process
    memory: int = 1 << 30  # bytes of address space, per process
    file_size: int = 16 << 20  # bytes, the largest file it may write
    disk: int = 64 << 20  # bytes of /tmp in all
    processes: int = 32  # processes and threads at once
    open_files: int = 256  # per process
    output: int = 1 << 20  # bytes kept of stdout and of stderr; more stops the program


@dataclass(frozen=True)
class RunResult:
    returncode: int  # exit status; 128 + n: killed by signal n inside the sandbox; -9: killed by us
    stdout: str  # decoded as UTF-8, invalid bytes replaced
    stderr: str
    timed_out: bool  # stopped at the wall-clock limit
    duration: float  # seconds
    truncated: bool = False  # stdout or stderr went past limits.output; the program was stopped there


class SandboxUnavailable(RuntimeError):
    pass


def run_python(code: str, stdin: str | bytes = "", limits: SandboxLimits = SandboxLimits(),
               allow_unisolated: bool = False) -> RunResult:
    """Run `code` as the __main__ module of a fresh interpreter in the sandbox, `stdin` as its input."""
    method = _method_or_raise(allow_unisolated)
    data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    return _run(method, code, data, limits)


def run_many(codes: list[str], stdins: list[str | bytes] | None = None, limits: SandboxLimits = SandboxLimits(),
             allow_unisolated: bool = False, max_workers: int | None = None) -> list[RunResult]:
    """run_python for each program (with the matching stdin), `max_workers` at a time (default: CPU count)."""
    _method_or_raise(allow_unisolated)
    stdins = [""] * len(codes) if stdins is None else stdins
    with ThreadPoolExecutor(max_workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda c, s: run_python(c, s, limits, allow_unisolated), codes, stdins))


_detected: dict[str, object] = {}
_lock = threading.Lock()


def isolation_method() -> str | None:
    """The isolation that works on this machine ("bwrap", "unshare"), or None; probed once, then cached."""
    with _lock:
        if "method" not in _detected:
            _detected["method"], _detected["why_not"] = _detect()
        return _detected["method"]


def isolation_problems() -> list[str]:
    """Why each method fails here ("bwrap: not installed", ...) when none works; else []."""
    if isolation_method() is not None:
        return []
    return list(_detected.get("why_not", []))


def _method_or_raise(allow_unisolated: bool) -> str:
    method = isolation_method()
    if method is not None:
        return method
    if not allow_unisolated:
        raise SandboxUnavailable(
            "refusing to run untrusted code: no sandbox works on this machine ("
            + "; ".join(_detected.get("why_not", [])) + "). Install bubblewrap (Debian/Ubuntu: "
            "apt-get install bubblewrap; Fedora: dnf install bubblewrap) with user namespaces enabled, or run "
            "as root with util-linux's unshare. To run it without isolation at your own risk, pass "
            "allow_unisolated=True (for code_tests: reward_args: {code_tests: {allow_unisolated: true}})."
        )
    with _lock:
        if not _detected.get("warned"):
            _detected["warned"] = True
            log.warning("running untrusted code WITHOUT a sandbox (allow_unisolated=True): it can read and write "
                        "your files, use the network, and fork without limit")
    return "unisolated"


# --- running one program ------------------------------------------------------------------------

def _run(method: str, code: str, data: bytes, limits: SandboxLimits) -> RunResult:
    workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
    code_fd = os.memfd_create("rlvr-program")
    info_r, info_w = os.pipe() if method == "bwrap" else (-1, -1)  # bwrap tells us its init's pid there
    init = _Init(info_r)
    try:
        _write_all(code_fd, code.encode("utf-8", "surrogatepass"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        argv, env, cwd = _command(method, workdir, code_fd, limits, code, info_w)
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=tuple(fd for fd in (code_fd, info_w) if fd >= 0), env=env, cwd=cwd,
                                start_new_session=True)
        for fd in (code_fd, info_w):
            if fd >= 0:
                os.close(fd)
        code_fd = info_w = -1
        try:
            out, err, timed_out, truncated = _communicate(proc, data, start + limits.timeout, limits.output, init)
        finally:
            _kill_tree(proc, method, init)
        duration = time.monotonic() - start
    finally:
        for fd in (code_fd, info_w):
            if fd >= 0:
                os.close(fd)
        init.close()
        _remove_tree(workdir)
    decode = (lambda b: b.decode("utf-8", "replace"))
    returncode = -signal.SIGKILL if timed_out or truncated else proc.returncode  # stopped by us
    return RunResult(returncode, decode(out), decode(err), timed_out, duration, truncated)


def _command(method: str, workdir: str, code_fd: int, limits: SandboxLimits, code: str, info_fd: int = -1):
    """(argv, env, cwd) that start rlvr/_sandbox_init.py, isolated by `method`."""
    spec = {"limits": {k: int(v) for k, v in asdict(limits).items() if k not in ("timeout", "output")},
            "main": "/sandbox/main.py", "drop": None}
    root = os.geteuid() == 0
    if root and method != "unisolated":
        spec.update(drop="uid", uid=random.SystemRandom().randrange(1 << 30, 1 << 31))
    env, cwd = dict(_ENV), "/"
    if method == "bwrap":
        argv = _bwrap_argv(root, code_fd, limits, info_fd)
    elif method == "unshare":
        argv = [shutil.which("unshare"), "--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]
        if not root:  # root of a new user namespace, where only our own uid is mapped
            argv += ["--user", "--map-root-user"]
            spec["drop"] = "caps"
        spec.update(root=workdir, ro_binds=_ro_paths(), symlinks=_root_symlinks(), disk=limits.disk, code_fd=code_fd)
        argv += ["--"]
    else:
        spec["main"] = os.path.join(workdir, "main.py")
        Path(spec["main"]).write_text(code, encoding="utf-8", errors="surrogatepass")
        # Outside a user namespace RLIMIT_NPROC counts every process of the user, the trainer's
        # threads included, so it would stop the program's first fork: no process limit here.
        del spec["limits"]["processes"]
        env.update(HOME=workdir, TMPDIR=workdir)
        argv, cwd = [], workdir
    return argv + [_interpreter(), "-I", "-S", "-c", _INIT.read_text(), json.dumps(spec)], env, cwd


def _bwrap_argv(root: bool, code_fd: int, limits: SandboxLimits, info_fd: int = -1) -> list[str]:
    argv = [shutil.which("bwrap"), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if info_fd >= 0:
        argv += ["--info-fd", str(info_fd)]
    if root:  # bwrap run by root keeps every capability unless told: keep only what changing uid needs
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    made = set()
    for path in _ro_paths():
        for parent in reversed(Path(path).parents[:-1]):  # bwrap would create them with mode 0700
            if parent not in made:
                made.add(parent)
                argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", path, path]
    for target, path in _root_symlinks():
        argv += ["--symlink", target, path]
    return argv + ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(limits.disk), "--tmpfs", "/tmp",
                   "--dir", "/sandbox", "--perms", "0444", "--ro-bind-data", str(code_fd), "/sandbox/main.py",
                   "--chdir", "/tmp", "--"]


class _Init:
    """The namespace init bwrap starts, as a pidfd opened as soon as bwrap names it on its info fd
    (the init cannot be reaped before that, so the pid names the right process)."""

    def __init__(self, info_fd: int):
        self.info_fd, self.buf, self.pidfd = info_fd, bytearray(), -1

    def read(self) -> bool:
        """Take what bwrap wrote; False once the info fd is closed."""
        chunk = os.read(self.info_fd, 4096)
        self.buf += chunk
        if self.pidfd < 0:
            try:
                pid = json.loads(self.buf)["child-pid"]
                self.pidfd = os.pidfd_open(int(pid))
            except (ValueError, KeyError, TypeError, OSError):
                pass
        return bool(chunk)

    def close(self) -> None:
        for fd in (self.info_fd, self.pidfd):
            if fd >= 0:
                os.close(fd)
        self.info_fd = self.pidfd = -1


def _communicate(proc: subprocess.Popen, data: bytes, deadline: float, cap: int, init: _Init | None = None):
    """Feed stdin, collect stdout and stderr up to `cap` bytes each, until both close and the process
    exits, the deadline passes, or the output overflows.  The process is not reaped here."""
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    if init is not None and init.info_fd >= 0:
        sel.register(init.info_fd, selectors.EVENT_READ, init)
    pending = memoryview(data)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    timed_out = truncated = False
    while any(k.data is not init for k in sel.get_map().values()) and not truncated:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(left):
            if key.data is init:
                if not init.read():
                    sel.unregister(key.fileobj)
                continue
            if key.fileobj is proc.stdin:
                try:
                    pending = pending[os.write(key.fd, pending[: 1 << 16]):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                sel.unregister(key.fileobj)
            buf = key.data
            buf += chunk
            truncated = truncated or len(buf) > cap
    sel.close()
    if not (timed_out or truncated):
        timed_out = not _wait_exit(proc.pid, deadline)
    return bytes(out[:cap]), bytes(err[:cap]), timed_out, truncated


def _wait_exit(pid: int, deadline: float) -> bool:
    """Whether child `pid` exits before the deadline (it stays unreaped, so its pid cannot be reused)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            return _readable(fd, deadline - time.monotonic())
        finally:
            os.close(fd)
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.005)
    return False


def _kill_tree(proc: subprocess.Popen, method: str, init: _Init | None = None) -> None:
    """Kill the namespace's init (bwrap's or ours), whose death makes the kernel kill everything in
    the PID namespace, and let our child (bwrap or unshare) reap it and exit; then kill our child's
    process group and wait until it is gone.  In that order the init is never orphaned: killing
    our child first would hand the init to the nearest subreaper, which is this process when the
    trainer runs as PID 1 of a container or as a subreaper, and it would stay a zombie."""
    inits = []
    if method != "unisolated":
        for pid in _children(proc.pid):
            try:
                inits.append(os.pidfd_open(pid))
            except OSError:
                pass
    if init is not None and init.info_fd >= 0:
        while _readable(init.info_fd, 0) and init.read():  # what bwrap wrote since (its init's pid)
            pass
    if init is not None and init.pidfd >= 0:
        inits.append(os.dup(init.pidfd))
    for fd in inits:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _readable(fd, 5.0)  # once the init has exited, so has everything else in its namespace
    if inits:
        _wait_exit(proc.pid, time.monotonic() + 1.0)  # our child reaps the init and exits
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: the group id cannot have been reused
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for fd in inits:  # an init whose parent exited first was handed to us (PID 1, or a subreaper): reap it
        try:
            os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            pass  # not ours: its parent reaped it
        os.close(fd)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f and not f.closed:
            f.close()


def _readable(fd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return [int(c) for t in tasks for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except OSError:
        return []


# --- the sandbox's file system --------------------------------------------------------------------

def _interpreter() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _ro_paths() -> list[str]:
    """Host paths mounted read-only at the same place: /usr, the Python installation, the loader cache."""
    python = _interpreter()
    wanted = ["/usr", os.path.dirname(python), sys.base_prefix, sys.base_exec_prefix]
    wanted += [f"/{d}" for d in ("lib", "lib32", "lib64", "libx32", "bin", "sbin") if os.path.isdir(f"/{d}") and not os.path.islink(f"/{d}")]
    paths = []
    for p in sorted({os.path.realpath(p) for p in wanted if p}, key=len):
        if p != "/" and not any(p == q or p.startswith(q + "/") for q in paths):
            paths.append(p)
    if os.path.isfile("/etc/ld.so.cache"):
        paths.append("/etc/ld.so.cache")
    return paths


def _root_symlinks() -> list[tuple[str, str]]:
    """Merged-/usr systems link /bin, /lib, ... into /usr: the same links in the sandbox."""
    names = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
    return [(os.readlink(f"/{d}"), f"/{d}") for d in names if os.path.islink(f"/{d}")]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _remove_tree(path: str) -> None:
    """Delete a working directory, also what a program made unreadable (chmod 000) or read-only."""
    def fix_and_retry(func, p, _exc):
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
            shutil.rmtree(p, onerror=fix_and_retry)
        else:
            os.unlink(p)

    shutil.rmtree(path, onerror=fix_and_retry)


# --- detection ------------------------------------------------------------------------------------

_PROBE = """
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
try:
    pid = os.fork()
except OSError:
    forked = False
else:
    forked = True
    if pid == 0:
        os._exit(0)
print(json.dumps({"ns": [os.readlink("/proc/self/ns/" + n) for n in ("pid", "net", "mnt")],
                  "caps": [int(status[k], 16) for k in ("CapEff", "CapPrm")], "nnp": status["NoNewPrivs"].strip(),
                  "forked": forked, "sees_host": os.path.exists(HOST)}))
"""


def _detect() -> tuple[str | None, list[str]]:
    why_not = []
    for method in METHODS:
        problem = _probe(method)
        if problem is None:
            log.debug("sandbox: using %s", method)
            return method, why_not
        why_not.append(f"{method}: {problem}")
        log.debug("sandbox: %s does not work: %s", method, problem)
    return None, why_not


def _probe(method: str) -> str | None:
    """None if `method` really isolates a program here, else what is wrong."""
    if shutil.which(method) is None:
        return "not installed"
    if method == "bwrap" and "--size" not in subprocess.run([shutil.which("bwrap"), "--help"], capture_output=True, text=True).stdout:
        return "too old (no --size; bubblewrap >= 0.7 needed)"
    with tempfile.NamedTemporaryFile(prefix="rlvr-probe-") as host_file:
        code = f"HOST = {host_file.name!r}\n{_PROBE}"
        try:
            result = _run(method, code, b"", SandboxLimits(timeout=30, processes=1))
        except OSError as e:
            return str(e)
    try:
        report = json.loads(result.stdout)
    except ValueError:
        return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    own = [os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "net", "mnt")]
    checks = {
        "no new PID, network and mount namespaces": not all(a != b for a, b in zip(report["ns"], own)),
        "capabilities left": report["caps"] != [0, 0],
        "no_new_privs not set": report["nnp"] != "1",
        "the process limit does not hold": report["forked"],
        "host files are visible": report["sees_host"],
    }
    failed = [what for what, bad in checks.items() if bad]
    return ", ".join(failed) if failed else None
