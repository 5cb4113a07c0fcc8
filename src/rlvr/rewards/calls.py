"""What a reward function of yours is called with, and what it may log, as TRL does it.

TRL calls each reward function with `prompts`, `completions`, `completion_ids`, every column of the
dataset (and every extra field a rollout_func returned), `trainer_state`, and two callables:

    log_extra(column, values)   a column of the completions log, one value per completion
    log_metric(name, value)     a scalar, averaged over the step's calls into the metrics row

rlvr has more to give, its EXTRAS: `prompt_texts` (the text the model saw), `max_completion_length`,
`env_rewards` (what an environment returned), `answer` (the answer column under that name,
where the dataset calls it otherwise) and `environments` (each completion's environment object, as
TRL's environment_factory gives it; only to a function whose signature names it, since it must be
pickled to reach the worker process).  A function given to GRPOTrainer as an object gets them only
where its signature names them, so a signature that is valid in TRL stays valid here; a function
named in the settings (`package.module:function`) also gets them through `**kwargs`.  The built-in
rewards get everything.

`call` runs where the function runs (in its worker process, or in the trainer's): the logged values
come back with the scores in a `Logged`, so nothing but plain values crosses the process boundary.

`async def` functions (and objects whose __call__ is one) are awaited together, as TRL's
GRPOTrainer awaits them with asyncio.gather: `gather` runs one call of each at once in one event
loop, each bounded by reward_timeout on its own, so three functions that each wait 1 s on a
service take about 1 s, not 3.  A function that blocks the loop (time.sleep inside `async def`)
holds the others: the caller's backstop (the worker's kill, or the signal inline) stops them all.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from dataclasses import dataclass, field

from rlvr.plugins import settle

EXTRAS = frozenset({"prompt_texts", "max_completion_length", "env_rewards", "answer", "environments"})
NAMED_ONLY = frozenset({"environments"})  # objects, which may not cross to a worker process: only where the signature names them


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
    return (EXTRAS - NAMED_ONLY) | named if takes_any and not given else frozenset(named)


def _recorder() -> tuple[Logged, dict]:
    """A Logged to fill, and the log_extra and log_metric a call is given that fill it."""
    out = Logged(None)

    def log_extra(column: str, values) -> None:
        out.extra.setdefault(str(column), []).extend(values)

    def log_metric(name: str, value: float) -> None:
        out.metrics.setdefault(str(name), []).append(float(value))

    return out, {"log_extra": log_extra, "log_metric": log_metric}


def call(fn, **kwargs) -> Logged:
    """fn(**kwargs, log_extra=..., log_metric=...), an `async def` function's scores awaited."""
    out, logs = _recorder()
    out.scores = settle(fn(**kwargs, **logs))
    return out


def is_async(fn) -> bool:
    """An `async def` function, a partial of one, or an object whose __call__ is one."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))


async def _attempt(fn, kwargs: dict) -> tuple:
    """("ok", Logged) or ("failed", kind, message): what one async function did, SystemExit included."""
    out, logs = _recorder()
    try:
        out.scores = await fn(**kwargs, **logs)
        return "ok", out
    except (Exception, SystemExit) as e:  # sys.exit in one function is that function's failure; the
        # caller's own BaseExceptions (Ctrl-C, the inline backstop's RewardTimeout) stop the whole call
        message = ("" if e.code is None else repr(e.code)) if isinstance(e, SystemExit) else str(e)
        return "failed", type(e).__name__, message


def gather(fns: dict, kwargs: dict, drop: dict, timeout: float | None) -> dict:
    """One call of every async function in `fns` (index -> function) at once, each given `kwargs`
    less its `drop[index]` keys: index -> ("ok", Logged) | ("timeout",) | ("failed", kind, message).
    `timeout` (seconds, None or 0 for none) bounds each function on its own."""

    async def one(i):
        task = asyncio.ensure_future(_attempt(fns[i], {k: v for k, v in kwargs.items() if k not in drop.get(i, ())}))
        done, _ = await asyncio.wait({task}, timeout=timeout or None)
        if not done:
            task.cancel()
            return ("timeout",)
        return task.result()

    async def every():
        return await asyncio.gather(*(one(i) for i in fns))

    return dict(zip(fns, settle(every())))
