"""Reward functions: the registry, user plug-ins, and scoring a batch with weights.

A reward function has TRL's signature

    fn(completions, **kwargs) -> list[float | None]

where `completions` holds one entry per completion (text, or a one-message list
for chat prompts) and kwargs carries what TRL passes, aligned with the completions:
`prompts`, `completion_ids` and every dataset column; plus `trainer_state`,
`log_extra` and `log_metric` (calls.py).  rlvr's own extras (`prompt_texts`, the
text the model saw; `max_completion_length`; `answer`, the answer column by that
name; `env_rewards`) reach a function that names them, or that takes **kwargs and
was named in the settings rather than given to GRPOTrainer.  `async def`
functions are awaited together, each bounded by reward_timeout (calls.gather).
None means "not applicable": it is left out of that function's mean and counts
as 0 in the weighted total (TRL's nansum).  A completion's score may also be a
list of step scores, (char_offset, score) pairs: a process reward, scored where each
step of the text ends (advantages.step_advantages has the rule).  A function
may return a ScoreList to report completions it could not score (timeouts,
errors).  `reward_args` in the config supplies keyword arguments per function.

The built-ins run in the trainer's process and bound themselves.  Your own functions run in a
worker process (reward_isolation=process, isolation.py) that is killed, with what it started, at
`reward_timeout`; sys.exit, KeyboardInterrupt and a crash there are errors naming the function.
reward_isolation=inline runs them in the trainer's process instead (deadline.py).

Names are the built-ins below, or `package.module:function`, or
`path/to/file.py:function` for your own, or a reward model's Hub id or local directory
(model.py: a sequence classifier scoring prompt + completion, as TRL's reward_funcs takes it).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import logging
import numbers
import traceback
from math import isfinite, isnan, nan
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlvr.isolation import CallFailed, CallTimedOut, Worker, WorkerDied, WorkerError
from rlvr.rewards import calls
from rlvr.rewards import model as reward_model
from rlvr.rewards.code import code_tests
from rlvr.rewards.countdown import countdown
from rlvr.rewards.deadline import RewardTimeout, time_limit
from rlvr.rewards.llm_judge import judge
from rlvr.rewards.format import boxed_format, format_curriculum, tag_count, think_answer_format
from rlvr.rewards.length import cosine_length, repetition_penalty, soft_overlong
from rlvr.rewards.math import accuracy, math_verify, numeric_accuracy, signed_accuracy
from rlvr.rewards.reasoning_gym import reasoning_gym_score
from rlvr.rewards.trl_names import get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward  # noqa: F401 - TRL's names
from rlvr.types import Example, Rollout, ScoreList, TrainerState
from rlvr.errors import RewardError  # noqa: F401 - raised here, defined in the leaf errors.py

RewardFn = Callable[..., list]
ISOLATION = ("process", "inline")  # where your own reward functions run (reward_isolation)
log = logging.getLogger(__name__)


def resolve_reward(name: str, model_device: str = "auto", model_batch_size: int = 32) -> RewardFn:
    """A built-in name, a function given as an object (register_reward), a dotted / file path to a
    function or a callable class (made with no arguments), or a reward model by Hub id or local
    directory (model.py: checked now, loaded at its first call on `model_device`); errors list the choices."""
    if name in REWARDS:
        return REWARDS[name]
    if name in GIVEN:
        return GIVEN[name]
    if reward_model.is_model_reference(name):
        return reward_model.RewardModel(name, device=model_device, batch_size=model_batch_size)  # checked, not loaded
    if ":" not in name:
        close = difflib.get_close_matches(name, REWARDS, n=1)
        raise ValueError(
            f"unknown reward function {name!r}; {f'did you mean {close[0]!r}? ' if close else ''}built-in: {', '.join(REWARDS)}, "
            "or give your own as package.module:function or path/to/file.py:function, or a reward model by "
            "Hub id (org/name) or local directory"
        )
    target, _, attr = name.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"reward function file not found: {path}")
        module = _load_file(path.resolve())
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"reward function {name!r}: cannot import {target!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: {target!r} has no function {attr!r}")
    return _instance(fn, name) if inspect.isclass(fn) else fn


def _instance(cls, name: str):
    """A reward written as a callable class, made once with no arguments."""
    try:
        fn = cls()
    except TypeError as e:
        raise ValueError(f"reward function {name!r} is a class and could not be made with no arguments ({e}); "
                         "give its arguments defaults, or pass an instance to GRPOTrainer") from None
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: instances of {cls.__name__} are not callable (define __call__)")
    return fn


# Reward functions and callable objects given as objects (GRPOTrainer), by the name they are logged under.
GIVEN: dict[str, RewardFn] = {}


def register_reward(fn, taken: set[str] = frozenset()) -> str:
    """The name a reward given as an object is known and logged by: TRL's (the function's
    __name__, else its class's), with a suffix where a built-in or another of the same run's
    functions (`taken`) has it.  A later function given under the same name takes the name over (a
    notebook that redefines `my_reward` and makes a new trainer trains with the new one); a trainer
    made before puts its own back when it trains (api/inputs.py given_objects)."""
    if isinstance(fn, type):
        fn = _instance(fn, fn.__name__)
    if not callable(fn):
        raise ValueError(f"reward_funcs: {fn!r} is not callable; give functions, callable objects, built-in names "
                         "or module:function paths")
    builtin = [n for n, f in REWARDS.items() if f is fn]
    if builtin:  # a built-in passed as a function (rlvr.rewards.accuracy_reward)
        return builtin[0]
    base = getattr(fn, "__name__", None) or type(fn).__name__
    name, k = base, 1
    while name in REWARDS or name in taken:
        k += 1
        name = f"{base}_{k}"
    GIVEN[name] = fn
    return name


@functools.lru_cache(maxsize=None)
def _load_file(path: Path):
    """Each reward file is executed once, so every name in it resolves to the same function."""
    spec = importlib.util.spec_from_file_location(f"rlvr_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(f"reward function file {path}:{e.lineno}: {e.msg}: {(e.text or '').strip()}") from None
    except Exception as e:  # the file raised while it was imported: its own line, not ours
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        line = f":{frames[-1].lineno}" if frames else ""
        raise ValueError(f"reward function file {path}{line} raised {e.__class__.__name__} when imported: {e}") from None
    return module


# What the trainer passes to every reward function, and the dataset columns built-ins read: not knobs.
CONTEXT = {"completions", "prompts", "prompt_texts", "completion_ids", "trainer_state", "max_completion_length", "answer",
           "test", "test_cases", "entry_point", "prompt_code", "nums", "target", "question", "metadata", "rg_dataset",
           "rg_config"}


def knobs(fn: RewardFn) -> list[str]:
    """The keyword arguments of a built-in reward that `reward_args` may set."""
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in CONTEXT]


def check_reward_args(name: str, args: dict, where: str | None = None) -> list[str]:
    """Problems with `reward_args.<name>` of a built-in reward: unknown knobs, or values it refuses
    (found by calling it on no completions).  Your own functions' arguments are yours to check.
    `where`: what the problems are said of (default reward_args.<name>)."""
    fn = REWARDS.get(name)
    if fn is None:
        return []
    where = where or f"reward_args.{name}"
    allowed = knobs(fn)
    problems = []
    for key in args:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"{where}: unknown setting {key!r}; {hint}{name} takes {', '.join(allowed) or 'none'}")
    if not problems:
        try:
            fn(completions=[], **args)
        except (ValueError, TypeError) as e:
            problems.append(f"{where}: {e}")
    return problems


def reward_name(name: str) -> str:
    """Short name used in metrics: `pkg.mod:my_reward` -> `my_reward`; a reward model's id or path
    -> its last part, as TRL (`org/my-rm` -> `my-rm`)."""
    if name not in REWARDS and name not in GIVEN and reward_model.is_model_reference(name):
        return reward_model.short_name(name)
    return name.rpartition(":")[2]


@dataclass
class Scores:
    total: list[float]  # weighted sum per completion (None counts as 0)
    per_func: dict[str, list[float | None]]
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # per function: timeouts, errors, retries
    extra: dict[str, list] = field(default_factory=dict)  # log_extra's columns, one value per completion
    logged: dict[str, list[float]] = field(default_factory=dict)  # log_metric's values by name (calls.py)
    # Process rewards: per completion, the weighted step scores as (char_offset, score), the offset None for
    # the end (the weighted scores given as one number, where any was); None when no function gave steps.
    steps: list[list[tuple[int | None, float]]] | None = None

    def mean(self, name: str) -> float:
        vals = [v for v in self.per_func[name] if v is not None]
        return sum(vals) / len(vals) if vals else nan


def merge_counters(parts) -> dict[str, dict[str, int]]:
    """Per-function counters (timeouts, errors, retries) of several rounds, processes or workers, added up."""
    out: dict[str, dict[str, int]] = {}
    for counters in parts:
        for name, counts in counters.items():
            mine = out.setdefault(name, {})
            for k, v in counts.items():
                mine[k] = mine.get(k, 0) + v
    return out


class RewardSet:
    """The configured reward functions with their weights and keyword arguments."""

    def __init__(self, names, weights=None, args: dict | None = None, timeout: float | None = None,
                 isolation: str = "process", model_device: str = "auto", model_batch_size: int = 32):
        """timeout: seconds one call of one of your own reward functions may take (reward_timeout);
        the built-ins bound themselves (grading workers, the sandbox's limits) and run in this process.
        isolation (reward_isolation): "process" runs your own functions in a worker process
        (isolation.py), killed with everything it started when a call overruns; "inline" runs them
        here, stopped by a signal (deadline.py), for functions that must share this process's
        memory or use CUDA.  model_device, model_batch_size: where reward models named by id or
        path score, and how many completions at once (reward_model_device, reward_model_batch_size)."""
        if isolation not in ISOLATION:
            raise ValueError(f"reward_isolation must be one of {', '.join(ISOLATION)}, got {isolation!r}")
        args, self.timeout, self.isolation = args or {}, timeout, isolation
        self.names = _unique([reward_name(n) for n in names])
        self.fns, self.extras = [], []  # extras: the rlvr-only keyword arguments each of your functions takes (calls.py)
        for full, short in zip(names, self.names):
            fn = resolve_reward(full, model_device, model_batch_size)
            kwargs = args.get(full, args.get(short))
            self.fns.append(functools.partial(fn, **kwargs) if kwargs else fn)
            self.extras.append(calls.accepted_extras(self.fns[-1], given=full in GIVEN))
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(self.fns)
        mine = {i: fn for i, fn in enumerate(self.fns) if not _builtin(fn)}
        self.waiting = {i: fn for i, fn in mine.items() if calls.is_async(fn)}  # async def: awaited together
        own = {i: functools.partial(calls.call, fn) for i, fn in mine.items() if i not in self.waiting}
        process = isolation == "process"
        self.worker = Worker(own, "reward") if own and process else None  # forked at its first call
        # The async functions' own worker, so they wait on their services while the others score.
        self.async_worker = Worker({"gather": functools.partial(calls.gather, self.waiting)}, "reward-async") \
            if self.waiting and process else None
        self._waiter = None  # the thread that waits for async_worker's answer

    @classmethod
    def of(cls, settings, names, weights=None, args: dict | None = None) -> "RewardSet":
        """`names` with the run's reward settings (RewardSettings): reward_timeout, reward_isolation and
        where reward models score (reward_model_device, reward_model_batch_size)."""
        return cls(names, weights, args, timeout=settings.reward_timeout, isolation=settings.reward_isolation,
                   model_device=settings.reward_model_device, model_batch_size=settings.reward_model_batch_size)

    @property
    def needs_main_thread(self) -> bool:
        """Whether scoring must run on the main thread, whose signals bound it (deadline.py): your own
        functions run inline (reward_isolation=inline), and reasoning-gym's scorers.  Otherwise any
        thread may score (your functions run in a worker process, the built-ins grade in their own)."""
        return self.isolation == "inline" or any(getattr(fn, "func", fn) is reasoning_gym_score for fn in self.fns)

    def close(self) -> None:
        """Stop the worker process of your own reward functions (a later call starts another)."""
        for worker in (self.worker, self.async_worker):
            if worker is not None:
                worker.close()
        if self._waiter is not None:
            self._waiter.shutdown(wait=False, cancel_futures=True)
            self._waiter = None

    def score_groups(self, examples: list[Example], groups: list[list[Rollout]], prompt_texts: list[str] | None = None,
                     trainer_state: TrainerState | None = None, max_completion_length: int | None = None) -> Scores:
        """Score every rollout of every group; group i belongs to examples[i] (rendered as prompt_texts[i])."""
        rows = [(i, ex, r) for i, (ex, group) in enumerate(zip(examples, groups)) for r in group]
        keys = dict.fromkeys(k for ex in examples for k in ex.columns)
        columns = {k: [ex.columns.get(k) for _, ex, _ in rows] for k in keys}
        extras = {"prompt_texts", "max_completion_length", "env_rewards", "environments"} | ({"answer"} - set(columns))  # not TRL's
        answers = [ex.answer for _, ex, _ in rows]  # the answer column's values, whatever its name
        columns.setdefault("answer", answers)
        completions = [  # a multi-turn rollout's whole conversation (TRL's shape); its last turn is the answer
            (r.messages or [{"role": "assistant", "content": r.text}]) if ex.is_conversational else r.text for _, ex, r in rows
        ]
        infos = [r.info or {} for _, _, r in rows]
        if any(infos):  # multi-turn: what the environment said; rollout_func: the fields it returned
            columns["env_rewards"] = [i.get("env_reward") for i in infos]
            if any("environment" in i for i in infos):  # TRL's: each completion's environment, to read its state
                columns["environments"] = [i.get("environment") for i in infos]
            for key in dict.fromkeys(k for i in infos for k in i.get("fields", {})):
                columns[key] = [i.get("fields", {}).get(key) for i in infos]
        context = {  # a rollout that started from its own messages (TRL's reset text) is scored with them
            "prompts": [info.get("prompt", ex.prompt) for (_, ex, _), info in zip(rows, infos)],
            "completion_ids": [r.completion_ids for _, _, r in rows],
            "prompt_texts": [info.get("prompt_text") or prompt_texts[i] for (i, _, _), info in zip(rows, infos)]
            if prompt_texts else None,
            "trainer_state": trainer_state or TrainerState(),
            "max_completion_length": max_completion_length,
        }
        return self.score(completions, {**context, **columns}, frozenset(extras), answers)

    def score(self, completions, kwargs: dict, extras: frozenset = frozenset(), answers: list | None = None) -> Scores:
        """Every function's scores of `completions`; `extras`: the keys of kwargs that are rlvr's own,
        given to your functions only where they take them (calls.py); `answers`: the reference answers
        the built-in verifiers grade against, as `answer` (a dataset column named answer may differ)."""
        n = len(completions)
        drop = {i: extras - self.extras[i] for i, fn in enumerate(self.fns) if not _builtin(fn)}  # rlvr's, not asked for
        waiting = self._start_async(completions, kwargs, drop)  # in its worker already, while the others score
        got = {}
        for i, fn in enumerate(self.fns):
            if i in self.waiting:
                continue
            if _builtin(fn):
                mine = kwargs if answers is None else {**kwargs, "answer": answers}
            else:
                mine = {k: v for k, v in kwargs.items() if k not in drop[i]}
            got[i] = self._outcome(i, n, lambda: self._call(i, completions, mine))
        if self.waiting:
            answered = self._finish_async(waiting, completions, kwargs, drop)
            for i in self.waiting:
                got[i] = self._outcome(i, n, lambda: _answer(answered, i))
        per_func, counters, extra, logged, steps = {}, {}, {}, {}, {}
        lengths = _lengths(completions)
        for i, name in enumerate(self.names):
            values = got[i]
            if isinstance(values, calls.Logged):  # your own function's, with what it logged
                extra.update(values.extra)
                for key, vals in values.metrics.items():
                    logged.setdefault(key, []).extend(vals)
                values = values.scores
            per_func[name], steps[name] = _check_output(name, values, n, lengths)
            counters[name] = {k: getattr(values, k, 0) for k in ("timeouts", "errors", "retries")}
        total = [
            float(sum(w * v for w, v in zip(self.weights, vals) if v is not None))  # 0.0 when all are None
            for vals in zip(*(per_func[name] for name in self.names))
        ]
        return Scores(total=total, per_func=per_func, counters=counters, extra=extra, logged=logged,
                      steps=self._steps(per_func, steps, n))

    def _steps(self, per_func: dict, steps: dict, n: int):
        """Scores.steps: each completion's weighted step scores, and at the end (None) the weighted sum of
        the scores given as one number where any function gave one; None when no function gave steps."""
        if all(s is None for s in steps.values()):
            return None
        out = []
        for j in range(n):
            mine: list[tuple[int | None, float]] = []
            outcome = None
            for w, name in zip(self.weights, self.names):
                if steps[name] is not None and steps[name][j] is not None:
                    mine += [(offset, w * score) for offset, score in steps[name][j]]
                elif per_func[name][j] is not None:
                    outcome = (outcome or 0.0) + w * per_func[name][j]
            out.append(mine + ([(None, outcome)] if outcome is not None else []))
        return out

    def _outcome(self, i: int, n: int, scores):
        """What scores() returned, or the i-th function's n scores as None when it ran past
        reward_timeout (counted); its failure as the one RewardError line that names it."""
        name = self.names[i]
        try:
            return scores()
        except (RewardTimeout, CallTimedOut):
            log.warning("reward function %r ran past reward_timeout=%g s: its %d scores of this batch are None, "
                        "counted in rewards/%s/timeouts", name, self.timeout, n, name)
            values = ScoreList([None] * n)
            values.timeouts = n
            return values
        except CallFailed as e:
            raise RewardError(_failure(name, e)) from e
        except WorkerDied as e:
            raise RewardError(f"reward function {name!r} did not return: its worker process {e}") from None
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {e.__class__.__name__}: {e}") from e

    def _start_async(self, completions, kwargs: dict, drop: dict):
        """The async functions' call, sent to their worker process and waited for in a thread (a
        Future), or None where they run in this process (after the others, _finish_async)."""
        if self.async_worker is None:
            return None
        from concurrent.futures import ThreadPoolExecutor

        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="rlvr-async-rewards")
        self.async_worker.start()  # forked before the waiter's call, so a fork's failure is raised here
        payload = {"kwargs": {"completions": completions, **kwargs}, "drop": drop, "timeout": self.timeout}
        return self._waiter.submit(self.async_worker.call, "gather", payload, _backstop(self.timeout))

    def _finish_async(self, waiting, completions, kwargs: dict, drop: dict):
        """index -> the async function's answer (calls.gather), or the exception that stopped them all."""
        try:
            if waiting is not None:
                return waiting.result()
            with time_limit(_backstop(self.timeout), "async reward functions"):
                return calls.gather(self.waiting, {"completions": completions, **kwargs}, drop, self.timeout)
        except (RewardTimeout, WorkerError) as e:  # the loop was blocked past the backstop, or the worker died
            return e

    def _call(self, i: int, completions, kwargs: dict):
        """The i-th function's scores: a built-in here, your own in the worker process (or inline)."""
        fn = self.fns[i]
        if _builtin(fn):
            return fn(completions=completions, **kwargs)
        if self.worker is not None:
            return self.worker.call(i, {"completions": completions, **kwargs}, self.timeout)
        with time_limit(self.timeout, f"reward function {self.names[i]!r}"):
            return calls.call(fn, completions=completions, **kwargs)


def _unique(names: list[str]) -> list[str]:
    """The metric names, a repeated one suffixed _2, _3 (two reward models saved as .../rm, one given as an object)."""
    out: list[str] = []
    for name in names:
        k, unique = 1, name
        while unique in out:
            k += 1
            unique = f"{name}_{k}"
        out.append(unique)
    return out


ASYNC_GRACE = 10.0  # seconds past reward_timeout before async functions that block their event loop are stopped


def _backstop(timeout: float | None) -> float | None:
    """The limit on the async functions' whole call: reward_timeout bounds each of them inside their
    event loop; this stops a loop that one of them blocks (time.sleep in an `async def`)."""
    return timeout + ASYNC_GRACE if timeout else None


def _answer(answered, i: int):
    """The i-th async function's scores (a Logged) from _finish_async's answer, or its failure raised."""
    if isinstance(answered, BaseException):
        raise answered
    kind, *rest = answered[i]
    if kind == "timeout":
        raise CallTimedOut("ran past reward_timeout")
    if kind == "failed":
        raise CallFailed(*rest)
    return rest[0]


def _builtin(fn) -> bool:
    """A built-in reward (REWARDS) or a reward model, which runs in the trainer's process."""
    return getattr(fn, "in_trainer", False) or getattr(fn, "func", fn) in REWARDS.values()


def _failure(name: str, e: CallFailed) -> str:
    """The one line a reward function's exception in its worker process is reported as."""
    if e.kind == "SystemExit":
        return f"reward function {name!r} called sys.exit({e.message})"
    if e.kind == "KeyboardInterrupt":
        return (f"reward function {name!r} raised KeyboardInterrupt itself (a Ctrl-C of the run stops the "
                "trainer, not the worker process your reward functions run in)")
    line = f"reward function {name!r} raised {e.kind}: {e.message}"
    if "CUDA" in e.message and "fork" in e.message:
        return f"{line}; CUDA cannot be used in a forked worker process: set reward_isolation=inline"
    if e.kind == "PicklingError":
        return f"{line}; or set reward_isolation=inline to run it in the trainer's process"
    return line


def _lengths(completions) -> list[int | None]:
    """Each completion's length in characters, the bound of its step offsets; None for a conversation
    of several turns (step scores are for a single turn)."""
    out = []
    for c in completions:
        if isinstance(c, str):
            out.append(len(c))
        elif isinstance(c, list) and len(c) == 1 and isinstance(c[0], dict) and isinstance(c[0].get("content"), str):
            out.append(len(c[0]["content"]))
        else:
            out.append(None)
    return out


def _check_output(name: str, values, n: int, lengths: list | None = None):
    """(scores, steps): the scores as floats or None, and where the function gave any completion a list
    of (char_offset, score) steps, those lists (None for a completion scored with one number); steps None
    when it gave none.  Lists, tuples, numpy arrays and torch tensors of Python, numpy or torch numbers
    are accepted; NaN means "not applicable", as None does (TRL's nansum).  A completion's score as
    steps counts as their sum; `lengths` (characters per completion) bound the offsets."""
    if not isinstance(values, (list, tuple)) and hasattr(values, "tolist"):  # numpy array, torch tensor
        values = values.tolist()
        values = values if isinstance(values, list) else [values]
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
        raise RewardError(f"reward function {name!r} must return a list of {n} floats or None, got {got}")
    out, steps = [], [None] * n
    for j, v in enumerate(values):
        if isinstance(v, (list, tuple)) or (hasattr(v, "tolist") and getattr(v, "ndim", 0) > 0):
            steps[j] = _check_steps(name, v, lengths[j] if lengths else None)
            out.append(sum(score for _, score in steps[j]) if steps[j] else None)
            continue
        if v is not None and not isinstance(v, (int, float)) and hasattr(v, "item"):  # numpy / torch scalar
            v = v.item()
        if v is None or (isinstance(v, float) and isnan(v)):
            out.append(None)
        elif isinstance(v, numbers.Real) and isfinite(v):  # bools count as 1 / 0
            out.append(float(v))
        else:
            raise RewardError(f"reward function {name!r} returned {v!r}; rewards must be finite numbers or None")
    return out, (steps if any(s is not None for s in steps) else None)


def _check_steps(name: str, pairs, length: int | None) -> list[tuple[int, float]] | None:
    """One completion's step scores as (char_offset, score) pairs in offset order (None when empty): each
    offset where a step of the text ends, 1 to the completion's length; each score a finite number."""
    pairs = pairs.tolist() if hasattr(pairs, "tolist") else pairs
    if length is None:
        raise RewardError(f"reward function {name!r} returned step scores for a conversation of several turns; "
                          "step scores (char_offset, score) are for a single-turn completion")
    out = []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RewardError(f"reward function {name!r} returned the step {pair!r}; a step score is a pair "
                              "(char_offset, score)")
        offset, score = (x.item() if hasattr(x, "item") else x for x in pair)
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or not 1 <= offset <= length:
            raise RewardError(f"reward function {name!r} returned the step offset {offset!r} for a completion of "
                              f"{length} characters; an offset is where the step ends, an integer from 1 to {length}")
        if not isinstance(score, numbers.Real) or not isfinite(score):  # bools count as 1 / 0
            raise RewardError(f"reward function {name!r} returned the step score {score!r}; step scores must be finite numbers")
        out.append((int(offset), float(score)))
    return sorted(out, key=lambda p: p[0]) or None


def environment(completions, env_rewards=None, **kwargs) -> list:
    """The rewards an environment's steps gave each rollout, summed (environments.py); None where it gave none.
    With turn_advantage=return, what is left once each turn's reward is credited on its turn (get_reward's)."""
    if env_rewards is None:
        return [None] * len(completions)
    return [None if r is None else float(r) for r in env_rewards]


# TRL's name for the math verifier (trl.rewards.accuracy_reward): `from rlvr.rewards import accuracy_reward`;
# TRL's other reward functions under their names (trl_names.py), for TRL's GRPO script.
accuracy_reward = accuracy

REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy,
    "numeric_accuracy": numeric_accuracy,
    "signed_accuracy": signed_accuracy,
    "format": think_answer_format,
    "boxed_format": boxed_format,
    "tag_count": tag_count,
    "format_curriculum": format_curriculum,
    "soft_overlong": soft_overlong,
    "cosine_length": cosine_length,
    "repetition_penalty": repetition_penalty,
    "code_tests": code_tests,
    "environment": environment,
    "countdown": countdown,
    "reasoning_gym": reasoning_gym_score,
    "judge": judge,
    "math_verify": math_verify,
}
