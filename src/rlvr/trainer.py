"""One training step, top to bottom: sample, score, advantage, update.  (The whole run,
with evaluation, logging, alerts and checkpoints around the steps, is run.py.)

One *generation* samples G completions for each of `prompts_per_step` prompts and scores them
(stages 1-3, rollout/generation.py), then optimizer steps train on it (stage 4, update.py): one per
part, when steps_per_generation splits it into parts of gradient_accumulation_steps micro-batches,
and all of that num_iterations times.  A step is one optimizer step, as in TRL, so max_steps and
save_steps mean what they mean there.  The settings are read here, once, and each part gets its own.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from rlvr import distributed, fsdp, interrupts
from rlvr.alerts import AlertMonitor
from rlvr.checkpoint import GeneratorState, load_checkpoint, restore_trainer_state, save_checkpoint, trainer_state
from rlvr.config import Config
from rlvr.llama import on_fast_path
from rlvr.logprobs import LogProbs
from rlvr.monitor import MetricsLog
from rlvr.optim import apply_optimizer_settings, autocast_dtype, build_optimizer, loss_scaler
from rlvr.reference import KLReference, KLSettings
from rlvr.rollout.generation import Generations, GenerationSettings
from rlvr.rollout.home import HomeThread
from rlvr.rollout.stage import RolloutStage
from rlvr.tasks import PromptStream
from rlvr.types import Batch, Example, Generation, TrainerState
from rlvr.update import PolicyUpdate, UpdateSettings

__all__ = ["StepRecord", "Trainer", "total_steps_for"]


class StepRecord:
    """A trainer whose step's record (its logged completions and `on_step(metrics)`) is kept in
    `unrecorded` from the moment the step is counted until the record is done; a checkpoint saved
    in between holds it, and the resumed run finishes it (run.py)."""

    unrecorded: dict | None = None  # {"step", "metrics", "completions"}
    log: MetricsLog

    def finish_record(self, on_step=None) -> None:
        """Record the last step (its completions, then `on_step(metrics)`), unless done already.
        Each part of a record does its own share once per step (monitor.MetricsLog,
        alerts.AlertMonitor), so a record that failed half way is finished, not repeated."""
        record = self.unrecorded
        if record is None:
            return
        if record["completions"]:
            self.log.add_completions(record["step"], record["completions"])
        if on_step is not None:
            on_step(record["metrics"])
        self.unrecorded = None


class Trainer(StepRecord):
    def __init__(self, cfg: Config, model, tokenizer, train_examples: list[Example], output_dir: Path, total_steps: int, ref_model=None,
                 world: distributed.World = distributed.SINGLE, full_model=None):
        self.cfg, self.model, self.tokenizer, self.ref_model = cfg, model, tokenizer, ref_model
        self.world = world  # this process among several (torchrun); only rank 0 writes files
        # With fsdp, `model` is sharded and `full_model` an unsharded copy that samples and is saved (fsdp.py).
        self.full_model = full_model if full_model is not None else model
        self.output_dir, self.total_steps = Path(output_dir), total_steps
        self.step = 0
        self.weight_subscribers: list = [fsdp.FullCopy(self.full_model)] if cfg.fsdp else []  # told after each update
        # Reward functions run on the thread of the training loop, also for a batch sampled ahead (rollout/home.py).
        self.home = HomeThread()
        self.rollout = RolloutStage(cfg, model, self.full_model, tokenizer, world, self.home)  # 1. rollout, 2. reward
        self.weight_subscribers.append(self.rollout)
        # Log-probs by rlvr's own forward (llama.py) where it applies, else the generic one (always with fsdp).
        device = next(self.full_model.parameters()).device
        self.logprobs = LogProbs(not cfg.fsdp and on_fast_path(model), cfg.temperature, autocast_dtype(cfg),
                                 cfg.per_device_train_batch_size, device)
        # With LoRA the reference is the policy with its adapter off: with fsdp, the full copy's, whose
        # forward is no collective (the ranks' batches differ in size), as for the old log-probs.
        self.kl = KLReference(KLSettings.from_config(cfg), self.full_model, ref_model, self.logprobs)
        self.prompts = PromptStream(train_examples, cfg.seed, shuffle=cfg.shuffle_dataset)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.batches = Generations(GenerationSettings.from_config(cfg), self.rollout, self.prompts, self.generator,
                                   self.kl, world, self.home)  # 1-3: sampling rounds, advantages, sampling ahead
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_steps)
        self.scaler = loss_scaler(cfg, device)  # fp16 only; disabled (a no-op) otherwise
        self.updater = PolicyUpdate(UpdateSettings.from_config(cfg, self.rollout.off_policy), model, self.optimizer,
                                    self.scheduler, self.logprobs, self.kl, self.rollout.pad_id, world,
                                    sampler_model=self.full_model, between_micro_batches=self.home.serve,
                                    scaler=self.scaler)  # 4
        self.log = MetricsLog(self.output_dir, cfg.logging_steps)
        self.alerts = AlertMonitor(cfg, self.output_dir / "alerts.jsonl" if world.is_main else None)
        self.log_completions = cfg.log_completions and world.is_main
        self.parts = cfg.steps_per_optimizer_step  # optimizer steps one pass over a generation takes
        self.uses, self.sharded = cfg.num_iterations * self.parts, cfg.fsdp  # optimizer steps per generation
        self.save_total_limit, self.resume_override = cfg.save_total_limit, cfg.resume_override
        self.last_samples: list[dict] = []
        self.pending: Generation | None = None  # the generation being trained on
        self.extra_state: dict = {}  # e.g. the accuracy before training, kept across resumes

    # --- the four stages ---------------------------------------------------------------------

    def generate(self) -> Generation:
        """1. rollout, 2. reward, 3. advantage: one generation (rollout/generation.py)."""
        return self.batches.generate(self._state())

    def update(self, batch: Batch, before_step=None) -> dict:
        """4. update: one optimizer step on the batch (update.py).  The samplers get the new weights
        from train_step, once the step is counted."""
        return self.updater(batch, self.step + 1, before_step)

    def train_step(self, on_step=None) -> dict:
        """One optimizer step, generating a new batch when the previous one is used up.

        With max_staleness=1 the batch of the next generation is sampled (in a thread, from the
        weights before this step's update) while this step computes its gradients, and is finished
        before the optimizer applies them.  A step is one unit: until the optimizer step nothing has
        changed (an error, in a reward of the batch sampled ahead too, leaves the run at the previous
        step), and from it on the step is counted whatever raises.  Its record (`on_step(metrics)`,
        run.py: evaluation, alerts, the metrics row; and the completions it logs) is kept in
        `unrecorded` until it is done, and saved with any checkpoint taken before then, so a resumed
        run finishes it (`finish_record`) instead of losing the row.  No Ctrl-C or SIGTERM cuts in
        from the update to the end of the record (interrupts.py)."""
        t0 = time.perf_counter()
        self.home.bind()
        self.finish_record(on_step)  # an earlier step's record that failed, if any
        if self.pending is None:
            self.pending = self.batches.generate_or_rewind(self._state())
        with interrupts.deferred(f"step {self.step + 1} (its update and its record)"):
            metrics = self._train_on(self.pending, t0)
            self.finish_record(on_step)
        return metrics

    def _train_on(self, gen: Generation, t0: float) -> dict:
        if gen.iterations_done == 0 and len(gen.batch):
            self.updater.prepare(gen.batch)  # old and reference log-probs, with the weights it is first trained at
        last_use, last_step = gen.iterations_done + 1 >= self.uses, self.step + 1 >= self.total_steps
        ahead = self.batches.settings.sample_ahead and last_use and not last_step
        if ahead:
            self.batches.start_ahead(self._state())
        following = []  # the next generation, when it was sampled ahead (finished before the optimizer step)
        schedule = self.scheduler.last_epoch  # moves with the optimizer step (or a step without an update)
        try:
            metrics = {**gen.metrics, **self.update(self._part(gen), lambda: following.extend(self._finish_ahead()))}
        except BaseException:
            if self.scheduler.last_epoch != schedule:  # raised after the step was applied: it is counted all the same
                self._count(gen, following, dict(gen.metrics), t0)
                raise
            self.optimizer.zero_grad(set_to_none=True)  # gradients of a step that was not applied
            if ahead:
                self.batches.drop_ahead()  # rewound: a checkpoint saved now resumes exactly
            raise
        self._count(gen, following, metrics, t0)
        if following or "skipped_update" not in metrics:
            self.publish_weights()
        return metrics

    def _count(self, gen: Generation, following: list, metrics: dict, t0: float) -> None:
        """The optimizer step is applied: count it, and keep its record until it is done."""
        gen.iterations_done += 1
        if gen.iterations_done >= self.uses:
            self.pending = following[0] if following else None
        self.step += 1
        completions = gen.samples if gen.iterations_done == 1 and gen.samples and self.log_completions else None
        self.unrecorded = {"step": self.step, "metrics": metrics, "completions": completions}
        self.last_samples = gen.samples
        self.kl.after_step(metrics)  # the beta this step used; adaptive KL: the next step's
        if self.batches.settings.sample_ahead:
            metrics["sampling/staleness"] = gen.staleness  # 1: sampled before the update that preceded its first use
        metrics.update(self.rollout.metrics())
        metrics["epoch"] = self.prompts.epochs_done
        metrics["step_time"] = time.perf_counter() - t0
        metrics["tokens_per_second"] = gen.metrics["num_tokens"] / self.parts / metrics["step_time"]

    def _finish_ahead(self) -> list[Generation]:
        return [self.batches.finish_ahead()] if self.batches.ahead is not None else []

    def _part(self, gen: Generation) -> Batch:
        """The rows this optimizer step trains on: the whole generation, or with steps_per_generation
        its next part in turn (contiguous rows, so groups stay together where the sizes allow)."""
        if self.parts == 1:
            return gen.batch
        rows = torch.tensor_split(torch.arange(len(gen.batch)), self.parts)[gen.iterations_done % self.parts]
        return gen.batch.select(rows)

    def _state(self) -> TrainerState:
        return TrainerState(global_step=self.step, max_steps=self.total_steps)

    def publish_weights(self) -> None:
        """Hand the updated weights to every sampler outside this model (vLLM, rollout workers)."""
        for subscriber in self.weight_subscribers:
            subscriber.update_weights(self.model)

    @property
    def poisoned(self) -> str | None:
        """Why the weights may no longer be saved (an update made them non-finite), or None."""
        return self.updater.poisoned

    # --- checkpoints (checkpoint.py) --------------------------------------------------------

    def _parts(self) -> dict:
        """What a checkpoint restores, besides the weights, each with state_dict / load_state_dict."""
        optimizer = fsdp.FullOptimizerState(self.model, self.optimizer) if self.sharded else self.optimizer
        return {"optimizer": optimizer, "scheduler": self.scheduler, "prompts": self.prompts,
                "generator": GeneratorState(self.generator), "log": self.log, "alerts": self.alerts, "kl": self.kl,
                **({"scaler": self.scaler} if self.scaler.is_enabled() else {})}

    def state_dict(self, collective: bool = True) -> dict:
        """With several processes, `collective` gathers every rank's pending batch (all ranks must
        call it); without, the pending batch is left out and regenerated on resume."""
        pending = self.pending
        if self.world.enabled:
            pending = distributed.gather(self.pending, self.world) if collective else None
        return trainer_state(self.step, self._parts(), pending=pending, extra=self.extra_state, unrecorded=self.unrecorded)

    def save(self, collective: bool = True) -> Path | None:
        """Every rank calls it (see state_dict); rank 0 writes the checkpoint and returns its path.
        With fsdp the optimizer state is gathered from every rank, so nothing is saved without `collective`;
        nor after an update made the weights non-finite."""
        if (self.sharded and not collective) or self.poisoned:
            return None
        state = self.state_dict(collective)
        if not self.world.is_main:
            return None
        return save_checkpoint(self.output_dir, self.step, self.full_model, self.tokenizer, state, self.save_total_limit)

    def resume(self, checkpoint: Path) -> None:
        state = load_checkpoint(checkpoint, self.full_model)
        if self.sharded:
            fsdp.load_full_state_dict(self.model, self.full_model.state_dict())
        restore_trainer_state(state, self._parts())
        if self.resume_override:  # the optimizer settings given now, not the checkpoint's
            apply_optimizer_settings(self.optimizer, self.scheduler, self.cfg)
        self.step, self.extra_state = state["step"], state.get("extra", {})
        self.unrecorded = state.get("unrecorded")  # a record the stopped run did not finish (train_step)
        self.pending = state["pending"]
        if self.world.enabled:  # one pending batch per rank, or none (then the generation is sampled again)
            fits = isinstance(self.pending, list) and len(self.pending) == self.world.world_size
            self.pending = self.pending[self.world.rank] if fits else None
        self.publish_weights()  # samplers outside this model (rollout workers, vLLM) get the checkpoint's weights

    def close(self) -> None:
        """Stop what the trainer started outside this process (the rollout workers) or in it."""
        self.batches.close()
        self.rollout.close()


def total_steps_for(cfg: Config, num_train_examples: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    generations = math.ceil(cfg.num_train_epochs * num_train_examples / cfg.prompts_per_step)
    return max(1, generations * cfg.num_iterations * cfg.steps_per_optimizer_step)
