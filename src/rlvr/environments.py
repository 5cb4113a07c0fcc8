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
        to train on it.

The rollout also ends at `max_turns` model turns or when `max_completion_length` tokens (the
model's and the observations' together) are used.  A step that raises, or runs past `env_timeout`
seconds, ends that rollout (its reward None), counted in env/errors; the run goes on.  A constructor
or reset that raises or runs past env_timeout, and a reset or step that returns what no rollout can
use (a reset's int, a step's None or tuple, a reward that is not a number), end the run with one line
naming the environment and what it returned (rollout/multiturn.py).

Tools (`tools=[...]`) are the built-in environment ToolEnvironment: each call in the model's turn,
written in its chat template family's format (tool_formats.py: <tool_call> tags, Llama's JSON,
Mistral's [TOOL_CALLS]), is run (tools.py) and the results come back as one `tool` message; a turn
without a call ends the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlvr.errors import RolloutError
from rlvr.plugins import load_named, register
from rlvr.tool_formats import FORMATS, ToolFormat
from rlvr.tools import ToolBox
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
        outputs = []
        for call in calls:
            output, ok = self.toolbox.run(call)
            self.calls += 1
            self.errors += not ok
            outputs.append(output)
        return Step(observation="\n".join(outputs), role="tool")


GIVEN: dict = {}  # environment factories given to GRPOTrainer as objects, by the name the Config holds


def register_environment(factory) -> str:
    return register(factory, GIVEN)


def load_environment(spec):
    """A factory of environments from a class, a function or "package.module:Name".  A class
    without rlvr's protocol (TRL's, say) is refused here, before any model loads; what a function
    makes is checked when it is made (`checked`)."""
    factory = load_named(spec, "environment", GIVEN, "package.module:ClassName")
    problem = protocol_problem(factory) if isinstance(factory, type) else None
    if problem:
        raise ValueError(problem)
    return factory


def protocol_problem(env) -> str | None:
    """Why `env` (an environment or its class) is not an rlvr environment, or None."""
    if callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None)):
        return None
    name = getattr(env, "__name__", type(env).__name__)
    if callable(getattr(env, "reset", None)):
        return (f"environment {name} has reset() but no step(text): it looks like TRL's environment protocol (its methods "
                "offered to the model as tools, get_reward()), which rlvr does not support yet; an rlvr environment has "
                "reset(example) and step(text) -> Step (docs/multiturn.md), and plain tools go in tools=[...]")
    return f"environment {name} must have reset(example) and step(text) -> Step methods (docs/multiturn.md)"


def checked(factory):
    """`factory`, with each environment it makes checked against the protocol (a RolloutError, which ends the run)."""
    def make():
        env = factory()
        problem = protocol_problem(env)
        if problem:
            raise RolloutError(problem)
        return env

    return make
