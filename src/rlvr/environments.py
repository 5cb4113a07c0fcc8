"""Environments: what a multi-turn rollout talks to.

An environment is any object with two methods; one is made for each completion of each prompt
(so it may keep state: a game board, a conversation, a budget):

    reset(example) -> first messages, or None
        `example` is the dataset row (rlvr.types.Example: .prompt, .answer, .columns).  Return the
        messages (or plain text) the model starts from, or None for the row's own prompt.  Every
        completion of one prompt must start from the same messages: GRPO compares them.
    step(text) -> Step(observation, done, reward)
        `text` is what the model just wrote (one turn).  Return done=True to end the rollout, or an
        observation: text appended as a message (role "user" unless the Step says otherwise) after
        which the model writes its next turn.  `reward` (optional, summed over the steps) reaches the
        reward functions as `env_rewards`; list the built-in reward `environment` in reward_funcs
        to train on it.  With turn_advantage=return each step's reward is credited on its own turn
        instead (and left out of env_rewards): docs/multiturn.md.

The rollout also ends at `max_turns` model turns or when `max_completion_length` tokens (the
model's and the observations' together) are used.  A step that raises, or runs past `env_timeout`
seconds, ends that rollout (its reward None), counted in env/errors; the run goes on.  A constructor
or reset that raises or runs past env_timeout, and a reset or step that returns what no rollout can
use (a reset's int, a step's None or tuple, a reward that is not a number), end the run with one line
naming the environment and what it returned (rollout/multiturn.py).

Tools (`tools=[...]`) are the built-in environment ToolEnvironment: each call in the model's turn,
written in its chat template family's format (tool_formats.py: <tool_call> tags, Llama's JSON,
Mistral's [TOOL_CALLS]), is run (tools.py) and the results come back as one `tool` message; a turn
without a call ends the rollout.  A tool (or a TRL environment's tool method) may return
ToolResult(output, reward=...): the rewards of a turn's calls, summed, are that turn's Step.reward.

TRL's protocol (GRPOTrainer's `environment_factory`) runs unchanged, through MethodEnvironment: a
class with reset(**row) and no step(text).  Its public methods (all but reset and get_reward) are
the model's tools, described by their type hints and docstrings; reset gets the dataset row as
keyword arguments and may return text, appended to the prompt's last user message (the whole prompt
where the row has none); the optional get_reward() scores the finished rollout (once, within
env_timeout).  `tools=[...]` may be given beside it: the model sees both.  A dict of factories mixes
environments: each row's `environment` column picks one, and only its methods are shown.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Protocol

from rlvr.errors import RolloutError
from rlvr.plugins import load_named, register, settle
from rlvr.tool_formats import FORMATS, ToolFormat
from rlvr.tools import ToolBox, ToolCall, ToolError, ToolResult
from rlvr.types import Example, Prompt


@dataclass
class Step:
    observation: str | None = None
    done: bool = False
    reward: float | None = None
    role: str = "user"  # who the observation is from, as a chat message


class Environment(Protocol):
    def reset(self, example: Example) -> Prompt | None: ...

    def step(self, text: str) -> Step: ...


class ToolEnvironment:
    """Runs the tool calls of each turn, read in `tool_format` (the tag format unless given); counts calls and errors."""

    def __init__(self, toolbox: ToolBox, tool_format: ToolFormat | None = None):
        self.toolbox = toolbox
        self.tool_format = tool_format or FORMATS["tags"]
        self.stop_strings = self.tool_format.stop_strings  # a turn ends where its call does: the model waits for the result
        self.calls = self.errors = 0

    def reset(self, example: Example) -> None:
        return None

    def step(self, text: str) -> Step:
        calls = self.tool_format.parse(text)
        if not calls:
            return Step(done=True)
        outputs, rewards = [], []
        for call in calls:
            output, ok = self.run(call)
            self.calls += 1
            self.errors += not ok
            if isinstance(output, ToolResult):  # a call with a reward
                rewards += [] if output.reward is None else [float(output.reward)]
                output = output.output
            outputs.append(output)
        return Step(observation="\n".join(outputs), role="tool", reward=sum(rewards) if rewards else None)

    def run(self, call: ToolCall) -> tuple[str | ToolResult, bool]:
        """(what the model reads back, or a ToolResult with it and the call's reward; whether the call worked)."""
        return self.toolbox.run(call)


RESERVED = ("reset", "get_reward")  # TRL's protocol: the methods of an environment that are not tools


def tool_methods(env) -> dict:
    """The public methods of a TRL-protocol environment that the model may call, by name."""
    return {name: getattr(env, name) for name in dir(type(env)) if not name.startswith("_") and name not in RESERVED
            and isinstance(inspect.getattr_static(type(env), name), (types.FunctionType, classmethod))}


def method_schemas(env, name: str) -> list[dict]:
    """The JSON schemas of an environment's tool methods (from their type hints and docstrings, as TRL)."""
    from transformers.utils import get_json_schema

    schemas = []
    for method_name, method in tool_methods(env).items():
        try:
            schemas.append(get_json_schema(method))
        except Exception as e:  # noqa: BLE001 - transformers says what the docstring lacks
            raise ToolError(f"environment {name}: its method {method_name}() is offered to the model as a tool, and {e} "
                            "(a tool method needs type hints and a docstring with an Args: section describing each "
                            "argument; make helpers private with a leading underscore)") from None
    return schemas


class MethodEnvironment(ToolEnvironment):
    """TRL's environment protocol over rlvr's: `env`'s public methods are tools the model calls (beside
    the run's own `toolbox`), reset(**row) may add text to the prompt, get_reward() scores the rollout."""

    def __init__(self, env, toolbox: ToolBox, tool_format: ToolFormat | None = None):
        super().__init__(toolbox, tool_format)
        self.env, self.methods = env, tool_methods(env)
        if callable(getattr(env, "get_reward", None)):
            self.final_reward = lambda: settle(env.get_reward())  # an async get_reward, awaited

    def reset(self, example: Example):
        """The example's prompt with what env.reset(**row) returned added to its last user message (TRL's
        rule); None where it returned None.  The row's `environment` column, which chose it, is not passed."""
        row = {"prompt": example.prompt, **{k: v for k, v in example.columns.items() if k != "environment"}}
        text = settle(self.env.reset(**row))
        if text is None or not isinstance(text, str):
            return text  # None: the row's own prompt; anything else is reported by the caller
        return appended(example.prompt, text)

    def run(self, call: ToolCall) -> tuple[str | ToolResult, bool]:
        method = self.methods.get(call.name)
        if method is not None and not call.error:  # in the step's own thread, bounded by env_timeout with the step
            return self.toolbox.run_here(method, call.arguments)
        if call.error or call.name in self.toolbox.tools:
            return self.toolbox.run(call)
        return f"Error: unknown tool {call.name!r}; the tools are {', '.join([*self.methods, *self.toolbox.tools])}", False


def appended(prompt, text: str):
    """`prompt` with `text` added to its last user message (TRL: content + text), or to its end (plain text);
    an empty prompt (a row without one) becomes `text` as the user's message."""
    if isinstance(prompt, str):
        return prompt + text
    messages = [dict(m) for m in prompt] or [{"role": "user", "content": ""}]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return [*messages, {"role": "user", "content": text}]
    messages[last]["content"] = f"{messages[last]['content']}{text}"
    return messages


def is_trl_protocol(env) -> bool:
    """TRL's environment protocol (reset, methods as tools) rather than rlvr's (reset and step(text))."""
    return callable(getattr(env, "reset", None)) and not callable(getattr(env, "step", None))


GIVEN: dict = {}  # environment factories given to GRPOTrainer as objects, by the name the Config holds


def register_environment(factory) -> str:
    return register(factory, GIVEN)


def load_environment(spec):
    """A factory of environments from a class, a function or "package.module:Name".  A class without
    a reset method is refused here, before any model loads; what a function makes is checked when it
    is made (`checked`)."""
    factory = load_named(spec, "environment", GIVEN, "package.module:ClassName")
    problem = protocol_problem(factory) if isinstance(factory, type) else None
    if problem:
        raise ValueError(problem)
    return factory


def protocol_problem(env) -> str | None:
    """Why `env` (an environment or its class) follows neither rlvr's protocol nor TRL's, or None."""
    if callable(getattr(env, "reset", None)):
        return None
    name = getattr(env, "__name__", type(env).__name__)
    return (f"environment {name} has no reset method: an environment has reset(example) and step(text) -> Step "
            "(rlvr's protocol), or reset(**row) and methods the model calls as tools (TRL's); docs/multiturn.md")


def environment_specs(environment) -> dict:
    """The run's `environment` setting as {name: spec}: one environment under None, or TRL's dict of
    several, each picked by the rows whose `environment` column names it."""
    if isinstance(environment, dict):
        return dict(environment)
    return {None: environment} if environment else {}


def checked(factory):
    """`factory`, with each environment it makes checked against the protocol (a RolloutError, which ends the run)."""
    def make():
        env = factory()
        problem = protocol_problem(env)
        if problem:
            raise RolloutError(problem)
        return env

    return make


class EnvironmentReward:
    """TRL's reward source for an environment class with get_reward(): what get_reward() returned for the
    rollouts of exactly that class (None for another's), at weight 1, logged under the class's name.  It
    runs in the trainer's process, where the rollouts' environments are."""

    in_trainer = True  # rewards/__init__.py: not sent to the reward functions' worker process

    def __init__(self, cls: type):
        self.cls, self.__name__ = cls, cls.__name__

    def __call__(self, completions, environments=None, env_rewards=None, **kwargs) -> list:
        envs = environments or [None] * len(completions)
        scores = env_rewards or [None] * len(completions)
        return [score if type(env) is self.cls else None for env, score in zip(envs, scores)]


def reward_sources(factories) -> list[type]:
    """The classes of the environments `factories` make which own their reward (get_reward, TRL's protocol),
    in order, each once; a factory that is not a class is called once to see what it makes."""
    found = []
    for factory in factories:
        cls = factory if isinstance(factory, type) else type(factory())
        if is_trl_protocol(cls) and callable(getattr(cls, "get_reward", None)) and cls not in found:
            found.append(cls)
    return found
