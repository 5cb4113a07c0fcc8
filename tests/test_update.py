"""Stage 4's reusable parts on their own: LogProbs and optimizer_step, without the GRPO trainer
(what SFT or DPO would take from update.py), and the KL term as one object."""

import subprocess
import sys

import pytest
import torch

from conftest import make_tiny_model, make_tokenizer
from rlvr.kl import kl_estimate
from rlvr.logprobs import LogProbs
from rlvr.reference import KLReference, KLSettings
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
    kl = KLReference(KLSettings(beta=0.5, placement="reward"), policy, reference, logprobs)
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
