"""Partial rollouts whose carried completions go on from the cache kept from their round before
(rollout/turns.py, HFSampler.resume, RolloutStage.sample_partial): round by round they sample what one
uninterrupted call samples, and what prefilling every carried completion again samples (tokens, log-probs,
finish reasons, texts), greedy and seeded, on the in-process engines (generic, fast, and the fast one's
static decode step that CUDA graphs replay, run eagerly here), with new prompts' groups started beside
carried rows and chunks smaller than the rows; a carried completion runs one token, not its history; the
caches held are those of the completions still carried, and none after a rewind."""

from __future__ import annotations

import pytest
import torch

from rlvr.rewards import Scores
from rlvr.rollout import SamplingParams
from rlvr.rollout.engine import FastSampler, GraphSampler, HFSampler
from rlvr.rollout.generation import Generations, GenerationSettings
from rlvr.rollout.producer import WeightVersions
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.stage import RolloutStage
from rlvr.rollout.turns import TurnCaches
from rlvr.tasks import PromptStream
from rlvr.types import Example, Rollout

QUESTIONS = ("what is 3+5?", "hi", "name a prime below 20 please", "7 - 1 =")
# Greedy, the tiny model repeats one character per prompt ("???...", "iii...", "eee...", "===..."): these stop
# its completions after 7, 5 and 11 tokens and leave the fourth to max_tokens; sampled, "1" and "a" stop some early.
STOPS = ("???????", "iiiii", "eeeeeeeeeee", "1", "a")


@pytest.fixture(scope="module")
def tiny():
    from conftest import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer()
    return make_tiny_model(len(tokenizer)).eval(), tokenizer


def _sampler(kind, model, tokenizer, max_batch_size=64):
    eos = [tokenizer.eos_token_id]
    if kind == "graph":
        return GraphSampler(model, tokenizer, eos, max_batch_size=max_batch_size, graphs=False)
    return {"generic": HFSampler, "fast": FastSampler}[kind](model, tokenizer, eos, max_batch_size=max_batch_size)


def _counted(sampler) -> list[tuple[tuple, int]]:
    """Record (history, tokens run) for each prompt a chunk starts from, by _prefill or _extend."""
    runs = []
    prefill, extend = sampler._prefill, sampler._extend

    def _prefill(prompts, n, max_new):
        runs.extend((tuple(p), len(p)) for p in prompts)
        return prefill(prompts, n, max_new)

    def _extend(prompts, kept, n, max_new):
        runs.extend((tuple(p), len(p) - (len(h.ids) if h is not None else 0)) for p, h in zip(prompts, kept))
        return extend(prompts, kept, n, max_new)

    sampler._prefill, sampler._extend = _prefill, _extend
    return runs


def _in_rounds(sampler, prompts, params, seeds, caches: TurnCaches | None):
    """The groups of `prompts` sampled round by round as the rollout stage samples them: all but the last
    prompt start in round 1, the last in round 2 beside the carried completions.  Each group draws from its
    own stream (seeds), continued from round to round, so that seeded rounds can equal one call.  Returns
    (the rollouts, group after group; the rounds run)."""
    streams = GroupGenerators(seeds) if seeds else None
    groups: list[list[Rollout]] = []
    rounds = 0
    while rounds < 2 or any(r.finish_reason == "partial" for g in groups for r in g):
        started = prompts[:-1] if rounds == 0 else prompts[-1:] if rounds == 1 else []
        groups += [[Rollout(p, [], [], "partial", "") for _ in range(params.n)] for p in started]  # after the carried rows
        rows = [(g, j) for g, group in enumerate(groups) for j, r in enumerate(group) if r.finish_reason == "partial"]
        per_row = None
        if streams:
            counts = [sum(1 for g, _ in rows if g == group) for group in range(len(groups))]
            per_row = GroupGenerators.per_row([(streams.pick([g]), c) for g, c in enumerate(counts) if c])
        kept = {} if caches is None else {"turns": caches, "keys": rows}
        for (g, j), r in zip(rows, sampler.resume([groups[g][j] for g, j in rows], params, per_row, **kept)):
            groups[g][j] = r
        rounds += 1
        if caches is not None:  # held: the caches of the completions the round cut, and only those
            assert set(caches.held) == {(g, j) for g, group in enumerate(groups) for j, r in enumerate(group)
                                        if r.finish_reason == "partial"}
    return [r for g in groups for r in g], rounds


def _same(a: list[Rollout], b: list[Rollout]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.prompt_ids, x.completion_ids, x.finish_reason, x.text) == (y.prompt_ids, y.completion_ids, y.finish_reason, y.text)
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("max_batch_size", [64, 4], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("kind", ["generic", "fast", "graph"])
def test_rounds_on_kept_caches_sample_what_one_call_and_a_prefill_each_round_sample(tiny, kind, max_batch_size, temperature):
    model, tokenizer = tiny
    prompts = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    params = SamplingParams(n=3, max_tokens=14, temperature=temperature, stop_strings=STOPS, round_tokens=3)
    seeds = [21, 22, 23, 24] if temperature else None
    sampler, again = _sampler(kind, model, tokenizer, max_batch_size), _sampler(kind, model, tokenizer, max_batch_size)
    prefilled_runs, kept_runs = _counted(again), _counted(sampler)
    prefilled, _ = _in_rounds(again, prompts, params, seeds, None)
    caches = TurnCaches()
    kept, rounds = _in_rounds(sampler, prompts, params, seeds, caches)
    assert rounds == 6 and len(caches) == 0  # 14 tokens in rounds of 3 from round 2 for the last prompt; none held at the end
    assert {"stop", "length"} <= {r.finish_reason for r in kept} and "partial" not in {r.finish_reason for r in kept}
    assert len({len(r.completion_ids) for r in kept}) >= 3  # completions end in different rounds
    _same(kept, prefilled)
    # A carried completion's history is longer than its prompt: prefilled whole each round without the caches,
    # one token (the last sampled) on them; a new prompt runs whole, once for its group in one chunk.
    carried = [run for history, run in kept_runs if list(history) not in prompts]
    assert carried and all(run == 1 for run in carried)
    assert all(run == len(history) for history, run in prefilled_runs)
    assert any(run > 3 for history, run in prefilled_runs if list(history) not in prompts)
    new = [history for history, _ in kept_runs if list(history) in prompts]
    if max_batch_size == 64:
        assert sorted(new) == sorted(tuple(p) for p in prompts)
    else:  # a group split between two chunks runs its prompt in each
        assert len(new) >= len(prompts)
    if temperature == 0.0 or max_batch_size == 64:  # (chunks split a group's rows, which then draw its stream in another order)
        whole = sampler.generate(prompts, SamplingParams(n=3, max_tokens=14, temperature=temperature, stop_strings=STOPS),
                                 GroupGenerators(seeds) if seeds else None)
        _same(kept, [r for g in whole for r in g])


def test_rows_of_one_history_go_on_as_one_from_the_first_of_their_caches(tiny):
    """Greedy, a group's three completions are identical: their rows run as one (repeated, as a new prompt's
    are), on the first of their three caches, and the other two are let go, not left behind."""
    model, tokenizer = tiny
    sampler = FastSampler(model, tokenizer, [tokenizer.eos_token_id])
    runs = _counted(sampler)
    caches = TurnCaches()
    params = SamplingParams(n=3, max_tokens=6, temperature=0.0, round_tokens=3)
    blank = [Rollout(tokenizer.encode("hi", add_special_tokens=False), [], [], "partial", "")] * 3
    first = sampler.resume(blank, params, None, caches, ["a", "b", "c"])
    assert len(caches) == 3 and all(r.completion_ids == first[0].completion_ids for r in first)
    second = sampler.resume(first, params, None, caches, ["a", "b", "c"])
    assert runs == [(tuple(blank[0].prompt_ids), 2), (tuple(first[0].prompt_ids + first[0].completion_ids), 1)]
    assert {r.finish_reason for r in second} == {"length"} and len(caches) == 0


# --- the rollout stage: caches follow the carried groups --------------------------------------------------


class LengthPath:
    """A rollout path of the tiny model: prompts as they are, a completion's reward its length."""

    def __init__(self, sampler, tokenizer):
        self.sampler, self.tokenizer = sampler, tokenizer

    def render(self, prompts):
        return list(prompts)

    def tokenize(self, texts):
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def score(self, examples, groups, texts, state):
        rewards = [float(len(r.completion_ids)) for g in groups for r in g]
        return Scores(rewards, {"length": rewards})


class NoKL:
    def penalize(self, totals, rollouts, pad_id, size):
        return totals, None


def _generations(tiny, k=2):
    """Generations of 2 groups of 3, 3 tokens a round, on the stage.  Greedy, the first prompt's group runs to
    its 40 tokens (14 rounds), carried from generation to generation, while each of the others stops after
    5 or 7 tokens ("hi", "what is 3+5?")."""
    model, tokenizer = tiny
    sampler = FastSampler(model, tokenizer, [tokenizer.eos_token_id])
    params = SamplingParams(n=3, max_tokens=40, temperature=0.0, stop_strings=STOPS)
    stage = RolloutStage(LengthPath(sampler, tokenizer), params)
    settings = GenerationSettings(num_generations=3, prompts_per_step=2, scale_rewards="group", advantage_estimator="grpo",
                                  normalize_then_sum=False, mask_truncated_completions=False, dynamic_sampling=False,
                                  max_sampling_rounds=0, num_completions_to_print=None, sample_ahead=True, skip_without_signal=True,
                                  turn_advantage="rollout")
    prompts = PromptStream([Example(q) for q in ("7 - 1 =", *("hi", "what is 3+5?") * 10)], seed=0, shuffle=False)
    versions = WeightVersions(lambda: None)
    gens = Generations(settings, stage, prompts, torch.Generator().manual_seed(5), NoKL())
    gens.carry_partials(3, versions, k)
    return gens, stage, versions


def _kept_keys(gens) -> set:
    """The (group key, member) of each completion carried on and not done: those whose caches may be held."""
    return {(g.key, j) for g in gens.carry[0] for j, r in enumerate(g.rollouts) if r.finish_reason == "partial"}


def _sampled(gen) -> list:
    return [(g.example.prompt, r.completion_ids, r.finish_reason) for g in gen.parts[0] for r in g.rollouts]


def test_the_stage_holds_the_caches_of_the_completions_it_carries_and_no_others(tiny):
    gens, stage, versions = _generations(tiny, k=1)
    first = gens.generate(None)
    assert first.metrics["sampling/rounds"] >= 1 and gens.carry[0]  # rounds, and groups carried on
    assert stage.kept.held and set(stage.kept.held) == _kept_keys(gens)
    versions.held = versions.current = 2  # two steps on: the groups carried are too old for max_staleness=1
    second = gens.generate(None)
    assert second.stale_groups == first.metrics["sampling/carried_groups"]  # all dropped, before more was sampled
    assert set(stage.kept.held) == _kept_keys(gens)  # their caches went with them


def test_a_rewind_lets_the_kept_caches_go_and_samples_the_same_again(tiny):
    """A generation rewound (the producer stopped for a checkpoint) puts back groups whose kept caches
    ran further on: they are let go, and the generation sampled again (prefilling the carried completions
    once) is the one sampled before; its rounds keep caches again."""
    gens, stage, _ = _generations(tiny)
    prompts = {tuple(ids) for ids in stage.path.tokenize(QUESTIONS)}
    gens.generate(None)
    before, carried = gens.position(), {g.key for g in gens.carry[0]}
    runs = _counted(stage.sampler)
    second = gens.generate(None)
    assert carried & {g.key for g in gens.carry[0]}  # a group carried through: its cache is of a longer history now
    assert all(run == 1 for history, run in runs if history not in prompts)
    gens.rewind(before)
    assert len(stage.kept) == 0
    runs.clear()
    again = gens.generate(None)
    continued = [run for history, run in runs if history not in prompts]
    assert continued[0] > 1 and 1 in continued  # the carried completions were prefilled once, then went on from caches
    assert _sampled(again) == _sampled(second)
    assert stage.kept.held and set(stage.kept.held) == _kept_keys(gens)


def test_groups_of_a_checkpoint_written_before_groups_had_keys_are_given_keys(tiny):
    gens, _, _ = _generations(tiny)
    gens.generate(None)
    old = []
    for g in gens.carry[0]:  # as pickle gives back a group saved without the field
        bare = object.__new__(type(g))
        object.__setattr__(bare, "__dict__", {k: v for k, v in g.__dict__.items() if k != "key"})
        old.append(bare)
    assert old and not hasattr(old[0], "key")
    gens.restore_carry((tuple(old), ()))
    assert all(hasattr(g, "key") for g in gens.carry[0]) and len({g.key for g in gens.carry[0]}) == len(old)
    gens.generate(None)  # carried on from them (prefilled once)


# --- a run of the tiny model -------------------------------------------------------------------------------


@pytest.mark.trains
@pytest.mark.parametrize("turn_cache", [True, False])
def test_a_run_with_partial_rollouts_continues_carried_completions_from_their_caches(tiny_model_dir, tmp_path, monkeypatch,
                                                                                    turn_cache):
    """3 steps of the free-running producer, 3 tokens a round: each carried completion a round continues
    runs only its last token on its kept cache (turn_cache=false: none is kept, each is prefilled)."""
    from conftest import free_running_run

    continued = []  # tokens run for a completion continued from a kept cache
    extend = FastSampler._extend

    def _extend(self, prompts, kept, n, max_new):
        continued.extend(len(p) - len(h.ids) for p, h in zip(prompts, kept) if h is not None)
        return extend(self, prompts, kept, n, max_new)

    monkeypatch.setattr(FastSampler, "_extend", _extend)
    rows = free_running_run(tiny_model_dir, tmp_path, num_generations=4, max_completion_length=12, stop_strings=["1"],
                            max_steps=3, partial_rollout_tokens=3, turn_cache=turn_cache)
    # the first generation (sampled before any update, the same in every run) took rounds: completions were carried
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["sampling/rounds"] >= 2, rows[0]["sampling/rounds"]
    assert (continued and set(continued) == {1}) if turn_cache else continued == []
