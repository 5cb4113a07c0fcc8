"""What a vLLM sampler sends with each request, the same from an engine in this process
(rollout/vllm.py) and to `rlvr vllm-serve` (rollout/vllm_client.py): the prompts, checked; the
sampling settings as a JSON-ready dict; one seed per prompt.  The dict's max_tokens is one number for
every prompt, or a list of one per prompt (partial rollouts continue each completion for what it has
left: rollout/vllm_partial.py); `max_tokens_of` reads it, `for_prompts` cuts it to some of the prompts.

Seeds.  Each prompt gets a seed from its group's own stream (request_seeds), so a run with a
fixed seed is reproducible and a group's completions do not depend on which process, server or
worker sampled it.
"""

from __future__ import annotations

import torch

from rlvr.rollout import SamplingParams
from rlvr.rollout.sampling import GroupGenerators


def draw_seeds(count: int, generator: torch.Generator | None) -> list[int]:
    """One vLLM seed per prompt, from the trainer's generator (fresh randomness without one)."""
    return torch.randint(0, 2**31 - 1, (count,), generator=generator).tolist()


def request_seeds(count: int, generator) -> list[int]:
    """One vLLM seed per prompt.  From a GroupGenerators (one seeded stream per group) each group's
    seed is drawn from its own stream, so the completions of a group depend on its seed alone.
    (vLLM gives a request's n completions seed, seed + 1, ...: hence drawn, not numbered in a row.)"""
    if isinstance(generator, GroupGenerators):
        return [int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(s))) for s in generator.seeds]
    return draw_seeds(count, generator)


def params_dict(params: SamplingParams, eos_token_ids: list[int]) -> dict:
    return {"n": params.n, "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
            "stop_strings": list(params.stop_strings), "eos_token_ids": eos_token_ids}


def max_tokens_of(params: dict, i: int) -> int:
    """The most tokens prompt i of a request may be given."""
    each = params["max_tokens"]
    return each[i] if isinstance(each, list) else each


def for_prompts(params: dict, rows: list[int]) -> dict:
    """The settings of the listed prompts alone (a share of a request sent to one server)."""
    if not isinstance(params["max_tokens"], list):
        return params
    return {**params, "max_tokens": [params["max_tokens"][i] for i in rows]}


def check_prompts(prompt_ids) -> None:
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("cannot sample from an empty prompt")
