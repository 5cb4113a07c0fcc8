"""rollout_func: a function of yours samples the completions (TRL's hook of that name).

    def my_rollouts(prompts, trainer) -> dict:
        ...
        return {"prompt_ids": [...], "completion_ids": [...], "logprobs": [...], "env_mask": [...], "my_field": [...]}

`prompts` holds each prompt of the step num_generations times in a row (one entry per completion,
as in TRL), as the dataset gives it (text or messages).  `trainer` has `args` (the Config),
`processing_class` (the tokenizer) and `generate(prompt_ids, n=1, max_tokens=None)`, which samples
with the run's own sampler (the in-process engine or vLLM) and returns per prompt n Rollouts
(.completion_ids, .logprobs, .text, .finish_reason).

The dict has one entry per prompt for each key: `prompt_ids`, `completion_ids` and `logprobs` (the
sampler's log-probability of each completion token) are required; `env_mask` (1 for a token the
policy wrote, 0 for one it did not, e.g. a tool's output) is optional and, as in TRL, keeps the
0-tokens out of the loss; every other key reaches the reward functions as a keyword argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from rlvr.plugins import load_named, register
from rlvr.rollout import RolloutError
from rlvr.rollout.multiturn import InThread, mix_seed, short
from rlvr.rollout.sampling import GroupGenerators
from rlvr.types import Rollout

GIVEN: dict = {}  # rollout functions given to GRPOTrainer as objects, by the name the Config holds
REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


def load_rollout_func(spec):
    return load_named(spec, "rollout_func", GIVEN, "package.module:function")


def register_rollout_func(fn) -> str:
    return register(fn, GIVEN)


class RolloutContext:
    """What a rollout_func gets as `trainer`.  `args`: what it reads as trainer.args, the run's
    settings (as TRL's reads its GRPOConfig); passed through, not read here."""

    def __init__(self, args, tokenizer, sampler, params, generator):
        self.args, self.processing_class = args, tokenizer
        self._sampler, self._params, self._generator = sampler, params, generator
        self._calls = 0
        self._started = time.perf_counter()
        self._sampled = 0.0  # seconds spent in generate, finished calls
        self._sampling_since: float | None = None  # when the call in progress began
        self.closed = False  # the rollout_func ran past its bound: it may no longer sample

    def generate(self, prompt_ids: list[list[int]], n: int = 1, max_tokens: int | None = None) -> list[list[Rollout]]:
        """Per prompt, n Rollouts from the run's sampler; seeded from the step's streams, so a resumed
        run samples the same."""
        if self.closed:
            raise RolloutError("this rollout_func ran past env_timeout and was given up: it may not sample any more")
        params = dataclasses.replace(self._params, n=n, max_tokens=max_tokens or self._params.max_tokens)
        generator = self._generator
        if isinstance(generator, GroupGenerators):  # one stream per prompt given, derived from the step's first
            generator = GroupGenerators([mix_seed(generator.seeds[0], i, self._calls) for i in range(len(prompt_ids))])
        self._calls += 1
        self._sampling_since = time.perf_counter()
        try:
            return self._sampler.generate(prompt_ids, params, generator)
        finally:
            self._sampled += time.perf_counter() - self._sampling_since
            self._sampling_since = None

    def own_seconds(self) -> float:
        """Seconds the rollout_func has run, not counting the sampling it asked for."""
        now = time.perf_counter()
        since = self._sampling_since
        return now - self._started - self._sampled - (now - since if since is not None else 0.0)


def _call(fn, name: str, prompts: list, context: RolloutContext, seconds: float | None):
    """fn(prompts, context), its errors as one line; with `seconds`, in a thread of its own (InThread),
    given up (and refused any further sampling) once its own time passes them."""
    stream = torch.cuda.current_stream() if torch.cuda.is_available() else None  # CUDA's stream is per thread

    def run():
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return fn(prompts, context)

    try:
        if seconds is None:
            return run()
        call = InThread(run, name="rlvr-rollout-func")
        while not call.done.wait(0.05):
            if context.own_seconds() > seconds:
                context.closed = True
                raise RolloutError(f"rollout_func {name} ran {seconds:g} s without returning, not counting its sampling "
                                   "(env_timeout): it was given up")
        return call.result()
    except (RolloutError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - the user's function: one line
        raise RolloutError(f"rollout_func {name} raised {type(e).__name__}: {e}") from e


def _ids(values, what: str, name: str, i: int, vocab: int | None) -> list[int]:
    """A row of token ids as ints, or a one-line error saying what is wrong with it."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise RolloutError(f"rollout_func {name}: {what} {i} is {short(values)} ({type(values).__name__}), not a list of token ids")
    out = []
    for v in values:
        try:
            whole = not isinstance(v, (bool, str, bytes)) and float(v) == int(v)  # an int, numpy's, a tensor's
        except (TypeError, ValueError, OverflowError):
            whole = False
        if not whole:
            raise RolloutError(f"rollout_func {name}: {what} {i} holds {short(v)} ({type(v).__name__}), not a token id")
        v = int(v)
        if v < 0 or (vocab is not None and v >= vocab):
            raise RolloutError(f"rollout_func {name}: {what} {i} holds the token id {v}, outside the vocabulary "
                               f"(0 to {vocab - 1 if vocab else 'its size'})")
        out.append(v)
    return out


def custom_rollouts(fn, args, tokenizer, sampler, examples, params, generator) -> list[list[Rollout]]:
    """Per example, params.n Rollouts made by `fn`, which sees `args` as trainer.args (RolloutContext).
    A completion that does not end in an end-of-sequence or padding token was cut: finish "length" (as TRL)."""
    n = params.n
    prompts = [ex.prompt for ex in examples for _ in range(n)]
    name = getattr(fn, "__name__", "rollout_func")
    out = _call(fn, name, prompts, RolloutContext(args, tokenizer, sampler, params, generator),
                getattr(args, "env_timeout", None) or None)
    if not isinstance(out, dict):
        raise RolloutError(f"rollout_func {name} must return a dict with {', '.join(REQUIRED)}; got {type(out).__name__}")
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise RolloutError(f"rollout_func {name} returned no {', '.join(missing)} (it must return {', '.join(REQUIRED)})")
    for key, values in out.items():
        if not hasattr(values, "__len__") or len(values) != len(prompts):
            raise RolloutError(f"rollout_func {name}: {key!r} must have one entry per prompt ({len(prompts)}: each of the "
                               f"{len(examples)} prompts {n} times); got {len(values) if hasattr(values, '__len__') else values!r}")
    extra = [k for k in out if k not in (*REQUIRED, "env_mask")]
    # As TRL: a completion that does not end in an end-of-sequence (or padding) token was cut off.
    ends = set(getattr(sampler, "eos", None) or {tokenizer.eos_token_id}) | {tokenizer.pad_token_id}
    # the ids the model can read: the tokenizer's, or the model's embedding rows where it has more (padded)
    config = getattr(getattr(sampler, "model", None), "config", None)
    vocab = max(len(tokenizer) if hasattr(tokenizer, "__len__") else 0, getattr(config, "vocab_size", None) or 0) or None
    rollouts = []
    for i in range(len(prompts)):
        completion = _ids(out["completion_ids"][i], "completion_ids", name, i, vocab)
        try:
            logprobs = [float(x) for x in out["logprobs"][i]]
        except (TypeError, ValueError):
            raise RolloutError(f"rollout_func {name}: logprobs {i} is {short(out['logprobs'][i])}, not a list of numbers") from None
        if len(logprobs) != len(completion):
            raise RolloutError(f"rollout_func {name}: completion {i} has {len(completion)} tokens but {len(logprobs)} logprobs")
        mask = None
        if "env_mask" in out:
            mask = [bool(m) for m in out["env_mask"][i]]
            if len(mask) != len(completion):
                raise RolloutError(f"rollout_func {name}: env_mask {i} has {len(mask)} entries for {len(completion)} tokens")
        finish = "stop" if completion and completion[-1] in ends else "length"
        text = tokenizer.decode(completion, skip_special_tokens=True)
        rollouts.append(Rollout(_ids(out["prompt_ids"][i], "prompt_ids", name, i, vocab), completion, logprobs, finish, text, mask=mask,
                                info={"fields": {k: out[k][i] for k in extra}}))
    return [rollouts[g * n : (g + 1) * n] for g in range(len(examples))]
