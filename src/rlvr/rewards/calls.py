"""What a reward function of yours is called with, and what it may log, as TRL does it.

TRL calls each reward function with `prompts`, `completions`, `completion_ids`, every column of the
dataset (and every extra field a rollout_func returned), `trainer_state`, and two callables:

    log_extra(column, values)   a column of the completions log, one value per completion
    log_metric(name, value)     a scalar, averaged over the step's calls into the metrics row

rlvr has more to give, its EXTRAS: `prompt_texts` (the text the model saw), `max_completion_length`,
`env_rewards` (what an environment returned) and `answer` (the answer column under that name,
where the dataset calls it otherwise).  A function given to GRPOTrainer as an object gets them only
where its signature names them, so a signature that is valid in TRL stays valid here; a function
named in the settings (`package.module:function`) also gets them through `**kwargs`.  The built-in
rewards get everything.

`call` runs where the function runs (in its worker process, or in the trainer's): the logged values
come back with the scores in a `Logged`, so nothing but plain values crosses the process boundary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from rlvr.plugins import settle

EXTRAS = frozenset({"prompt_texts", "max_completion_length", "env_rewards", "answer"})


@dataclass
class Logged:
    """A call's scores, with what the function logged through log_extra and log_metric."""

    scores: object
    extra: dict = field(default_factory=dict)  # column -> one value per completion
    metrics: dict = field(default_factory=dict)  # name -> the values logged in this call


def accepted_extras(fn, given: bool) -> frozenset:
    """The EXTRAS `fn` is called with: those its signature names, and with **kwargs all of them
    unless it was given to GRPOTrainer as an object (`given`: then only TRL's keyword arguments)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: TRL's arguments only
        return frozenset()
    named = {p.name for p in params if p.kind is not p.VAR_KEYWORD} & EXTRAS
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    return EXTRAS if takes_any and not given else frozenset(named)


def call(fn, **kwargs) -> Logged:
    """fn(**kwargs, log_extra=..., log_metric=...), an `async def` function's scores awaited."""
    out = Logged(None)

    def log_extra(column: str, values) -> None:
        out.extra.setdefault(str(column), []).extend(values)

    def log_metric(name: str, value: float) -> None:
        out.metrics.setdefault(str(name), []).append(float(value))

    out.scores = settle(fn(**kwargs, log_extra=log_extra, log_metric=log_metric))
    return out
