"""benchmarks/async_sim.py: the sync step worked out by hand, a partial rollout traced by hand, and what must hold
whatever the lengths: k = 0 is sync, equal work gives equal throughput, staleness stays within k, no token is lost."""

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("async_sim", Path(__file__).parents[1] / "benchmarks" / "async_sim.py")
sim = importlib.util.module_from_spec(_SPEC)
sys.modules["async_sim"] = sim  # dataclasses looks the module up while building Setup
_SPEC.loader.exec_module(sim)

# A small long-tailed run: 16 prompts x 4 completions on 2 rollout GPUs, a few hundredths of a second per schedule.
SMALL = sim.Setup(prompts=16, generations=4, rollout_gpus=2, max_concurrency=64, length_median=600,
                  max_completion_length=4096, train_rate=3000.0, push_time=1.0, steps=16, warmup=4)


def run(setup, schedule, k=0, lengths=None):
    if schedule == "sync":
        return sim.summarize(sim.simulate_sync(setup, lengths), "sync", 0)
    return sim.summarize(sim.simulate_async(setup, k, schedule == "partial", lengths), schedule, k)


def test_sync_step_is_the_hand_computed_sum():
    # One GPU, 2 prompts x 2 completions of 3, 5 and 2, 4 tokens, all in flight at once; t(n) = a + b*n.
    # 4 running for 2 iterations, then 3 for 1, 2 for 1, 1 for 1: 2(a+4b) + (a+3b) + (a+2b) + (a+b) = 5a + 14b,
    # i.e. a x the longest completion + b x all tokens.  Training: 14 tokens / 100 tokens/s; then the push.
    a, b, rate, push = 0.01, 0.001, 100.0, 0.5
    setup = sim.Setup(prompts=2, generations=2, rollout_gpus=1, decode_a=a, decode_b=b, train_rate=rate,
                      push_time=push, steps=2, warmup=0)
    result = run(setup, "sync", lengths=[[3, 5], [2, 4]])
    rollout = 5 * a + 14 * b  # 0.064 s
    step = rollout + 14 / rate + push  # 0.064 + 0.14 + 0.5 = 0.704 s
    assert result["step_ends"] == pytest.approx([0.0, step, 2 * step])
    assert result["seconds_per_step"] == pytest.approx(step)
    assert result["trainer_idle"] == pytest.approx(rollout / step)  # it waits for the sampling only
    assert result["sampler_idle"] == pytest.approx(14 / rate / step)  # the GPU waits for the training only

    # Two slots: 3 and 5 start, 2 and 4 wait.  3 ends after 3 iterations (2 running), 2 takes its slot and ends
    # with 5 at iteration 5 (2 running), then 4 runs alone for 4 more: 3(a+2b) + 2(a+2b) + 4(a+b) = 9a + 14b.
    result = run(replace(setup, max_concurrency=2), "sync", lengths=[[3, 5], [2, 4]])
    assert result["seconds_per_step"] == pytest.approx(9 * a + 14 * b + 14 / rate + push)


def test_partial_rollout_traced_by_hand():
    # One GPU, one prompt, one completion per step, k=1 (two groups may be in flight or waiting), one token a
    # second whatever the batch (a=1, b=0), training one token a second, pushes free.  Lengths 5, 2, 1, ...
    #   t=0  starts g0 (5 tokens) and g1 (2), both on weights v0
    #   t=2  g1 done; the trainer updates on it (2 s)             -> step 1 ends at t=4, v1
    #   t=4  partial: g0 has 4 tokens of v0 and goes on with v1, g2 (1 token) starts on v1
    #   t=5  g0 and g2 done; the trainer updates on g0 (5 s)      -> step 2 ends at t=10: staleness 1,1,1,1,0
    #   t=10 the trainer updates on g2 (1 s, its token is v1)     -> step 3 ends at t=11: staleness 1
    setup = sim.Setup(prompts=1, generations=1, rollout_gpus=1, decode_a=1.0, decode_b=0.0, train_rate=1.0,
                      push_time=0.0, steps=3, warmup=0)
    partial = run(setup, "partial", 1, lengths=[[5], [2], [1]])
    assert partial["step_ends"] == pytest.approx([0, 4, 10, 11])
    assert partial["token_staleness"] == {0: 2 + 1, 1: 4 + 1}
    assert (partial["token_staleness_mean"], partial["token_staleness_max"]) == (pytest.approx(5 / 8), 1)
    # Without partial rollouts the push waits for g0 to finish on v0 (t=5); g2 then starts on v1 and ends at t=6:
    # the same step ends, but all 5 tokens of g0 are one version old.
    whole = run(setup, "async", 1, lengths=[[5], [2], [1]])
    assert whole["step_ends"] == pytest.approx([0, 4, 10, 11])
    assert whole["token_staleness"] == {0: 2, 1: 5 + 1}
    assert whole["group_staleness_mean"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("schedule", ["async", "partial"])
def test_staleness_zero_is_sync(schedule):
    # k=0: at most B groups in flight, so the trainer has to wait for all of them and the rollout GPUs for the push.
    sync, same = run(SMALL, "sync"), run(SMALL, schedule, 0)
    assert same["step_ends"] == pytest.approx(sync["step_ends"])
    assert same["dropped_per_step"] == 0 and same["token_staleness_max"] == 0


def test_equal_work_gives_equal_throughput():
    # All completions 100 tokens, t(n) = b*n (a GPU's rate is 1/b tokens/s whatever its batch), training and pushes
    # free: every schedule keeps both rollout GPUs busy at 2/b = 1,000 tokens/s, so a step takes
    # 8 x 2 x 100 tokens x b / 2 GPUs = 1.6 s, unless groups are dropped: in async with k >= 2 the trainer outruns
    # the engines draining for its pushes, and their groups come too old.  Partial rollouts never waste a token.
    # 60 steps, so that the steps the async rows finish together (2, 3 or 5 at once) fill the window evenly.
    setup = sim.Setup(prompts=8, generations=2, rollout_gpus=2, max_concurrency=64, decode_a=0.0, decode_b=0.002,
                      train_rate=math.inf, push_time=0.0, steps=60, warmup=0)
    for schedule, k in [("sync", 0), ("async", 1), ("async", 2), ("async", 4), ("partial", 1), ("partial", 4)]:
        result = run(setup, schedule, k, lengths=[[100, 100]])
        assert result["sampler_idle"] == pytest.approx(0, abs=1e-12), (schedule, k)
        assert result["sampler_tokens_per_s"] == pytest.approx(2 / 0.002), (schedule, k)
        if result["dropped_per_step"] == 0:
            assert result["seconds_per_step"] == pytest.approx(8 * 2 * 100 * 0.002 / 2), (schedule, k)
        else:  # the same tokens per second, some of them thrown away
            assert schedule == "async" and result["seconds_per_step"] > 1.6, (schedule, k)
    assert run(setup, "async", 4, lengths=[[100, 100]])["dropped_per_step"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_is_not_slower_than_sync_without_push_time(seed):
    setup = replace(SMALL, push_time=0.0, seed=seed)
    sync = run(setup, "sync")["seconds_per_step"]
    for schedule in ("async", "partial"):
        for k in (1, 2, 4):
            assert run(setup, schedule, k)["seconds_per_step"] <= sync, (schedule, k)


def test_stale_groups_are_dropped_and_none_trained_beyond_k():
    tight, loose = run(SMALL, "async", 1), run(SMALL, "async", SMALL.steps)
    assert tight["dropped_per_step"] > 0 and tight["tokens"]["dropped"] > 0
    assert tight["group_staleness_max"] <= 1 and max(tight["token_staleness"]) <= 1
    # With k beyond the run's length nothing is dropped, and some groups come more than one version old:
    # the bound of k=1 above did bind.
    assert loose["dropped_per_step"] == 0 and loose["tokens"]["dropped"] == 0
    assert loose["group_staleness_max"] > 1
    # Partial rollouts drop nothing; a token is never older than its group's first token.
    partial = run(SMALL, "partial", 1)
    assert partial["tokens"]["dropped"] == 0
    assert partial["token_staleness_max"] == partial["group_staleness_max"] > 1


@pytest.mark.parametrize("schedule,k", [("sync", 0), ("async", 1), ("async", 4), ("partial", 2)])
def test_every_sampled_token_is_trained_dropped_or_still_pending(schedule, k):
    tokens = run(SMALL, schedule, k)["tokens"]
    assert tokens["generated"] == tokens["trained"] + tokens["dropped"] + tokens["pending"]
    assert tokens["trained"] > 0


def test_a_seed_gives_one_result_and_the_cli_prints_json(monkeypatch, capsys):
    def strip(rows):
        return [{key: value for key, value in row.items() if key != "step_ends"} for row in rows]

    assert strip(sim.compare(SMALL, (1,))[0]) == strip(sim.compare(SMALL, (1,))[0])
    assert strip(sim.compare(SMALL, (1,))[0]) != strip(sim.compare(replace(SMALL, seed=1), (1,))[0])
    monkeypatch.setattr(sys, "argv", ["async_sim.py", "--json", "--prompts", "8", "--generations", "2",
                                      "--rollout-gpus", "2", "--steps", "6", "--warmup", "2", "--staleness", "1"])
    sim.main()
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["schedule"], r["k"]) for r in rows] == [("sync", 0), ("async", 1), ("partial", 1)]
    assert rows[0]["speedup"] == 1.0
