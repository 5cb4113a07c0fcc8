"""Rollout workers (rollout/workers.py) on a local Ray cluster, with the tiny model on CPU.

The reference is the in-process path: the same trainer, seed and weights with
rollout_workers=0.  Runs with 1 or 2 workers, and a run in which a worker is killed
in the middle of a round and another is killed after a weight update, must sample
and score exactly what it samples and scores: every group once, in order.
"""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")

from rlvr.config import ConfigError, build_config  # noqa: E402
from rlvr.lora import wrap  # noqa: E402
from rlvr.models import disable_dropout, load_model  # noqa: E402
from rlvr.rewards import Scores  # noqa: E402
from rlvr.rollout.workers import concat_scores  # noqa: E402
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


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (starting one takes seconds); shut down afterwards."""
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("rewards")
    flag = d / "killed"
    flag.touch()  # present: die_once does nothing until a test removes it
    (d / "worker_rewards.py").write_text(REWARDS.format(flag=str(flag)))
    return d / "worker_rewards.py", flag


def make_trainer(tiny_model_dir, reward_file, tmp_path, workers: int, lora: bool = False) -> Trainer:
    """With `lora`, the policy is wrapped in a LoRA adapter as `rlvr train use_peft=true` wraps it, and its
    dropout (the adapter's too) turned off as disable_dropout=true (the default) does: with the adapter's
    dropout on, the update draws from the global RNG, which the two paths leave in different states."""
    path, _ = reward_file
    cfg = build_config({
        "model": str(tiny_model_dir), "num_generations": 4, "per_device_train_batch_size": 16,  # 4 prompts per step
        "max_completion_length": 10, "temperature": 1.0, "learning_rate": 3e-2, "beta": 0.0,
        "reward_funcs": [f"{path}:letters", f"{path}:die_once"], "rollout_workers": workers, "seed": 7,
        "use_peft": lora, "lora_r": 4, "lora_alpha": 8,
    })
    model, tokenizer, _ = load_model(str(tiny_model_dir))
    if lora:
        model = wrap(model, cfg.model_settings, str(tiny_model_dir), cfg.seed)
        disable_dropout(model)
    return Trainer(cfg, model, tokenizer, EXAMPLES, tmp_path, total_steps=10)


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
    workers = trainer.rollout.workers
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
    a = Scores([1.0, 0.0], {"f": [1.0, None]}, {"f": {"timeouts": 1, "errors": 0}})
    b = Scores([0.5], {"f": [0.5]}, {"f": {"timeouts": 2, "errors": 1}})
    joined = concat_scores([a, b])
    assert joined.total == [1.0, 0.0, 0.5] and joined.per_func == {"f": [1.0, None, 0.5]}
    assert joined.counters == {"f": {"timeouts": 3, "errors": 1}}
