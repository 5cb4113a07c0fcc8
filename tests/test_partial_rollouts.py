"""Partial rollouts (partial_rollout_tokens, rollout/generation.py): the engine continues a completion
exactly where it stopped; a generation is made of the groups that are done, long ones carried to the
next, in an order worked out by hand; a carried group that could no longer be trained is dropped and
counted, before more is sampled for it and again when its generation is taken; and runs of the tiny
model (the bound holds per token, it learns, a stopped run resumes with its carried groups)."""

import copy
import json

import pytest
import torch
from conftest import free_running_run, metrics_rows, stop_in_update

from rlvr.config import ConfigError, build_config
from rlvr.rewards import Scores
from rlvr.rollout import SamplingParams
from rlvr.rollout.generation import Generations, GenerationSettings
from rlvr.rollout.home import HomeThread
from rlvr.rollout.producer import Producer, WeightVersions
from rlvr.rollout.stage import Sampled
from rlvr.run import train
from rlvr.tasks import PromptStream
from rlvr.types import Example, PartialGroup, Rollout

# --- the engine: a completion continued where it stopped ------------------------------------------


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "generic"])
def test_a_completion_resumed_round_by_round_is_the_one_sampled_in_one_go(tiny, fast):
    """Greedy, so the tokens depend on the weights alone: 3 tokens a round, resumed until done, gives the
    same tokens, log-probs, finish reasons and texts as one call; what is carried says "partial"."""
    from rlvr.rollout.engine import FastSampler, HFSampler

    model, tokenizer = tiny
    sampler = (FastSampler if fast else HFSampler)(copy.deepcopy(model).eval(), tokenizer, [10**6])
    prompts = [tokenizer.encode("what is 2 + 3?"), tokenizer.encode("7 - 1 =")]
    whole = SamplingParams(n=3, max_tokens=10, temperature=0.0, stop_strings=("9",))
    in_one_go = [r for g in sampler.generate(prompts, whole) for r in g]
    rounds = SamplingParams(n=3, max_tokens=10, temperature=0.0, stop_strings=("9",), round_tokens=3)
    out = [r for g in sampler.generate(prompts, rounds) for r in g]
    assert all(r.finish_reason == "partial" and len(r.completion_ids) == 3 for r in out if r.finish_reason != "stop")
    calls = 1
    while any(r.finish_reason == "partial" for r in out):
        carried = [i for i, r in enumerate(out) if r.finish_reason == "partial"]
        for i, r in zip(carried, sampler.resume([out[i] for i in carried], rounds)):
            assert r.prompt_ids == out[i].prompt_ids and r.completion_ids[: len(out[i].completion_ids)] == out[i].completion_ids
            out[i] = r
        calls += 1
    assert calls >= 3  # 10 tokens in rounds of 3: four calls where a completion runs the whole length
    for a, b in zip(out, in_one_go):
        assert (a.completion_ids, a.finish_reason, a.text) == (b.completion_ids, b.finish_reason, b.text)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert {r.finish_reason for r in out} <= {"stop", "length"}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "generic"])
def test_new_prompts_started_as_empty_partials_draw_what_their_groups_draw_in_one_call(tiny, fast):
    """A partial-rollout round decodes the new prompts' completions in the same call as the carried ones,
    each started as an empty partial with its group's stream repeated for its G rows
    (GroupGenerators.per_row) and its prompt prefilled once for them: sampled at temperature 1, with a
    repetition penalty, they are exactly the completions generate() draws for the prompts' groups."""
    from rlvr.rollout.engine import FastSampler, HFSampler
    from rlvr.rollout.sampling import GroupGenerators

    model, tokenizer = tiny
    sampler = (FastSampler if fast else HFSampler)(copy.deepcopy(model).eval(), tokenizer, [10**6])
    prompts = [tokenizer.encode("what is 2 + 3?"), tokenizer.encode("7 - 1 =")]
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, top_p=0.9, repetition_penalty=1.2)
    groups = [r for g in sampler.generate(prompts, params, GroupGenerators([5, 6])) for r in g]
    blank = [Rollout(p, [], [], "partial", "") for p in prompts for _ in range(3)]
    rows = sampler.resume(blank, params, GroupGenerators.per_row([(GroupGenerators([5, 6]), 3)]))
    assert [r.completion_ids for r in rows] == [r.completion_ids for r in groups]
    assert all(r.logprobs == pytest.approx(g.logprobs, abs=1e-4) and r.prompt_ids == g.prompt_ids for r, g in zip(rows, groups))


def test_a_resumed_completion_keeps_its_token_versions_and_gets_the_held_one_after(tiny):
    from rlvr.rollout.engine import FastSampler

    model, tokenizer = tiny
    sampler = FastSampler(copy.deepcopy(model).eval(), tokenizer, [10**6])

    class Held:  # the producer's WeightVersions, as the engine sees it: no load, version 5 held
        held = 5

        def refresh(self):
            return False

    sampler.live = Held()
    partial = Rollout(tokenizer.encode("1 + 1 ="), [5, 6], [-1.0, -2.0], "partial", "", versions=[3, 4])
    (r,) = sampler.resume([partial], SamplingParams(n=4, max_tokens=5, round_tokens=2))
    assert r.completion_ids[:2] == [5, 6] and r.logprobs[:2] == [-1.0, -2.0]
    assert r.versions == [3, 4, 5, 5] and r.finish_reason == "partial"


# --- a generation's rounds, worked out by hand --------------------------------------------------------


class LengthStage:
    """A rollout stage whose completions of prompt P are LENGTHS[P] tokens long (each token the sampler's
    held version), decoded round_tokens at a time; the reward of a completion is its length."""

    pad_id, tokenizer = 0, None

    def __init__(self, lengths):
        self.lengths, self.calls = lengths, []

    def sample_partial(self, examples, carried, generator, state, round_tokens, version):
        self.calls.append(([g.example.prompt for g in carried], [ex.prompt for ex in examples]))

        def more(r, total):
            n = min(round_tokens, total - len(r.completion_ids))
            ids = r.completion_ids + [7] * n
            finish = "partial" if len(ids) < total else "stop"
            return Rollout(r.prompt_ids, ids, r.logprobs + [-1.0] * n, finish, "x" * len(ids), versions=r.versions + [version] * n)

        every = [PartialGroup(g.example, g.text, tuple(more(r, self.lengths[g.example.prompt] + j) if r.finish_reason == "partial"
                                                       else r for j, r in enumerate(g.rollouts))) for g in carried]
        blank = Rollout([1], [], [], "partial", "", versions=[])
        every += [PartialGroup(ex, ex.prompt, tuple(more(blank, self.lengths[ex.prompt] + j) for j in range(2))) for ex in examples]
        done = [g for g in every if g.done]
        rewards = [float(len(r.completion_ids)) for g in done for r in g.rollouts]
        return (Sampled([g.example for g in done], [list(g.rollouts) for g in done], Scores(rewards, {"length": rewards}), 1.0, 0.5),
                [g for g in every if not g.done])


class NoKL:
    def penalize(self, totals, rollouts, pad_id, size):
        return totals, None


def _generations(lengths, order, current=0, k=2):
    settings = GenerationSettings(num_generations=2, prompts_per_step=2, scale_rewards="group", advantage_estimator="grpo",
                                  normalize_then_sum=False, mask_truncated_completions=False, dynamic_sampling=False,
                                  max_sampling_rounds=0, num_completions_to_print=None, sample_ahead=True, skip_without_signal=True,
                                  turn_advantage="rollout")
    prompts = PromptStream([Example(p) for p in order], seed=0, shuffle=False)
    versions = WeightVersions(lambda: None, version=current)
    gens = Generations(settings, LengthStage(lengths), prompts, torch.Generator(), NoKL())
    gens.carry_partials(2, versions, k)
    return gens, versions


def _prompts(gen):
    return [g.example.prompt for g in gen.parts[0]]


def test_long_completions_are_carried_to_the_next_generation_and_new_prompts_fill_their_place():
    # completions of A are 1 and 2 tokens, B 5 and 6, C 1 and 2, D 3 and 4, E 1 and 2; 2 tokens a round, 2 prompts a step
    gens, versions = _generations({"A": 1, "B": 5, "C": 1, "D": 3, "E": 1}, "ABCDE")
    first = gens.generate(None)
    # round 1: A and B start, A is done; round 2: B goes on, C starts and is done: A and C make the generation
    assert gens.rollout.calls == [([], ["A", "B"]), (["B"], ["C"])]
    assert _prompts(first) == ["A", "C"] and first.metrics["sampling/rounds"] == 1
    assert [g.example.prompt for g in gens.carry[0]] == ["B"] and gens.carry[1] == ()
    assert first.metrics["sampling/carried_groups"] == 1 and first.epochs_drawn == 3 / 5
    versions.held = versions.current = 1  # a step later
    second = gens.generate(None)
    # round 3: B (4 of its 5 and 6 tokens) is done, D starts; round 4: D goes on and E starts, both done: E waits
    assert gens.rollout.calls[2:] == [(["B"], ["D"]), (["D"], ["E"])]
    assert _prompts(second) == ["B", "D"] and gens.carry[0] == () and [g.example.prompt for g in gens.carry[1]] == ["E"]
    assert second.metrics["sampling/rounds"] == 1 and second.metrics["sampling/carried_groups"] == 1
    b = second.parts[0][0].rollouts[1]  # B's 6 tokens: 2 a round, the first two rounds at version 0
    assert b.versions == [0, 0, 0, 0, 1, 1] and b.completion_ids == [7] * 6
    assert second.token_versions == {0: 4 + 4, 1: 3 + 7}  # B: 4 + 4 at version 0; B's last 3, D's 7 at 1
    assert len(second.batch) == 4 and second.batch.advantages.tolist() == pytest.approx([-0.7071, 0.7071] * 2, abs=1e-4)


def test_a_generation_sampled_for_every_process_gives_each_rank_its_own_groups():
    """Several processes free-running: rank 0 samples a generation whole and each rank trains the groups
    distributed.owners gives it (Generations.reassemble): A's completions (1 and 2 tokens) on rank 0, C's (3
    and 4) on rank 1; with three ranks the third gets none (an empty batch, which still joins the update)."""
    from rlvr.distributed import World

    gens, _ = _generations({"A": 1, "C": 3}, "AC")
    gens.partial = None  # whole completions in one round: no partial rollouts here
    gens.keep_parts = True
    gen = gens.assemble(*_done_groups(gens, ["A", "C"]), None)
    lengths = {r: gens.reassemble(gen, world=World(r, 2)).batch.completion_mask.sum(1).tolist() for r in (0, 1)}
    assert lengths == {0: [1, 2], 1: [3, 4]}
    three = [gens.reassemble(gen, world=World(r, 3)) for r in range(3)]
    assert [len(g.batch) for g in three] == [2, 2, 0]
    assert all(g.metrics["reward"] == gen.metrics["reward"] and g.groups == 2 for g in three)  # the metrics of every group


def _done_groups(gens, prompts):
    """(chosen, groups, rounds, drawn) for one round in which every prompt's group is done."""
    sampled, pending = gens.rollout.sample_partial([Example(p) for p in prompts], [], None, None, 100, 0)
    assert not pending
    round_ = gens._round(sampled)
    return round_.groups, round_.groups, [round_], len(prompts)


def test_a_carried_group_that_could_no_longer_be_trained_is_dropped_before_more_is_sampled_for_it():
    gens, versions = _generations({"A": 1, "B": 5, "C": 1, "D": 1, "E": 1}, "ABCDE", k=1)
    gens.generate(None)  # A and C; B carried with 4 tokens of version 0
    versions.held = versions.current = 2  # two steps on: B's tokens are 2 versions old, more than max_staleness=1
    second = gens.generate(None)
    assert gens.rollout.calls[2:] == [([], ["D", "E"])]  # B was not continued: D and E took its place
    assert _prompts(second) == ["D", "E"] and second.stale_groups == 1 and gens.carry == ((), ())


def test_taking_a_generation_leaves_out_the_groups_grown_too_old_since_and_counts_them():
    gens, versions = _generations({"A": 1, "B": 5, "C": 1, "D": 3, "E": 1}, "ABCDE", k=2)
    gens.generate(None)
    versions.held = versions.current = 1
    second = gens.generate(None)  # B (oldest token version 0) and D (version 1)
    producer = Producer(gens, versions, lambda: None, 2, HomeThread())
    producer.ready.extend([second, copy.copy(second)])
    taken = producer.take(2)  # B's first tokens are 2 versions old: still within max_staleness=2
    assert taken is second and producer.since_take()["sampling/stale_dropped_groups"] == 0
    taken = producer.take(3)  # now 3: B is left out, D stays
    assert _prompts(taken) == ["D"] and len(taken.batch) == 2 and taken.groups == 1
    assert taken.token_versions == {1: 7} and taken.metrics["completions/num_tokens"] == 7
    assert producer.since_take()["sampling/stale_dropped_groups"] == 1


def test_settings_partial_rollouts_cannot_run_with_are_refused():
    free = {"max_staleness": 2, "async_mode": "free", "partial_rollout_tokens": 64}
    assert build_config(free).partial_rollout_tokens == 64
    with pytest.raises(ConfigError, match="partial_rollout_tokens must be >= 0"):
        build_config({**free, "partial_rollout_tokens": -1})
    with pytest.raises(ConfigError, match="partial_rollout_tokens carries unfinished completions .* set async_mode=free"):
        build_config({"max_staleness": 2, "partial_rollout_tokens": 64})
    for vllm in ({"use_vllm": True}, {"use_vllm": True, "vllm_mode": "server"}):  # vLLM continues them too (rollout/vllm_partial.py)
        assert build_config({**free, **vllm}).partial_rollout_tokens == 64
    with pytest.raises(ConfigError, match="not with tools, environment or rollout_func"):
        build_config({**free, "tools": ["calculator"]})
    with pytest.raises(ConfigError, match="partial_rollout_tokens and dynamic_sampling"):
        build_config({**free, "dynamic_sampling": True, "loss_type": "dapo"})
    with pytest.raises(ConfigError, match="partial_rollout_tokens needs the free-running producer, which this run cannot have"):
        build_config({**free, "async_mode": "auto", "rollout_workers": 2})


# --- runs of the tiny model ------------------------------------------------------------------------


@pytest.mark.trains
def test_a_run_with_partial_rollouts_learns_and_no_token_is_older_than_max_staleness(tiny_model_dir, tmp_path):
    """Groups of 4 completions of up to 12 tokens, 3 tokens a round, ended early by a stop string: the
    tiny model learns the reward all the same (about 0.8 by step 25 in the runs tried), and the bound
    holds per token."""
    rows = free_running_run(tiny_model_dir, tmp_path, num_generations=4, max_completion_length=12, stop_strings=["1"],
                            max_steps=60, partial_rollout_tokens=3)
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.8, rewards
    assert all(0 <= r["sampling/staleness_mean"] <= r["sampling/staleness_max"] <= 2 for r in rows)
    # completions were continued (a generation took further rounds); which groups were carried on depends on
    # the lengths the model samples (the unit tests above pin that down)
    assert any(r["sampling/rounds"] >= 1 for r in rows) and all("sampling/carried_groups" in r for r in rows)


@pytest.mark.trains
def test_a_stopped_run_with_partial_rollouts_resumes_with_its_carried_groups(tiny_run_config, tmp_path, monkeypatch):
    """Stopped in step 4's update: the checkpoint holds the groups carried on; the resumed run trains them
    (no prompt is lost), and no prompt is trained twice."""
    settings = {"max_steps": 6, "save_steps": 100, "log_completions": True, "num_generations": 2,
                "max_completion_length": 12, "stop_strings": ["1"], "max_staleness": 2, "async_mode": "free",
                "partial_rollout_tokens": 3, "task_args": {"digits": 2, "num_train": 200, "num_test": 8}}
    out = tmp_path / "run"
    restore = stop_in_update(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run_config(out, **settings))
    def key(prompt):
        return json.dumps(prompt)

    def carried_at(step):
        pending, done = torch.load(out / f"checkpoint-{step}" / "trainer_state.pt", weights_only=False)["carry"]
        assert all(isinstance(g, PartialGroup) and not g.done for g in pending)
        return {key(g.example.prompt) for g in (*pending, *done)}

    carried = carried_at(3)
    assert carried
    restore()
    train(tiny_run_config(out, resume=True, **settings))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    trained = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        trained.setdefault(key(row["prompt"]), set()).add(row["step"])
    assert all(len(steps) == 1 for steps in trained.values())  # 6 steps x 4 prompts of 200: none sampled twice
    later = {p for p, steps in trained.items() if min(steps) >= 4}
    # each group carried at the stop is trained after it, still carried at the end, or dropped as too old (counted)
    unaccounted = carried - later - carried_at(6)
    assert len(unaccounted) <= sum(r["sampling/stale_dropped_groups"] for r in rows[3:])
