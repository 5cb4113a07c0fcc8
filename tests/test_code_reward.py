"""The code_tests reward: right scores for honest programs, and no way to forge a pass."""

from __future__ import annotations

import json
import secrets
import textwrap
import time

import pytest
from test_sandbox import leaves_nothing  # noqa: F401  (autouse: no process, socket or directory left behind)

from rlvr.rewards import code
from rlvr.rewards.code import build_program, code_tests, extract_program, prepare_tests
from rlvr.sandbox import SandboxLimits, SandboxUnavailable, isolation_method, run_python

pytestmark = pytest.mark.skipif(isolation_method() is None, reason="no sandbox works here: apt-get install bubblewrap")

PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
CHECK = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(-1, 1) == 0
    assert candidate(10, 5) == 15
    assert candidate(0, 0) == 0
"""
TEST_CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}, {"input": "0 7\n", "output": "7\n"}]


def score(programs: list[str], bound: float = 10.0, **columns):
    """code_tests on HumanEval-style `add` rows (unless columns say otherwise), within `bound` seconds."""
    n = len(programs)
    columns.setdefault("timeout", 2.0)
    if "test_cases" not in columns and "test" not in columns:
        columns.update(test=[CHECK] * n, entry_point=["add"] * n, prompt_code=[PROMPT] * n)
    start = time.monotonic()
    scores = code_tests(programs, **columns)
    assert time.monotonic() - start < bound
    return scores


# --- honest programs ----------------------------------------------------------------------------------

@pytest.mark.processes
def test_correct_programs_score_one_in_every_shape():
    scores = score([
        "```python\ndef add(a, b):\n    return a + b\n```",  # the whole function
        "    return a + b\n",  # the body, after the prompt
        "Here it is:\n```python\nimport operator\n\ndef add(a, b):\n    return operator.add(a, b)\n```\nDone.",
        "```python\ndef add(a, b):\n    return a - b\n```\nOops, fixed:\n```python\ndef add(a, b):\n    return a + b\n```",
    ])
    assert scores == [1.0, 1.0, 1.0, 1.0] and (scores.timeouts, scores.errors) == (0, 0)


@pytest.mark.processes
def test_chat_completions_are_read_too():
    scores = code_tests([[{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]],
                        test=[CHECK], entry_point=["add"], prompt_code=[PROMPT])
    assert scores == [1.0]


@pytest.mark.processes
def test_partially_correct_programs_get_the_fraction_passed():
    scores = score(["    return a + b if a >= 0 else 99\n", "    return 0\n", "    return a * b + (a + b) * (a * b == 0)\n"])
    # a >= 0: tests 1, 3, 4 pass; 0 passes tests 2 and 4 (sums 0); a*b is right only where both are 0 (test 4)
    assert scores == [0.75, 0.5, 0.25]


@pytest.mark.processes
def test_all_or_nothing_mode():
    scores = score(["    return a + b\n", "    return a + b if a >= 0 else 99\n"], mode="all")
    assert scores == [1.0, 0.0]
    with pytest.raises(ValueError, match="mode must be one of"):
        code_tests(["x"], test=[CHECK], mode="most")


@pytest.mark.processes
def test_plain_asserts_with_setup_statements_in_order():
    test = "import math\nassert double(2) == 4\nx = double(5)\nassert x == 10\nassert True\nassert math.isclose(double(0.1), 0.2)\nassert double(-1) == -2"
    scores = code_tests(["def double(x):\n    return 2 * x", "def double(x):\n    return x + x if x > 1 else 0"], test=[test] * 2)
    assert scores == [1.0, 0.5]  # 4 tests (`assert True` is none); the second program fails 0.1 and -1


@pytest.mark.processes
def test_a_failing_setup_statement_fails_the_tests_after_it():
    test = "assert f(1) == 1\ny = f('boom')\nassert f(2) == 2"
    assert code_tests(["def f(x):\n    return x + 0"], test=[test]) == [0.5]


@pytest.mark.processes
def test_expected_exceptions_are_builtin_exceptions():
    test = "try:\n    f(-1)\n    raised = False\nexcept ValueError:\n    raised = True\nassert raised\nassert f(4) == 2"
    good = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5"
    assert code_tests([good, "def f(x):\n    return abs(x) ** 0.5"], test=[test] * 2) == [1.0, 0.5]


@pytest.mark.processes
def test_stdin_stdout_cases():
    programs = ["a, b = map(int, input().split())\nprint(a + b)", "a, b = map(int, input().split())\nprint(a + b if a else a * b)",
                "import sys\nprint(sum(map(int, sys.stdin.read().split())), end='  \\n\\n')"]
    scores = score(programs, test_cases=[TEST_CASES] * 3)
    assert scores == [1.0, pytest.approx(2 / 3), 1.0]  # trailing whitespace is ignored; 0 * 7 != 7


@pytest.mark.processes
def test_assert_tests_and_cases_together_and_rows_without_tests():
    program = "import sys\ndef add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    scores = code_tests([program, program], test=[CHECK, None], entry_point=["add", None], test_cases=[TEST_CASES, None])
    assert scores == [1.0, None]


@pytest.mark.processes
def test_a_hang_in_one_test_keeps_the_earlier_passes_and_counts_a_timeout():
    scores = score(["    while a == 10:\n        pass\n    return a + b\n"], timeout=1.0)
    assert scores == [0.5] and scores.timeouts == 1  # tests 1 and 2 passed before the hang in test 3
    scores = score(["import sys\nn = int(input())\nwhile n == 5:\n    pass\nprint(n + 0)"],
                   test_cases=[[{"input": "1", "output": "1"}, {"input": "5", "output": "5"}, {"input": "7", "output": "7"}]], timeout=1.5)
    assert scores == [pytest.approx(2 / 3)] and scores.timeouts == 1  # the cases after the hang still run


@pytest.mark.processes
def test_helpers_from_the_prompt_are_the_datasets_not_the_programs():
    prompt = "def double(x):\n    return 2 * x\n\n\ndef half(y):\n    \"\"\"x with double(x) == y\"\"\"\n"
    test = "def check(candidate):\n    assert double(candidate(8)) == 8\n    assert double(candidate(3)) == 3"
    programs = ["    return y / 2\n", "def double(x):\n    return 8\n\ndef half(y):\n    return 0\n"]
    scores = code_tests(programs, test=[test] * 2, entry_point=["half"] * 2, prompt_code=[prompt] * 2)
    assert scores == [1.0, 0.0]


# --- extraction and preparation ----------------------------------------------------------------------------

def test_extract_program():
    assert extract_program("```python\na = 1\n```\ntext\n```\nb = 2\n```\n```bash\nrm -rf /\n```") == "b = 2\n"
    assert extract_program("Sure:\n```py\nx = 1\n") == "x = 1\n"  # an unclosed last fence
    assert extract_program("x = 1") == "x = 1"
    assert build_program("def f():\n    return 1", "f", "import math\ndef f():\n    '''doc'''\n").startswith("import math")
    assert build_program("    return 1\n", "f", "def f():\n    '''doc'''\n") == "def f():\n    '''doc'''\n    return 1\n"


def test_prepare_tests():
    source, num_tests, names = prepare_tests(CHECK, "add", PROMPT)
    assert num_tests == 4 and names == ("add",) and source.rstrip().endswith("check(add)")
    assert prepare_tests("x = f(1)\nprint(x)", None, None)[1:] == (1, ("f",))  # no assert: the whole is one test
    assert prepare_tests("assert True\nimport os", None, None) == ("", 0, ())  # nothing tested
    with pytest.raises(ValueError, match="does not parse"):
        prepare_tests("assert (", None, None)
    with pytest.raises(ValueError, match="must be a list of"):
        code_tests(["print(1)"], test_cases=[[{"input": 1}]])


# --- forgery ---------------------------------------------------------------------------------------------

@pytest.mark.processes
def test_fake_verdicts_on_stdout_score_zero():
    fake = "import json\nfor n in range(3):\n    print('PASS')\n    print(json.dumps({'nonce': 'x' * 32, 'passed': [True] * 4, 'timed_out': False}))\n"
    scores = score([fake + "def add(a, b):\n    print('ALL TESTS PASSED')\n    return None\n", fake])
    assert scores == [0.0, 0.0]
    assert score([fake], test_cases=[TEST_CASES]) == [0.0]


@pytest.mark.processes
@pytest.mark.parametrize("exit_code", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit(0)",
                                       "raise KeyboardInterrupt", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"])
def test_exiting_before_the_tests_scores_zero(exit_code):
    assert score([exit_code + "\ndef add(a, b):\n    return a + b\n"]) == [0.0]
    assert score([exit_code], test_cases=[TEST_CASES]) == [0.0]


@pytest.mark.processes
def test_exiting_inside_the_function_fails_the_tests():
    scores = score(["    if a < 0:\n        raise SystemExit(0)\n    if a == 10:\n        raise KeyboardInterrupt\n    return a + b\n",
                    "    if a == 10:\n        import os\n        os._exit(0)\n    return a + b\n"])
    assert scores == [0.5, 0.5]  # tests 1 and 4 pass; after os._exit the remaining calls fail


GENERATOR_CHECK = """
def check(candidate):
    inputs = [(1, 2), (-1, 1), (10, 5)]
    expected = [3, 0, 15]
    assert all(candidate(*x) == y for x, y in zip(inputs, expected))
    assert all(x == y for x, y in zip(map(lambda args: candidate(*args), inputs), expected))
"""


@pytest.mark.processes
@pytest.mark.parametrize("exception", ["StopIteration", "StopAsyncIteration", "GeneratorExit"])
def test_control_flow_exceptions_cannot_end_a_tests_generator(exception):
    """A StopIteration raised by the program would end the generator inside `all(...)` early, and
    `all` of nothing is True; it reaches the tests as an ordinary error, so both asserts fail."""
    forged = f"def add(a, b):\n    raise {exception}\n"
    honest = "def add(a, b):\n    return a + b\n"
    scores = code_tests([forged, honest], test=[GENERATOR_CHECK] * 2, entry_point=["add"] * 2)
    assert scores == [0.0, 1.0]


@pytest.mark.processes
def test_tests_that_test_nothing_score_none():
    """`assert True` is no test: a check made only of it gives no score, not a syntax error and 0."""
    program = "def add(a, b):\n    return a + b\n"
    trivial = ["def check(candidate):\n    assert True\n", 'def check(candidate):\n    """doc"""\n    assert True\n    pass\n',
               "assert True\n", "import math\nassert True\n"]
    scores = code_tests([program] * 4, test=trivial, entry_point=["add", "add", None, None])
    assert scores == [None, None, None, None] and (scores.timeouts, scores.errors) == (0, 0)
    assert prepare_tests(trivial[0], "add", None)[1] == 0
    # with stdin/stdout cases beside them, the cases are the tests
    both = code_tests(["print(sum(map(int, input().split())))"], test=["assert True"], test_cases=[TEST_CASES])
    assert both == [1.0]


@pytest.mark.processes
def test_always_equal_objects_score_zero():
    scores = score([
        "class A:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\ndef add(a, b):\n    return A()\n",
        "class A(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return A(7)\n",
        "class S(str):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return S('x')\n",
    ])
    assert scores == [0.0, 0.0, 0.0]
    truthy = "class T:\n    def __bool__(self):\n        return True\ndef is_even(n):\n    return T()"
    honest = "def is_even(n):\n    return n % 2 == 0"
    assert code_tests([truthy, honest], test=["assert is_even(2)\nassert not is_even(3)"] * 2) == [0.0, 1.0]


@pytest.mark.processes
def test_patching_builtins_and_the_harness_scores_zero():
    attack = """
        import builtins, sys, gc, json
        class Never(Exception):
            pass
        builtins.AssertionError = Never
        builtins.print = lambda *a, **k: None
        sys.exit = lambda *a: None
        json.dumps = lambda *a, **k: '{"id": 1, "ok": true, "value": 3}'
        main = sys.modules["__main__"]
        for name in ("encode", "decode", "_serve", "_describe"):
            if hasattr(main, name):
                setattr(main, name, lambda *a, **k: 3)
        for obj in gc.get_objects():  # anything that looks like a verdict: make it all True
            if type(obj) is list and obj and all(x is False for x in obj):
                obj[:] = [True] * len(obj)
        frame = sys._getframe()
        while frame:
            for value in list(frame.f_locals.values()):
                if type(value) is list and value and all(x is False for x in value):
                    value[:] = [True] * len(value)
            frame = frame.f_back
        def add(a, b):
            return None
    """
    assert score([textwrap.dedent(attack)]) == [0.0]


@pytest.mark.processes
def test_closing_or_writing_every_descriptor_scores_zero():
    attack = """
        import os, json
        line = json.dumps({"nonce": "0" * 32, "passed": [True] * 4, "timed_out": False}).encode() + b"\\n"
        for fd in range(3, 256):
            try:
                os.write(fd, line)
            except OSError:
                pass
        for fd in range(256):
            try:
                os.close(fd)
            except OSError:
                pass
        def add(a, b):
            return a + b
    """
    attack = textwrap.dedent(attack)
    assert score([attack]) == [0.0]
    assert score([attack.replace("def add", "print(7)\ndef add")], test_cases=[TEST_CASES]) == [0.0]


@pytest.mark.processes
def test_the_judge_cannot_be_reached_through_proc():
    """The program runs as the judge's child with the same uid; the judge's memory and descriptors stay closed."""
    attack = """
        import os
        done = []
        for what in ("fd/0", "fd/1", "fd/2", "mem", "environ"):
            try:
                fd = os.open(f"/proc/{os.getppid()}/{what}", os.O_RDWR if what.startswith("fd") else os.O_RDONLY)
                os.write(fd, b"HACKED " + what.encode() + b"\\n") if what.startswith("fd") else os.read(fd, 100)
                done.append(what)
            except OSError:
                pass
        def add(a, b):
            return len(done)
    """
    job = {"nonce": secrets.token_hex(16), "program": build_program(textwrap.dedent(attack), "add", None), "timeout": 5.0,
           "test": prepare_tests("assert add(0, 0) == 0", None, None)[0], "num_tests": 1, "names": ["add"],
           "prompt_code": None, "cases": None}
    result = run_python(code._JUDGE.read_text(), json.dumps(job), SandboxLimits(timeout=8))
    assert "HACKED" not in result.stdout
    assert json.loads(result.stdout)["passed"] == [True]  # add() saw that nothing could be opened


@pytest.mark.processes
def test_verdicts_forged_through_proc_score_zero():
    attack = """
        import json, os
        line = json.dumps({"nonce": "0" * 32, "passed": [True] * 4, "timed_out": False}).encode() + b"\\n"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            for fd in ("1", "2"):
                try:
                    os.write(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY), line)
                except OSError:
                    pass
        def add(a, b):
            return None
    """
    assert score([textwrap.dedent(attack)]) == [0.0]


@pytest.mark.processes
def test_signalling_the_judge_changes_nothing():
    harass = "import os, signal\nfor s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGALRM, signal.SIGPIPE):\n    os.kill(os.getppid(), s)\n"
    assert score([harass + "def add(a, b):\n    return a + b\n", harass + "def add(a, b):\n    return 0\n"]) == [1.0, 0.5]


@pytest.mark.processes
def test_killing_or_stopping_the_judge_scores_zero():
    scores = score(["import os\nos.kill(os.getppid(), 9)\ndef add(a, b):\n    return a + b\n"])
    assert scores == [0.0] and scores.errors == 1
    scores = score(["import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\ndef add(a, b):\n    return a + b\n"],
                   timeout=0.5, bound=4)
    assert scores == [0.0] and scores.timeouts == 1


@pytest.mark.processes
def test_resource_attacks_score_zero_and_end_in_time():
    attacks = [
        "while True:\n    pass",  # infinite loop
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",  # fork bomb
        "x = bytearray(1 << 40)",  # memory bomb
        "import sys\nsys.setrecursionlimit(10**8)\ndef add(a, b):\n    return eval('add(a, b)')\n",  # recursion bomb
        "import ctypes\ndef add(a, b):\n    return ctypes.string_at(0)\n",  # crash the interpreter
        "import os\nos.setsid()\nif os.fork():\n    os._exit(0)\nwhile True:\n    pass",  # daemonise
        "import shutil, os\nshutil.rmtree('/tmp', ignore_errors=True)\ntry:\n    os.chmod('/tmp', 0)\nexcept OSError:\n    pass\n"
        "def add(a, b):\n    return a + b\n",
    ]
    scores = score(attacks, bound=12, timeout=1.0)
    assert scores[:-1] == [0.0] * 6
    assert scores[-1] == 1.0  # it only damaged its own sandbox
    io_attacks = ["while True:\n    print('3' * 1000)", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe3\\n')",
                  "open('/tmp/big', 'wb').write(b'x' * (1 << 30))\nprint(3)"]
    scores = score(io_attacks, test_cases=[[TEST_CASES[0]]] * 3, bound=12)
    assert scores == [0.0, 0.0, 0.0]


@pytest.mark.processes
def test_reading_for_the_answers_finds_nothing():
    snoop = """
        import os
        found = []
        for root in ("/tmp", "/sandbox", f"/proc/{os.getppid()}", "/proc/1"):
            for name in ("cmdline", "environ", "main.py", "input-1", "output-0", "output-1"):
                try:
                    found.append(open(os.path.join(root, name), "rb").read())
                except OSError:
                    pass
        blob = b" ".join(found)
        print(10 if b'"output": "10"' in blob else 0)
    """
    assert score([textwrap.dedent(snoop)], test_cases=[TEST_CASES[1:2]]) == [0.0]


def test_huge_completions_are_not_run():
    start = time.monotonic()
    assert score(["    return a + b\n" + "#" * (10 << 20)]) == [0.0]  # run, it would pass and score 1
    assert time.monotonic() - start < 10


@pytest.mark.processes
def test_refuses_to_run_without_a_sandbox(monkeypatch):
    from rlvr import sandbox

    monkeypatch.setitem(sandbox._detected, "method", None)
    monkeypatch.setitem(sandbox._detected, "why_not", ["bwrap: not installed"])
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        score(["    return a + b\n"])
    assert score(["    return a + b\n"], allow_unisolated=True) == [1.0]
