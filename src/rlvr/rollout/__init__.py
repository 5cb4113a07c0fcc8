"""Rollout: sample G completions per prompt.

Every sampler takes token ids of prompts and SamplingParams and returns, per
prompt, `n` Rollouts (token ids, sampling log-probs, finish reason, text).
The in-process engine (rollout/engine.py) runs a Hugging Face model with a KV
cache; vLLM (rollout/vllm.py) implements the same `generate`.

`sampling_params` is the one place where the sampling settings become the
SamplingParams the samplers use, for training, evaluation and `rlvr sample` alike;
`generation_settings` applies `generation_kwargs` (TRL's extra GenerationConfig /
vLLM SamplingParams arguments) over the settings' own.  rollout/path.py takes
prompts through a sampler to scored completions with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rlvr.types import Rollout
from rlvr.errors import RolloutError  # noqa: F401 - raised here, defined in the leaf errors.py

if TYPE_CHECKING:
    from rlvr.config import SamplingSettings


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    repetition_penalty: float = 1.0  # CTRL's penalty on tokens already in the prompt or completion; 1 = off
    stop_strings: tuple = ()
    # Partial rollouts (partial_rollout_tokens): the most tokens a completion gets in this call; one not done
    # by then ends with finish_reason "partial" and is continued later (the sampler's resume: HFSampler.resume,
    # or vLLM's through rollout/vllm_partial.py).  0: to the end.
    round_tokens: int = 0


# generation_kwargs keys, by their transformers / vLLM names -> the rlvr setting each one sets
GENERATION_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "stop_strings": "stop_strings", "stop": "stop_strings"}
LENGTH_KWARGS = ("max_new_tokens", "max_tokens")  # max_completion_length by other names: accepted only equal to it


def generation_settings(section: SamplingSettings) -> tuple[dict, list[str]]:
    """(settings, problems): the training rollouts' sampling settings by rlvr name, with
    section.generation_kwargs applied over the section's own, as TRL lets them override; and what is wrong
    with generation_kwargs (a key rlvr does not support yet, a value of the wrong kind), that key
    then left out.  min_p None means off, as in the config."""
    settings = {"temperature": section.temperature, "top_p": section.top_p, "top_k": section.top_k, "min_p": section.min_p,
                "repetition_penalty": section.repetition_penalty, "stop_strings": tuple(section.stop_strings)}
    problems = []
    for key, value in section.generation_kwargs.items():
        name, where = GENERATION_KWARGS.get(key), f"generation_kwargs.{key}"
        if name == "stop_strings":
            value = [value] if isinstance(value, str) else value
            if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
                settings[name] = tuple(value)
            else:
                problems.append(f"{where} must be a string or a list of strings; got {value!r}")
        elif name == "top_k":
            value = 0 if value in (None, -1) else value  # transformers' None and vLLM's -1: no top-k, rlvr's 0
            if _is_number(value, whole=True):
                settings[name] = value
            else:
                problems.append(f"{where} must be a whole number; got {value!r}")
        elif name is not None:
            if _is_number(value) or (name == "min_p" and value is None):
                settings[name] = None if value is None else float(value)
            else:
                problems.append(f"{where} must be a number; got {value!r}")
        elif key in LENGTH_KWARGS:
            if value != section.max_completion_length:
                problems.append(f"{where}={value!r}: set max_completion_length={value} instead (it also sets the "
                                "length rewards' limit and vLLM's context)")
        elif key == "do_sample":
            if value is not True:
                problems.append(f"{where}={value!r}: training rollouts are always sampled (evaluation is greedy "
                                "with eval_temperature=0)")
        else:
            known = ", ".join([*GENERATION_KWARGS, *LENGTH_KWARGS, "do_sample"])
            problems.append(f"{where} is not supported yet; generation_kwargs may set: {known}")
    return settings, problems


def sampling_params(settings, n: int | None = None, eval_temperature: float | None = None) -> SamplingParams:
    """SamplingParams from the rollout settings (cfg.rollout_settings, or a Config), for
    training, evaluation and `rlvr sample` alike:

    - training (the default): num_generations completions of each prompt at the training settings,
      generation_kwargs applied over them;
    - evaluation (eval_temperature given): at that temperature, with the training truncation
      (top_k, top_p, min_p) only when sampled (eval_temperature > 0), the stop strings always, and
      no repetition penalty: it changes what the model would say, and evaluation measures the model;
    - n: that many completions of each prompt instead of num_generations (eval_num_samples, or
      `rlvr sample`'s n).

    max_completion_length bounds each completion (with tools, all of its turns together)."""
    values, problems = generation_settings(settings)
    if problems:  # settings.check_settings reports these before a model loads
        from rlvr.errors import ConfigError

        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    values["min_p"] = values["min_p"] or 0.0  # None: off
    if eval_temperature is not None:
        sampled = eval_temperature > 0
        values = {"temperature": eval_temperature, "top_p": values["top_p"] if sampled else 1.0,
                  "top_k": values["top_k"] if sampled else 0, "min_p": values["min_p"] if sampled else 0.0,
                  "stop_strings": values["stop_strings"]}
    return SamplingParams(n=settings.num_generations if n is None else n, max_tokens=settings.max_completion_length, **values)


def _is_number(value, whole: bool = False) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (not whole and isinstance(value, float))


def ends_with_stop(ids: list[int], stops, tokenizer) -> bool:
    """Whether a stop string is in the decoded last few tokens of `ids` (each token decodes to at least one
    character, so a stop string the last token completes is in them): the in-process engine's check after
    each token, and vLLM's continued completions' (rollout/vllm_partial.py)."""
    window = max(len(s) for s in stops) + 2
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=True)
    return any(s in tail for s in stops)


def decoded_text(ids: list[int], stops, eos, tokenizer) -> str:
    """A completion's text as rlvr's samplers write it: its tokens decoded without the EOS token, cut
    before the first stop string."""
    if ids and ids[-1] in eos:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def pad_token_id(tokenizer, eos_token_ids: list[int]) -> int:
    """The id that pads a batch of completions: the tokenizer's pad token, else the first EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]


class Sampler(Protocol):
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[list[Rollout]]: ...
