"""One training step, top to bottom: sample, score, advantage, update.  (The whole run,
with evaluation, logging, alerts and checkpoints around the steps, is run.py.)

One *generation* samples G completions for each of `prompts_per_step` prompts
(stages 1-3), then `num_iterations` optimizer steps train on it (stage 4).
A step is one optimizer step, as in TRL, so max_steps and save_steps mean
what they mean there.
"""

from __future__ import annotations

import math
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlvr import distributed, fsdp, interrupts
from rlvr.advantages import group_advantages
from rlvr.alerts import AlertMonitor
from rlvr.checkpoint import load_checkpoint, save_checkpoint
from rlvr.config import Config
from rlvr.kl import AdaptiveKL, sequence_kl
from rlvr.llama import LlamaRunner, batch_logprobs, supports
from rlvr.lora import is_peft, reference_off
from rlvr.losses import LossNorm, policy_loss, selective_logprobs, truncated_importance_weights
from rlvr.monitor import MetricsLog, generation_metrics
from rlvr.optim import build_optimizer
from rlvr.rollout.home import HomeThread
from rlvr.rollout.stage import RolloutStage
from rlvr.tasks import PromptStream
from rlvr.types import Batch, Example, Rollout, TrainerState


@dataclass
class SampledGroup:
    """The G completions of one prompt with their rewards (total after any KL penalty, and per function)."""

    example: Example
    rollouts: list[Rollout]
    rewards: list[float]
    per_func: dict[str, list]
    kl: list[float] | None = None  # per completion, summed over tokens (kl_penalty=reward)
    rank: int = 0  # the process that sampled it, and trains on it (distributed.py)

    @property
    def has_signal(self) -> bool:
        return max(self.rewards) > min(self.rewards)


@dataclass
class Round:
    groups: list[SampledGroup]
    counters: dict
    rollout_seconds: float
    reward_seconds: float


def _informative(rounds: list[Round]) -> int:
    return sum(g.has_signal for r in rounds for g in r.groups)


class NonFinite(RuntimeError):
    """A loss, gradient, learning rate or weight that is inf or nan: the run stops."""


@dataclass
class Generation:
    """One generated, scored batch and how many optimizer steps have used it."""

    batch: Batch
    metrics: dict
    samples: list[dict] = field(default_factory=list)
    iterations_done: int = 0
    staleness: int = 0  # 1 when sampled ahead, with the weights before the update that precedes its first use


class Trainer:
    def __init__(self, cfg: Config, model, tokenizer, train_examples: list[Example], output_dir: Path, total_steps: int, ref_model=None,
                 world: distributed.World = distributed.SINGLE, full_model=None):
        self.cfg, self.model, self.tokenizer, self.ref_model = cfg, model, tokenizer, ref_model
        self.world = world  # this process among several (torchrun); only rank 0 writes files
        # With fsdp, `model` is sharded and `full_model` an unsharded copy that samples and is saved (fsdp.py).
        self.full_model = full_model if full_model is not None else model
        # Batches are built on the CPU; each micro-batch moves to the model's device (a GPU, or the CPU).
        self.device = next(self.full_model.parameters()).device
        self.output_dir, self.total_steps = Path(output_dir), total_steps
        # rlvr's own forward (llama.py) for log-probs; else the generic one (always with fsdp: see fsdp.py)
        self.fast = supports(model) and not cfg.fsdp
        self._runners: dict[int, LlamaRunner] = {}
        self.weight_subscribers: list = []  # objects with update_weights(model), told after each optimizer step
        if cfg.fsdp:
            self.weight_subscribers.append(fsdp.FullCopy(self.full_model))
        # Reward functions run on the thread of the training loop, also for a batch sampled ahead (rollout/home.py).
        self.home = HomeThread()
        self.rollout = RolloutStage(cfg, model, self.full_model, tokenizer, world, self.home)  # stages 1 and 2
        self.weight_subscribers.append(self.rollout)
        # Completions from another engine (vLLM, rollout workers) or sampled ahead get the TIS correction (losses.py).
        self.corrects_sampling = cfg.vllm_importance_sampling_correction and self.rollout.off_policy
        self.prompts = PromptStream(train_examples, cfg.seed)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_steps)
        self.beta = cfg.beta  # moved by the adaptive KL controller when kl_target is set
        self.kl_control = AdaptiveKL(cfg.beta, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target else None
        self.log = MetricsLog(self.output_dir, cfg.logging_steps)
        self.alerts = AlertMonitor(cfg, self.output_dir / "alerts.jsonl" if world.is_main else None)
        self.last_samples: list[dict] = []
        self.step = 0
        self.pending: Generation | None = None
        self.ahead: Future | None = None  # with max_staleness=1, the next generation, sampled while this step trains
        self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="rlvr-ahead") if cfg.max_staleness else None
        self.extra_state: dict = {}  # e.g. the accuracy before training, kept across resumes
        self.poisoned: str | None = None  # why the weights may no longer be saved (non-finite after an update)

    # --- stages 1-3: one generation ----------------------------------------------------

    def generate(self) -> Generation:
        """Sample and score G completions per prompt, then compute advantages.

        With dynamic_sampling (DAPO), groups whose rewards are all equal are dropped and
        further rounds of prompts are sampled until prompts_per_step groups carry signal,
        or max_sampling_rounds extra rounds have run; then the informative groups are used."""
        cfg, size = self.cfg, self.cfg.num_generations
        rounds = [self._sample_round()]  # 1. rollout and 2. reward
        while cfg.dynamic_sampling and len(rounds) <= cfg.max_sampling_rounds and _informative(rounds) < cfg.prompts_per_step:
            rounds.append(self._sample_round())
        groups = [g for r in rounds for g in r.groups]
        chosen = [g for g in groups if g.has_signal][: cfg.prompts_per_step] if cfg.dynamic_sampling else groups
        rewards = torch.tensor([x for g in chosen for x in g.rewards])
        advantages, zero_std = group_advantages(rewards, size, cfg.scale_rewards)  # 3. advantage
        rollouts = [r for g in chosen for r in g.rollouts]
        keep = (~zero_std).repeat_interleave(size)  # groups without signal are left out
        keep &= torch.tensor([g.rank == self.world.rank for g in chosen], dtype=torch.bool).repeat_interleave(size)
        batch = Batch.from_rollouts(rollouts, advantages, keep, self.rollout.pad_id, cfg.mask_truncated_completions, size)
        metrics = generation_metrics(groups, rounds, size)
        if cfg.dynamic_sampling:
            metrics["sampling/rounds"] = len(rounds) - 1
            metrics["sampling/dropped_groups"] = sum(not g.has_signal for g in groups)
        samples = [
            {"prompt": g.example.prompt, "answer": g.example.answer, "completion": r.text, "reward": reward,
             "advantage": advantages[i * size + j].item(), "finish_reason": r.finish_reason}
            for i, g in enumerate(chosen) for j, (r, reward) in enumerate(zip(g.rollouts, g.rewards))
        ][: cfg.num_completions_to_print]
        return Generation(batch, metrics, samples)

    def _sample_round(self) -> "Round":
        """One round: prompts_per_step prompts, G completions each, scored; with kl_penalty=reward
        the reward is lowered by beta x the completion's KL to the reference."""
        cfg = self.cfg
        examples = self.prompts.take(cfg.prompts_per_step)  # the same on every rank
        out = self.rollout.sample(examples, self.generator, TrainerState(global_step=self.step, max_steps=self.total_steps))
        totals, kls = list(out.scores.total), None
        if self.beta > 0 and cfg.kl_penalty == "reward":
            kls = self._sequence_kl([r for group in out.groups for r in group])
            totals = [t - self.beta * k for t, k in zip(totals, kls)]
        groups = []
        for i, (ex, group) in enumerate(zip(out.examples, out.groups)):
            idx = range(i * cfg.num_generations, (i + 1) * cfg.num_generations)
            groups.append(SampledGroup(ex, group, [totals[j] for j in idx], {n: [v[j] for j in idx] for n, v in out.scores.per_func.items()},
                                       None if kls is None else [kls[j] for j in idx], self.world.rank))
        if not self.world.enabled:
            return Round(groups, out.scores.counters, out.rollout_seconds, out.reward_seconds)
        parts = distributed.gather((groups, out.scores.counters, out.rollout_seconds, out.reward_seconds), self.world)
        counters: dict = {}  # every rank sees every group
        for _, part, _, _ in parts:
            for name, counts in part.items():
                for k, v in counts.items():
                    counters.setdefault(name, {})[k] = counters.get(name, {}).get(k, 0) + v
        return Round([g for p in parts for g in p[0]], counters, max(p[2] for p in parts), max(p[3] for p in parts))

    @torch.no_grad()
    def _sequence_kl(self, rollouts: list[Rollout]) -> list[float]:
        """Per completion: sum over tokens of the KL estimate between the sampling policy
        (the sampler's log-probs) and the reference model."""
        batch = Batch.from_rollouts(rollouts, torch.zeros(len(rollouts)), torch.ones(len(rollouts), dtype=torch.bool),
                                    self.rollout.pad_id, False, self.cfg.num_generations)
        return sequence_kl(batch.sampler_logprobs, self._ref_logprobs(batch), batch.completion_mask, self.cfg.kl_estimator).tolist()

    @property
    def loss_beta(self) -> float:
        """The KL coefficient in the loss: beta, unless the KL is charged to the reward instead."""
        return self.beta if self.cfg.kl_penalty == "loss" else 0.0

    @torch.no_grad()
    def _fill_reference_logprobs(self, batch: Batch) -> None:
        """old_logprobs (only needed when a batch is trained on more than once) and ref_logprobs."""
        if self.cfg.num_iterations > 1:
            batch.old_logprobs = self._logprobs_in_chunks(self.full_model, batch)  # the same weights, unsharded
        if self.loss_beta > 0:
            batch.ref_logprobs = self._ref_logprobs(batch)

    def _ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """Under the reference: the frozen copy, or with LoRA the policy with its adapter disabled."""
        if self.ref_model is not None:
            return self._logprobs_in_chunks(self.ref_model, batch)
        if not is_peft(self.model):
            raise ValueError("beta > 0 needs a reference model: pass make_reference(model, beta) to Trainer")
        with reference_off(self.model):
            return self._logprobs_in_chunks(self.model, batch)

    def _logprobs_in_chunks(self, model, batch: Batch) -> torch.Tensor:
        out = torch.zeros(batch.completion_ids.shape)
        size = self.cfg.per_device_train_batch_size
        for lo in range(0, len(batch), size):
            sub = batch.select(slice(lo, lo + size)).to(self.device)
            logprobs, _ = self.completion_logprobs(model, sub)
            out[lo : lo + size, : logprobs.shape[1]] = logprobs.float().cpu()
        return out

    # --- stage 4: one optimizer step ----------------------------------------------------

    def update(self, batch: Batch) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        # Totals over every rank's batch, so each rank's loss is its share of the whole batch's loss.
        size = cfg.per_device_train_batch_size
        rows, num_tokens, micro = distributed.sum_counts([len(batch), batch.num_tokens, math.ceil(len(batch) / size)], self.world)
        if rows == 0:  # every group had equal rewards: nothing to learn from
            with warnings.catch_warnings():  # stepping the schedule without an optimizer step is intended
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            return {"learning_rate": lr, "skipped_update": 1.0, "timing/update": 0.0}
        # With fsdp every rank runs as many micro-batches as the busiest one, and FSDP sums the gradients.
        lockstep = distributed.max_count(math.ceil(len(batch) / size), self.world) if cfg.fsdp else 0
        sums = self.accumulate_gradients(batch, LossNorm(rows, num_tokens, cfg.max_completion_length, micro), lockstep)
        if not cfg.fsdp:
            distributed.sum_gradients(self.model.parameters(), self.world)  # before clipping: the global norm
        if self.world.enabled:
            sums = distributed.merge_sums(distributed.gather(sums, self.world))
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
        if not (math.isfinite(sums["loss"]) and math.isfinite(grad_norm) and math.isfinite(lr)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFinite(f"step {self.step + 1}: the loss is {sums['loss']}, the gradient norm {grad_norm}, the learning "
                            f"rate {lr}; the update was not applied, so the weights are those of step {self.step}")
        self.optimizer.step()
        if not all(torch.isfinite(p).all() for p in self.model.parameters() if p.requires_grad):
            self.poisoned = f"step {self.step + 1}'s update made weights non-finite (inf or nan)"
            raise NonFinite(f"{self.poisoned}; nothing after the last checkpoint is saved")
        self.scheduler.step()
        if self.ahead is None:  # else once the generation sampled ahead is done (train_step)
            self.publish_weights()
        tokens = max(num_tokens, 1)
        metrics = {"loss": sums["loss"], "entropy": sums["entropy"] / tokens, "grad_norm": grad_norm, "learning_rate": lr,
                   "update_tokens": sums["update_tokens"], "update_flops": sums["update_flops"]}
        for k in ("low", "high", "region"):
            metrics[f"clip_ratio/{k}_mean"] = sums[f"clip_ratio/{k}"] / tokens
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / tokens
        if "sampling/importance_sampling_ratio" in sums:
            metrics["sampling/importance_sampling_ratio/mean"] = sums["sampling/importance_sampling_ratio"] / tokens
            metrics["sampling/importance_sampling_ratio/max"] = sums["sampling/importance_sampling_ratio/max"]
            metrics["sampling/sampling_logp_difference/mean"] = sums["sampling/sampling_logp_difference"] / tokens
        metrics["timing/update"] = time.perf_counter() - t0
        return metrics

    def publish_weights(self) -> None:
        """Hand the updated weights to every sampler outside this model (vLLM, rollout workers)."""
        for subscriber in self.weight_subscribers:
            subscriber.update_weights(self.model)

    def accumulate_gradients(self, batch: Batch, norm: LossNorm | None = None, num_micro_batches: int = 0) -> dict:
        """Backward over micro-batches of per_device_train_batch_size completions; returns metric sums.

        The loss of each micro-batch is normalised by totals over the whole batch
        (LossNorm; over every rank's batch when several processes train), so the
        accumulated gradient does not depend on the split."""
        cfg = self.cfg
        self.model.train()
        size = cfg.per_device_train_batch_size
        norm = norm or LossNorm(len(batch), batch.num_tokens, cfg.max_completion_length, math.ceil(len(batch) / size))
        sums = {"loss": 0.0, "entropy": 0.0, "update_tokens": 0.0, "update_flops": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for lo in range(0, max(len(batch), num_micro_batches * size), size):
            micro = (batch.select(slice(lo, lo + size)) if lo < len(batch) else self._empty_micro_batch()).to(self.device)
            tokens, flops = self._work(micro)
            sums["update_tokens"] += tokens
            sums["update_flops"] += flops
            logprobs, entropy = self.completion_logprobs(self.model, micro)
            old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
            weights = None
            if self.corrects_sampling and micro.sampler_logprobs is not None:
                weights = truncated_importance_weights(old, micro.sampler_logprobs, micro.completion_mask,
                                                       cfg.vllm_importance_sampling_cap)
                mask = micro.completion_mask
                sums["sampling/importance_sampling_ratio"] = sums.get("sampling/importance_sampling_ratio", 0.0) + weights[mask].sum().item()
                sums["sampling/importance_sampling_ratio/max"] = max(sums.get("sampling/importance_sampling_ratio/max", 0.0),
                                                                     weights[mask].max().item() if mask.any() else 0.0)
                diff = (old.detach() - micro.sampler_logprobs).abs()[mask]
                sums["sampling/sampling_logp_difference"] = sums.get("sampling/sampling_logp_difference", 0.0) + diff.sum().item()
            loss, m = policy_loss(
                logprobs, old, micro.advantages, micro.completion_mask, norm,
                loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                importance_sampling_level=cfg.importance_sampling_level, ref_logprobs=micro.ref_logprobs,
                beta=self.loss_beta, kl_estimator=cfg.kl_estimator,
                importance_weights=weights,
            )
            loss.backward()
            self.home.serve()  # reward calls of a batch sampled ahead, between micro-batches
            sums["loss"] += loss.item()
            sums["entropy"] += torch.where(micro.completion_mask, entropy, 0.0).sum().item()
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v.item()
        return sums

    def _empty_micro_batch(self) -> Batch:
        """A micro-batch without tokens (zero loss and gradient) for a rank with fewer than the others (fsdp)."""
        empty = fsdp.empty_micro_batch(self.rollout.pad_id)
        if self.loss_beta > 0:
            empty.ref_logprobs = torch.zeros((1, 1))
        return empty

    def _work(self, batch: Batch) -> tuple[int, float]:
        """(tokens through the transformer body, FLOPs of forward + backward) for one micro-batch:
        6 x parameters per token, the output layer only where a completion token is predicted."""
        head = self.model.get_output_embeddings().weight.numel()
        body = sum(p.numel() for p in self.model.parameters()) - (0 if self.model.config.tie_word_embeddings else head)
        predicted = int(batch.completion_mask.sum())
        if self.fast:  # each group's prompt once, no padding
            firsts = {}
            for row, g in enumerate(batch.group_ids.tolist() if batch.group_ids is not None else range(len(batch))):
                firsts.setdefault(g, row)
            tokens = int(batch.prompt_mask[list(firsts.values())].sum()) + predicted
        else:  # padded prompt + completion for every row, the output layer at every completion position
            tokens = batch.prompt_ids.numel() + batch.completion_ids.numel()
            predicted = batch.completion_ids.numel()
        return tokens, 6.0 * (body * tokens + head * predicted)

    def completion_logprobs(self, model, batch: Batch):
        """Per-token log-probs (and entropies) of the completion tokens under `model`,
        with logits divided by the sampling temperature, as the sampler saw them."""
        if self.fast:
            runner = self._runners.setdefault(id(model), LlamaRunner(model))
            with self._autocast():
                return batch_logprobs(runner, batch, self.cfg.temperature, torch.bfloat16 if self.cfg.bf16 else None)
        return self.reference_logprobs(model, batch)

    def reference_logprobs(self, model, batch: Batch):
        """The straightforward computation: the model's own forward over padded prompt + completion."""
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        width = batch.completion_ids.shape[1]
        with self._autocast():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=width + 1).logits
        logits = logits[:, :-1] / self.cfg.temperature  # position t predicts token t + 1
        return selective_logprobs(logits, batch.completion_ids)

    def _autocast(self):
        if not self.cfg.bf16:
            import contextlib

            return contextlib.nullcontext()
        return torch.autocast(device_type=next(self.model.parameters()).device.type, dtype=torch.bfloat16)

    # --- the loop -------------------------------------------------------------------------

    def train_step(self, on_step=None) -> dict:
        """One optimizer step, generating a new batch when the previous one is used up.

        With max_staleness=1 the batch of the next generation is sampled (in a thread, from the
        weights before this step's update) while this step trains, and is ready when the step
        returns; the samplers get the new weights only then.  `on_step(metrics)` records the step
        (run.py: evaluation, alerts, the metrics row); from the update to its end no Ctrl-C or
        SIGTERM cuts in (interrupts.py), so weights, step and records always agree."""
        t0 = time.perf_counter()
        self.home.bind()
        if self.pending is None:
            self.pending = self._generate_or_rewind()
        with interrupts.deferred(f"step {self.step + 1} (its update and its record)"):
            metrics = self._train_on(self.pending, t0)
            if on_step is not None:
                on_step(metrics)
        return metrics

    def _train_on(self, gen: "Generation", t0: float) -> dict:
        if gen.iterations_done == 0 and len(gen.batch):
            self._fill_reference_logprobs(gen.batch)  # with the weights it is first trained at
        last_use, last_step = gen.iterations_done + 1 >= self.cfg.num_iterations, self.step + 1 >= self.total_steps
        if self._ahead_thread is not None and last_use and not last_step:
            before = self._sampling_position()
            self.ahead = self._ahead_thread.submit(self._generate_ahead)
        try:
            metrics = {**gen.metrics, **self.update(gen.batch)}
        except BaseException:
            if self.ahead is not None:  # drop what was sampled ahead: a checkpoint saved now resumes exactly
                self.home.refuse()  # its reward calls fail, so it ends
                wait([self.ahead])
                self.home.accept()
                self.ahead = None
                self._rewind(before)
            raise
        following = None  # the next generation, when it was sampled ahead
        if self.ahead is not None:
            self.home.serve_until(self.ahead)  # its reward calls run here
            following, self.ahead = self.ahead.result(), None  # an error in it is raised here
            self.publish_weights()
        if self.cfg.max_staleness:
            metrics["sampling/staleness"] = gen.staleness  # 1: sampled before the update that preceded its first use
        if self.beta > 0:
            metrics["beta"] = self.beta  # the beta this step used
        if self.kl_control is not None:  # adaptive KL: the next step's beta
            self.beta = self.kl_control.update(metrics.get("kl"))
        gen.iterations_done += 1
        if gen.iterations_done == 1 and gen.samples and self.cfg.log_completions and self.world.is_main:
            self.log.add_completions(self.step + 1, gen.samples)
        self.last_samples = gen.samples
        if gen.iterations_done >= self.cfg.num_iterations:
            self.pending = following
        self.step += 1
        metrics["epoch"] = self.prompts.epochs_done
        metrics["step_time"] = time.perf_counter() - t0
        metrics["tokens_per_second"] = gen.metrics["num_tokens"] / metrics["step_time"]
        return metrics

    def _generate_or_rewind(self) -> Generation:
        before = self._sampling_position()
        try:
            return self.generate()
        except BaseException:  # leave data and sampler where they were, so a checkpoint saved now resumes exactly
            self._rewind(before)
            raise

    def _sampling_position(self) -> tuple:
        """Where the prompt stream and the sampler's generator are: what a generation moves on."""
        return self.prompts.state_dict(), self.generator.get_state()

    def _rewind(self, position: tuple) -> None:
        self.prompts.load_state_dict(position[0])
        self.generator.set_state(position[1])

    def _generate_ahead(self) -> Generation:
        with self.rollout.side_stream():
            gen = self._generate_or_rewind()
        gen.staleness = 1
        return gen

    def state_dict(self, collective: bool = True) -> dict:
        """With several processes, `collective` gathers every rank's pending batch (all ranks must
        call it); without, the pending batch is left out and regenerated on resume."""
        pending = self.pending
        if self.world.enabled:
            pending = distributed.gather(self.pending, self.world) if collective else None
        return {
            "step": self.step,
            "optimizer": fsdp.full_optimizer_state(self.model, self.optimizer) if self.cfg.fsdp else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "prompts": self.prompts.state_dict(),
            "generator": self.generator.get_state(),
            "log": self.log.state_dict(),
            "alerts": self.alerts.state_dict(),
            "pending": pending,
            "extra": self.extra_state,
            "beta": self.beta,
            "kl_control": self.kl_control.state_dict() if self.kl_control else None,
        }

    def save(self, collective: bool = True) -> Path | None:
        """Every rank calls it (see state_dict); rank 0 writes the checkpoint and returns its path.
        With fsdp the optimizer state is gathered from every rank, so nothing is saved without `collective`;
        nor after an update made the weights non-finite."""
        if (self.cfg.fsdp and not collective) or self.poisoned:
            return None
        state = self.state_dict(collective)
        if not self.world.is_main:
            return None
        return save_checkpoint(self.output_dir, self.step, self.full_model, self.tokenizer, state, self.cfg.save_total_limit)

    def resume(self, checkpoint: Path) -> None:
        state = load_checkpoint(checkpoint, self.full_model)
        self.step = state["step"]
        if self.cfg.fsdp:
            fsdp.load_full_state_dict(self.model, self.full_model.state_dict())
            fsdp.load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.cfg.resume_override:  # the optimizer settings given now, not the checkpoint's
            self._apply_optimizer_settings()
        self.prompts.load_state_dict(state["prompts"])
        self.generator.set_state(state["generator"])
        self.log.load_state_dict(state["log"])
        if "alerts" in state:
            self.alerts.load_state_dict(state["alerts"])
        self.pending = state["pending"]
        if self.world.enabled:  # one pending batch per rank, or none (then the generation is sampled again)
            fits = isinstance(self.pending, list) and len(self.pending) == self.world.world_size
            self.pending = self.pending[self.world.rank] if fits else None
        self.extra_state = state.get("extra", {})
        self.beta = state.get("beta", self.beta)
        if self.kl_control is not None and state.get("kl_control"):
            self.kl_control.load_state_dict(state["kl_control"])
        self.publish_weights()  # samplers outside this model (rollout workers, vLLM) get the checkpoint's weights

    def _apply_optimizer_settings(self) -> None:
        cfg = self.cfg
        self.scheduler.base_lrs = [cfg.learning_rate] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group.update(initial_lr=cfg.learning_rate, lr=cfg.learning_rate * factor(self.scheduler.last_epoch),
                         weight_decay=cfg.weight_decay, eps=cfg.adam_epsilon, betas=(cfg.adam_beta1, cfg.adam_beta2))
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def close(self) -> None:
        """Stop what the trainer started outside this process (the rollout workers) or in it."""
        if self._ahead_thread is not None:
            self.home.refuse()
            self._ahead_thread.shutdown(wait=True)
        self.rollout.close()


def total_steps_for(cfg: Config, num_train_examples: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    generations = math.ceil(cfg.num_train_epochs * num_train_examples / cfg.prompts_per_step)
    return max(1, generations * cfg.num_iterations)
