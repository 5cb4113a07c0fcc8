"""async_mode=free (rollout/producer.py): the producer's queue bound, stale generations dropped, a
stop that rewinds, errors, the weights' lock; the in-process engine's in-flight weight loads token by
token; and runs of the tiny model (the staleness bound holds per token, it learns, a stopped run
resumes with nothing lost or sampled twice)."""

import copy
import json
import threading
import time

import pytest
import torch
from conftest import free_running_run, metrics_rows, stop_in_update

from rlvr.config import ConfigError, build_config
from rlvr.rollout import SamplingParams
from rlvr.rollout.home import HomeThread
from rlvr.rollout.producer import Cancelled, Producer, WeightVersions, oldest_version, token_staleness
from rlvr.run import train
from rlvr.types import Generation


class FakeGenerations:
    """Generations whose n-th generation is n, sampled when the test lets it (`allow`); position: how many were sampled."""

    def __init__(self, versions=None):
        self.count, self.allowed, self.versions = 0, threading.Semaphore(0), versions
        self.running = threading.Event()

    def position(self):
        return self.count

    def rewind(self, position):
        self.count = position

    def generate_or_rewind(self, state):
        before = self.count
        self.running.set()
        try:
            while not self.allowed.acquire(timeout=0.01):
                if self.versions is not None:
                    self.versions.refresh()  # as the engine does between tokens: raises Cancelled when stopping
        except BaseException:
            self.rewind(before)
            raise
        finally:
            self.running.clear()
        self.count += 1
        return Generation(batch=None, metrics={"n": self.count}, groups=2, token_versions={None: 10})


def _producer(k=2):
    versions = WeightVersions(lambda: None)
    gens = FakeGenerations(versions)
    return Producer(gens, versions, lambda: None, k, HomeThread()), gens, versions


def _wait(condition, seconds=30.0):
    deadline = time.monotonic() + seconds  # a bound on a hang, never on how fast it runs
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_it_keeps_at_most_max_staleness_generations_in_flight_and_hands_them_over_in_order():
    producer, gens, _ = _producer(k=2)
    producer.start()
    for _ in range(5):
        gens.allowed.release()
    _wait(lambda: len(producer.ready) == 2)
    _wait(lambda: producer.idle_seconds > 0 or not gens.running.is_set())
    assert len(producer.ready) == 2 and gens.count == 2 and not gens.running.is_set()  # waits with two ready
    assert producer.take(0).metrics["n"] == 1
    _wait(lambda: len(producer.ready) == 2)  # room for one more: it samples the third
    assert [producer.take(0).metrics["n"] for _ in range(3)] == [2, 3, 4]
    assert producer.ready[0].token_versions == {0: 10}  # unrecorded tokens: the version it started with
    producer.close()


def test_a_generation_older_than_max_staleness_is_dropped_and_counted():
    producer, gens, _ = _producer(k=2)
    producer.restore([Generation(None, {"n": n}, groups=3, token_versions={v: 5, v + 1: 5}) for n, v in ((1, 0), (2, 1), (3, 3))])
    assert producer.take(3).metrics["n"] == 2  # 1 is 3 versions behind step 3 (its oldest token); 2 is 2 behind
    assert producer.since_take() == {"sampling/queue_depth": 1, "sampling/stale_dropped_groups": 3,
                                     "sampling/stale_dropped_generations": 1, "timing/sampler_idle": 0.0,
                                     "sampling/in_flight_loads": 0}
    assert producer.since_take()["sampling/stale_dropped_groups"] == 0  # counted once
    gen = Generation(None, {}, token_versions={4: 30, 6: 10})
    assert oldest_version(gen) == 4 and token_staleness(gen, 6) == (1.5, 2)  # (2 * 30 + 0 * 10) / 40


def test_drain_cancels_the_running_generation_rewinds_it_and_keeps_the_ready_ones():
    producer, gens, versions = _producer(k=3)
    producer.start()
    gens.allowed.release()
    _wait(lambda: len(producer.ready) == 1 and gens.running.is_set())  # the second is being sampled
    ready = producer.drain()
    assert [g.metrics["n"] for g in ready] == [1] and gens.count == 1  # rewound to right after the ready one
    assert producer.thread is None
    assert producer.take(0).metrics["n"] == 1  # the queue stays; take starts the thread again
    gens.allowed.release()
    assert producer.take(0).metrics["n"] == 2  # sampled again, from where it was rewound to
    producer.close()


def test_an_error_in_the_producer_is_raised_by_take():
    producer, gens, _ = _producer()

    def broken(state):
        raise ValueError("the reward function broke")

    gens.generate_or_rewind = broken
    with pytest.raises(ValueError, match="the reward function broke"):
        producer.take(0)
    producer.close()


def test_weights_load_only_when_newer_ones_are_published_and_never_during_an_optimizer_step():
    loads = []
    versions = WeightVersions(lambda: loads.append(versions.current))
    assert versions.refresh() is False and loads == []
    versions.step_begin()
    versions.publish()  # nothing newer: the version is still 0
    loader = threading.Thread(target=versions.load_now)
    loader.start()
    loader.join(timeout=0.2)
    assert loader.is_alive() and loads == []  # waits for the step
    versions.step_end(1)
    loader.join()
    assert loads == [1] and versions.held == 1
    versions.step_begin()
    versions.step_end(2)
    assert versions.refresh() is False  # not published yet
    versions.publish()
    assert versions.refresh() is True and loads == [1, 2] and versions.held == 2
    versions.cancelled = True
    with pytest.raises(Cancelled):
        versions.refresh()


# --- the in-process engine: weights loaded between two decode steps ---------------------------------


class SwitchAt:
    """A producer's weight versions for the engine: at the `at`-th refresh the sampler's model takes `new`'s weights."""

    def __init__(self, model, new, at):
        self.model, self.new, self.at, self.calls, self.held = model, new, at, 0, 0

    def refresh(self):
        self.calls += 1
        if self.calls != self.at:
            return False
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.new.parameters()):
                p.copy_(q)
        self.held = 1
        return True


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "generic"])
def test_in_flight_weights_sample_the_tokens_after_the_load_and_say_so(tiny, fast):
    from rlvr.rollout.engine import FastSampler, HFSampler

    model, tokenizer = tiny
    cls = FastSampler if fast else HFSampler
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0)
    prompts = [tokenizer.encode("what is 2 + 3?"), tokenizer.encode("7 - 1 =")]

    def sample(new=None, at=3):
        sampler_model = copy.deepcopy(model).eval()
        sampler = cls(sampler_model, tokenizer, [10**6])  # no end token: every completion is 8 tokens
        if new is not None:
            sampler.live = SwitchAt(sampler_model, new, at)
        return [r for g in sampler.generate(prompts, params, torch.Generator().manual_seed(0)) for r in g]

    plain = sample()
    assert all(r.versions is None for r in plain)
    same = sample(new=model)  # the same weights loaded mid-way: nothing changes (the sampling weights are rebuilt)
    assert [r.completion_ids for r in same] == [r.completion_ids for r in plain]
    assert all(abs(a - b) < 1e-5 for r, s in zip(same, plain) for a, b in zip(r.logprobs, s.logprobs))
    assert all(r.versions == [0, 0, 0, 1, 1, 1, 1, 1] for r in same)  # loaded after the 3rd token
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    switched = sample(new=other)
    # the first three tokens come from the old weights, exactly as without the load; the 4th on from the new
    assert all(r.completion_ids[:3] == s.completion_ids[:3] and r.logprobs[:3] == pytest.approx(s.logprobs[:3], abs=1e-5)
               for r, s in zip(switched, plain))
    assert max(abs(a - b) for r, s in zip(switched, plain) for a, b in zip(r.logprobs[3:4], s.logprobs[3:4])) > 1e-2


# --- runs of the tiny model --------------------------------------------------------------------------


@pytest.mark.trains
def test_a_free_running_run_learns_and_no_token_is_older_than_max_staleness(tiny_model_dir, tmp_path):
    """The tiny model learns a reward from samples up to two versions old (it was the lockstep test's
    run, max_staleness=1, before the free-running producer; lockstep's lag is tests/test_off_policy.py's)."""
    rows = free_running_run(tiny_model_dir, tmp_path, num_generations=8, max_completion_length=4, max_steps=40,
                            eval_strategy="steps", eval_steps=20)
    # held-out evaluation stops the producer and samples with the policy's weights (steps 20 and 40)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [20, 40]
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.8, rewards
    assert all(0 <= r["sampling/staleness_mean"] <= r["sampling/staleness_max"] <= 2 for r in rows)
    assert all(r["sampling/staleness"] == r["sampling/staleness_max"] for r in rows)  # the oldest token is the first
    assert all(r["sampling/queue_depth"] <= 2 and r["sampling/stale_dropped_groups"] == 0 for r in rows)
    assert any(r["sampling/staleness_max"] >= 1 for r in rows)  # it did run ahead
    for key in ("timing/trainer_idle", "timing/sampler_idle", "sampling/weight_version"):
        assert all(key in r for r in rows)


@pytest.mark.trains
@pytest.mark.parametrize("resumed_as", ["free", "on-policy"])
def test_a_stopped_free_running_run_resumes_with_its_queue_and_nothing_lost_or_sampled_twice(tiny_run_config, tmp_path,
                                                                                               monkeypatch, resumed_as):
    """Stopped in step 4's update: the checkpoint holds step 4's generation and the ones queued (the one being
    sampled is rewound), so the resumed run trains the same prompts in the same order as an on-policy run;
    also when it is resumed on-policy (the queue is trained first)."""
    import zlib

    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format",  # a function of the text alone, so a rewound generation scores alike
                        lambda completions, **kw: [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions])
    settings = {"max_steps": 6, "save_steps": 100, "log_completions": True}
    on_policy = tmp_path / "on-policy"
    train(tiny_run_config(on_policy, **settings))

    out = tmp_path / "free"
    def queued(trainer):  # something is queued (its rewards served)
        _wait(lambda: trainer.home.serve() or len(trainer.producer.ready) >= 1)

    restore = stop_in_update(monkeypatch, 3, queued)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run_config(out, max_staleness=2, async_mode="free", **settings))
    state = torch.load(out / "checkpoint-3" / "trainer_state.pt", weights_only=False)
    assert state["pending"].iterations_done == 0 and len(state["queued"]) >= 1
    queued_reward = state["queued"][0].metrics["reward"]
    restore()
    resumed = {"max_staleness": 2, "async_mode": "free"} if resumed_as == "free" else {"resume_override": True}
    train(tiny_run_config(out, resume=True, **resumed, **settings))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[4]["reward"] == queued_reward

    def prompts(run):
        steps = {}
        for line in (run / "completions.jsonl").read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["step"], []).append(row["prompt"])
        return [sorted(set(p)) for _, p in sorted(steps.items())]

    assert prompts(out) == prompts(on_policy)


@pytest.mark.trains
def test_without_in_flight_updates_each_generation_comes_from_one_version(tiny_run_config, tmp_path):
    out = tmp_path / "run"
    train(tiny_run_config(out, max_staleness=2, async_mode="free", in_flight_weight_updates=False, max_steps=6,
                          temperature=1.0, max_completion_length=16))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["sampling/staleness_mean"] == r["sampling/staleness_max"] == r["sampling/staleness"] <= 2 for r in rows)


def test_settings_it_cannot_run_with_are_refused():
    with pytest.raises(ConfigError, match="async_mode must be lockstep, free or auto"):
        build_config({"async_mode": "fast"})
    with pytest.raises(ConfigError, match="async_mode=free keeps up to max_staleness generations in flight: set max_staleness >= 1"):
        build_config({"async_mode": "free"})
    with pytest.raises(ConfigError, match="async_mode=free with fsdp samples every process's share on rank 0, on vLLM servers"):
        build_config({"async_mode": "free", "max_staleness": 1, "fsdp": True})
    with pytest.raises(ConfigError, match="async_mode=free is not supported with rollout_workers"):
        build_config({"async_mode": "free", "max_staleness": 1, "rollout_workers": 2})
    with pytest.raises(ConfigError, match="weight_sync_steps=3 lets a sample lag up to 3"):
        build_config({"async_mode": "free", "max_staleness": 2, "weight_sync_steps": 3})
    from rlvr.distributed import World
    from rlvr.settings import check_runnable

    with pytest.raises(ConfigError, match="async_mode=free with 2 training processes samples every process's share on "
                                          "rank 0, on vLLM servers .* set use_vllm=true vllm_mode=server"):
        check_runnable(build_config({"max_staleness": 1, "async_mode": "free", "num_generations": 4,
                                     "per_device_train_batch_size": 8}), World(0, 2))
    with pytest.raises(ConfigError, match="async_mode=free with fsdp and kl_penalty=reward is not supported"):
        check_runnable(build_config({"max_staleness": 1, "async_mode": "free", "num_generations": 4, "fsdp": True,
                                     "use_vllm": True, "vllm_mode": "server", "beta": 0.1, "kl_penalty": "reward",
                                     "per_device_train_batch_size": 8}), World(0, 2))


def test_the_scoring_thread_runs_calls_off_the_caller_thread_and_raises_their_errors():
    from rlvr.rollout.home import ScoringThread

    scoring = ScoringThread()
    assert scoring.call(lambda x: (x, threading.current_thread().name), 3) == (3, "rlvr-scoring")

    def broken():
        raise ValueError("bad reward")

    with pytest.raises(ValueError, match="bad reward"):
        scoring.call(broken)
    assert scoring.call(lambda: 1) == 1  # the thread lives on after a call's error
    scoring.close()
    scoring.thread.join(timeout=30)
    assert not scoring.thread.is_alive()


def test_which_reward_sets_must_score_on_the_main_thread():
    from rlvr.rewards import RewardSet

    assert not RewardSet(["accuracy", "boxed_format"]).needs_main_thread  # graded in worker processes
    assert RewardSet(["accuracy"], isolation="inline").needs_main_thread  # bounded by the main thread's signals
    assert RewardSet(["reasoning_gym"]).needs_main_thread  # reasoning-gym's scorers are bounded so too


def test_auto_runs_free_where_free_can_run_and_lockstep_elsewhere():
    from rlvr.config import free_running

    def section(**kw):
        return build_config({"max_staleness": 2, "async_mode": "auto", **kw}).rollout_settings

    assert free_running(section(), 1, fsdp=False)
    assert not free_running(section(), 2, fsdp=False)  # several processes sampling in-process: one generation ahead, in lockstep
    assert not free_running(section(), 2, fsdp=True)
    assert not free_running(section(use_vllm=True, vllm_mode="colocate"), 2, fsdp=False)
    # several processes on vLLM servers: rank 0's producer samples for all, as TRL's AsyncGRPOTrainer
    assert free_running(section(use_vllm=True, vllm_mode="server"), 2, fsdp=False)
    assert free_running(section(use_vllm=True, vllm_mode="server"), 2, fsdp=True)
    assert not free_running(section(rollout_workers=2), 1, fsdp=False)
    assert not free_running(section(max_staleness=0), 1, fsdp=False)  # on-policy
    assert not free_running(section(async_mode="lockstep"), 1, fsdp=False)
    assert free_running(section(async_mode="free"), 1, fsdp=False)
    from rlvr import AsyncGRPOConfig

    assert AsyncGRPOConfig(output_dir="x").async_mode == "auto"  # TRL's async trainer is free-running
