"""Tools a policy may call in a multi-turn rollout, and how its calls are read.

A tool is a plain Python function with type hints and a docstring whose `Args:` section describes
each argument (as TRL's `tools=[...]`); transformers turns it into the JSON schema that chat
templates with tool support (Qwen's, for one) show the model.  Two tools are built in:

    python       runs the code in the sandbox (sandbox.py), with the isolation and limits of
                 `code_tests`, and returns what it printed
    calculator   evaluates an arithmetic expression (+ - * / // % ** and parentheses)

A call is written in the format of the model's chat template family (tool_formats.py): the tag
format that Qwen's and Hermes' templates use, which is also the documented format for models whose
template has no tool calling, Llama 3.1+'s JSON or Mistral's [TOOL_CALLS].  This module reads the
tag format and the JSON object of a call that all three share:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

Nothing a tool does can stop the run: an exception, a wrong argument, a call past `tool_timeout`,
a malformed call or an unknown tool all come back to the model as a one-line error message, and
are counted; an output longer than `max_tool_output_chars` is cut, with a note saying so.

Your own tools run in a worker process (isolation.py), not a thread: a call past `tool_timeout`
is killed with every process it started, even one stuck in C code or holding the GIL, and leaves
nothing running behind.  The built-in python tool runs each program in the sandbox, so a ToolBox
with it refuses to be made where no sandbox works; the calculator bounds itself.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import math
import numbers
import operator
import re
import signal
from dataclasses import dataclass
from typing import Callable

from rlvr.isolation import CallFailed, CallTimedOut, Worker, WorkerDied
from rlvr.plugins import load_named, register, settle
from rlvr.errors import ToolError  # noqa: F401 - raised here, defined in the leaf errors.py

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_EXPRESSION_CHARS = 200  # the calculator refuses longer expressions


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a tool's name and its arguments, or why it could not be read."""

    name: str | None
    arguments: dict
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What a tool (or a TRL environment's tool method) may return instead of its plain value: the output
    the model reads back (text, or a value shown as a plain return value is) and a reward for the call.
    The rewards of a turn's calls, summed, are that turn's reward (Step.reward; docs/multiturn.md)."""

    output: object
    reward: float | None = None

    def __post_init__(self):
        r = self.reward
        if r is not None and (isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r)):
            raise ValueError(f"ToolResult's reward must be a finite number or None; got {r!r}")


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block of `text`, in order; an unclosed block at the end counts (generation
    stops at the closing tag, which the sampler then cuts from the text)."""
    return [call_from_json(body.strip()) for body in _CALL.findall(text)]


def call_from_json(body: str) -> ToolCall:
    """The call a JSON text holds, or a ToolCall whose error says why it holds none."""
    try:
        data = json.loads(body)
    except ValueError:
        return ToolCall(None, {}, f"the tool call is not valid JSON: {body[:80]!r}")
    except RecursionError:
        return ToolCall(None, {}, "the tool call is nested too deeply to read")
    return call_from_data(data)


def call_from_data(data) -> ToolCall:
    """The call a decoded JSON value holds: {"name": ..., "arguments": {...}} (or "parameters", Llama's
    key; the arguments may be a JSON string, OpenAI's shape), or a ToolCall whose error says what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(None, {}, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's shape: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            args = None
    if not isinstance(args, dict):
        return ToolCall(data["name"], {}, f"the arguments of {data['name']!r} must be a JSON object")
    return ToolCall(data["name"], args)


def format_tool_call(name: str, arguments: dict) -> str:
    """A call in the tag format (for prompts that show the model an example)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# --- built-in tools --------------------------------------------------------------------------

def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed (stdout, then stderr).

    Args:
        code: A complete Python program; use print() to show results.
    """
    raise RuntimeError("the python tool runs through Tool.python")  # the schema's source; see Tool.python


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 3) * 4".
    """
    if not isinstance(expression, str) or len(expression) > _EXPRESSION_CHARS:
        raise ValueError(f"the expression must be a string of at most {_EXPRESSION_CHARS} characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("the power is too large")
        if abs(left) > 1e30 or abs(right) > 1e30:
            raise ValueError("a number is too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


BUILTIN_TOOLS = {"python": python, "calculator": calculator}
GIVEN: dict = {}  # tools given to GRPOTrainer as functions, by the name the Config holds


def register_tool(function) -> str:
    if not callable(function):
        raise ToolError(f"tools: {function!r} is not a function")
    return register(function, GIVEN)


# --- tools as the rollout sees them ---------------------------------------------------------

@dataclass
class Tool:
    name: str
    function: Callable
    schema: dict  # the JSON schema a chat template shows the model

    @classmethod
    def of(cls, spec) -> "Tool":
        """A Tool from a function, a built-in name (python, calculator) or "package.module:function"."""
        if isinstance(spec, str) and spec in BUILTIN_TOOLS:
            function = BUILTIN_TOOLS[spec]
        else:
            try:
                function = load_named(spec, "tool", GIVEN, f"a built-in tool ({', '.join(BUILTIN_TOOLS)}) or package.module:function")
            except ValueError as e:
                raise ToolError(str(e)) from None
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(function)
        except Exception as e:  # transformers explains what the docstring lacks
            name = getattr(function, "__name__", repr(function))
            raise ToolError(f"tool {name!r}: {e} (a tool needs type hints and a docstring with an Args: section "
                            "describing each argument)") from None
        return cls(schema["function"]["name"], function, schema)


def require_sandbox(allow_unisolated: bool = False) -> None:
    """Raise ToolError if the python tool could not run a program here: no sandbox works
    (sandbox.py) and allow_unisolated is off."""
    from rlvr import sandbox

    if allow_unisolated or sandbox.isolation_method() is not None:
        return
    why = "; ".join(sandbox.isolation_problems())
    raise ToolError("tools: the python tool runs the model's code in a sandbox, and none works on this machine"
                    f"{f' ({why})' if why else ''}: install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) "
                    "with user namespaces enabled, or run as root with util-linux's unshare; or leave python out of tools")


class ToolBox:
    """The tools of a run; your own run in a worker process, forked at the first call."""

    def __init__(self, tools, timeout: float = 10.0, max_output_chars: int = 2000, allow_unisolated: bool = False):
        self.tools = {t.name: t for t in (Tool.of(spec) for spec in tools)}
        self.timeout, self.max_output_chars, self.allow_unisolated = timeout, max_output_chars, allow_unisolated
        if any(t.function is python for t in self.tools.values()):
            require_sandbox(allow_unisolated)
        own = {t.name: functools.partial(_as_text, t.function) for t in self.tools.values()
               if t.function not in BUILTIN_TOOLS.values()}
        self.worker = Worker(own, "tool") if own else None

    def close(self) -> None:
        """Stop the worker process of your own tools (a later call starts another)."""
        if self.worker is not None:
            self.worker.close()

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def run(self, call: ToolCall) -> tuple[str | ToolResult, bool]:
        """(what the model reads back, or a ToolResult with it and the call's reward; whether the call worked)."""
        if call.error:
            return f"Error: {call.error}", False
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; the tools are {', '.join(self.tools)}", False
        if tool.function is python:
            return self._python(call.arguments)
        if tool.function is calculator:
            return self.run_here(calculator, call.arguments)
        problem = _argument_problem(tool.function, call.arguments)
        if problem:
            return f"Error: {problem}", False
        return self._in_worker(tool, call.arguments)

    def run_here(self, function, arguments: dict) -> tuple[str | ToolResult, bool]:
        """function(**arguments) in this thread, for a function that bounds itself (the calculator) or is bounded
        by its caller (a TRL environment's method, within its step's env_timeout): its arguments checked, an async
        result awaited, a failure read back as one Error line, the output cut as a tool's."""
        problem = _argument_problem(function, arguments)
        if problem:
            return f"Error: {problem}", False
        try:
            value = settle(function(**arguments))
        except Exception as e:  # noqa: BLE001 - the model reads every failure back
            return f"Error: {f'{type(e).__name__}: {e}'[:500]}", False
        return self._cut(value if isinstance(value, ToolResult) else _to_text(value)), True

    def _in_worker(self, tool: Tool, arguments: dict) -> tuple[str | ToolResult, bool]:
        try:
            text = self.worker.call(tool.name, arguments, self.timeout)
        except CallTimedOut:
            return f"Error: {tool.function.__name__} ran past {self.timeout:g} s and was stopped waiting for", False
        except CallFailed as e:
            return f"Error: {f'{e.kind}: {e.message}'[:500]}", False
        except WorkerDied as e:
            return f"Error: {tool.name} did not return: its process {e}", False
        return self._cut(text), True

    def _python(self, arguments: dict) -> tuple[str, bool]:
        from rlvr.sandbox import SandboxLimits, run_python

        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) - {"code"}:
            return "Error: python takes one argument, code (a string)", False
        limits = SandboxLimits(timeout=self.timeout + 2.0, cpu_time=int(self.timeout) + 1,
                               output=max(4096, 4 * self.max_output_chars))
        result = run_python(code, limits=limits, allow_unisolated=self.allow_unisolated)
        if result.timed_out or result.returncode in (128 + signal.SIGXCPU, -signal.SIGXCPU):  # wall clock or CPU time
            return f"Error: the program ran past {self.timeout:g} s and was stopped", False
        text = (result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")).strip()
        if result.returncode != 0 and not text:
            text = f"Error: the program was stopped (exit status {result.returncode})"
        return self._cut(text or "(no output)"), result.returncode == 0

    def _cut(self, text: str | ToolResult) -> str | ToolResult:
        """What a tool returned as the model reads it: text (a ToolResult's output, kept with its reward) cut to
        max_output_chars, its start and its end (where a traceback says what went wrong), with a note of how
        much was cut between them."""
        if isinstance(text, ToolResult):
            return ToolResult(self._cut(_to_text(text.output)), text.reward)
        limit = self.max_output_chars
        if len(text) <= limit:
            return text
        tail = limit // 4
        return f"{text[: limit - tail]}\n[output cut: {len(text) - limit} characters]\n{text[len(text) - tail :] if tail else ''}"


def _argument_problem(function, arguments: dict) -> str | None:
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as e:
        return f"{function.__name__}: {e}"
    except ValueError:  # a builtin without a signature: let the call say
        return None
    return None


def _as_text(function, /, **arguments) -> str | ToolResult:
    """A tool's result as the text the model reads, or a ToolResult of it (run in the worker, so only text
    and a number cross back)."""
    value = settle(function(**arguments))  # an async tool's result, awaited
    return ToolResult(_to_text(value.output), value.reward) if isinstance(value, ToolResult) else _to_text(value)


def _to_text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    try:
        return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    except (TypeError, ValueError):
        return str(value)
