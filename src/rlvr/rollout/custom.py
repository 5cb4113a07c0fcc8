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

import dataclasses

from rlvr.plugins import load_named, register
from rlvr.rollout import RolloutError
from rlvr.rollout.multiturn import mix_seed
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

    def generate(self, prompt_ids: list[list[int]], n: int = 1, max_tokens: int | None = None) -> list[list[Rollout]]:
        """Per prompt, n Rollouts from the run's sampler; seeded from the step's streams, so a resumed
        run samples the same."""
        params = dataclasses.replace(self._params, n=n, max_tokens=max_tokens or self._params.max_tokens)
        generator = self._generator
        if isinstance(generator, GroupGenerators):  # one stream per prompt given, derived from the step's first
            generator = GroupGenerators([mix_seed(generator.seeds[0], i, self._calls) for i in range(len(prompt_ids))])
        self._calls += 1
        return self._sampler.generate(prompt_ids, params, generator)


def custom_rollouts(fn, args, tokenizer, sampler, examples, params, generator) -> list[list[Rollout]]:
    """Per example, params.n Rollouts made by `fn`, which sees `args` as trainer.args (RolloutContext).
    A completion that does not end in an end-of-sequence or padding token was cut: finish "length" (as TRL)."""
    n = params.n
    prompts = [ex.prompt for ex in examples for _ in range(n)]
    out = fn(prompts, RolloutContext(args, tokenizer, sampler, params, generator))
    name = getattr(fn, "__name__", "rollout_func")
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
    rollouts = []
    for i in range(len(prompts)):
        completion = [int(t) for t in out["completion_ids"][i]]
        logprobs = [float(x) for x in out["logprobs"][i]]
        if len(logprobs) != len(completion):
            raise RolloutError(f"rollout_func {name}: completion {i} has {len(completion)} tokens but {len(logprobs)} logprobs")
        mask = None
        if "env_mask" in out:
            mask = [bool(m) for m in out["env_mask"][i]]
            if len(mask) != len(completion):
                raise RolloutError(f"rollout_func {name}: env_mask {i} has {len(mask)} entries for {len(completion)} tokens")
        finish = "stop" if completion and completion[-1] in ends else "length"
        text = tokenizer.decode(completion, skip_special_tokens=True)
        rollouts.append(Rollout([int(t) for t in out["prompt_ids"][i]], completion, logprobs, finish, text, mask=mask,
                                info={"fields": {k: out[k][i] for k in extra}}))
    return [rollouts[g * n : (g + 1) * n] for g in range(len(examples))]
