"""Rollout: sample G completions per prompt.

Every sampler takes token ids of prompts and SamplingParams and returns, per
prompt, `n` Rollouts (token ids, sampling log-probs, finish reason, text).
The in-process engine (rollout/engine.py) runs a Hugging Face model with a KV
cache; vLLM (rollout/vllm.py) implements the same `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlvr.types import Rollout


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_strings: tuple = ()


def pad_token_id(tokenizer, eos_token_ids: list[int]) -> int:
    """The id that pads a batch of completions: the tokenizer's pad token, else the first EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]


class Sampler(Protocol):
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[list[Rollout]]: ...
