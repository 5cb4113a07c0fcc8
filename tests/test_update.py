"""Stage 4's reusable parts on their own: LogProbs and optimizer_step, without the GRPO trainer
(what SFT or DPO would take from update.py), and the KL term as one object."""

import math
import subprocess
import sys

import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from rlvr.config import KLSettings
from rlvr.kl import kl_estimate
from rlvr.logprobs import LogProbs
from rlvr.reference import KLReference
from rlvr.types import Batch, Rollout
from rlvr.update import NonFinite, optimizer_step


def _batch(tokenizer, prompt: str, completion: str) -> Batch:
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    rollout = Rollout(p, c, [0.0] * len(c), "stop", completion)
    return Batch.from_rollouts([rollout], torch.zeros(1), torch.ones(1, dtype=torch.bool), 0, False, 1)


def _constant_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_an_sft_step_from_the_parts_alone_learns_the_target():
    """Supervised fine-tuning written with LogProbs and optimizer_step only: the target's
    log-probability rises step after step, and the learning rate reported is the one used."""
    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    batch = _batch(tokenizer, "what is 2+2?", "4")
    logprobs = LogProbs(fast=True, temperature=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = _constant_schedule(optimizer)
    seen = []
    for step in range(1, 6):
        optimizer.zero_grad()
        logp, _ = logprobs(model, batch)
        loss = -logp[batch.completion_mask].mean()
        loss.backward()
        seen.append(-loss.item())
        grad_norm, lr = optimizer_step(model, optimizer, scheduler, max_grad_norm=1.0, loss=loss.item(), step=step)
        assert lr == 1e-2 and grad_norm > 0
    assert all(b > a for a, b in zip(seen, seen[1:])), seen


@pytest.mark.processes
def test_the_reusable_parts_do_not_import_the_trainer():
    code = ("import sys, rlvr.update, rlvr.logprobs, rlvr.reference; "
            "print(sorted(m for m in ('rlvr.trainer', 'rlvr.rollout.generation', 'rlvr.run') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_nan_loss_is_refused_and_the_weights_stay():
    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = _constant_schedule(optimizer)
    logp, _ = LogProbs(fast=True, temperature=1.0)(model, _batch(tokenizer, "a", "b"))
    (logp.sum() * float("nan")).backward()
    with pytest.raises(NonFinite, match="step 7: the loss is nan.*not applied, so the weights are those of step 6"):
        optimizer_step(model, optimizer, scheduler, max_grad_norm=1.0, loss=float("nan"), step=7)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())  # and the bad gradient is gone


def test_kl_in_the_reward_lowers_each_reward_by_beta_times_its_summed_estimate():
    tokenizer = make_tokenizer()
    policy, reference = make_tiny_model(len(tokenizer), seed=0), make_tiny_model(len(tokenizer), seed=1)
    p = tokenizer("hi", add_special_tokens=False)["input_ids"]
    c = tokenizer("ab", add_special_tokens=False)["input_ids"]
    sampler_logp = [-1.0, -2.0]  # what the sampler reported for the two tokens
    rollouts = [Rollout(p, c, sampler_logp, "stop", "ab"), Rollout(p, c[:1], sampler_logp[:1], "stop", "a")]
    logprobs = LogProbs(fast=True, temperature=1.0)
    kl = KLReference(KLSettings(beta=0.5, kl_penalty="reward"), policy, reference, logprobs)
    rewards, kls = kl.penalize([1.0, 0.0], rollouts, 0, 2)
    # By hand: ref log-probs of the tokens from the reference model, k3 per token, summed per completion.
    batch = Batch.from_rollouts(rollouts, torch.zeros(2), torch.ones(2, dtype=torch.bool), 0, False, 2)
    ref = logprobs.in_chunks(reference, batch)
    k3 = kl_estimate(torch.tensor(sampler_logp), ref[0], "k3")
    expected = [k3.sum().item(), k3[0].item()]
    assert kls == pytest.approx(expected, rel=1e-6)
    assert rewards == pytest.approx([1.0 - 0.5 * expected[0], 0.0 - 0.5 * expected[1]], rel=1e-6)
    assert kl.loss_beta == 0.0  # charged to the reward, so not to the loss as well
    assert KLReference(KLSettings(beta=0.5), policy, reference, logprobs).penalize([1.0], rollouts[:1], 0, 1) == ([1.0], None)


# --- the loss settings, wired from the config into PolicyUpdate --------------------------------


def test_update_settings_take_the_loss_settings_from_the_config():
    from rlvr.config import build_config
    from rlvr.update import UpdateSettings

    def from_config(cfg, off_policy):  # as the trainer builds them
        return UpdateSettings.from_sections(cfg.update_settings, cfg.rollout_settings, cfg.steps_per_optimizer_step, off_policy)

    cfg = build_config({"delta": 1.5, "epsilon_high": 0.28, "top_entropy_quantile": 0.2,
                        "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5,
                        "vllm_importance_sampling_cap": 2.0})  # TRL's older name for clip_max
    s = from_config(cfg, off_policy=True)
    assert (s.delta, s.top_entropy_quantile) == (1.5, 0.2)
    assert (s.sampler_correction, s.sampler_clip_min, s.sampler_clip_max) == ("token_mask", 0.5, 2.0)
    assert from_config(cfg, off_policy=False).sampler_correction is None  # the trained model sampled
    off = build_config({"vllm_importance_sampling_correction": False})
    assert from_config(off, off_policy=True).sampler_correction is None
    default = from_config(build_config({}), off_policy=True)  # TRL's defaults
    assert (default.sampler_correction, default.sampler_clip_min, default.sampler_clip_max) == ("sequence_mask", None, 3.0)
    assert (default.delta, default.top_entropy_quantile) == (None, 1.0)


@pytest.mark.parametrize("settings,message", [
    ({"delta": 1.2}, "delta .* must be > 1 \\+ epsilon_high = 1.2"),
    ({"delta": 1.25, "epsilon_high": 0.28}, "must be > 1 \\+ epsilon_high = 1.28"),
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile must be in \\[0, 1\\]"),
    ({"top_entropy_quantile": -0.1}, "top_entropy_quantile must be in \\[0, 1\\]"),
    ({"vllm_importance_sampling_clip_min": 3.0}, "clip_min \\(3.0\\) must be less than vllm_importance_sampling_clip_max \\(3.0\\)"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None}, "truncates the ratio"),
])
def test_loss_settings_that_cannot_work_are_refused(settings, message):
    from rlvr.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=message):
        build_config(settings)


def test_loss_settings_trl_allows_are_accepted():
    from rlvr.config import build_config

    build_config({"delta": 1.21, "top_entropy_quantile": 0.0})
    build_config({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None,
                  "vllm_importance_sampling_clip_min": 0.5})  # truncating from below only
    build_config({"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": None})  # no bound
    build_config({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None,
                  "vllm_importance_sampling_correction": False})  # the mode is not used


def _two_completions(tokenizer) -> Batch:
    p = tokenizer("what is 2+2?", add_special_tokens=False)["input_ids"]
    rollouts = [Rollout(p, tokenizer(c, add_special_tokens=False)["input_ids"], [0.0] * 3, "stop", c) for c in ("4 a", "5 b")]
    return Batch.from_rollouts(rollouts, torch.tensor([1.0, -0.5]), torch.ones(2, dtype=torch.bool), 0, False, 2)


def _policy_update(model, **settings):
    from rlvr.losses import LossKnobs
    from rlvr.update import EntropySettings, PolicyUpdate, UpdateSettings

    base = dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.2, importance_sampling_level="token", micro_batch_size=2,
                max_completion_length=3, max_grad_norm=0.0, num_iterations=1, sampler_correction=None, fsdp=False,
                sampler_clip_min=None, sampler_clip_max=3.0, delta=None, top_entropy_quantile=1.0, router_aux_loss_coef=0.0,
                knobs=LossKnobs(), off_policy_mask_threshold=None, sampler_reports=False,
                entropy=EntropySettings(0.0, False, 0.0, 1.0, 0.005, 0.2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients are what is checked
    logprobs = LogProbs(fast=True, temperature=1.0)
    kl = KLReference(KLSettings(beta=0.0), model, None, logprobs)
    return PolicyUpdate(UpdateSettings(**{**base, **settings}), model, optimizer, _constant_schedule(optimizer), logprobs, kl, 0)


@pytest.mark.parametrize("micro_batch_size", [2, 1])
def test_top_entropy_quantile_trains_on_the_high_entropy_tokens_of_each_micro_batch(micro_batch_size):
    """As TRL: the entropy threshold is the quantile over the tokens of one micro-batch (on every
    rank), and only the tokens at or above it carry the policy gradient."""
    from rlvr.losses import LossNorm, entropy_threshold, high_entropy_mask, policy_loss

    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    batch = _two_completions(tokenizer)
    update = _policy_update(model, top_entropy_quantile=0.5, micro_batch_size=micro_batch_size)
    update.accumulate_gradients(batch)
    got = [p.grad.clone() for p in model.parameters()]

    # By hand: the same loss with the mask of each micro-batch's own median entropy.
    model.zero_grad()
    norm = LossNorm(2, batch.num_tokens, 3, 2 // micro_batch_size)
    kept = 0
    for lo in range(0, 2, micro_batch_size):
        micro = batch.select(slice(lo, lo + micro_batch_size))
        logp, entropy = update.logprobs(model, micro)
        mask = micro.completion_mask
        keep = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 0.5))
        kept += int(keep.sum())
        loss, _ = policy_loss(logp, logp.detach(), micro.advantages, mask, norm, loss_type="dapo", entropy_mask=keep)
        loss.backward()
    # the median of 6 (or 3) distinct entropies keeps 3 (or 2 + 2) of the 6 tokens
    assert kept == {2: 3, 1: 4}[micro_batch_size]
    assert all(torch.allclose(g, p.grad, atol=1e-7) for g, p in zip(got, model.parameters()))
    every = _policy_update(model, micro_batch_size=micro_batch_size)
    every.accumulate_gradients(batch)
    assert not all(torch.allclose(g, p.grad, atol=1e-7) for g, p in zip(got, model.parameters()))  # the mask mattered


def test_sequence_mask_correction_and_its_metrics_by_hand():
    """The default vllm_importance_sampling_mode: each completion weighted by its whole sampler
    ratio, zero above clip_max; the metrics are TRL's."""
    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    batch = _two_completions(tokenizer)
    batch.advantages = torch.tensor([1.0, 1.0])
    with torch.no_grad():
        logp, _ = LogProbs(fast=True, temperature=1.0)(model, batch)
    ln2 = math.log(2)
    # trainer - sampler log-prob per token: row 0: ln 2, ln 2, ln 2 -> ratio 8 > 3: weight 0
    #                                      row 1: ln 2, ln 2, -ln 16 -> ratio 4 * 1/16 = 0.25
    diff = torch.tensor([[ln2, ln2, ln2], [ln2, ln2, -4 * ln2]])
    batch.sampler_logprobs = logp - diff
    metrics = _policy_update(model, sampler_correction="sequence_mask", sampler_clip_max=3.0)(batch, step=1)
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(0.0)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(0.125, rel=1e-5)  # (0 + 0.25) / 2 completions
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(0.25, rel=1e-5)
    # |difference| over the 6 tokens: (5 ln 2 + 4 ln 2) / 6 = 1.5 ln 2 = 1.039721; the largest is 4 ln 2 = 2.772589
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(1.5 * ln2, rel=1e-5)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(4 * ln2, rel=1e-5)
    # ratio 1 to the old log-probs, A = 1: per-token loss -v: row 0: 0 x 3, row 1: -0.25 x 3; dapo: -0.75 / 6 = -0.125
    assert metrics["loss"] == pytest.approx(-0.125, rel=1e-5)


def test_token_truncate_metrics_are_over_tokens():
    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    batch = _two_completions(tokenizer)
    with torch.no_grad():
        logp, _ = LogProbs(fast=True, temperature=1.0)(model, batch)
    ln2 = math.log(2)
    # token ratios 2, 2, 2 / 2, 2, 1/16, truncated at 3 (none) and from below at 0.5: 2, 2, 2, 2, 2, 0.5
    batch.sampler_logprobs = logp - torch.tensor([[ln2, ln2, ln2], [ln2, ln2, -4 * ln2]])
    metrics = _policy_update(model, sampler_correction="token_truncate", sampler_clip_min=0.5, sampler_clip_max=3.0)(batch, step=1)
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5, rel=1e-5)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(10.5 / 6, rel=1e-5)  # (5 x 2 + 0.5) / 6 tokens
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0, rel=1e-5)


def test_the_adaptive_entropy_coefficient_by_hand():
    """TRL's control: a step applies the coefficient the step before left, only while that step's entropy
    was at or below the target (the first applies none); then it moves by delta within [min, max]."""
    from rlvr.update import EntropyControl, EntropySettings

    control = EntropyControl(EntropySettings(0.1, True, 0.0, 0.12, 0.015, 0.5))
    applied = []
    for entropy in [0.4, 0.3, 0.6, 0.7, 0.2]:
        applied.append(control.applied())
        control.after_step(entropy)
    # coef after each step: 0.115 (0.4 <= 0.5), 0.12 (capped), 0.105, 0.09, 0.105
    assert applied == pytest.approx([0.0, 0.115, 0.12, 0.0, 0.0])
    assert control.coef == pytest.approx(0.105) and control.last == 0.2
    fixed = EntropyControl(EntropySettings(0.05, False, 0.0, 1.0, 0.005, 0.2))
    fixed.after_step(0.9)
    assert (fixed.applied(), fixed.coef) == (0.05, 0.05)  # without control: always the setting


def test_the_entropy_bonus_is_the_mean_entropy_of_each_micro_batch_over_the_micro_batches():
    from rlvr.losses import LossNorm, policy_loss
    from rlvr.update import EntropySettings

    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    batch = _two_completions(tokenizer)
    update = _policy_update(model, micro_batch_size=1, entropy=EntropySettings(0.3, False, 0.0, 1.0, 0.005, 0.2))
    sums = update.accumulate_gradients(batch)
    got = [p.grad.clone() for p in model.parameters()]
    # by hand: each micro-batch's loss minus 0.3 x its mean token entropy / 2 micro-batches
    model.zero_grad()
    norm = LossNorm(2, batch.num_tokens, 3, 2)
    entropies = []
    for lo in range(2):
        micro = batch.select(slice(lo, lo + 1))
        logp, entropy = update.logprobs(model, micro)
        mask = micro.completion_mask
        loss, _ = policy_loss(logp, logp.detach(), micro.advantages, mask, norm, loss_type="dapo")
        entropies.append(entropy[mask].sum().item())
        (loss - 0.3 * entropy[mask].mean() / 2).backward()
    assert all(torch.allclose(g, p.grad, atol=1e-7) for g, p in zip(got, model.parameters()))
    assert sums["entropy_bonus/sum"] == pytest.approx(sum(entropies), rel=1e-5)
    assert sums["entropy_bonus/count"] == batch.num_tokens
