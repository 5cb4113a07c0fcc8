"""The KL term to a reference policy, in one object: which reference, which estimator, charged to
the loss or to the reward, and the coefficient beta with its adaptive controller (kl.py has the
formulas).

The reference is a frozen copy of the starting model, or with LoRA the policy itself with its
adapter switched off (no copy).  With fsdp the frozen copy is sharded like the policy (fsdp.py):
each process keeps 1/N of it; its forwards, and those of the sharded policy with its adapter off,
run in lockstep, every rank as many as the busiest.  With `kl_penalty="loss"` each update adds beta x the per-token
estimate (`kl_estimator`) to the loss (GRPO); with `kl_penalty="reward"` each completion's reward
is lowered by beta x its summed estimate before the advantages (RLHF with PPO).  With `kl_target`,
beta moves after every step toward the value that keeps the measured KL near it, over about
`kl_horizon` steps.  With `sync_ref_model` (TRL's, from TR-DPO, https://arxiv.org/abs/2404.09656)
the frozen copy moves toward the policy every ref_model_sync_steps optimizer steps,
reference = alpha x policy + (1 - alpha) x reference (alpha: ref_model_mixup_alpha); the moved
reference is then part of the checkpoint state, so that a resumed run uses it.  The settings are
config.KLSettings, the KL section of the run's settings.
"""

from __future__ import annotations

import torch

from rlvr import distributed, fsdp
from rlvr.config import KLSettings
from rlvr.kl import AdaptiveKL, sequence_kl
from rlvr.lora import is_peft, reference_off
from rlvr.types import Batch, Rollout


class KLReference:
    def __init__(self, settings: KLSettings, policy, ref_model, logprobs, world: distributed.World = distributed.SINGLE,
                 sharded: bool = False):
        """policy: the trained model (its adapter is switched off when there is no ref_model);
        logprobs: a logprobs.LogProbs, how log-probs are computed; sharded: with fsdp, `policy` is
        sharded (fsdp.shard) and so is ref_model: their forwards are collectives."""
        self.settings, self.policy, self.ref_model, self.logprobs = settings, policy, ref_model, logprobs
        self.world, self.sharded = world, sharded
        self.beta = settings.beta
        self.control = AdaptiveKL(settings.beta, settings.kl_target, settings.kl_horizon) if settings.kl_target else None
        # optimizer steps between moves of the reference toward the policy; 0: it never moves
        self.sync_every = settings.ref_model_sync_steps if settings.sync_ref_model else 0
        if self.sync_every and ref_model is None:
            raise ValueError("sync_ref_model needs a reference model of its own to move (beta > 0, without LoRA)")
        self.steps = 0  # optimizer steps seen by after_step: when the reference is synced

    @property
    def in_reward(self) -> bool:
        return self.beta > 0 and self.settings.kl_penalty == "reward"

    @property
    def loss_beta(self) -> float:
        """The coefficient in the loss: beta, unless the KL is charged to the reward instead."""
        return self.beta if self.settings.kl_penalty == "loss" else 0.0

    @torch.no_grad()
    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """Log-probs [B, T] under the reference: the frozen copy, or the policy with its adapter off."""
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, batch)
        if not is_peft(self.policy):
            raise ValueError("beta > 0 needs a reference model: pass make_reference(model, beta) to Trainer")
        with reference_off(self.policy):
            return self._logprobs(self.policy, batch)

    def _logprobs(self, model, batch: Batch) -> torch.Tensor:
        if not self.sharded:
            return self.logprobs.in_chunks(model, batch)
        return fsdp.lockstep_logprobs(self.logprobs, model, batch, self.world)

    def fill(self, batch: Batch) -> None:
        """Reference log-probs for the loss, once per batch (before its first update)."""
        if self.loss_beta > 0:
            batch.ref_logprobs = self.ref_logprobs(batch)

    def sequence_kl(self, rollouts: list[Rollout], pad_id: int, group_size: int) -> list[float]:
        """Per completion: the sum over its tokens of the estimate between the sampling policy
        (the sampler's log-probs) and the reference.  Rollouts come in groups of group_size."""
        n = len(rollouts)
        batch = Batch.from_rollouts(rollouts, torch.zeros(n), torch.ones(n, dtype=torch.bool), pad_id, False, group_size)
        return sequence_kl(batch.sampler_logprobs, self.ref_logprobs(batch), batch.loss_mask,
                           self.settings.kl_estimator).tolist()

    def penalize(self, rewards: list[float], rollouts: list[Rollout], pad_id: int,
                 group_size: int) -> tuple[list[float], list[float] | None]:
        """(rewards, per-completion KL): lowered by beta x KL when the KL is charged to the reward."""
        if not self.in_reward:
            return rewards, None
        kls = self.sequence_kl(rollouts, pad_id, group_size)
        return [r - self.beta * k for r, k in zip(rewards, kls)], kls

    def after_step(self, metrics: dict) -> None:
        """After each optimizer step: record the beta this step used; with a target, move it for the
        next step; every ref_model_sync_steps steps (sync_ref_model), move the reference toward the policy."""
        if self.beta > 0:
            metrics["beta"] = self.beta
        if self.control is not None:
            self.beta = self.control.update(metrics.get("kl"))
        self.steps += 1
        if self.sync_every and self.steps % self.sync_every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """reference <- alpha x policy + (1 - alpha) x reference, parameter by parameter (TRL's
        SyncRefModelCallback), from the model being trained, whose step has just been taken: a sharded
        reference mixes shard by shard."""
        alpha = self.settings.ref_model_mixup_alpha
        if self.sharded:
            return fsdp.mix_into(self.ref_model, self.policy, alpha)
        policy = dict(self.policy.named_parameters())
        for name, ref in self.ref_model.named_parameters():
            ref.mul_(1.0 - alpha).add_(policy[name].to(ref.device, ref.dtype), alpha=alpha)

    @property
    def synced(self) -> bool:
        """Whether the reference has moved from the starting model."""
        return bool(self.sync_every) and self.steps >= self.sync_every

    def state_dict(self) -> dict:
        state = {"beta": self.beta, "kl_control": self.control.state_dict() if self.control else None, "steps": self.steps}
        if self.synced and not self.sharded:  # else the starting model, which a resumed run loads anyway (sharded: shards())
            state["ref_model"] = fsdp.full_state(self.ref_model)
        return state

    def shards(self) -> dict:
        """A moved reference's shards: with fsdp each rank's own, which it saves in a checkpoint;
        without, the whole reference, which a sharded checkpoint resumed without fsdp reads back."""
        if self.synced and self.ref_model is not None:
            return {"ref_model": fsdp.model_shards(self.ref_model, trained_only=False)}
        return {}

    def load_shards(self, shards: dict) -> None:
        if "ref_model" in shards:
            fsdp.load_model_shards(self.ref_model, shards["ref_model"])

    def load_state_dict(self, state: dict) -> None:
        self.beta = state.get("beta", self.beta)
        if self.control is not None and state.get("kl_control"):
            self.control.load_state_dict(state["kl_control"])
        self.steps = state.get("steps", self.steps)
        if state.get("ref_model") is not None and self.ref_model is not None:
            if self.sharded:
                fsdp.load_full_state_dict(self.ref_model, state["ref_model"])
            else:
                self.ref_model.load_state_dict(state["ref_model"])
