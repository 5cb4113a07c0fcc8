"""The code reward: run the program in a completion against its tests, in the sandbox.

    code_tests(completions, test=[...], entry_point=[...], prompt_code=[...])   # assert-style tests
    code_tests(completions, test_cases=[[{"input": "1 2", "output": "3"}], ...])  # stdin/stdout tests

The program is the last ```python (or plain ```) block of the completion, else the whole text.
With `prompt_code` (HumanEval's prompt: imports, helpers and the signature with its docstring)
the program is the prompt followed by the completion, so a completion may be the function's body
alone; a completion that defines the entry point itself gets the prompt before it too, two lines
apart, for its imports and helpers, and its definition replaces the prompt's stub.

Tests, from the dataset columns (lists aligned with the completions):
  test         assertions: HumanEval's `def check(candidate): ...` with `entry_point`, or plain
               top-level `assert f(1) == 2` lines.  Each top-level statement of the check body (or
               of the module) that contains an assert is one test; the other statements are setup
               and keep their order; `assert True` is no test, and a row whose tests are only
               that scores None (no test).  A setup statement that fails ends the run: the tests
               after it fail.
  test_cases   [{"input": str, "output": str}, ...]: the program runs as a script once per case;
               stdout, stripped, with trailing whitespace on each line ignored, must equal output.
A row with neither scores None.  The assert tests share one process running the program: after a
crash or a hang the tests left fail.  Each stdin/stdout case gets an equal share of the time left.

Knobs (reward_args.code_tests): mode "fraction" of the tests passed (default) or "all" (1 if
every test passes, else 0); timeout, seconds for all the tests of one program (10);
max_workers, programs run at once (CPU count); allow_unisolated (False; see rlvr/sandbox.py).
rewards/code_tests/timeouts counts programs stopped at the time limit, rewards/code_tests/errors
programs that left no verdict (the sandbox failed, or the program killed the judge: scored 0).

Threat model.  The completion is hostile: it may try to escape, to damage the host, or to be
scored as passing without passing.  Containment is rlvr/sandbox.py (namespaces, a read-only
minimal root, no network, an unprivileged uid, rlimits, the whole process tree killed at the
end).  The verdict is computed by a judge process (rewards/_code_judge.py) in which the model's
code never runs: the program runs in a separate worker process that the judge calls over pipes,
with arguments and results carried as JSON that decodes only into exact built-in types.  Hence
printing "PASS" lines, sys.exit(0) / os._exit(0) before the tests, raising SystemExit or
KeyboardInterrupt, monkey-patching builtins, print, sys.exit, AssertionError or the harness,
returning an object whose __eq__ is always True, crashing the interpreter with ctypes, and writing
to or closing file descriptors all act on the worker only, and can only make tests fail.  An
exception that steers control flow (StopIteration and its kin, which would end a test's generator
early and leave `all(...)` nothing false to see) reaches the tests as a RuntimeError.  The judge
is non-dumpable (no ptrace, no /proc/<pid>/mem or /fd by the same uid), ignores catchable
signals, and signs its one verdict line with a random nonce that exists only in this process and
in the judge, sent before any of the program's processes exist; a missing, duplicated or
malformed verdict scores 0.  (Under rootless bubblewrap the sandbox's init runs as the program's
uid and holds the judge's stdout, so a program can write into it through /proc/1/fd/1: without
the nonce that can only spoil its own verdict.)
Known limits: a program can kill or stop the judge (same uid): that scores 0 and counts as an
error or a timeout, never as a pass.  Values crossing to the tests must be plain data: a function
that returns its own class, a generator or a numpy scalar fails, and a test cannot see changes the
program makes to its arguments or inspect the function object.  Test code and `prompt_code` come
from the dataset and are trusted: they run in the judge (still inside the sandbox).  A program
that recognises the tests' inputs can hard-code their answers; only hidden tests help there.
Anything that breaks the kernel breaks the sandbox.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import logging
import re
import secrets
from pathlib import Path

from rlvr.sandbox import SandboxLimits, run_many
from rlvr.types import ScoreList, completion_text

log = logging.getLogger(__name__)
MODES = ("fraction", "all")
MAX_COMPLETION_CHARS = 100_000  # longer completions score 0 without running
_JUDGE = Path(__file__).with_name("_code_judge.py")
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)
_RECORD = "__rlvr_record__"


def code_tests(completions, test=None, test_cases=None, entry_point=None, prompt_code=None, mode: str = "fraction",
               timeout: float = 10.0, max_workers: int | None = None, allow_unisolated: bool = False,
               **kwargs) -> ScoreList:
    """Fraction of its tests (or all-or-nothing, mode="all") that each completion's program passes."""
    if mode not in MODES:
        raise ValueError(f"code_tests: mode must be one of {MODES}, got {mode!r}")
    n = len(completions)

    def column(values):
        return [None] * n if values is None else list(values)

    tests, cases, entry_points, prompts = map(column, (test, test_cases, entry_point, prompt_code))
    scores = ScoreList([None] * n)
    jobs = {}
    for i, completion in enumerate(completions):
        if not tests[i] and not cases[i]:
            continue
        source, num_tests, names = prepare_tests(tests[i], entry_points[i], prompts[i]) if tests[i] else (None, 0, ())
        row_cases = _check_cases(cases[i], i)
        if not num_tests and not row_cases:
            continue  # tests that test nothing (`assert True`): no score
        text = completion_text(completion)
        if len(text) > MAX_COMPLETION_CHARS:
            scores[i] = 0.0
            continue
        program = build_program(extract_program(text), entry_points[i], prompts[i])
        jobs[i] = {"nonce": secrets.token_hex(16), "program": program, "timeout": float(timeout), "test": source,
                   "num_tests": num_tests, "names": list(names), "prompt_code": prompts[i], "cases": row_cases}
    if not jobs:
        return scores
    limits = SandboxLimits(timeout=timeout + 2.0, cpu_time=int(timeout) + 1)
    judge = _JUDGE.read_text()
    results = run_many([judge] * len(jobs), [json.dumps(job) for job in jobs.values()], limits,
                       allow_unisolated=allow_unisolated, max_workers=max_workers)
    for (i, job), result in zip(jobs.items(), results):
        scores[i], timed_out, error = _score(result, job, mode)
        scores.timeouts += timed_out
        scores.errors += error
        if error:
            log.debug("code_tests: no verdict for row %d (exit status %s): %s", i, result.returncode, result.stderr[-500:])
    return scores


def extract_program(text: str) -> str:
    """The last ```python (or untagged) fenced block; an unclosed last fence runs to the end; else all the text."""
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else text


def build_program(code: str, entry_point: str | None, prompt_code: str | None) -> str:
    if not prompt_code:
        return code
    if entry_point and _defines(code, entry_point):
        return prompt_code.rstrip("\n") + "\n\n\n" + code
    return prompt_code + code


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # what hostile nesting raises
        return False
    return any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name for s in tree.body)


@functools.lru_cache(maxsize=1024)
def prepare_tests(test: str, entry_point: str | None = None, prompt_code: str | None = None) -> tuple[str, int, tuple[str, ...]]:
    """(the source the judge runs, the number of tests, the names the tests take from the program).

    Each test statement becomes `try: <statement> except BaseException: record(i, False) else:
    record(i, True)`; with a check function and an entry point, `check(<entry point>)` is appended."""
    try:
        module = ast.parse(test)
    except SyntaxError as e:
        raise ValueError(f"code_tests: the test code does not parse: {e}") from None
    check = next((s for s in module.body if isinstance(s, ast.FunctionDef) and s.name == "check"), None)
    if check is not None and entry_point:
        check.body, num_tests = _wrap_tests(check.body)
        if not num_tests and not _does_something(check.body):
            return "", 0, ()  # `assert True` alone: no test
        check.body = check.body or [ast.Pass()]
        call = ast.parse(f"check({entry_point})").body
        module.body += call if num_tests else [_wrapped(call, 0)]
    else:
        module.body, num_tests = _wrap_tests(module.body)
        if not num_tests and not _does_something(module.body):
            return "", 0, ()
        if not num_tests:
            module.body = [_wrapped(module.body, 0)]
    names = _free_names(ast.parse(test)) - _bound_names(prompt_code)
    if entry_point:
        names.add(entry_point)
    return ast.unparse(ast.fix_missing_locations(module)), max(num_tests, 1), tuple(sorted(names))


def _does_something(body: list[ast.stmt]) -> bool:
    """Whether statements do anything beyond `pass`, docstrings and imports (a test with no assert
    that runs code checks that it runs without an error; one that runs nothing tests nothing)."""
    return any(not isinstance(s, (ast.Pass, ast.Import, ast.ImportFrom)) and
               not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body)


def _wrap_tests(body: list[ast.stmt]) -> tuple[list[ast.stmt], int]:
    out, num_tests = [], 0
    for stmt in body:
        if _asserts(stmt):
            out.append(_wrapped([stmt], num_tests))
            num_tests += 1
        elif not isinstance(stmt, ast.Assert):  # `assert True` is dropped
            out.append(stmt)
    return out, num_tests


def _wrapped(stmts: list[ast.stmt], index: int) -> ast.Try:
    node = ast.parse(f"try:\n    pass\nexcept BaseException:\n    {_RECORD}({index}, False)\nelse:\n    {_RECORD}({index}, True)").body[0]
    node.body = stmts or [ast.Pass()]
    return node


def _asserts(node: ast.AST) -> list[ast.Assert]:
    """The asserts that test something (not `assert True`), outside nested functions and classes."""
    if isinstance(node, ast.Assert):
        return [] if isinstance(node.test, ast.Constant) and node.test.value else [node]
    found = []
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            found += _asserts(child)
    return found


def _bound_names(code: str | None) -> set[str]:
    if not code:
        return set()
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return _names(tree)[1]


def _free_names(tree: ast.AST) -> set[str]:
    loaded, bound = _names(tree)
    return loaded - bound - set(dir(builtins))


def _names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names read, names bound anywhere in the tree), ignoring scopes."""
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded, bound


def _check_cases(cases, row: int) -> list[dict] | None:
    if not cases:
        return None
    if not isinstance(cases, (list, tuple)) or not all(
        isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str) for c in cases
    ):
        raise ValueError(f"code_tests: test_cases of row {row} must be a list of {{'input': str, 'output': str}}")
    return [{"input": c["input"], "output": c["output"]} for c in cases]


def _score(result, job: dict, mode: str) -> tuple[float, bool, bool]:
    """(reward, timed out, error) from the judge's run; only a single verdict line with our nonce counts."""
    verdicts = []
    for line in result.stdout.splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if type(message) is dict and message.get("nonce") == job["nonce"]:
            verdicts.append(message)
    total = job["num_tests"] + len(job["cases"] or [])
    passed = verdicts[0].get("passed") if len(verdicts) == 1 else None
    if type(passed) is not list or len(passed) != total:
        return 0.0, result.timed_out, not result.timed_out
    num_passed = sum(p is True for p in passed)
    reward = num_passed / total if mode == "fraction" else float(num_passed == total)
    return reward, result.timed_out or verdicts[0].get("timed_out") is True, False
