"""The update stage on the tiny model: accumulation, skipped groups, old log-probs, schedules."""

import math

import pytest
import torch

from rlvr.config import build_config
from rlvr.optim import lr_factor
from rlvr.trainer import Trainer
from rlvr.types import Batch, Example, Rollout


def make_trainer(tiny, tmp_path, ref_model=None, **kw):
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "learning_rate": 1e-3, "num_generations": 2, **kw})
    return Trainer(cfg, model, tokenizer, [Example("What is 1+1?", "2")], output_dir=tmp_path, total_steps=10, ref_model=ref_model)


def make_batch(trainer, n=4, seed=0):
    ids = trainer.tokenizer("what is 2+2?", add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for i in range(n):
        length = 3 + i % 3
        comp = torch.randint(4, 50, (length,), generator=g).tolist()
        rollouts.append(Rollout(ids[: 5 + i], comp, [0.0] * length, "stop" if i % 2 else "length", "x"))
    adv = torch.randn(n, generator=g)
    return Batch.from_rollouts(rollouts, adv, torch.ones(n, dtype=torch.bool), 0, False)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_gradient_accumulation_4x1_equals_1x4(tiny, tmp_path, loss_type):
    whole = make_trainer(tiny, tmp_path, loss_type=loss_type, per_device_train_batch_size=4, beta=0.0)
    batch = make_batch(whole)
    whole.updater.accumulate_gradients(batch)
    g_whole = grads(whole.model)
    split = make_trainer(tiny, tmp_path, loss_type=loss_type, per_device_train_batch_size=1, gradient_accumulation_steps=4)
    split.model = whole.model  # same weights
    split.updater.accumulate_gradients(batch)
    g_split = grads(split.model)
    for name in g_whole:
        assert torch.allclose(g_whole[name], g_split[name], rtol=1e-5, atol=1e-7), name


def test_a_step_without_signal_is_adamws_step_on_zero_gradients(tiny, tmp_path):
    # As TRL's step on zero advantages (beta = 0): every gradient 0, and AdamW steps. Its first step has
    # no momentum yet, so without weight decay the weights stay; its step count and the schedule move.
    trainer = make_trainer(tiny, tmp_path)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    empty = make_batch(trainer).select(torch.zeros(4, dtype=torch.bool))
    metrics = trainer.update(empty)
    assert (metrics["loss"], metrics["grad_norm"], metrics["clip_ratio/region_mean"]) == (0.0, 0.0, 0.0)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert all(int(state["step"]) == 1 for state in trainer.optimizer.state.values())
    assert trainer.scheduler.last_epoch == 1  # the schedule advances with the step count


def test_generate_leaves_zero_std_groups_out(tiny, tmp_path, monkeypatch):
    import rlvr.rewards as rewards

    # first prompt's group all 1.0 (no signal), second prompt's group mixed
    def fixed(completions, **kwargs):
        return [1.0, 1.0, 0.0, 1.0]

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", fixed)
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["boxed_format"],
                        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 4})
    trainer = Trainer(cfg, model, tokenizer, [Example("a", "1"), Example("b", "2")], tmp_path, 10)
    gen = trainer.generate()
    assert gen.metrics["frac_reward_zero_std"] == 0.5
    assert len(gen.batch) == 2  # only the informative group reaches the update
    # the mixed group [0, 1]: mean 0.5, sample std sqrt(0.5); A = -+0.5 / (0.707107 + 1e-4)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert gen.batch.advantages.tolist() == pytest.approx([-a, a])
    assert gen.metrics["reward"] == 0.75


@pytest.mark.parametrize("estimator, scale, expected", [
    ("rloo", "none", [-1.0, 1.0]),  # each completion minus the other's reward
    ("reinforce_pp", "group", None),  # whitened over the batch's tokens: every group trains (below)
])
def test_generate_uses_the_advantage_estimator(tiny, tmp_path, monkeypatch, estimator, scale, expected):
    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", lambda completions, **kwargs: [1.0, 1.0, 0.0, 1.0])
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["boxed_format"],
                        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 4,
                        "advantage_estimator": estimator, "scale_rewards": scale})
    gen = Trainer(cfg, model, tokenizer, [Example("a", "1"), Example("b", "2")], tmp_path, 10).generate()
    assert gen.metrics["frac_reward_zero_std"] == 0.5
    if expected is not None:  # rloo: the equal group (advantage 0) is left out, as GRPO's
        assert gen.batch.advantages.tolist() == pytest.approx(expected)
    else:  # reinforce_pp: all four completions go to the update; centred rewards 0, 0, -0.5, 0.5 whitened over tokens
        assert len(gen.batch) == 4
        n = gen.batch.completion_mask.sum(-1).float()
        x = torch.tensor([0.0, 0.0, -0.5, 0.5])
        mean = (x * n).sum() / n.sum()
        std = (((x - mean) ** 2 * n).sum() / (n.sum() - 1)).sqrt()
        assert gen.batch.advantages.tolist() == pytest.approx(((x - mean) / std).tolist(), abs=1e-4)


def test_second_iteration_uses_old_logprobs(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path, num_iterations=2, learning_rate=5e-2, per_device_train_batch_size=4)
    batch = make_batch(trainer)
    with torch.no_grad():
        before = trainer.logprobs.in_chunks(trainer.model, batch)  # the sampling policy's log-probs
    trainer.updater.prepare(batch)
    assert batch.ref_logprobs is None  # beta = 0 loads no reference
    assert torch.allclose(batch.old_logprobs, before, atol=1e-6)  # the old log-probs are the pre-update policy's
    first = trainer.update(batch)
    with torch.no_grad():
        moved = trainer.logprobs.in_chunks(trainer.model, batch)
    assert (moved - before).abs().max() > 1e-3  # the step changed the policy ...
    assert torch.allclose(batch.old_logprobs, before, atol=1e-6)  # ... and the old log-probs stayed those of the old policy
    second = trainer.update(batch)
    # on the first pass the policy is the old policy (ratio 1, nothing clipped); after a large
    # step the ratio has moved away from 1 and the clipped loss differs from plain PG
    assert first["clip_ratio/region_mean"] == 0.0
    assert second["clip_ratio/region_mean"] > 0.0


def test_mask_truncated_completions_masks_whole_rows(tiny, tmp_path):
    rollouts = [Rollout([1, 2], [5, 6, 7], [0.0] * 3, "length", "a"), Rollout([1], [5, 2], [0.0] * 2, "stop", "b")]
    batch = Batch.from_rollouts(rollouts, torch.tensor([1.0, -1.0]), torch.tensor([True, True]), 0, mask_truncated=True)
    assert batch.completion_mask.tolist() == [[False, False, False], [True, True, False]]
    assert batch.prompt_mask.tolist() == [[True, True], [False, True]]  # left padding
    assert batch.num_tokens == 2


def test_reference_logprobs_come_from_the_frozen_start(tiny, tmp_path):
    from rlvr.models import make_reference

    model, _ = tiny
    trainer = make_trainer(tiny, tmp_path, make_reference(model, 0.1), beta=0.1, per_device_train_batch_size=4)
    batch = make_batch(trainer)
    trainer.updater.prepare(batch)
    assert torch.allclose(batch.ref_logprobs, trainer.logprobs.in_chunks(model, batch))
    metrics = trainer.update(batch)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first step
    trainer.update(batch)
    trainer.update(batch)
    assert trainer.update(batch)["kl"] > 0  # and it grows once the policy moves
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


def test_bf16_autocast_runs_and_stays_close(tiny, tmp_path):
    fp32 = make_trainer(tiny, tmp_path, per_device_train_batch_size=4)
    bf16 = make_trainer(tiny, tmp_path, per_device_train_batch_size=4, bf16=True)
    batch = make_batch(fp32)
    with torch.no_grad():
        a, _ = fp32.logprobs(fp32.model, batch)
        b, _ = bf16.logprobs(bf16.model, batch)
    mask = batch.completion_mask
    a, b = a[mask], b[mask]
    assert not torch.equal(a, b)  # the matmuls did run in bf16
    # bf16 keeps 8 significant bits: one rounding is off by at most 2^-9 relative.  The log-prob is a
    # logit minus a logsumexp of about its size, each from matmuls with bf16 inputs (rounded twice)
    # and fp32 sums, so allow 2^-8 of the log-prob's size plus 2^-8 (measured here: 1.1e-3 at |logp| 4.2).
    assert torch.all((a - b).abs() <= 2**-8 * (1 + a.abs()))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights stay fp32


@pytest.mark.parametrize(
    "kind,step,expected",
    [
        ("constant", 0, 1.0),  # no warmup in transformers' constant schedule
        ("constant_with_warmup", 0, 0.0),  # warmup 2: step / 2, as transformers
        ("constant_with_warmup", 1, 0.5),
        ("constant_with_warmup", 5, 1.0),
        ("linear", 2, 1.0),  # warmup done, decay starts: 1 - 0 / 8
        ("linear", 6, 0.5),  # 1 - (6 - 2) / (10 - 2)
        ("linear", 10, 0.0),
        ("cosine", 6, 0.5),  # 0.5 * (1 + cos(pi * 0.5))
        ("cosine", 4, 0.5 * (1 + math.cos(math.pi * 0.25))),
    ],
)
def test_learning_rate_schedule(kind, step, expected):
    assert lr_factor(step, total_steps=10, warmup_steps=2, kind=kind) == pytest.approx(expected)


def test_unscorable_completions_are_counted_in_the_metrics(tiny, tmp_path, monkeypatch):
    import rlvr.rewards as rewards
    from rlvr.types import ScoreList

    def flaky(completions, **kwargs):
        return ScoreList([0.0, 1.0] * (len(completions) // 2), timeouts=3, errors=1)

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", flaky)
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["boxed_format"],
                        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 3})
    gen = Trainer(cfg, model, tokenizer, [Example("a", "1"), Example("b", "2")], tmp_path, 10).generate()
    assert gen.metrics["rewards/boxed_format/timeouts"] == 3
    assert gen.metrics["rewards/boxed_format/errors"] == 1


def test_reward_functions_see_the_step_and_the_rendered_prompt(tiny, tmp_path, monkeypatch):
    import rlvr.rewards as rewards

    seen = {}

    def spy(completions, trainer_state, prompt_texts, max_completion_length, **kwargs):
        seen.update(step=trainer_state.global_step, total=trainer_state.max_steps, text=prompt_texts[0], max_len=max_completion_length)
        return [0.0] * len(completions)

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", spy)
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["boxed_format"],
                        "num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 3, "system_prompt": "be brief"})
    trainer = Trainer(cfg, model, tokenizer, [Example("hello", "1")], tmp_path, total_steps=7)
    trainer.step = 4
    trainer.generate()
    assert seen == {"step": 4, "total": 7, "max_len": 3,
                    "text": "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"}


def test_reward_args_reach_the_function(tiny, tmp_path):
    from rlvr.tasks import build_rewards

    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["accuracy"],
                        "reward_args": {"accuracy": {"final_number": True}}})
    scores = build_rewards(cfg.reward_settings, cfg.data_settings).score_groups([Example("q", "12")], [[Rollout([1], [2], [0.0], "stop", "so 12 apples")]])
    assert scores.total == [1.0]  # the last number counts because of reward_args


def test_a_batch_moves_whole_to_the_models_device(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path)
    batch = make_batch(trainer)
    batch.ref_logprobs = torch.zeros(batch.completion_ids.shape)
    assert batch.to("cpu") is batch and trainer.logprobs.device == torch.device("cpu")
    moved = batch.to("meta")
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "ref_logprobs",
                 "sampler_logprobs"):
        assert getattr(moved, name).device.type == "meta", name
    assert moved.old_logprobs is None and moved.group_ids is None


@pytest.mark.trains
def test_steps_per_generation_splits_one_generation_over_optimizer_steps(tiny, tmp_path, monkeypatch):
    """TRL's steps_per_generation = 2 x gradient_accumulation_steps: one generation of 8 completions
    feeds two optimizer steps of 4, the second against the old log-probs of the first's weights."""
    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", lambda completions, **kw: [float(i % 2) for i in range(len(completions))])
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "num_generations": 4, "per_device_train_batch_size": 4,
                        "steps_per_generation": 2, "max_completion_length": 4, "learning_rate": 5e-2,
                        "reward_funcs": ["boxed_format"]})
    assert (cfg.prompts_per_step, cfg.steps_per_optimizer_step) == (2, 2)
    trainer = Trainer(cfg, model, tokenizer, [Example(f"{i}+1?", str(i + 1)) for i in range(6)], tmp_path, 4)
    generated, trained = [], []
    real_generate, real_update = trainer.batches.generate_or_rewind, trainer.update

    def generate(state):
        gen = real_generate(state)
        generated.append(gen)
        return gen

    monkeypatch.setattr(trainer.batches, "generate_or_rewind", generate)
    monkeypatch.setattr(trainer, "update", lambda batch, *rest: trained.append(batch) or real_update(batch, *rest))
    metrics = [trainer.train_step() for _ in range(4)]
    assert len(generated) == 2 and [len(b) for b in trained] == [4, 4, 4, 4]
    whole = generated[0].batch
    assert torch.equal(trained[0].completion_ids, whole.select(slice(0, 4)).completion_ids)
    assert torch.equal(trained[1].completion_ids, whole.select(slice(4, 8)).completion_ids)
    assert whole.old_logprobs is not None  # taken once, before the first part's update
    assert metrics[0]["clip_ratio/region_mean"] == 0.0  # first part: the policy is still the sampling policy
    assert metrics[1]["clip_ratio/region_mean"] > 0.0  # second part: trained against the old log-probs, after a step


def test_total_steps_count_the_parts_of_each_generation():
    from rlvr.trainer import total_steps_for

    cfg = build_config({"num_generations": 4, "per_device_train_batch_size": 4, "generation_batch_size": 16,
                        "num_train_epochs": 1, "num_iterations": 2})
    # 16 completions = 4 prompts a generation; 40 prompts -> 10 generations x 4 parts x 2 iterations
    assert total_steps_for(cfg, 40) == 80
