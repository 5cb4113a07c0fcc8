"""rlvr.sandbox against hostile programs.

Every test checks the result, a time bound, and (fixture `leaves_nothing`) that nothing is left
behind: no process of a sandbox uid, no listening socket, no working directory.  The tests that
matter most for escaping run under each isolation method that works here (`method` fixture).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import rlvr
from rlvr import sandbox
from rlvr.sandbox import RunResult, SandboxLimits, SandboxUnavailable, isolation_method, run_many, run_python

pytestmark = pytest.mark.skipif(isolation_method() is None, reason="no sandbox works here: apt-get install bubblewrap")
FAST = SandboxLimits(timeout=2)
SANDBOX_UIDS = 1 << 30  # as root, each run gets a fresh uid at or above this


def run(code: str, limits: SandboxLimits = FAST, stdin: str = "", bound: float | None = None) -> RunResult:
    """run_python, checking that it returns within `bound` seconds (default: the timeout + 10, room for
    a loaded machine to start and reap the sandbox; what a test checks is that it does not run on)."""
    start = time.monotonic()
    result = run_python(textwrap.dedent(code), stdin=stdin, limits=limits)
    elapsed = time.monotonic() - start
    assert elapsed < (bound if bound is not None else limits.timeout + 10), (elapsed, result)
    return result


def _sandbox_processes(uids: set[int]) -> list[str]:
    """Host processes running as one of `uids`, the sandbox uids this test's runs were given (only
    meaningful as root, where runs get their own uid; the other pytest-xdist worker has its own runs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if os.geteuid() == 0 and uid in uids:
            found.append(pid)
    return found


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def _listening(uids: set[int] | None = None) -> set[str]:
    """The host's listening TCP sockets; as root, those of `uids` only (the sandbox uids of this test's
    runs: the other pytest-xdist worker's servers and launchers listen too)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        sockets |= {line.split()[1] for line in lines if line.split()[3] == "0A"
                    and (uids is None or os.geteuid() != 0 or int(line.split()[7]) in uids)}
    return sockets


def _work_dirs() -> set[str]:
    import tempfile

    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("rlvr-sandbox-")}


def _record_sandbox_uids(monkeypatch) -> set[int]:
    """The set that will hold every uid a sandbox run of this process draws (sandbox.py draws each
    run's uid from random.SystemRandom)."""
    uids: set[int] = set()

    class Recording(random.SystemRandom):
        def randrange(self, *args, **kwargs):
            value = super().randrange(*args, **kwargs)
            uids.add(value)
            return value

    monkeypatch.setattr(sandbox.random, "SystemRandom", Recording)
    return uids


@pytest.fixture(autouse=True)
def leaves_nothing(monkeypatch):
    uids = _record_sandbox_uids(monkeypatch)
    sockets, dirs = _listening(uids), _work_dirs()
    yield
    assert _sandbox_processes(uids) == []  # run_python returns after the whole tree is gone: no grace period
    deadline = time.monotonic() + 2
    while (_listening(uids) - sockets or _work_dirs() - dirs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listening(uids) - sockets == set()
    assert _work_dirs() - dirs == set()


_working: dict[str, bool] = {}


@pytest.fixture(params=sandbox.METHODS)
def method(request, monkeypatch):
    """Run the test under one isolation method (skipped where that method does not work)."""
    if request.param not in _working:
        _working[request.param] = sandbox._probe(request.param) is None
    if not _working[request.param]:
        pytest.skip(f"{request.param} does not work on this machine")
    monkeypatch.setitem(sandbox._detected, "method", request.param)
    return request.param


# --- it works ---------------------------------------------------------------------------------------

@pytest.mark.processes
@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives each run a uid of its own")
def test_each_run_as_root_gets_a_fresh_uid_the_leftover_check_watches(monkeypatch):
    uids = _record_sandbox_uids(monkeypatch)
    script = "import os\nprint(os.getuid())"
    seen = {int(run(script).stdout), int(run(script).stdout)}
    assert seen == uids and len(seen) == 2 and min(seen) >= SANDBOX_UIDS  # what leaves_nothing looks for


@pytest.mark.processes
def test_runs_a_program_with_stdin_and_captures_its_output():
    result = run("import sys\nname = input()\nprint('hello', name)\nprint('oops', file=sys.stderr)\nsys.exit(3)", stdin="bob\n")
    assert (result.returncode, result.stdout, result.stderr, result.timed_out) == (3, "hello bob\n", "oops\n", False)
    assert result.duration > 0


@pytest.mark.processes
def test_large_stdin_and_output_do_not_deadlock():
    data = "x" * (5 << 20)
    result = run("import sys\ndata = sys.stdin.read()\nprint(len(data))\nsys.stdout.write('y' * 500_000)",
                 stdin=data, limits=SandboxLimits(timeout=10), bound=10)
    assert result.stdout.startswith(f"{len(data)}\n") and len(result.stdout) == len(f"{len(data)}\n") + 500_000


@pytest.mark.processes
def test_runs_in_parallel():
    # Each program prints when its sleep began and ended: run at once, every sleep began before any ended
    # (one after the other, none would), however slowly a loaded machine starts them.
    program = "import time; a = time.time(); time.sleep(1); print(a, time.time())"
    results = run_many([program] * 8, limits=SandboxLimits(timeout=20), max_workers=8)
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    assert len(spans) == 8 and max(start for start, _ in spans) < min(end for _, end in spans)


@pytest.mark.processes
def test_no_privileges(method):
    result = run("""
        import os
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        print(int(status["CapEff"], 16), int(status["CapPrm"], 16), status["NoNewPrivs"].strip(), os.getpid() < 10)
        print(sorted(p for p in os.listdir("/proc") if p.isdigit()))
    """)
    lines = result.stdout.splitlines()
    assert lines[0] == "0 0 1 True"  # no capabilities, no_new_privs, a fresh PID namespace
    assert len(eval(lines[1])) <= 3  # only the namespace's init and us


@pytest.mark.processes
def test_environment_does_not_leak(monkeypatch):
    monkeypatch.setenv("RLVR_TEST_SECRET", "hunter2")
    result = run("import os; print(sorted(os.environ))")
    assert "RLVR_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout


# --- time ---------------------------------------------------------------------------------------------

@pytest.mark.processes
def test_programs_are_stopped_at_the_wall_clock_timeout():
    programs = [
        "while True:\n    pass",  # an infinite loop
        "import time\nprint('start', flush=True)\ntime.sleep(60)",  # sleeping uses no CPU time
        "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
        "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass",  # ignoring every signal it can
    ]
    start = time.monotonic()
    results = run_many(programs, limits=SandboxLimits(timeout=1), max_workers=3)
    assert time.monotonic() - start < 30  # far below the 60 s sleep; the loops would never end
    assert all(r.timed_out and r.returncode == -9 and 1 <= r.duration < 10 for r in results), results
    assert results[1].stdout == "start\n"


@pytest.mark.processes
def test_cpu_time_limit():
    result = run("while True:\n    pass", limits=SandboxLimits(timeout=20, cpu_time=1), bound=4)
    assert not result.timed_out and result.returncode != 0  # killed by SIGXCPU / SIGKILL after ~1 s of CPU


# --- processes ---------------------------------------------------------------------------------------

@pytest.mark.processes
def test_fork_bomb_hits_the_process_limit(method):
    result = run("""
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(n, e.errno)
    """, limits=SandboxLimits(timeout=5, processes=16))
    forked, errno = map(int, result.stdout.split())
    assert forked < 16 and errno == 11  # EAGAIN; the sleeping children die with the sandbox


@pytest.mark.processes
def test_exponential_fork_bomb_is_contained():
    result = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, limits=SandboxLimits(timeout=1, processes=32))
    assert result.timed_out


@pytest.mark.processes
def test_thread_bomb_hits_the_process_limit():
    result = run("""
        import threading, time
        n = 0
        try:
            while True:
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
                n += 1
        except RuntimeError:
            print(n)
    """, limits=SandboxLimits(timeout=3, processes=16))
    assert int(result.stdout) < 16


@pytest.mark.processes
def test_fork_bomb_does_not_starve_a_parallel_sandbox():
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)"
    polite = "import os, time\ntime.sleep(0.5)\npids = [os.fork() or os._exit(0) for _ in range(8)]\nprint(len(pids))"
    results = run_many([bomb, polite], limits=SandboxLimits(timeout=1.5, processes=16), max_workers=2)
    assert results[1].stdout == "8\n"  # each sandbox counts its own processes


@pytest.mark.processes
def test_setsid_double_fork_escape_dies_with_the_sandbox(method, tmp_path):
    marker = f"rlvr-escape-{os.getpid()}-{time.monotonic_ns()}"
    loop = f"import os, time\nwhile True:\n    for d in ({str(tmp_path)!r}, '/tmp'):\n        try:\n            open(d + '/escaped', 'a').write('x')\n        except OSError:\n            pass\n    time.sleep(0.1)"
    for keep_running in (False, True):
        seen = []
        code = f"""
            import os, sys, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv(sys.executable, [sys.executable, "-c", {loop!r}, {marker!r}])
                os._exit(0)
            time.sleep(0.5)
            print("spawned", flush=True)
            while {keep_running}:
                pass
        """
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.extend(_processes_with(marker))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        result = run(code, limits=SandboxLimits(timeout=1))
        stop.set()
        watcher.join()
        assert result.stdout == "spawned\n" and result.timed_out == keep_running
        assert seen, "the escaped process never ran; the test proves nothing"
        assert _processes_with(marker) == []  # dead as soon as run_python returns
    time.sleep(0.3)
    assert list(tmp_path.iterdir()) == []  # it never wrote into the host directory, not even after the run


@pytest.mark.processes
def test_killing_the_parent_or_everything_harms_only_the_sandbox():
    result = run("import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\nprint('still here')")
    assert result.stdout == "still here\n"  # the namespace's init is not ours to kill, or ignores it
    result = run("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\nprint('alive')")
    assert result.stdout == "alive\n"  # every process it may signal is in the sandbox


@pytest.mark.processes
def test_fatal_signals_end_only_the_program():
    result = run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.returncode == 128 + 11 and not result.timed_out


# --- memory, files, output -------------------------------------------------------------------------------

@pytest.mark.processes
def test_memory_bomb_hits_the_address_space_limit():
    result = run("""
        blocks = []
        try:
            while True:
                blocks.append(bytearray(16 << 20))
        except MemoryError:
            print(len(blocks) * 16)
    """, limits=SandboxLimits(timeout=5, memory=512 << 20))
    assert int(result.stdout) < 512  # MiB
    result = run("x = bytearray(8 << 30)", limits=SandboxLimits(timeout=5, memory=512 << 20))
    assert "MemoryError" in result.stderr


@pytest.mark.processes
def test_huge_file_is_cut_at_the_file_size_limit():
    result = run("""
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        written = 0
        with open("big", "wb") as f:
            try:
                while True:
                    written += f.write(b"x" * (1 << 20))
                    f.flush()
            except OSError as e:
                print(written >> 20, e.errno)
    """, limits=SandboxLimits(timeout=5, file_size=8 << 20))
    assert result.stdout.split() == ["8", "27"]  # 8 MiB, then EFBIG
    result = run("open('big', 'wb').write(b'x' * (20 << 20))", limits=SandboxLimits(timeout=5, file_size=8 << 20))
    assert "File too large" in result.stderr  # Python ignores SIGXFSZ: the write fails


@pytest.mark.processes
def test_disk_is_capped():
    result = run("""
        written = 0
        try:
            for i in range(100):
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * (4 << 20))
                written += 4
        except OSError as e:
            print(written, e.errno)
    """, limits=SandboxLimits(timeout=5, disk=32 << 20))
    written, errno = map(int, result.stdout.split())
    assert written <= 32 and errno == 28  # ENOSPC


@pytest.mark.processes
def test_huge_stdout_is_truncated_and_stopped():
    result = run("while True:\n    print('x' * 1000)", limits=SandboxLimits(timeout=20, output=1 << 20), bound=5)
    assert result.truncated and not result.timed_out and len(result.stdout) == 1 << 20


@pytest.mark.processes
def test_too_many_open_files():
    result = run("""
        files = []
        try:
            while True:
                files.append(open("/dev/null"))
        except OSError as e:
            print(len(files), e.errno)
    """, limits=SandboxLimits(timeout=5, open_files=64))
    opened, errno = map(int, result.stdout.split())
    assert opened < 64 and errno == 24  # EMFILE


@pytest.mark.processes
def test_non_utf8_output():
    result = run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\x80 done')")
    assert result.stdout == "ok \ufffd\ufffd\ufffd done"


@pytest.mark.processes
def test_ctypes_crash_and_recursion_bomb_end_only_the_program():
    result = run("import ctypes\nctypes.string_at(0)")
    assert result.returncode == 128 + 11  # SIGSEGV
    result = run("def f(n):\n    return f(n + 1)\nf(0)")
    assert "RecursionError" in result.stderr
    result = run("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return eval('f(n + 1)')\nf(0)", limits=SandboxLimits(timeout=5))
    assert result.returncode == 128 + 11 and not result.timed_out  # the C stack overflows: SIGSEGV


# --- the host's files and network ------------------------------------------------------------------------

@pytest.mark.processes
def test_host_files_are_invisible(method, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the password")
    project = Path(rlvr.__file__).resolve().parents[2]
    paths = [secret, "/etc/shadow", "/etc/passwd", project / "pyproject.toml", Path(rlvr.__file__), Path(sys.prefix) / "pyvenv.cfg",
             Path.home() / ".bash_history", "/home", "/work", "/var", "/sys/class"]
    result = run(f"""
        import os
        for path in {[str(p) for p in paths]!r}:
            print(os.path.exists(path))
        print(sorted(os.listdir("/")))
    """)
    lines = result.stdout.splitlines()
    assert lines[:-1] == ["False"] * len(paths), result
    assert set(eval(lines[-1])) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root", "sandbox", "sbin", "tmp", "usr", "opt"}


@pytest.mark.processes
def test_cannot_write_or_delete_outside_tmp(method):
    python_dir = os.path.dirname(sandbox._interpreter())
    before = sorted(os.listdir(python_dir))
    targets = ["/usr/evil", "/etc/evil", "/evil", "/sandbox/main.py", f"{python_dir}/evil", "/proc/sys/kernel/hostname"]
    result = run(f"""
        import os, shutil
        for path in {targets!r}:
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError:
                print("refused")
        for action in (lambda: os.chmod("/usr/bin", 0o777), lambda: os.remove({sandbox._interpreter()!r}),
                       lambda: os.rename("/usr/lib", "/usr/gone"), lambda: shutil.rmtree("/usr")):
            try:
                action()
                print("done")
            except OSError:
                print("refused")
        open("/tmp/mine", "w").write("fine")
        print(open("/tmp/mine").read())
    """)
    assert result.stdout.split() == ["refused"] * (len(targets) + 4) + ["fine"], result
    assert sorted(os.listdir(python_dir)) == before
    assert run("print('the sandbox still works')").stdout == "the sandbox still works\n"


def _host_addresses() -> list[str]:
    addresses = ["127.0.0.1"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent; this picks the outgoing interface
            addresses.append(s.getsockname()[0])
    except OSError:
        pass
    return addresses


@pytest.mark.processes
def test_host_network_is_unreachable(method):
    connections = []
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    server.settimeout(0.1)
    port = server.getsockname()[1]
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connections.append(server.accept())
            except OSError:
                pass

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    try:
        result = run(f"""
            import socket
            for host in {_host_addresses()!r}:
                try:
                    socket.create_connection((host, {port}), timeout=1)
                    print("connected")
                except OSError:
                    print("unreachable")
            try:
                socket.getaddrinfo("example.com", 80)
                print("resolved")
            except OSError:
                print("no dns")
        """, limits=SandboxLimits(timeout=5))
    finally:
        stop.set()
        acceptor.join()
        server.close()
    assert set(result.stdout.splitlines()) == {"unreachable", "no dns"}, result
    assert connections == []


@pytest.mark.processes
def test_listening_inside_is_invisible_to_the_host():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free now; the program listens on it inside its namespace
    code = f"""
        import socket, time
        s = socket.socket()
        s.bind(("127.0.0.1", {port}))
        s.listen()
        print("listening", flush=True)
        time.sleep(1)
    """
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run, code, SandboxLimits(timeout=5))
        time.sleep(0.5)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1)
        assert future.result().stdout == "listening\n"


# --- fail closed ------------------------------------------------------------------------------------------

def test_refuses_to_run_without_isolation(monkeypatch):
    monkeypatch.setitem(sandbox._detected, "method", None)
    monkeypatch.setitem(sandbox._detected, "why_not", ["bwrap: not installed", "unshare: Operation not permitted"])
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*allow_unisolated=True"):
        run_python("print(1)")
    with pytest.raises(SandboxUnavailable):
        run_many(["print(1)"])


@pytest.mark.processes
def test_unisolated_mode_is_an_explicit_opt_in_that_warns_once(monkeypatch, caplog):
    monkeypatch.setitem(sandbox._detected, "method", None)
    monkeypatch.setitem(sandbox._detected, "warned", False)
    with caplog.at_level(logging.WARNING, logger="rlvr.sandbox"):
        first = run_python("import os; print(os.getcwd())", allow_unisolated=True)
        second = run_python("while True:\n    pass", limits=SandboxLimits(timeout=0.5), allow_unisolated=True)
    assert "rlvr-sandbox-" in first.stdout and second.timed_out
    assert len([r for r in caplog.records if "WITHOUT a sandbox" in r.message]) == 1


@pytest.mark.processes
def test_detection_tries_the_next_method(monkeypatch):
    real_which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    method, why_not = sandbox._detect()
    assert why_not[0] == "bwrap: not installed"
    assert method in ("unshare", None)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    assert sandbox._detect() == (None, ["bwrap: not installed", "unshare: not installed"])


@pytest.mark.processes
def test_the_kernel_keyrings_are_out_of_reach(method):
    """A new uid keeps the session keyring: without the filter the program read (and could revoke)
    a key the trainer holds.  Now every keyring call is refused."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(248, b"user", b"rlvr-test-secret", b"s3cret", 6, -3)  # add_key to our session keyring
    if key < 0:
        pytest.skip("no session keyring here")
    try:
        result = run("""
            import ctypes, errno
            libc = ctypes.CDLL(None, use_errno=True)
            found = libc.syscall(250, 10, -3, b"user", b"rlvr-test-secret", 0)  # KEYCTL_SEARCH the session keyring
            print("found" if found >= 0 else errno.errorcode[ctypes.get_errno()])
            print("added" if libc.syscall(248, b"user", b"mine", b"x", 1, -3) >= 0 else errno.errorcode[ctypes.get_errno()])
        """)
        assert result.stdout.split() == ["EPERM", "EPERM"], result
    finally:
        libc.syscall(250, 3, key, 0, 0, 0)  # KEYCTL_REVOKE our test key


@pytest.mark.processes
@pytest.mark.parametrize("route", ["memfd", "shm", "msg"])
def test_memory_outside_the_address_space_limit_is_refused(method, route):
    """1 GB through memfd_create or SysV shared memory would belong to no process, so RLIMIT_AS
    would not see it; each route is refused."""
    code = {
        "memfd": "import os, mmap\nfd = os.memfd_create('x')\nos.ftruncate(fd, 1 << 30)\nm = mmap.mmap(fd, 1 << 30)\nm[::4096] = b'x' * (1 << 18)\nprint('held')",
        "shm": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nid = libc.shmget(0, 1 << 30, 0o1600)\nprint('held' if id >= 0 else ctypes.get_errno())",
        "msg": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nids = [libc.msgget(0, 0o1600) for _ in range(100)]\nprint('held' if max(ids) >= 0 else ctypes.get_errno())",
    }[route]
    result = run(code, limits=SandboxLimits(timeout=10, memory=256 << 20))
    assert "held" not in result.stdout, result
    assert "Operation not permitted" in result.stderr or result.stdout.strip() == "1", result  # EPERM


@pytest.mark.processes
def test_no_zombie_is_left_when_the_trainer_is_a_subreaper():
    """As PID 1 of a container (or a subreaper), orphans are ours to reap: sandboxes stopped at their
    time or output limit must leave no zombie init behind."""
    import subprocess

    code = textwrap.dedent("""
        import ctypes, os, sys
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        from rlvr.sandbox import SandboxLimits, run_python
        for program in ["while True: pass", "print('x' * 10_000_000)", "import os\\nos.setsid()\\nwhile True: pass"] * 2:
            run_python(program, limits=SandboxLimits(timeout=1, output=1 << 16))
        zombies = []
        for task in os.listdir("/proc/self/task"):
            for child in open(f"/proc/self/task/{task}/children").read().split():
                state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
                zombies += [child] if state == "Z" else []
        print("zombies", len(zombies))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(rlvr.__file__).parents[1])})
    assert out.stdout.strip() == "zombies 0", out.stdout + out.stderr
