"""Stage 4 of a step: one optimizer step on a generated batch.

The batch is split into micro-batches of `micro_batch_size` completions; each one's log-probs
(logprobs.py), its policy loss (loss_type's; weighted for samples from another engine, masked to
the high-entropy tokens and the off-policy completions when asked), the KL term (losses.py) and
an entropy bonus (EntropyControl) are computed and backpropagated, each normalised by totals over
the whole batch (over every rank's batch with several processes), so the accumulated gradient
does not depend on the split.  Then `optimizer_step` sums gradients over
ranks, clips their global norm, refuses non-finite values, and steps the optimizer and the
learning-rate schedule.

`LogProbs` and `optimizer_step` are what another objective (SFT, DPO) needs from here; the
policy loss is GRPO's own.

`on_event(name)` is told transformers' callback points (events.py): "on_substep_end" after each
backward pass but the last, "on_pre_optimizer_step" with the final (summed, unscaled, clipped)
gradients on the parameters, "on_optimizer_step" after the step; the math is the same without it.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch

from rlvr import config, distributed, fsdp
from rlvr.losses import (TOKEN_NORMALISED, LossKnobs, LossNorm, entropy_threshold, high_entropy_mask, off_policy_mask,
                         policy_loss, sampler_importance_weights)
from rlvr.types import Batch
from rlvr.errors import NonFinite  # noqa: F401 - raised here, defined in the leaf errors.py


@dataclass(frozen=True)
class UpdateSettings:
    """What PolicyUpdate reads: the update's settings as this run uses them (every field set by
    from_sections; the defaults are the settings sections' own)."""

    loss_type: str
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: str
    micro_batch_size: int  # per_device_train_batch_size
    max_completion_length: int
    max_grad_norm: float  # 0: no clipping
    num_iterations: int  # optimizer steps per generated batch: > 1 needs the old log-probs
    sampler_correction: str | None  # vllm_importance_sampling_mode; None: no correction (on-policy samples)
    fsdp: bool
    sampler_clip_min: float | None  # vllm_importance_sampling_clip_min
    sampler_clip_max: float | None  # vllm_importance_sampling_clip_max
    delta: float | None  # two-sided clipping: the unclipped ratio's cap
    top_entropy_quantile: float  # train on the tokens of this top fraction of entropy (1: all)
    router_aux_loss_coef: float  # a Mixture-of-Experts model's load-balancing loss weight, resolved (0: not computed)
    knobs: LossKnobs  # sapo's and vespo's settings
    off_policy_mask_threshold: float | None  # leave out off-policy completions with A < 0 (None: off)
    sampler_reports: bool  # the sampler's log-probs are another policy's (another engine, a rollout_func, older weights)
    entropy: EntropySettings  # the entropy bonus and its adaptive control

    @classmethod
    def from_sections(cls, update: config.UpdateSettings, rollout: config.RolloutSettings, steps_per_optimizer_step: int,
                      off_policy: bool, model_config=None, custom_rollouts: bool = False) -> UpdateSettings:
        """steps_per_optimizer_step: optimizer steps one generation feeds (Config.steps_per_optimizer_step);
        off_policy: the samples come from another engine or older weights (rollout/stage.py);
        model_config: the trained model's transformers config (for its router loss); custom_rollouts: a
        rollout_func samples them (its log-probs are the sampling policy's, as off_policy's are)."""
        corrects = rollout.vllm_importance_sampling_correction and off_policy
        return cls(update.loss_type, update.epsilon, update.epsilon_high, update.importance_sampling_level,
                   update.per_device_train_batch_size, rollout.max_completion_length, update.max_grad_norm,
                   update.num_iterations * steps_per_optimizer_step, rollout.vllm_importance_sampling_mode if corrects else None,
                   update.fsdp, sampler_clip_min=rollout.vllm_importance_sampling_clip_min,
                   sampler_clip_max=rollout.vllm_importance_sampling_clip_max, delta=update.delta,
                   top_entropy_quantile=update.top_entropy_quantile,
                   router_aux_loss_coef=router_coefficient(update.router_aux_loss_coef, model_config),
                   knobs=LossKnobs(update.sapo_temperature_pos, update.sapo_temperature_neg, update.vespo_k_pos,
                                   update.vespo_lambda_pos, update.vespo_k_neg, update.vespo_lambda_neg),
                   off_policy_mask_threshold=update.off_policy_mask_threshold, sampler_reports=off_policy or custom_rollouts,
                   entropy=EntropySettings(update.entropy_coef, update.use_adaptive_entropy, update.entropy_coef_min,
                                           update.entropy_coef_max, update.entropy_coef_delta, update.entropy_target))


@dataclass(frozen=True)
class EntropySettings:
    """TRL's entropy bonus: the loss minus coef x the mean entropy of the tokens trained on (the same for
    every loss_type), and its adaptive control (Skywork-OR1, https://arxiv.org/abs/2505.22312)."""

    coef: float  # entropy_coef: the bonus's weight; with `adaptive`, its start
    adaptive: bool  # use_adaptive_entropy
    coef_min: float
    coef_max: float
    delta: float
    target: float  # entropy_target

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0 or self.adaptive


class EntropyControl:
    """The entropy bonus's state across steps, a checkpoint part: the coefficient and the last step's mean
    entropy.  As TRL: a step applies the coefficient left by the one before (adaptive: only while that
    step's entropy was at or below the target; the first step, with none measured, applies none); after
    the step, an adaptive coefficient moves up by delta (to coef_max) when the step's entropy was at or
    below the target, else down (to coef_min)."""

    def __init__(self, settings: EntropySettings):
        self.settings, self.coef, self.last = settings, settings.coef, math.inf

    def applied(self) -> float:
        s = self.settings
        return self.coef if not s.adaptive or self.last <= s.target else 0.0

    def after_step(self, entropy: float) -> None:
        s = self.settings
        if s.adaptive:
            self.coef = min(self.coef + s.delta, s.coef_max) if entropy <= s.target else max(self.coef - s.delta, s.coef_min)
            self.last = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last = state["coef"], state["last"]


def router_coefficient(setting: float | None, model_config) -> float:
    """The weight of the load-balancing loss: `router_aux_loss_coef` when set, else the model's own
    (0.0 for a model without routers).  A model is a Mixture of Experts when its config can ask for
    router logits (`output_router_logits`), as in transformers' MoE models and TRL."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    moe = text is not None and hasattr(text, "output_router_logits")
    if setting is None:
        return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    if setting and not moe:
        raise config.ConfigError(f"router_aux_loss_coef={setting} weights a Mixture-of-Experts model's router loss, but "
                                 f"{type(text).__name__} has no routers; leave it unset (null) or 0")
    return float(setting)


def optimizer_step(model, optimizer, scheduler, max_grad_norm: float, loss: float, step: int,
                   world: distributed.World = distributed.SINGLE, sharded: bool = False,
                   scaler: torch.amp.GradScaler | None = None, on_event=None) -> tuple[float, float]:
    """After the backward passes: sum the gradients over processes (FSDP has already: `sharded`),
    clip their global norm to max_grad_norm (0: no clipping), step the optimizer and the schedule.
    Returns (gradient norm, learning rate used).  Raises NonFinite, without applying the update,
    when the loss, gradient norm or learning rate is inf or nan; and after applying it when it made
    a weight non-finite (`.poisoned` is then set on the exception).

    With fp16's loss scaler (optim.loss_scaler; the backward passes went through `backward`) the
    gradients are unscaled before their norm is taken, and gradients that overflowed are a normal
    skipped step, as in TRL: no update, no step of the schedule, the scale halved, and the
    non-finite norm returned.  Only a scale below MIN_LOSS_SCALE (overflow at every scale) stops the run.
    on_event: as the module docstring says (an overflow's skipped step too, as transformers; a refused one not)."""
    on_event = on_event or _no_event
    lr = scheduler.get_last_lr()[0]
    if not sharded:
        distributed.sum_gradients(model.parameters(), world)  # before clipping: the global norm
    scaling = scaler is not None and scaler.is_enabled()
    if scaling:
        scaler.unscale_(optimizer)  # the true gradients, before their norm is measured and clipped
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
    overflow = scaling and not math.isfinite(grad_norm)
    if not math.isfinite(lr) or not (overflow or math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        raise NonFinite(f"step {step}: the loss is {loss}, the gradient norm {grad_norm}, the learning "
                        f"rate {lr}; the update was not applied, so the weights are those of step {step - 1}")
    on_event("on_pre_optimizer_step")  # the gradients the optimizer applies are on the parameters
    if overflow:
        _skip_overflow(optimizer, scaler, step)
        on_event("on_optimizer_step")
        return grad_norm, lr
    if scaling:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    on_event("on_optimizer_step")
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        error = NonFinite(f"step {step}'s update made weights non-finite (inf or nan); nothing after the last checkpoint is saved")
        error.poisoned = f"step {step}'s update made weights non-finite (inf or nan)"
        raise error
    scheduler.step()
    return grad_norm, lr


def _no_event(name: str) -> None:
    pass


MIN_LOSS_SCALE = 2.0**-24  # fp16's smallest subnormal: below it every scaled gradient underflows


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
    """loss.backward(), through fp16's loss scale when `scaler` is on (optim.loss_scaler)."""
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _skip_overflow(optimizer, scaler: torch.amp.GradScaler, step: int) -> None:
    """An fp16 step whose gradients overflowed: no update, and GradScaler halves its scale."""
    scaler.update()  # reads the inf or nan that unscale_ found
    optimizer.zero_grad(set_to_none=True)
    if scaler.get_scale() < MIN_LOSS_SCALE:
        raise NonFinite(f"step {step}: the gradients overflow fp16 at every loss scale (now {scaler.get_scale():.3g}); "
                        f"the update was not applied, so the weights are those of step {step - 1}. Try bf16=true")


def skip_step(scheduler) -> None:
    """A step without an update (no completion carried signal): the schedule moves on all the same."""
    with warnings.catch_warnings():  # stepping the schedule without an optimizer step is intended
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


class PolicyUpdate:
    def __init__(self, settings: UpdateSettings, model, optimizer, scheduler, logprobs, kl, pad_id: int,
                 world: distributed.World = distributed.SINGLE, between_micro_batches=None, scaler=None,
                 on_event=None, objective=None):
        """logprobs: a logprobs.LogProbs; kl: a reference.KLReference; between_micro_batches: called
        after each backward pass (the reward calls of a batch sampled ahead, rollout/home.py);
        scaler: fp16's loss scaler (optim.loss_scaler), or None; on_event: told the points of the
        step (the module docstring); objective: a loss of another method over the same tokens
        (distill.Distillation): called as objective(model, micro, norm) -> (logp, entropy, loss, metric
        sums), it gives the log-probs and the loss, and GRPO's term is added times its policy_weight."""
        self.settings, self.model, self.optimizer, self.scheduler = settings, model, optimizer, scheduler
        self.logprobs, self.kl, self.pad_id, self.world = logprobs, kl, pad_id, world
        self.between_micro_batches = between_micro_batches or (lambda: None)
        self.poisoned: str | None = None  # why the weights may no longer be saved
        self.scaler = scaler
        self.on_event = on_event or _no_event
        self.entropy = EntropyControl(settings.entropy)  # the entropy bonus's coefficient, across steps
        self.objective = objective

    @torch.no_grad()
    def prepare(self, batch: Batch) -> None:
        """Before a batch's first update: old_logprobs (needed only when it is trained on more than
        once) and the reference log-probs of the KL term."""
        if self.settings.num_iterations > 1:
            batch.old_logprobs = (fsdp.lockstep_logprobs(self.logprobs, self.model, batch, self.world) if self.settings.fsdp
                                  else self.logprobs.in_chunks(self.model, batch))
        self.kl.fill(batch)

    def __call__(self, batch: Batch, step: int, before_step=None) -> dict:
        """One optimizer step on this process's `batch`; `step` is its number (for messages).
        `before_step()` runs after the backward passes and before the weights change (trainer.py:
        the batch sampled ahead is finished there, so an error in it leaves the step unapplied)."""
        before_step = before_step or (lambda: None)
        s, t0 = self.settings, time.perf_counter()
        size = s.micro_batch_size
        # Totals over every rank's batch, so each rank's loss is its share of the whole batch's loss; the
        # completions of groups without signal, left out of the batch, count where the loss normalises.
        rows, num_tokens, micro, trained, trained_tokens, generation_tokens = distributed.sum_counts(
            [len(batch) + batch.skipped_rows, batch.num_tokens + batch.skipped_tokens, math.ceil(len(batch) / size),
             len(batch), batch.num_tokens, batch.generation_tokens], self.world)
        # dapo's normaliser: this step's tokens, or with several steps per generation each step's share of the
        # generation's tokens (TRL's: the generation's count over steps_per_generation)
        norm_tokens = generation_tokens / batch.generation_parts if generation_tokens else num_tokens
        if trained == 0:  # every group had equal rewards: nothing to learn from, but AdamW steps as in TRL
            before_step()
            return self._step_without_signal(step, t0)
        # With fsdp every rank runs as many micro-batches as the busiest one, and FSDP sums the gradients;
        # so does every rank when the entropy threshold of each micro-batch is taken over all ranks.
        together = s.fsdp or (self.world.enabled and s.top_entropy_quantile < 1)
        lockstep = distributed.max_count(math.ceil(len(batch) / size), self.world) if together else 0
        sums = self.accumulate_gradients(batch, LossNorm(rows, norm_tokens, s.max_completion_length, micro), lockstep)
        if self.world.enabled:
            sums = distributed.merge_sums(distributed.gather(sums, self.world))
        before_step()
        try:
            grad_norm, lr = optimizer_step(self.model, self.optimizer, self.scheduler, s.max_grad_norm, sums["loss"], step,
                                           self.world, sharded=s.fsdp, scaler=self.scaler, on_event=self.on_event)
        except NonFinite as e:
            self.poisoned = getattr(e, "poisoned", None)
            raise
        if s.entropy.enabled:  # the step's mean entropy over the tokens trained on, every rank's: the next coefficient
            self.entropy.after_step(sums["entropy_bonus/sum"] / max(sums["entropy_bonus/count"], 1.0))
        tokens = max(num_tokens, 1)
        metrics = {"loss": sums["loss"], "entropy": sums["entropy"] / max(trained_tokens, 1), "grad_norm": grad_norm,
                   "learning_rate": lr, "update_tokens": sums["update_tokens"], "update_flops": sums["update_flops"]}
        counted = tokens if s.importance_sampling_level == "token" else rows  # sequence ratios clip whole completions
        for k in ("low", "high", "region"):
            if f"clip_ratio/{k}" in sums:  # the clipped loss types'
                metrics[f"clip_ratio/{k}_mean"] = sums[f"clip_ratio/{k}"] / counted
        if "cispo_clip_ratio" in sums:
            metrics["cispo_clip_ratio"] = sums["cispo_clip_ratio"] / counted
        if "vespo/phi_seq" in sums:  # over every completion, as TRL's mean (vespo trains every group: see generation.py)
            metrics["vespo/phi_seq_mean"] = sums["vespo/phi_seq"] / max(rows, 1)
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / tokens
        if "divergence" in sums:  # rlvr distill: the teacher's divergence per completion token
            metrics["divergence"] = sums["divergence"] / tokens
        if s.entropy.enabled:  # TRL's: the policy term's loss per micro-batch (averaged), and the coefficient after the step
            metrics["policy_loss"] = sums["policy_loss"] / max(sums["policy_loss/count"], 1.0)
            metrics["entropy_coef"] = self.entropy.coef
        for k in EXTREMES:  # with several processes: averaged over every process's micro-batches
            if sums.get(k + "/count"):
                metrics[k] = sums[k + "/sum"] / sums[k + "/count"]
        if sums.get("aux_loss/count"):
            metrics["aux_loss"] = sums["aux_loss"] / sums["aux_loss/count"]
        if sums.get("sampling/importance_sampling_ratio/count"):
            key = "sampling/importance_sampling_ratio"
            metrics[key + "/min"], metrics[key + "/max"] = sums[key + "/min"], sums[key + "/max"]
            metrics[key + "/mean"] = sums[key] / sums[key + "/count"]
            metrics["sampling/sampling_logp_difference/mean"] = sums["sampling/sampling_logp_difference"] / tokens
            metrics["sampling/sampling_logp_difference/max"] = sums["sampling/sampling_logp_difference/max"]
        metrics["timing/update"] = time.perf_counter() - t0
        return metrics

    def _step_without_signal(self, step: int, t0: float) -> dict:
        """The optimizer step of a batch without signal: every gradient 0, as TRL's loss of zero advantages
        gives (beta = 0), so AdamW's momentum and weight decay still move the weights, as in TRL."""
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        grad_norm, lr = optimizer_step(self.model, self.optimizer, self.scheduler, self.settings.max_grad_norm, 0.0, step,
                                       self.world, sharded=self.settings.fsdp, scaler=self.scaler, on_event=self.on_event)
        return {"loss": 0.0, "grad_norm": grad_norm, "learning_rate": lr, "clip_ratio/low_mean": 0.0,
                "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0, "timing/update": time.perf_counter() - t0}

    def accumulate_gradients(self, batch: Batch, norm: LossNorm | None = None, num_micro_batches: int = 0) -> dict:
        """Backward over micro-batches; returns metric sums.  `norm`: the totals the loss of each
        micro-batch is normalised by (this batch's when None); num_micro_batches: at least this many
        backward passes, empty ones past the batch's end (fsdp's lockstep; without fsdp, such a pass
        only joins the other ranks' entropy threshold)."""
        s = self.settings
        self.model.train()
        size = s.micro_batch_size
        norm = norm or LossNorm(len(batch), batch.num_tokens, s.max_completion_length, math.ceil(len(batch) / size))
        sums = {"loss": 0.0, "entropy": 0.0, "update_tokens": 0.0, "update_flops": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        end = max(len(batch), num_micro_batches * size)
        for lo in range(0, end, size):
            if lo > 0:  # a micro-batch's backward pass is done and another follows (transformers' substep)
                self.on_event("on_substep_end")
            if lo >= len(batch) and not s.fsdp:
                self._entropy_mask(None, None)
                continue
            micro = (batch.select(slice(lo, lo + size)) if lo < len(batch) else self._empty_micro_batch()).to(self.logprobs.device)
            tokens, flops = work(self.model, micro, self.logprobs.fast)
            sums["update_tokens"] += tokens
            sums["update_flops"] += flops
            bonus = self.entropy.applied() if s.entropy.enabled else 0.0
            own = None
            if self.objective is not None:  # another method's loss over these tokens (distill.py)
                logprobs, entropy, *own = self.objective(self.model, micro, norm)
                aux = None
            elif s.router_aux_loss_coef:
                logprobs, entropy, aux = self.logprobs.with_router_loss(self.model, micro, entropy_grad=bool(bonus))
            else:
                (logprobs, entropy), aux = self.logprobs(self.model, micro, entropy_grad=bool(bonus)), None
            old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
            weights = None
            if s.sampler_correction is not None and micro.sampler_logprobs is not None:
                weights = sampler_importance_weights(old, micro.sampler_logprobs, micro.loss_mask,
                                                     s.sampler_correction, s.sampler_clip_min, s.sampler_clip_max)
                _add_sampling_sums(sums, weights, old, micro)
            off_policy = None
            if s.off_policy_mask_threshold is not None:  # against the sampling policy's log-probs where another one sampled, as TRL
                sampled = micro.sampler_logprobs if s.sampler_reports and micro.sampler_logprobs is not None else old
                off_policy = off_policy_mask(micro.advantages, logprobs, sampled, micro.loss_mask, s.off_policy_mask_threshold)
            trained = self._entropy_mask(entropy, micro.loss_mask)
            loss, m = policy_loss(
                logprobs, old, micro.advantages, micro.loss_mask, norm,
                loss_type=s.loss_type, epsilon=s.epsilon, epsilon_high=s.epsilon_high, delta=s.delta,
                importance_sampling_level=s.importance_sampling_level, ref_logprobs=micro.ref_logprobs,
                beta=self.kl.loss_beta, kl_estimator=self.kl.settings.kl_estimator,
                bias_correction_kl=self.kl.settings.use_bias_correction_kl, importance_weights=weights,
                entropy_mask=trained, sequence_mask=off_policy, knobs=s.knobs,
            )
            if own is not None:  # its loss, and GRPO's times its weight (then GRPO's metrics too)
                weight = self.objective.policy_weight
                loss, m = own[0] + weight * loss, {**(m if weight else {}), **own[1]}
            if s.entropy.enabled:
                loss = self._entropy_bonus(loss, m, entropy, micro.loss_mask if trained is None else trained, norm, bonus)
            if lo >= len(batch):  # fsdp's empty micro-batch: a pass for the collectives, no completion to count
                m = {}
            if aux is not None:  # weighted per micro-batch, as TRL weighs it per accumulation step
                loss = loss + s.router_aux_loss_coef * aux / norm.num_micro_batches
                m["aux_loss"], m["aux_loss/count"] = aux.detach(), torch.tensor(1.0)
            backward(loss, self.scaler)
            self.between_micro_batches()
            sums["loss"] += loss.item()
            sums["entropy"] += torch.where(micro.loss_mask, entropy, 0.0).sum().item()
            for k, v in m.items():
                if k in EXTREMES:  # averaged over the micro-batches, as TRL logs them (summed across processes)
                    sums[k + "/count"] = sums.get(k + "/count", 0.0) + 1.0
                    k += "/sum"
                sums[k] = sums.get(k, 0.0) + v.item()
        return sums

    def _entropy_bonus(self, loss, m: dict, entropy, trained, norm: LossNorm, coef: float):
        """The loss minus coef x the micro-batch's mean entropy over the tokens trained on, weighted as one of
        norm.num_micro_batches (TRL's entropy bonus, the same for every loss_type); into `m`, TRL's policy_loss
        (this micro-batch's policy term as TRL's loss states it) and the entropy sums of the adaptive control."""
        weights = torch.where(trained, entropy, torch.zeros_like(entropy))
        tokens = trained.sum()
        # rlvr's micro-batch loss is its share of the step's; TRL states a mean-normalised one per micro-batch
        share = self.world.world_size if self.settings.loss_type in TOKEN_NORMALISED else norm.num_micro_batches
        m["policy_loss"], m["policy_loss/count"] = loss.detach() * share, torch.tensor(1.0)
        m["entropy_bonus/sum"], m["entropy_bonus/count"] = weights.sum().detach(), tokens.detach().float()
        if not coef:
            return loss
        return loss - coef * weights.sum() / tokens.clamp(min=1) / norm.num_micro_batches

    def _entropy_mask(self, entropy, mask):
        """The tokens trained on, as TRL picks them: with top_entropy_quantile < 1, those whose entropy
        reaches its quantile over this micro-batch's tokens on every rank (all ranks take part, with
        entropy None past their batch's end); None (every token) otherwise."""
        q = self.settings.top_entropy_quantile
        if q >= 1:
            return None
        local = torch.zeros(0) if entropy is None else entropy.detach()[mask].float().cpu()
        threshold = entropy_threshold(torch.cat(distributed.gather(local, self.world)), q)
        return None if entropy is None else high_entropy_mask(entropy, mask, threshold)

    def _empty_micro_batch(self) -> Batch:
        """A micro-batch without tokens (zero loss and gradient) for a rank with fewer than the others (fsdp)."""
        empty = Batch.empty(self.pad_id)
        if self.kl.loss_beta > 0:
            empty.ref_logprobs = torch.zeros((1, 1))
        return empty


EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")  # per micro-batch extremes (losses.policy_loss)


def _add_sampling_sums(sums: dict, weights, old, micro: Batch) -> None:
    """The importance-sampling metrics (TRL's names): the weights' sum, count, min and max over the
    masked tokens (token modes) or the completions with a token (sequence modes), and the sum and
    max of |old - sampler| log-prob differences over the masked tokens."""
    mask = micro.loss_mask
    values = weights[mask] if weights.shape == mask.shape else weights[mask.any(-1)].flatten()
    key = "sampling/importance_sampling_ratio"
    sums[key] = sums.get(key, 0.0) + values.sum().item()
    sums[key + "/count"] = sums.get(key + "/count", 0.0) + values.numel()
    diff = (old.detach() - micro.sampler_logprobs).abs()[mask]
    diff_key = "sampling/sampling_logp_difference"
    sums[diff_key] = sums.get(diff_key, 0.0) + diff.nansum().item()
    if values.numel():
        sums[key + "/min"] = min(sums.get(key + "/min", math.inf), values.min().item())
        sums[key + "/max"] = max(sums.get(key + "/max", -math.inf), values.max().item())
        sums[diff_key + "/max"] = max(sums.get(diff_key + "/max", -math.inf), diff.nan_to_num(nan=0.0).max().item())


def work(model, batch: Batch, fast: bool) -> tuple[int, float]:
    """(tokens through the transformer body, FLOPs of forward + backward) for one micro-batch:
    6 x parameters per token, the output layer only where a completion token is predicted."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - (0 if model.config.tie_word_embeddings else head)
    predicted = int(batch.completion_mask.sum())
    if fast:  # each group's prompt once, no padding
        firsts = {}
        for row, g in enumerate(batch.group_ids.tolist() if batch.group_ids is not None else range(len(batch))):
            firsts.setdefault(g, row)
        tokens = int(batch.prompt_mask[list(firsts.values())].sum()) + predicted
    else:  # padded prompt + completion for every row, the output layer at every completion position
        tokens = batch.prompt_ids.numel() + batch.completion_ids.numel()
        predicted = batch.completion_ids.numel()
    return tokens, 6.0 * (body * tokens + head * predicted)
