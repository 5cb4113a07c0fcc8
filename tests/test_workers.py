"""Rollout workers (rollout/workers.py) on a local Ray cluster, with the tiny model on CPU.

The reference is the in-process path: the same trainer, seed and weights with
rollout_workers=0.  Runs with 1 or 2 workers, and a run in which a worker is killed
in the middle of a round and another is killed after a weight update, must sample
and score exactly what it samples and scores: every group once, in order.  So must
multi-turn runs (tools, rlvr's and TRL's environments routed by a column, a rollout_func),
whose tools and environments run on the actors: their turns, masks, environment rewards
and tool counters too.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

ray = pytest.importorskip("ray")

from rlvr.config import ConfigError, build_config  # noqa: E402
from rlvr.errors import RolloutError  # noqa: E402
from rlvr.lora import wrap  # noqa: E402
from rlvr.models import disable_dropout, load_model  # noqa: E402
from rlvr.rewards import Scores  # noqa: E402
from rlvr.rollout.workers import _slice_scores, concat_scores  # noqa: E402
from rlvr.trainer import Trainer  # noqa: E402
from rlvr.types import Example, TrainerState  # noqa: E402

EXAMPLES = [Example(f"what is {i} + {i}?", str(2 * i)) for i in range(12)]

REWARDS = '''
import os, signal

FLAG = {flag!r}


def letters(completions, **kwargs):
    """How many different characters: varies within a group, so every update has signal."""
    return [float(len(set(c))) for c in completions]


def die_once(completions, **kwargs):
    """Kills its rollout worker on its first call after FLAG is removed (a preempted worker); it runs in
    the worker's reward process (reward_isolation=process), whose parent is the worker."""
    try:  # created atomically: when both workers score at once, only one of them dies
        os.close(os.open(FLAG, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return [0.5] * len(completions)
    os.kill(os.getppid(), signal.SIGKILL)
    return [0.5] * len(completions)
'''


AGENTS = '''
import time

from rlvr.environments import Step


class Echo:
    """rlvr's protocol: answers each turn, ends the rollout after three; a reward from the turns' lengths."""

    def reset(self, example):
        self.n = 0

    def step(self, text):
        self.n += 1
        return Step("again", done=self.n >= 3, reward=float(len(text) % 2))


class Counter:
    """TRL's protocol: a method as a tool, reset(**row) adding to the prompt, get_reward()."""

    def reset(self, **row):
        self.count = 0
        return " count!"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def get_reward(self):
        return float(self.count)


class Hangs(Echo):
    def step(self, text):
        time.sleep(3600)


class BadReset(Echo):
    def reset(self, example):
        return 42


def rollouts(prompts, trainer):
    """A rollout_func: one sampled turn, then text the policy did not write."""
    tok = trainer.processing_class
    ids = tok(["q: " + p for p in prompts], add_special_tokens=False)["input_ids"]
    out = trainer.generate(ids, n=1, max_tokens=6)
    tail = tok("ok", add_special_tokens=False)["input_ids"]
    return {"prompt_ids": ids, "completion_ids": [g[0].completion_ids + tail for g in out],
            "logprobs": [g[0].logprobs + [0.0] * len(tail) for g in out],
            "env_mask": [[1] * len(g[0].completion_ids) + [0] * len(tail) for g in out]}
'''
# Whole tool calls, each one token of the agents' tokenizer: the tiny random model writes them (about one
# token in 60), so its rollouts call the tools, the python one in the sandbox of the worker's node.
CALLS = ['<tool_call>\n' + json.dumps({"name": name, "arguments": args}) + '\n</tool_call>'
         for name, args in (("calculator", {"expression": "6*7"}), ("python", {"code": "print(2**10)"}),
                            ("increment", {"by": 2}))]


@pytest.fixture(scope="module")
def agents_dir(tmp_path_factory):
    """worker_agents.py (AGENTS), importable here and, on the PYTHONPATH Ray starts with, on the actors."""
    d = tmp_path_factory.mktemp("agents")
    (d / "worker_agents.py").write_text(AGENTS)
    return d


@pytest.fixture(scope="module")
def ray_cluster(agents_dir):
    """One local Ray cluster for the module (starting one takes seconds); shut down afterwards."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(agents_dir), before]))
    sys.path.insert(0, str(agents_dir))
    try:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    finally:
        os.environ.pop("PYTHONPATH") if before is None else os.environ.update(PYTHONPATH=before)
    yield
    ray.shutdown()
    sys.path.remove(str(agents_dir))


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("rewards")
    flag = d / "killed"
    flag.touch()  # present: die_once does nothing until a test removes it
    (d / "worker_rewards.py").write_text(REWARDS.format(flag=str(flag)))
    return d / "worker_rewards.py", flag


def make_trainer(tiny_model_dir, reward_file, tmp_path, workers: int, lora: bool = False, examples=EXAMPLES,
                 **settings) -> Trainer:
    """With `lora`, the policy is wrapped in a LoRA adapter as `rlvr train use_peft=true` wraps it, and its
    dropout (the adapter's too) turned off as disable_dropout=true (the default) does: with the adapter's
    dropout on, the update draws from the global RNG, which the two paths leave in different states.
    `settings`: over the test's own."""
    path, _ = reward_file
    cfg = build_config({
        "model": str(tiny_model_dir), "num_generations": 4, "per_device_train_batch_size": 16,  # 4 prompts per step
        "max_completion_length": 10, "temperature": 1.0, "learning_rate": 3e-2, "beta": 0.0,
        "reward_funcs": [f"{path}:letters", f"{path}:die_once"], "rollout_workers": workers, "seed": 7,
        "use_peft": lora, "lora_r": 4, "lora_alpha": 8, **settings,
    })
    model, tokenizer, _ = load_model(str(tiny_model_dir))
    if lora:
        model = wrap(model, cfg.model_settings, str(tiny_model_dir), cfg.seed)
        disable_dropout(model)
    return Trainer(cfg, model, tokenizer, examples, tmp_path, total_steps=10)


def run(trainer: Trainer, between=None) -> dict:
    """A round on the starting weights, one training step (its own round, then an update),
    a round on the updated weights.  `between(trainer)` runs before the last round."""
    try:
        first = trainer.batches.sample_round(TrainerState())
        metrics = trainer.train_step()
        if between is not None:
            between(trainer)
        last = trainer.batches.sample_round(TrainerState())
    finally:
        trainer.close()
    return {"first": first, "last": last, "metrics": metrics}


def assert_same_rounds(got: dict, want: dict) -> None:
    for key in ("first", "last"):
        a, b = got[key], want[key]
        assert len(a.groups) == len(b.groups) == 4
        for ga, gb in zip(a.groups, b.groups):
            assert ga.example == gb.example
            assert [r.completion_ids for r in ga.rollouts] == [r.completion_ids for r in gb.rollouts]
            assert [r.text for r in ga.rollouts] == [r.text for r in gb.rollouts]
            assert [r.finish_reason for r in ga.rollouts] == [r.finish_reason for r in gb.rollouts]
            for ra, rb in zip(ga.rollouts, gb.rollouts):
                assert ra.logprobs == pytest.approx(rb.logprobs, abs=1e-5)
            assert ga.rewards == gb.rewards and ga.per_func == gb.per_func
        assert a.counters == b.counters


@pytest.fixture(scope="module")
def reference(tiny_model_dir, reward_file, tmp_path_factory):
    """The in-process run."""
    return run(make_trainer(tiny_model_dir, reward_file, tmp_path_factory.mktemp("local"), workers=0))


@pytest.mark.trains
@pytest.mark.processes
@pytest.mark.parametrize("workers", [1, 2])
def test_workers_sample_and_score_what_the_in_process_path_does(ray_cluster, tiny_model_dir, reward_file, tmp_path, reference, workers):
    trainer = make_trainer(tiny_model_dir, reward_file, tmp_path, workers)
    assert trainer.rollout.workers in trainer.rollout.subscribers
    got = run(trainer)
    assert_same_rounds(got, reference)  # so 1 and 2 workers give identical rollouts, too
    # The update saw the same completions and rewards: the same loss.  The workers' completions
    # get the importance correction; their sampler is the trainer's own code, so the ratio is 1.
    assert got["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-4, abs=1e-6)
    assert got["metrics"]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert got["metrics"]["sampling/sampling_logp_difference/mean"] < 1e-4
    assert "sampling/importance_sampling_ratio/mean" not in reference["metrics"]
    # A step that learned something: the last round is sampled from new weights.
    changed = [ra.completion_ids != rb.completion_ids
               for ga, gb in zip(got["first"].groups, got["last"].groups) for ra, rb in zip(ga.rollouts, gb.rollouts)]
    assert reference["metrics"]["grad_norm"] > 0 and any(changed)
    # The whole policy went to the workers once, a tied output layer not twice.
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert got["metrics"]["workers/weight_sync_bytes"] == model_bytes


@pytest.fixture(scope="module")
def lora_reference(tiny_model_dir, reward_file, tmp_path_factory):
    """The in-process run with use_peft."""
    return run(make_trainer(tiny_model_dir, reward_file, tmp_path_factory.mktemp("local-lora"), workers=0, lora=True))


@pytest.mark.trains
@pytest.mark.processes
def test_lora_workers_sample_and_score_what_the_in_process_path_does(ray_cluster, tiny_model_dir, reward_file, tmp_path,
                                                                     lora_reference, reference):
    """use_peft with 2 workers: each holds a peft model built once from the trainer's state and is
    sent only the adapter after the update; the rollouts are the in-process LoRA run's."""
    from peft import get_peft_model_state_dict

    trainer = make_trainer(tiny_model_dir, reward_file, tmp_path, workers=2, lora=True)
    adapter = get_peft_model_state_dict(trainer.model)
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.get_base_model().parameters())
    got = run(trainer)
    assert_same_rounds(got, lora_reference)
    assert got["metrics"]["loss"] == pytest.approx(lora_reference["metrics"]["loss"], rel=1e-4, abs=1e-6)
    assert got["metrics"]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    # The update moved the adapter, and only the adapter went to the workers: its bytes, not the model's.
    changed = [ra.completion_ids != rb.completion_ids
               for ga, gb in zip(got["first"].groups, got["last"].groups) for ra, rb in zip(ga.rollouts, gb.rollouts)]
    assert lora_reference["metrics"]["grad_norm"] > 0 and any(changed)
    assert got["first"].groups[0].rollouts[0].completion_ids == reference["first"].groups[0].rollouts[0].completion_ids  # B = 0 at the start
    print(f"\nLoRA update sent to the workers: {got['metrics']['workers/weight_sync_bytes']} bytes "
          f"(the adapter: {adapter_bytes}; the model: {model_bytes})")
    assert got["metrics"]["workers/weight_sync_bytes"] == adapter_bytes < model_bytes / 4
    assert got["metrics"]["workers/replacements"] == 0 and got["metrics"]["workers/weight_sync_seconds"] > 0


@pytest.mark.trains
@pytest.mark.processes
def test_killed_workers_are_replaced_and_their_groups_retried_once(ray_cluster, tiny_model_dir, reward_file, tmp_path, reference):
    _, flag = reward_file
    trainer = make_trainer(tiny_model_dir, reward_file, tmp_path, workers=2)
    first_pids = trainer.rollout.workers.pids()
    flag.unlink()  # the first worker to score a group kills itself: the first round loses half its groups
    killed = {}

    def kill_after_update(trainer):
        # A worker preempted after the weights were pushed: its replacement must hold the new weights.
        killed["first_round"] = trainer.rollout.workers.replacements
        killed["pids"] = trainer.rollout.workers.pids()
        ray.kill(trainer.rollout.workers.actors[1], no_restart=True)

    workers = trainer.rollout.workers
    got = run(trainer, between=kill_after_update)
    assert flag.exists()
    assert killed["first_round"] == 1 and workers.replacements == 2
    assert len(set(first_pids) & set(killed["pids"])) == 1  # one of the two first actors was replaced
    assert_same_rounds(got, reference)  # every group exactly once, with the same completions and scores
    assert got["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-4, abs=1e-6)


# --- multi-turn rollouts on the workers --------------------------------------------------------------

def agent_settings(case: str, reward_file) -> dict:
    """The settings of each multi-turn case, over make_trainer's."""
    path, _ = reward_file
    return {
        "tools": {"tools": ["calculator", "python"], "max_turns": 3, "max_completion_length": 40},
        "environments": {"environment": {"echo": "worker_agents:Echo", "counter": "worker_agents:Counter"},
                         "max_turns": 3, "max_completion_length": 30, "stop_strings": list("aeiou "),  # short turns
                         "reward_funcs": [f"{path}:letters", f"{path}:die_once", "environment"]},
        "rollout_func": {"rollout_func": "worker_agents:rollouts"},
    }[case]


ROUTED = [Example(f"what is {i} + {i}?", str(2 * i), {"environment": "echo" if i % 2 else "counter"}) for i in range(12)]
MULTI_TURN_METRICS = ("turns/mean", "turns/max", "tools/calls_per_completion", "tools/errors_per_completion", "env/errors")


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory):
    """The tiny model with the tokenizer whose tokens include CALLS."""
    from conftest import make_tokenizer, save_tiny_model

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(CALLS)
    return save_tiny_model(tokenizer, tmp_path_factory.mktemp("tiny-agent"))


def agent_trainer(model_dir, reward_file, tmp_path, case: str, workers: int) -> Trainer:
    examples = ROUTED if case == "environments" else EXAMPLES
    return make_trainer(model_dir, reward_file, tmp_path, workers, examples=examples, max_prompt_length=100,
                        **agent_settings(case, reward_file))


@pytest.fixture(scope="module")
def agent_reference(ray_cluster, agent_model_dir, reward_file, tmp_path_factory):
    """The in-process run of a multi-turn case, made when a test first asks for it."""
    done = {}

    def get(case: str) -> dict:
        if case not in done:
            done[case] = run(agent_trainer(agent_model_dir, reward_file, tmp_path_factory.mktemp(case), case, workers=0))
        return done[case]

    return get


def assert_same_turns(got: dict, want: dict) -> None:
    """Beyond assert_same_rounds: each rollout's masks, turns, messages, token versions and what its
    environment said (turns, env_reward, env_error, tool counters, the start TRL's reset wrote)."""
    for key in ("first", "last"):
        for ga, gb in zip(got[key].groups, want[key].groups):
            for ra, rb in zip(ga.rollouts, gb.rollouts):
                assert (ra.mask, ra.messages, ra.info, ra.versions) == (rb.mask, rb.messages, rb.info, rb.versions)
    assert {k: got["metrics"].get(k) for k in MULTI_TURN_METRICS} == {k: want["metrics"].get(k) for k in MULTI_TURN_METRICS}


@pytest.mark.trains
@pytest.mark.processes
@pytest.mark.parametrize("case, workers", [("tools", 2), ("environments", 2), ("rollout_func", 1)])
def test_workers_run_multi_turn_rollouts_as_the_in_process_path_does(ray_cluster, agent_model_dir, reward_file, tmp_path,
                                                                     agent_reference, case, workers):
    """The actors make the tools and environments and run them, along the trainer's own path.  (A
    rollout_func is called once per worker with its share of the prompts: one worker for the same run.)
    With tools, as test_killed_workers_are_replaced_and_their_groups_retried_once, the first worker to score
    a group kills itself and another is killed after the update: both are replaced, the rollouts the same."""
    trainer, between = agent_trainer(agent_model_dir, reward_file, tmp_path, case, workers), None
    pool, (_, flag) = trainer.rollout.workers, reward_file
    if case == "tools":
        flag.unlink()
        between = lambda t: ray.kill(t.rollout.workers.actors[1], no_restart=True)  # noqa: E731
    got, want = run(trainer, between), agent_reference(case)
    if case == "tools":
        assert flag.exists() and pool.replacements == 2
    assert_same_rounds(got, want)
    assert_same_turns(got, want)
    assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-4, abs=1e-6)
    rollouts = [r for key in ("first", "last") for g in got[key].groups for r in g.rollouts]
    assert any(not all(r.mask) for r in rollouts)  # tokens the policy did not write: out of the loss
    if case != "rollout_func":
        assert max(r.info["turns"] for r in rollouts) > 1 and got["metrics"]["env/errors"] == 0
    if case == "tools":  # both tools ran on the actors: the python one printed 2**10 in the sandbox
        assert got["metrics"]["tools/calls_per_completion"] > 0
        assert any(m["role"] == "tool" and "1024" in m["content"] for r in rollouts for m in r.messages)
    if case == "environments":  # each row's own environment: Echo's rewards by step, Counter's by get_reward
        assert all(r.info["env_reward"] is not None for r in rollouts)
        assert {g.example.columns["environment"] for key in ("first", "last") for g in got[key].groups} == {"echo", "counter"}


@pytest.mark.processes
def test_a_hanging_environment_on_a_worker_ends_its_rollouts_and_a_broken_one_the_run(ray_cluster, agent_model_dir, reward_file,
                                                                                     tmp_path):
    """As in-process (tests/test_hostile_rollouts.py): a step past env_timeout ends its rollout, counted in
    env/errors; a reset that returns what no rollout can use ends the run with one line naming it."""
    import torch

    from rlvr.rollout.multiturn import EnvironmentFailed

    settings = {"environment": {"hangs": "worker_agents:Hangs", "broken": "worker_agents:BadReset"}, "env_timeout": 1,
                "max_completion_length": 30, "stop_strings": list("aeiou ")}  # the first turn ends before the budget
    hanging, broken = [Example("hi", columns={"environment": "hangs"})] * 2, [Example("hi", columns={"environment": "broken"})]
    outcomes = []
    for workers in (0, 1):
        (tmp_path / str(workers)).mkdir()
        trainer = make_trainer(agent_model_dir, reward_file, tmp_path / str(workers), workers, **settings)
        try:
            out = trainer.rollout.sample(hanging, torch.Generator().manual_seed(0), TrainerState())
            with pytest.raises(EnvironmentFailed) as failed:
                trainer.rollout.sample(broken, torch.Generator().manual_seed(0), TrainerState())
        finally:
            trainer.close()
        outcomes.append(([(r.finish_reason, r.info) for g in out.groups for r in g], str(failed.value)))
    assert outcomes[1] == outcomes[0]
    rollouts, message = outcomes[1]
    assert all(info["turns"] == 1 and info["env_error"] == (finish != "length") for finish, info in rollouts)
    assert sum(info["env_error"] for _, info in rollouts) >= 6  # (a turn cut at the budget is not answered)
    assert message.startswith("BadReset.reset returned 42 (int)") and "\n" not in message


@pytest.mark.processes
def test_an_environment_the_workers_cannot_import_is_a_one_line_error(ray_cluster, agent_model_dir, reward_file, tmp_path,
                                                                      monkeypatch):
    """Importable here, not on the actors' nodes (not on the PYTHONPATH Ray started with)."""
    (tmp_path / "driver_only.py").write_text(AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RolloutError, match=r"^a rollout worker could not start: ValueError: environment "
                                           r"'driver_only:Echo': No module named 'driver_only'$"):
        make_trainer(agent_model_dir, reward_file, tmp_path, 1, environment="driver_only:Echo")


def test_objects_given_to_grpo_trainer_are_refused_with_workers(tmp_path):
    from rlvr import GRPOConfig, GRPOTrainer

    def add(a: int) -> int:
        """Add one.

        Args:
            a: A number.
        """
        return a + 1

    class Env:
        def reset(self, **row):
            return None

    args = GRPOConfig(output_dir=str(tmp_path), rollout_workers=2)
    with pytest.raises(ConfigError, match=r"rollout_workers need tools, environment_factory by name or package.module:name"):
        GRPOTrainer("some/model", reward_funcs=["accuracy"], args=args, train_dataset=[{"prompt": "a", "environment": "e"}],
                    tools=[add], environment_factory={"e": Env})
    with pytest.raises(ConfigError, match=r"rollout_workers need rollout_func by name"):
        GRPOTrainer("some/model", reward_funcs=["accuracy"], args=args, train_dataset=[{"prompt": "a"}],
                    rollout_func=lambda prompts, trainer: {})


def test_missing_ray_is_a_config_error(monkeypatch):
    from rlvr.settings import check_settings

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails, as when it is not installed
    with pytest.raises(ConfigError, match=r"pip install 'rlvr\[ray\]'"):
        check_settings(build_config({"rollout_workers": 2}))  # packages are checked at launch
    from rlvr.rollout.workers import import_ray

    with pytest.raises(ImportError, match=r"pip install 'rlvr\[ray\]'"):
        import_ray()


def test_rollout_workers_take_vllm_and_lora_but_not_vllm_servers():
    cfg = build_config({"rollout_workers": 2, "use_vllm": True, "use_peft": True})
    assert cfg.rollout_workers == 2 and cfg.use_vllm and cfg.use_peft and cfg.vllm_mode == "colocate"
    with pytest.raises(ConfigError, match="runs vLLM inside each Ray worker.*vllm_mode=colocate"):
        build_config({"rollout_workers": 1, "use_vllm": True, "vllm_mode": "server"})


def test_scores_of_slices_are_joined_in_order():
    a = Scores([1.0, 0.0], {"f": [1.0, None]}, {"f": {"timeouts": 1, "errors": 0}}, {"note": ["x", "y"]}, {"m": [1.0]})
    b = Scores([0.5], {"f": [0.5]}, {"f": {"timeouts": 2, "errors": 1}}, {"note": ["z"]}, {"m": [3.0]})
    joined = concat_scores([a, b])
    assert joined.total == [1.0, 0.0, 0.5] and joined.per_func == {"f": [1.0, None, 0.5]}
    assert joined.counters == {"f": {"timeouts": 3, "errors": 1}}
    assert joined.extra == {"note": ["x", "y", "z"]} and joined.logged == {"m": [1.0, 3.0]}  # log_extra, log_metric
    second = _slice_scores(a, 1, 2, first=False)  # a later slice of one worker's Scores: its logged values counted once
    assert second.extra == {"note": ["y"]} and second.logged == {}
