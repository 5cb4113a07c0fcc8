"""The judge: runs inside the sandbox, tests a program, prints the verdict (see rewards/code.py).

rlvr/rewards/code.py runs this file with rlvr.sandbox.run_python and a JSON job on stdin:

    {"nonce": "...", "program": "...", "timeout": 10.0,
     "test": "<test source, each test wrapped to call __rlvr_record__(i, ok)>" or null,
     "num_tests": 3, "names": ["add"], "prompt_code": "..." or null,
     "cases": [{"input": "...", "output": "..."}, ...]}

and prints one line: {"nonce": "...", "passed": [true, false, ...], "timed_out": false, "note": "..."}.

The program never runs in this interpreter.  For function tests it runs in a second interpreter,
this file in its --worker role, which the judge calls over two pipes; arguments and results
travel as JSON that decodes only into exact built-in types (None, bool, int, float, complex, str,
bytes, list, tuple, dict, set, frozenset), so no object of the program's (an `__eq__` that is
always true, a lying `__bool__`) ever reaches the assertions, and patching builtins or this
module's code only changes the worker.  For stdin/stdout cases each case runs the program as a
script, its output going to a file that the judge compares.  Before any of that starts the judge
makes itself non-dumpable (so processes of the same uid cannot ptrace it, read its memory or open
its descriptors through /proc), ignores the signals that can be ignored, and reads its whole job
and closes stdin.  The nonce in the verdict line tells rewards/code.py that the judge, not
something else in the sandbox, wrote it.
"""

import builtins
import json
import os
import select
import signal
import subprocess
import sys
import time

_IGNORED = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM",
                                               "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGVTALRM", "SIGPROF", "SIGXFSZ")]
MAX_REPLY = 16 << 20  # bytes of one reply from the worker
MAX_OUTPUT = 16 << 20  # bytes of a case's stdout that are compared
_CONTAINERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return _serve(int(sys.argv[2]), int(sys.argv[3]))
    if sys.argv[1:2] == ["--script"]:
        return _run_script(sys.argv[2])
    _harden()
    job = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    deadline = time.monotonic() + job["timeout"]
    passed, timed_out, note = [], False, ""
    if job.get("test"):
        passed, timed_out, note = _function_tests(job, deadline)
    if job.get("cases"):
        more, late = _io_tests(job["program"], job["cases"], deadline)
        passed, timed_out = passed + more, timed_out or late
    print(json.dumps({"nonce": job["nonce"], "passed": passed, "timed_out": timed_out, "note": note}), flush=True)


def _harden() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
        raise SystemExit("judge: cannot make itself non-dumpable; refusing to judge")
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)


def _restore_signals() -> None:
    """In a child before exec: the program gets the usual signal dispositions back."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_DFL)


# --- function tests: the program in a worker process -------------------------------------------

def _function_tests(job: dict, deadline: float) -> tuple[list, bool, str]:
    passed = [False] * job["num_tests"]
    worker = _Worker(deadline)
    namespace = {"__name__": "__test__", "__builtins__": builtins}
    try:
        names = worker.load(job["program"], job["names"])
        if job.get("prompt_code"):  # the dataset's code (e.g. helpers the tests use), not the model's
            exec(compile(job["prompt_code"], "<prompt>", "exec"), namespace)
        for name in job["names"]:
            namespace[name] = _resolve(worker, name, names.get(name))
        namespace["__rlvr_record__"] = passed.__setitem__
        exec(compile(job["test"], "<test>", "exec"), namespace)
        note = ""
    except BaseException as e:  # the program did not load, or a setup step failed: later tests stay failed
        note = f"{type(e).__name__}: {e}"[:500]
    worker.close()
    return passed, worker.timed_out, note


class _Failed(Exception):
    """The worker died, timed out or broke the protocol: this and every later call fail."""


class _Worker:
    def __init__(self, deadline: float):
        self.deadline, self.timed_out, self.broken, self.seq = deadline, False, None, 0
        to_worker, from_worker = os.pipe(), os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", __file__, "--worker", str(to_worker[0]), str(from_worker[1])],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(to_worker[0], from_worker[1]), start_new_session=True, preexec_fn=_restore_signals)
        os.close(to_worker[0])
        os.close(from_worker[1])
        self.out, self.inp, self.buf = to_worker[1], from_worker[0], bytearray()
        os.set_blocking(self.out, False)

    def load(self, program: str, names: list) -> dict:
        reply = self._ask({"op": "load", "program": program, "names": names})
        if reply.get("ok") is not True:
            raise _Failed(f"the program failed to load: {_error_text(reply)}")
        return reply.get("names") if type(reply.get("names")) is dict else {}

    def proxy(self, name: str):
        def call(*args, **kwargs):
            try:
                message = {"op": "call", "name": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
            except (TypeError, ValueError, RecursionError) as e:
                raise TypeError(f"a test argument cannot be passed to the program: {e}") from None
            reply = self._ask(message)
            if reply.get("ok") is True:
                return decode(reply.get("value"))
            raise _exception(reply)
        return call

    def _ask(self, message: dict) -> dict:
        if self.broken:
            raise _Failed(self.broken)
        self.seq += 1
        message["id"] = self.seq
        try:
            self._send(json.dumps(message).encode() + b"\n")
            while True:  # skip anything that is not the answer to this request
                try:
                    reply = json.loads(self._line())
                except ValueError:
                    continue
                if type(reply) is dict and reply.get("id") == self.seq:
                    return reply
        except _Failed as e:
            self.broken = str(e)
            self.close()
            raise

    def _wait(self, fd: int, event: int) -> None:
        left = self.deadline - time.monotonic()
        poller = select.poll()
        poller.register(fd, event)
        if left <= 0 or not poller.poll(left * 1000):
            self.timed_out = True
            raise _Failed("timed out")

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            self._wait(self.out, select.POLLOUT)
            try:
                view = view[os.write(self.out, view):]
            except BlockingIOError:
                continue
            except OSError:
                raise _Failed(self._death()) from None

    def _line(self) -> bytes:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_REPLY:
                raise _Failed("reply too large")
            self._wait(self.inp, select.POLLIN)
            chunk = os.read(self.inp, 1 << 16)
            if not chunk:
                raise _Failed(self._death())
            self.buf += chunk
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        return line

    def _death(self) -> str:
        try:
            status = self.proc.wait(timeout=max(0.0, min(1.0, self.deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            return "the program closed its channel"
        return f"the program's process ended (status {status})"

    def close(self) -> None:
        _kill(self.proc)
        for fd in (self.out, self.inp):
            try:
                os.close(fd)
            except OSError:
                pass
        self.out = self.inp = -1


def _resolve(worker: "_Worker", name: str, kind):
    """What a name the tests take from the program is, in the judge: a proxy to call the program's
    function, a copy of its plain data, the judge's own import of a module of that very name (as
    when a test uses `math` that only the program imported), or a function raising NameError."""
    if kind == "function":
        return worker.proxy(name)
    if type(kind) is list and len(kind) == 2 and kind[0] == "value":
        return decode(kind[1])
    if kind == ["module", name]:
        import importlib

        try:
            return importlib.import_module(kind[1])
        except ImportError:
            pass
    return _missing(name)


def _missing(name: str):
    def call(*args, **kwargs):
        raise NameError(f"the program does not define {name!r}")
    return call


# Exceptions that steer control flow rather than report an error: raised inside a test's
# generator or iterator (`all(f(x) == y for ...)`, `map(candidate, ...)`), StopIteration ends the
# iteration early and the test sees nothing false.  The program's ones arrive as RuntimeError.
_CONTROL_FLOW = {"StopIteration", "StopAsyncIteration", "GeneratorExit"}


def _exception(reply: dict) -> Exception:
    """The program's exception as a built-in exception of the same type where there is one, except
    the control-flow ones, which become a RuntimeError naming them."""
    error = reply.get("error")
    kind, text = (error if type(error) is list and len(error) == 2 else ["Exception", "?"])
    cls = getattr(builtins, str(kind), None)
    if isinstance(cls, type) and issubclass(cls, Exception) and str(kind) not in _CONTROL_FLOW:
        try:
            return cls(str(text))
        except Exception:
            pass
    return RuntimeError(f"{kind}: {text}")


def _error_text(reply: dict) -> str:
    error = reply.get("error")
    return ": ".join(map(str, error)) if type(error) is list else str(error)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


# --- stdin/stdout cases ----------------------------------------------------------------------------

def _io_tests(program: str, cases: list, deadline: float) -> tuple[list, bool]:
    path = os.path.abspath("solution.py")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(program)
    passed, timed_out = [], False
    for i, case in enumerate(cases):
        budget = (deadline - time.monotonic()) / (len(cases) - i)  # time left, shared by the cases left
        if budget <= 0:
            passed.append(False)
            timed_out = True
            continue
        try:
            output, late = _run_case(path, case["input"], budget, i)
        except OSError:  # e.g. the program filled the disk
            output, late = None, False
        timed_out = timed_out or late
        passed.append(output is not None and not late and _normalize(output) == _normalize(case["output"]))
    return passed, timed_out


def _run_case(path: str, text: str, budget: float, i: int) -> tuple[str, bool]:
    with open(f"input-{i}", "wb") as f:
        f.write(text.encode("utf-8", "surrogatepass"))
    with open(f"input-{i}", "rb") as stdin, open(f"output-{i}", "wb") as stdout:
        proc = subprocess.Popen([sys.executable, "-I", "-S", __file__, "--script", path], stdin=stdin, stdout=stdout, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_restore_signals)
    try:
        proc.wait(timeout=budget)
        late = False
    except subprocess.TimeoutExpired:
        late = True
    _kill(proc)
    with open(f"output-{i}", "rb") as f:
        return f.read(MAX_OUTPUT).decode("utf-8", "replace"), late


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


# --- the program's processes: a worker that answers calls, or a script --------------------------------

def _add_site_packages() -> None:
    """Started with -S (fast, no .pth files run): the installation's packages are importable all the same."""
    import site

    sys.path += [p for p in site.getsitepackages() if p not in sys.path]


def _run_script(path: str) -> None:
    import types

    _add_site_packages()
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = path, builtins
    sys.modules["__main__"], sys.argv = module, [path]
    exec(code, module.__dict__)


def _serve(requests_fd: int, replies_fd: int) -> None:
    _add_site_packages()
    requests, replies = os.fdopen(requests_fd, "rb"), os.fdopen(replies_fd, "wb")

    def reply(message: dict) -> None:
        replies.write(json.dumps(message).encode() + b"\n")
        replies.flush()

    load = json.loads(requests.readline())
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(compile(load["program"], "solution.py", "exec"), namespace)
    except BaseException as e:
        return reply({"id": load["id"], "ok": False, "error": [type(e).__name__, str(e)[:300]]})
    reply({"id": load["id"], "ok": True, "names": {name: _describe(namespace[name]) for name in load["names"] if name in namespace}})
    for line in requests:
        request = json.loads(line)
        try:
            value = namespace[request["name"]](*decode(request["args"]), **decode(request["kwargs"]))
            message = {"id": request["id"], "ok": True, "value": encode(value)}
        except BaseException as e:
            message = {"id": request["id"], "ok": False, "error": [type(e).__name__, str(e)[:300]]}
        reply(message)


def _describe(value):
    if isinstance(value, type(builtins)):
        return ["module", value.__name__]
    if callable(value):
        return "function"
    try:
        return ["value", encode(value)]
    except (TypeError, ValueError, RecursionError):
        return None


# --- plain data <-> JSON: every JSON array is a tagged value ---------------------------------------

def encode(value):
    """Plain data -> JSON-able.  Subclasses of the built-in types are converted to the base type."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        value = int(value)
        return value if abs(value) < 1 << 53 else ["int", format(value, "x")]
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, complex):
        value = complex(value)
        return ["complex", value.real, value.imag]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    if isinstance(value, dict):
        return ["dict", [[encode(k), encode(v)] for k, v in value.items()]]
    for kind in (list, tuple, set, frozenset):
        if isinstance(value, kind):
            return [kind.__name__, [encode(v) for v in value]]
    raise TypeError(f"a {type(value).__name__} cannot travel between the program and its tests (plain data only)")


def decode(data):
    """JSON -> plain data of exact built-in types; anything else is rejected."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list and len(data) in (2, 3) and type(data[0]) is str:
        tag, body = data[0], data[1]
        if tag in _CONTAINERS and type(body) is list and len(data) == 2:
            return _CONTAINERS[tag](decode(v) for v in body)
        if tag == "dict" and type(body) is list and len(data) == 2:
            if all(type(pair) is list and len(pair) == 2 for pair in body):
                return {decode(k): decode(v) for k, v in body}
        if tag == "int" and type(body) is str and len(data) == 2:
            return int(body, 16)
        if tag == "bytes" and type(body) is str and len(data) == 2:
            return bytes.fromhex(body)
        if tag == "complex" and len(data) == 3 and type(body) in (int, float) and type(data[2]) in (int, float):
            return complex(body, data[2])
    raise ValueError("malformed value from the program")


if __name__ == "__main__":
    main()
