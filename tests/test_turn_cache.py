"""Multi-turn rollouts whose later turns go on from the cache kept from the turn before (rollout/turns.py)
sample what prefilling the whole history again samples: the same tokens, log-probs, masks, finish reasons
and texts, greedy and seeded, on the in-process engines (generic, fast, and the fast one's static decode
step that CUDA graphs replay, run eagerly here), with rows ending at different turns and chunks smaller
than the rows; and they hold caches only for live rollouts."""

from __future__ import annotations

import pytest
import torch

from rlvr.config import build_config
from rlvr.environments import Step
from rlvr.rollout import SamplingParams
from rlvr.rollout import multiturn
from rlvr.rollout.engine import FastSampler, GraphSampler, HFSampler
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.turns import TurnCaches
from rlvr.types import Example


class EchoEnv:
    """Answers each turn with an observation whose length depends on the turn's text and the example, and ends
    the rollout on some of them: rollouts end at different turns, with different histories, also greedy."""

    stop_strings = ["\n", "e", "a", "o", "1"]  # frequent in the tiny model's turns: most turns end at one

    def reset(self, example):
        self.seed, self.turns = len(example.prompt), 0
        return None

    def step(self, text):
        self.turns += 1
        key = len(text) + self.seed + self.turns
        return Step("ok " + "x" * (key % 7), done=key % 4 == 0)


@pytest.fixture(scope="module")
def tiny():
    from conftest import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer()
    return make_tiny_model(len(tokenizer)).eval(), tokenizer


def _sampler(kind, model, tokenizer, max_batch_size):
    eos = [tokenizer.eos_token_id]
    if kind == "graph":
        return GraphSampler(model, tokenizer, eos, max_batch_size=max_batch_size, graphs=False)
    return {"generic": HFSampler, "fast": FastSampler}[kind](model, tokenizer, eos, max_batch_size=max_batch_size)


def _rollouts(sampler, tokenizer, turn_cache: bool, temperature: float, max_turns: int = 4):
    cfg = build_config({"environment": "test_turn_cache:EchoEnv", "max_turns": max_turns, "max_completion_length": 120,
                        "turn_cache": turn_cache})
    multi = multiturn.MultiTurn(cfg.rollout_settings, cfg.data_settings, tokenizer, EchoEnv, name="EchoEnv")
    examples = [Example(q) for q in ("what is 3+5?", "hi", "name a prime below 20 please")]
    params = SamplingParams(n=3, max_tokens=120, temperature=temperature)
    generator = GroupGenerators([11, 12, 13]) if temperature else None
    _, groups = multi.generate(sampler, examples, [ex.prompt for ex in examples], params, generator)
    return [r for group in groups for r in group]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("max_batch_size", [64, 4], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("kind", ["generic", "fast", "graph"])
def test_later_turns_on_the_kept_cache_sample_what_a_prefill_of_the_history_samples(tiny, kind, max_batch_size, temperature):
    model, tokenizer = tiny
    sampler = _sampler(kind, model, tokenizer, max_batch_size)
    prefilled = _rollouts(sampler, tokenizer, turn_cache=False, temperature=temperature)
    runs = {"prefill": 0, "extend": 0}
    for name in runs:  # count the calls of each way to start a chunk
        original = getattr(sampler, f"_{name}")
        setattr(sampler, f"_{name}", lambda *a, _f=original, _n=name, **k: (runs.__setitem__(_n, runs[_n] + 1), _f(*a, **k))[1])
    kept = _rollouts(sampler, tokenizer, turn_cache=True, temperature=temperature)
    turns = [r.info["turns"] for r in kept]
    assert len(set(turns)) > 1 and max(turns) >= 3  # rollouts end at different turns, some after three or more
    assert {r.finish_reason for r in kept} == ({"stop", "length"} if temperature else {"stop"})  # sampled: one runs out of budget
    # the first turn alone is prefilled (3 prompts of 3 completions: one chunk, or three of one prompt each)
    assert runs["prefill"] == (1 if max_batch_size == 64 else 3) and runs["extend"] >= max(turns) - 1
    for a, b in zip(prefilled, kept):
        assert a.completion_ids == b.completion_ids and a.mask == b.mask
        assert a.finish_reason == b.finish_reason and a.text == b.text and a.info["turns"] == b.info["turns"]
        assert a.messages == b.messages
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_caches_are_held_only_for_live_rollouts_and_let_go_at_the_end(tiny, monkeypatch):
    model, tokenizer = tiny
    made: list[TurnCaches] = []
    seen: list[tuple[int, int]] = []  # (caches held, rollouts still live) when a later turn asks for them

    class Watched(TurnCaches):
        def __init__(self):
            super().__init__()
            made.append(self)

        def keep(self, keys):
            keys = list(keys)
            super().keep(keys)
            seen.append((len(self), len(keys)))

    monkeypatch.setattr(multiturn, "TurnCaches", Watched)
    rollouts = _rollouts(FastSampler(model, tokenizer, [tokenizer.eos_token_id]), tokenizer, True, 1.0)
    assert len(made) == 1 and len(made[0]) == 0  # nothing held once generate returned
    assert seen and all(held <= live for held, live in seen) and any(held for held, _ in seen)
    assert any(r.info["turns"] == 4 for r in rollouts)  # the last turn ran on kept caches, and kept none


def test_a_kept_cache_must_be_a_prefix_of_the_history(tiny):
    model, tokenizer = tiny
    sampler = FastSampler(model, tokenizer, [tokenizer.eos_token_id])
    caches = TurnCaches()
    ids = tokenizer("say hi", add_special_tokens=False)["input_ids"]
    params = SamplingParams(n=1, max_tokens=30, temperature=0, stop_strings=("\n", "i"))  # the tiny model greedy: "iii..."
    (first,), = sampler.generate([ids], params, None, turns=caches, keys=["a"])
    held = caches.held["a"]  # the prompt and the turn, less its last token (sampled, not run)
    assert first.finish_reason == "stop" and held.ids == ids + first.completion_ids[:-1] and held.keys.shape[-1] == len(held.ids)
    with pytest.raises(ValueError, match="not a prefix"):
        sampler.generate([[ids[0] + 1] + ids[1:] + first.completion_ids], params, None, turns=caches, keys=["a"])
    with pytest.raises(ValueError, match="one key per completion"):
        sampler.generate([ids], params, None, turns=caches)
