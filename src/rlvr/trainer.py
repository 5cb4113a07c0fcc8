"""The parts every method builds and checkpoints (RunCore), and GRPO's step on them (Trainer):
sample, score, advantage, update.  (The whole run, with evaluation, logging, alerts and checkpoints
around the steps, is run.py and loop.py; SFT, RFT and DPO add their steps in finetune/trainer.py.)

One *generation* samples G completions for each of `prompts_per_step` prompts and scores them
(stages 1-3, rollout/generation.py), then optimizer steps train on it (stage 4, update.py): one per
part, when steps_per_generation splits it into parts of gradient_accumulation_steps micro-batches,
and all of that num_iterations times.  A step is one optimizer step, as in TRL, so max_steps and
save_steps mean what they mean there.  The settings are read here, once, and each part gets its own.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rlvr import distributed, fsdp, interrupts
from rlvr.alerts import AlertMonitor
from rlvr.audit import reward_audit
from rlvr.checkpoint import (CheckpointError, DiskFull, GeneratorState, is_sharded, load_checkpoint, load_shards, load_trainer_state, load_weights,
                             restore_trainer_state, save_checkpoint, save_sharded_checkpoint, trainer_state)
from rlvr.config import Config, free_running
from rlvr.errors import DatasetError
from rlvr.llama import on_fast_path
from rlvr.lora import is_peft
from rlvr.logprobs import LogProbs
from rlvr.models import WeightCopy, eos_token_ids
from rlvr.monitor import MetricsLog
from rlvr.optim import apply_optimizer_settings, autocast_dtype, build_optimizer, loss_scaler
from rlvr.reference import KLReference, KLSettings
from rlvr.rollout import sampling_params
from rlvr.rollout.engine import make_sampler
from rlvr.rollout.generation import Generations, GenerationSettings
from rlvr.rollout.home import HomeThread, ScoringThread
from rlvr.rollout.producer import Producer, WeightVersions, token_staleness
from rlvr.rollout.path import RolloutPath
from rlvr.rollout.stage import RolloutStage
from rlvr.rundir import save_final_model
from rlvr.tasks import PromptStream, build_rewards
from rlvr.types import Batch, Example, Generation, TrainerState
from rlvr.update import PolicyUpdate, UpdateSettings

__all__ = ["RunCore", "RunData", "StepRecord", "Trainer", "Distiller", "rollout_stage", "steps_for", "total_steps_for"]


def rollout_stage(cfg: Config, model, sampler_model, tokenizer, world: distributed.World = distributed.SINGLE,
                  home: HomeThread | None = None, gathered=None) -> RolloutStage:
    """Stages 1 and 2 with the sampler the settings pick: vLLM (in this process or a server), sent
    the weights after every update; else the in-process engine on `sampler_model` (the trained model,
    or with fsdp its unsharded copy), from a copy of its own when sampling ahead (max_staleness);
    plus Ray rollout workers that sample and score when rollout_workers > 0 (vLLM then runs in each).
    `gathered`: with fsdp, the fsdp.GatheredCopy whose weights exist only while the in-process
    engine samples; the engines outside (vLLM, a copy sampling ahead) are sent them from the shards."""
    eos = eos_token_ids(model, tokenizer)
    source, subscribers, workers, window = sampler_model, [], None, None
    if gathered is not None:
        source = model  # sharded: what a subscriber is sent is gathered a tensor at a time
    if cfg.use_vllm and cfg.rollout_workers == 0:
        from rlvr.models import resolve_model_path
        from rlvr.rollout.vllm import make_vllm_sampler

        sampler = make_vllm_sampler(cfg.rollout_settings, cfg.model_settings, resolve_model_path(cfg.model), tokenizer,
                                    eos, world, max_prompt_length=cfg.max_prompt_length, bf16=cfg.bf16, seed=cfg.seed)
        sampler.update_weights(source)
        subscribers.append(sampler)
    else:
        if cfg.max_staleness:  # it samples while the policy trains: from a copy, refreshed after each update
            with gathered.gathered() if gathered is not None else contextlib.nullcontext():
                sampler_model = copy.deepcopy(sampler_model).eval()
            subscribers.append(fsdp.FullCopy(sampler_model) if gathered is not None else WeightCopy(sampler_model))
        elif gathered is not None:
            window = gathered.gathered
        sampler = make_sampler(sampler_model, tokenizer, eos, bf16=cfg.bf16, cuda_graphs=cfg.cuda_graphs)
        if window is not None:  # the fused weights the fast sampler builds go with the gathered ones
            gathered.on_release.append(getattr(sampler, "release", lambda: None))
    if cfg.rollout_workers > 0:
        from rlvr.rollout.workers import RolloutWorkers

        workers = RolloutWorkers(model, tokenizer, eos, cfg)  # each actor builds the run's path from cfg
        subscribers.append(workers)
    # prompts -> scored completions: with tools or an environment, rollouts of several turns
    path = RolloutPath.of(cfg, tokenizer, sampler, build_rewards(cfg.reward_settings, cfg.data_settings))
    off_policy = cfg.use_vllm or cfg.rollout_workers > 0 or cfg.max_staleness > 0
    return RolloutStage(path, sampling_params(cfg.rollout_settings), world, home, source=source,
                        subscribers=subscribers, workers=workers, off_policy=bool(off_policy), window=window,
                        turn_cache=cfg.turn_cache)


class StepRecord:
    """A trainer whose step's record (its logged completions and `on_step(metrics)`) is kept in
    `unrecorded` from the moment the step is counted until the record is done; a checkpoint saved
    in between holds it, and the resumed run finishes it (loop.py)."""

    unrecorded: dict | None = None  # {"step", "metrics", "completions"}, and "audit": its disagreements
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
        if record.get("audit"):
            self.log.add_audit(record["step"], record["audit"])
        if on_step is not None:
            on_step(record["metrics"])
        self.unrecorded = None


@dataclass
class RunData:
    """What a run trains and evaluates on: the train examples (the prompts, their answers and
    columns), the test examples, and for sft / dpo the demonstrations or pairs (finetune/data.py)."""

    train_examples: list[Example]
    test_examples: list[Example]
    items: list | None = None
    teacher: object = None  # rlvr distill: a teacher given to DistillationTrainer as a loaded model


class RunCore(StepRecord):
    """The parts of a run that every method builds, checkpoints and restores the same way: the
    optimizer and its schedule, the fp16 loss scaler, the seeded prompt stream and generator, the
    log-probs, the metrics log, the alerts, extra state kept across resumes, the step's record
    (StepRecord), and the samplers told the new weights.  A method adds its step:

        _prepare()            what the step trains on (GRPO: the generation; RFT / DPO rounds: a new round when due)
        _step(prepared, t0)   the update, counted by _count_step, and its metrics
        _own_parts()          its checkpoint parts besides the shared ones (state_dict / load_state_dict)
        _own_state(collective), _load_own(state)   its plain values in a checkpoint

    A subclass's __init__ calls RunCore.__init__, then _plan once it knows its prompts and steps."""

    poisoned: str | None = None  # why the weights may no longer be saved (an update made them non-finite)
    rollout: RolloutStage  # sampling and scoring: evaluation samples with `rollout.sampler`
    events = None  # the run's events.TrainerEvents (loop.py sets it): told the callback points inside a step
    sync_every = 1  # optimizer steps between weight pushes to the samplers (GRPO: weight_sync_steps)

    def __init__(self, cfg: Config, model, tokenizer, output_dir: Path, world: distributed.World = distributed.SINGLE,
                 full_model=None, temperature: float = 1.0):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.world = world  # this process among several (torchrun); only rank 0 writes files
        # With fsdp, `model` is sharded and `full_model` an unsharded copy that samples and is saved (fsdp.py),
        # holding its weights only while they are gathered (`gathered`, fsdp.GatheredCopy).
        self.full_model = full_model if full_model is not None else model
        self.output_dir, self.step, self.sharded = Path(output_dir), 0, cfg.fsdp
        self.gathered = fsdp.GatheredCopy(self.full_model, model) if cfg.fsdp else None
        self.weight_subscribers: list = []  # told after each update (every weight_sync_steps steps: publish_weights)
        self.synced_at = 0  # the step whose weights the samplers outside this model hold
        device = next(self.full_model.parameters()).device
        # Log-probs by rlvr's own forward (llama.py) where it applies, with fsdp too, else the generic one.
        self.logprobs = LogProbs(on_fast_path(model), temperature, autocast_dtype(cfg.update_settings),
                                 cfg.per_device_train_batch_size, device)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.scaler = loss_scaler(cfg.update_settings, device)  # fp16 only; disabled (a no-op) otherwise
        self.log = MetricsLog(self.output_dir, cfg.logging_steps)
        self.alerts = AlertMonitor(cfg.run_settings, self.output_dir / "alerts.jsonl" if world.is_main else None)
        self.last_samples: list[dict] = []
        self.extra_state: dict = {}  # e.g. the accuracy before training, kept across resumes

    def _plan(self, prompts: list, total_steps: int) -> None:
        """The prompts (or units) in their seeded order, and the optimizer with its schedule over total_steps."""
        self.prompts = PromptStream(prompts, self.cfg.seed, shuffle=self.cfg.shuffle_dataset)
        self.total_steps = total_steps
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.update_settings, total_steps)

    # --- the step ----------------------------------------------------------------------------

    def train_step(self, on_step=None) -> dict:
        """One optimizer step.  A step is one unit: until the optimizer step nothing has changed
        (an error leaves the run at the previous step), and from it on the step is counted whatever
        raises.  Its record (`on_step(metrics)`, loop.py: evaluation, alerts, the metrics row; and the
        completions it logs) is kept in `unrecorded` until it is done, and saved with any checkpoint
        taken before then, so a resumed run finishes it (`finish_record`) instead of losing the row.
        No Ctrl-C or SIGTERM cuts in from the update to the end of the record (interrupts.py)."""
        t0 = time.perf_counter()
        self._begin_step()
        self.finish_record(on_step)  # an earlier step's record that failed, if any
        self._event("on_step_begin")
        prepared = self._prepare()
        with interrupts.deferred(f"step {self.step + 1} (its update and its record)"):
            metrics = self._step(prepared, t0)
            self.finish_record(on_step)
        return metrics

    def _begin_step(self) -> None:
        pass

    def _event(self, name: str) -> None:
        """Tell the run's callbacks a point of the step (on_step_begin here; update.py's inside the update)."""
        if self.events is not None:
            self.events.fire(name)

    def _prepare(self):
        return None

    def _step(self, prepared, t0: float) -> dict:
        raise NotImplementedError

    def _count_step(self, metrics: dict, completions: list | None = None) -> None:
        """The optimizer step is applied: count it, and keep its record until it is done."""
        self.step += 1
        self.unrecorded = {"step": self.step, "metrics": metrics, "completions": completions}

    def _timed(self, metrics: dict, t0: float) -> None:
        metrics["epoch"] = self.prompts.epochs_done
        metrics["step_time"] = time.perf_counter() - t0

    def _state(self):
        """What reward functions get as `trainer_state`: transformers' TrainerState of the run, as
        TRL passes its own (a copy, so a batch sampled ahead sees the state it was started in)."""
        if self.events is None:
            return TrainerState(global_step=self.step, max_steps=self.total_steps)
        return copy.copy(self.events.state)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps one pass over the train prompts (or units) takes."""
        raise NotImplementedError

    def whole_weights(self):
        """A context in which `full_model` holds the whole weights: with fsdp they are gathered from
        the shards (every rank enters it, also those that only wait) and dropped on leaving."""
        return self.gathered.gathered() if self.gathered is not None else contextlib.nullcontext()

    def hold_whole_weights(self) -> None:
        """With fsdp, gather the whole weights into `full_model` for good (the run is over: the Python
        API hands the model back); a no-op otherwise."""
        if self.gathered is not None:
            self.gathered.hold()

    def publish_weights(self) -> None:
        """Hand the updated weights to every sampler outside this model (vLLM, rollout workers)."""
        self._load_samplers()
        self.synced_at = self.step

    def _load_samplers(self) -> None:
        for subscriber in self.weight_subscribers:
            subscriber.update_weights(self.model)

    # --- checkpoints (checkpoint.py) --------------------------------------------------------

    def _parts(self) -> dict:
        """What a checkpoint restores, besides the weights, each with state_dict / load_state_dict
        (with fsdp the optimizer's state is in the shards, `_shards`)."""
        return {**({} if self.sharded else {"optimizer": self.optimizer}), "scheduler": self.scheduler, "prompts": self.prompts,
                "generator": GeneratorState(self.generator), "log": self.log, "alerts": self.alerts, **self._own_parts(),
                **({"scaler": self.scaler} if self.scaler.is_enabled() else {})}

    def _own_parts(self) -> dict:
        return {}

    def _shards(self) -> dict:
        """With fsdp, what each rank saves of its own into a checkpoint (its dcp/): its shards of the
        trained weights and of the optimizer's state, and a method's own (`_own_shards`); without, the
        same whole, as a sharded checkpoint resumed without fsdp reads them."""
        return {"model": fsdp.model_shards(self.model), "optimizer": fsdp.optimizer_shards(self.model, self.optimizer),
                **self._own_shards()}

    def _own_shards(self) -> dict:
        return {}

    def _load_shards(self, shards: dict) -> None:
        if "model" in shards:
            fsdp.load_model_shards(self.model, shards["model"])
        fsdp.load_optimizer_shards(self.model, self.optimizer, shards["optimizer"])

    def _own_state(self, collective: bool) -> dict:
        return {}

    def _load_own(self, state: dict) -> None:
        pass

    def state_dict(self, collective: bool = True) -> dict:
        """With several processes, `collective` gathers what each rank holds of its own (all ranks
        must call it); without, that is left out and made again on resume."""
        return trainer_state(self.step, self._parts(), **self._own_state(collective), extra=self.extra_state,
                             unrecorded=self.unrecorded)

    def save(self, collective: bool = True, keep: Path | None = None) -> Path | None:
        """Every rank calls it (see state_dict); rank 0 writes the checkpoint and returns its path.
        With fsdp the optimizer state is gathered from every rank, so nothing is saved without `collective`;
        nor after an update made the weights non-finite.  `keep`: a checkpoint save_total_limit never removes."""
        if (self.sharded and not collective) or self.poisoned:
            return None
        if self.sync_every > 1 and self.synced_at != self.step and (collective or not self.world.enabled):
            # off the weight_sync_steps schedule (a save_steps or a signal): the samplers get these weights
            # now, as a resume from this checkpoint would give them, so that the two runs go on alike
            self.publish_weights()
        state = self.state_dict(collective)
        if self.sharded:  # each rank writes its shards; no rank gathers the model (a LoRA adapter only)
            with self.gathered.trained() if is_peft(self.model) else contextlib.nullcontext():
                return save_sharded_checkpoint(self.output_dir, self.step, self._write_model, self.tokenizer, state,
                                               self._shards(), self.cfg.save_total_limit, self.world, keep)
        if not self.world.is_main:
            return None
        return save_checkpoint(self.output_dir, self.step, self.full_model, self.tokenizer, state, self.cfg.save_total_limit, keep)

    def _write_model(self, directory: Path) -> None:
        """A sharded checkpoint's model files besides its shards: with LoRA the adapter, in peft's
        format (gathered: GatheredCopy.trained); else the config, with which it loads in one process."""
        if is_peft(self.full_model):
            self.full_model.save_pretrained(directory)
        else:
            fsdp.save_config(self.full_model, directory)

    def resume(self, checkpoint: Path) -> None:
        if not self.sharded:
            state = load_checkpoint(checkpoint, self.full_model)
        else:
            state = load_trainer_state(checkpoint)
            if not is_sharded(checkpoint):  # written by an rlvr before sharded checkpoints: the whole weights and optimizer state
                self.load_checkpoint_weights(checkpoint)
                fsdp.load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self._load_own(state)  # before the parts: a method's own values may make a part (finetune's round stream)
        restore_trainer_state(state, self._parts())
        if is_sharded(checkpoint):  # after the parts: they say which shards there are (a moved reference)
            shards = self._shards()
            if not self.sharded:  # resumed without fsdp: the weights are in (load_checkpoint), the rest is read whole
                del shards["model"]
            load_shards(checkpoint, shards)
            self._load_shards(shards)
        if self.cfg.resume_override:  # the optimizer settings given now, not the checkpoint's
            apply_optimizer_settings(self.optimizer, self.scheduler, self.cfg.update_settings)
        self.step, self.extra_state = state["step"], state.get("extra", {})
        self.unrecorded = state.get("unrecorded")  # a record the stopped run did not finish (train_step)
        self.publish_weights()  # samplers outside this model (rollout workers, vLLM) get the checkpoint's weights

    def load_checkpoint_weights(self, checkpoint: Path) -> None:
        """A checkpoint's weights into the trained model, on every rank (load_best_model_at_end)."""
        if self.sharded and is_sharded(checkpoint):
            shards = {"model": fsdp.model_shards(self.model)}
            load_shards(checkpoint, shards)
            fsdp.load_model_shards(self.model, shards["model"])
            return
        with self.whole_weights():
            load_weights(checkpoint, self.full_model)
            if self.sharded:
                fsdp.load_full_state_dict(self.model, self.full_model.state_dict())

    def save_final(self, output_dir: Path, how: str) -> None:
        """The final model in output_dir (rundir.save_final_model; lora_save=`how`); every rank calls
        it, rank 0 writes.  With fsdp and full fine-tuning it is streamed from the shards a tensor at a
        time (fsdp.save_streamed), never whole on a rank; a failure is raised on every rank."""
        if not self.sharded or is_peft(self.model):
            with self.whole_weights():
                if self.world.is_main:
                    save_final_model(self.full_model, self.tokenizer, output_dir, how)
            return
        joined, failure = [], None

        def write(directory: Path) -> None:
            joined.append(True)
            fsdp.save_streamed(self.model, self.full_model, directory)

        if self.world.is_main:
            try:
                save_final_model(self.full_model, self.tokenizer, output_dir, how, write=write)
            except Exception as e:  # noqa: BLE001 - every rank is told below
                failure = e
        if not joined:  # rank 0 failed before streaming (or is not rank 0): the others wait in its gathers
            fsdp.save_streamed(self.model, self.full_model, None)
        told = distributed.broadcast(None if failure is None else str(failure), self.world)
        if failure is not None:
            raise failure
        if told is not None:
            raise (DiskFull if told.startswith("disk full") else CheckpointError)(told)

    def close(self) -> None:
        """Stop what the trainer started outside this process (the rollout workers) or in it."""
        self.rollout.close()


class Trainer(RunCore):
    """GRPO's step: 1. rollout, 2. reward, 3. advantage (a generation, rollout/generation.py), 4. update (update.py).
    A method on the same step with a loss of its own (Distiller) gives `_objective()` and may train
    on every completion (`trains_every_completion`: no group is left out for equal rewards)."""

    trains_every_completion = False

    def __init__(self, cfg: Config, model, tokenizer, train_examples: list[Example], output_dir: Path, total_steps: int, ref_model=None,
                 world: distributed.World = distributed.SINGLE, full_model=None):
        super().__init__(cfg, model, tokenizer, output_dir, world, full_model, temperature=cfg.temperature)
        self.ref_model = ref_model
        # Reward functions run on the thread of the training loop, also for a batch sampled ahead (rollout/home.py).
        self.home = HomeThread()
        self.rollout = rollout_stage(cfg, model, self.full_model, tokenizer, world, self.home, self.gathered)  # 1. rollout, 2. reward
        self.weight_subscribers.append(self.rollout)
        # With LoRA the reference is the policy with its adapter off; with fsdp the sharded policy's, its
        # forwards in lockstep over the ranks, as the frozen reference's and the old log-probs'.
        self.kl = KLReference(cfg.section(KLSettings), model, ref_model, self.logprobs, world, sharded=cfg.fsdp)
        self._plan(train_examples, total_steps)
        generation = GenerationSettings.of(cfg.rollout_settings, cfg.update_settings, cfg.prompts_per_step,
                                           cfg.num_completions_to_print, cfg.steps_per_optimizer_step,
                                           every_completion=self.trains_every_completion)
        self.audit = reward_audit(cfg.reward_settings, cfg.data_settings, cfg.seed) if world.is_main else None
        self.free = free_running(cfg.rollout_settings, world.world_size, cfg.fsdp)  # async_mode=free: a producer samples
        # Free-running with several processes: rank 0's producer samples every process's share (on vLLM servers, as
        # TRL's AsyncGRPOTrainer), each generation is shared when it is taken (_shared), and the trainers load the
        # servers together after their optimizer steps (publish_weights; fsdp gathers on every rank).
        self.from_rank0 = self.free and world.enabled
        if self.from_rank0:
            self.rollout.world = distributed.SINGLE  # rank 0 samples all of a generation's prompts
        self.batches = Generations(generation, self.rollout, self.prompts, self.generator, self.kl,
                                   distributed.SINGLE if self.from_rank0 else world, self.home,
                                   self.audit)  # 1-3: sampling rounds, advantages, sampling ahead
        self.batches.keep_parts = self.from_rank0  # (partial rollouts keep them too: carry_partials)
        self.updater = PolicyUpdate(UpdateSettings.from_sections(cfg.update_settings, cfg.rollout_settings, cfg.steps_per_optimizer_step,
                                                                  self.rollout.off_policy, self.full_model.config,
                                                                  self.rollout.path.rollout_func is not None), model, self.optimizer,
                                    self.scheduler, self.logprobs, self.kl, self.rollout.pad_id, world,
                                    between_micro_batches=self.home.serve,
                                    scaler=self.scaler, on_event=self._event, objective=self._objective())  # 4
        self.log_completions = cfg.log_completions and world.is_main
        self.parts = cfg.steps_per_optimizer_step  # optimizer steps one pass over a generation takes
        self.uses = cfg.num_iterations * self.parts  # optimizer steps per generation
        self.pending: Generation | None = None  # the generation being trained on
        self.sync_every = cfg.weight_sync_steps  # the samplers of their own get the weights every this many steps
        self.waited = 0.0  # seconds the last update waited for the generation sampled ahead (or the last take waited)
        self.queued: list[Generation] = []  # a free-running checkpoint's queue, resumed without a producer
        self.scoring: ScoringThread | None = None  # async_mode=free: where the producer's reward calls run
        self.producer: Producer | None = None  # async_mode=free: the thread that samples while the trainer trains (rank 0's)
        if self.free and world.is_main:
            sampler = self.rollout.sampler  # the in-process engine loads newer weights between decode steps
            if self.from_rank0 and hasattr(sampler, "pause_every_load"):  # the trainer loads it while the producer samples
                sampler.pause_every_load = True
            load = self._never_from_producer if self.from_rank0 else self._load_from_producer
            self.producer = Producer(self.batches, WeightVersions(load), self._state, cfg.max_staleness,
                                     self.home, stream=self.rollout.side_stream,
                                     in_flight=sampler if cfg.in_flight_weight_updates and getattr(sampler, "reloads_in_flight", False)
                                     else None)
            if cfg.partial_rollout_tokens:  # a completion not done within them is carried on (rollout/generation.py)
                self.batches.carry_partials(cfg.partial_rollout_tokens, self.producer.versions, cfg.max_staleness)
            if not self.rollout.rewards.needs_main_thread:  # scored off the training loop (rollout/home.py)
                self.scoring = self.rollout.home = ScoringThread()

    def publish_weights(self) -> None:
        """With a free-running producer in one process, tell it the new weights; it loads them itself when it
        can.  With several, every rank loads the servers now (fsdp gathers each tensor from every rank), as TRL's
        AsyncGRPOTrainer syncs: vLLM's own servers are paused for it with their requests kept (in flight);
        samplers that cannot take weights while they sample get them once rank 0's generation is done."""
        if not self.free:
            return super().publish_weights()
        if not self.from_rank0:
            self.producer.versions.publish()
            self.synced_at = self.step
            return
        between = self.producer is not None and self.producer.in_flight is None
        with self.producer.between_generations() if between else contextlib.nullcontext():
            super().publish_weights()
        if self.producer is not None:
            self.producer.versions.loaded(self.step)

    def _never_from_producer(self) -> None:
        raise RuntimeError("with several processes the trainers load the samplers together (publish_weights), never "
                           "rank 0's producer alone")

    def _load_from_producer(self) -> None:
        """The producer's weight load (rollout/producer.py), ordered on a GPU with the training stream."""
        with self.rollout.after_training():
            self._load_samplers()

    def _objective(self):
        """The update's loss when it is not GRPO's own (update.PolicyUpdate.objective): None here."""
        return None

    @classmethod
    def load_data(cls, cfg: Config, objects=None) -> RunData:
        """The task's or dataset's splits, or the examples given to GRPOTrainer (api/)."""
        if objects is not None and objects.train_examples is not None:
            return RunData(objects.train_examples, objects.test_examples)
        from rlvr.tasks import load_splits

        return RunData(*load_splits(cfg.data_settings, cfg.seed))

    @classmethod
    def for_run(cls, cfg: Config, model, tokenizer, data: RunData, output_dir: Path, reference, world: distributed.World,
                full_model=None) -> Trainer:
        total = total_steps_for(cfg, len(data.train_examples))
        return cls(cfg, model, tokenizer, data.train_examples, output_dir, total, reference, world, full_model)

    # --- the four stages ---------------------------------------------------------------------

    def generate(self) -> Generation:
        """1. rollout, 2. reward, 3. advantage: one generation (rollout/generation.py)."""
        return self.batches.generate(self._state())

    def update(self, batch: Batch, before_step=None) -> dict:
        """4. update: one optimizer step on the batch (update.py).  The samplers get the new weights
        from train_step, once the step is counted."""
        return self.updater(batch, self.step + 1, before_step)

    # train_step (RunCore) generates a new batch when the previous one is used up.  With
    # max_staleness=1 the batch of the next generation is sampled (in a thread, from the weights
    # before this step's update) while this step computes its gradients, and is finished before the
    # optimizer applies them; an error in a reward of the batch sampled ahead too leaves the run at
    # the previous step.

    def _begin_step(self) -> None:
        self.home.bind()

    def _prepare(self) -> Generation:
        if self.pending is None and self.free:
            t0 = time.perf_counter()
            gen = self.producer.take(self.step) if self.producer is not None else None  # serves its reward calls while it waits
            self.pending = self._shared(gen) if self.from_rank0 else gen
            self.waited = time.perf_counter() - t0
        if self.pending is None and self.queued:
            self.pending = self.queued.pop(0)
        if self.pending is None:
            self.pending = self.batches.generate_or_rewind(self._state())
            self.pending.weight_version = self.synced_at  # the step itself where the sampler is the policy (synced every step)
        return self.pending

    def _shared(self, gen: Generation | None) -> Generation:
        """Several processes, free-running: the generation rank 0 took (`gen` there, None elsewhere) on every rank,
        each with its own share of the groups as its batch (distributed.owners).  Rank 0 sends its parts, not its
        batch; each rank makes the advantages, batch and metrics again from them (Generations.reassemble)."""
        light = None if gen is None else replace(gen, batch=None, samples=[], audit=None)
        out = self.batches.reassemble(distributed.broadcast(light, self.world), world=self.world)
        if gen is not None:
            out.audit = gen.audit  # the reward audit rank 0 started (rank 0 alone has one)
        out.parts = None  # not needed once made: a checkpoint of the generation in training stays its batch's size
        return out

    def _step(self, gen: Generation, t0: float) -> dict:
        if gen.iterations_done == 0:
            gen.staleness = self.step - gen.weight_version  # the later uses of num_iterations are the loss's own business
        if gen.iterations_done == 0 and len(gen.batch):
            self.updater.prepare(gen.batch)  # old and reference log-probs, with the weights it is first trained at
        last_use, last_step = gen.iterations_done + 1 >= self.uses, self.step + 1 >= self.total_steps
        ahead = self.batches.settings.sample_ahead and not self.free and not self.queued and last_use and not last_step
        if ahead:
            self.batches.start_ahead(self._state())
        following = []  # the next generation, when it was sampled ahead (finished before the optimizer step)
        schedule = self.scheduler.last_epoch  # moves with the optimizer step (or a step without an update)
        stepping = []  # async_mode=free: the weights' lock, held by the optimizer step (rollout/producer.py)

        def before_step():
            following.extend(self._finish_ahead())
            if self.producer is not None:
                self.producer.versions.step_begin()
                stepping.append(True)

        try:
            metrics = {**gen.metrics, **self.update(self._part(gen), before_step)}
        except BaseException:
            if self.scheduler.last_epoch != schedule:  # raised after the step was applied: it is counted all the same
                self._count(gen, following, dict(gen.metrics), t0)
                raise
            self.optimizer.zero_grad(set_to_none=True)  # gradients of a step that was not applied
            if ahead:
                self.batches.drop_ahead()  # rewound: a checkpoint saved now resumes exactly
            raise
        finally:
            if stepping:
                self.producer.versions.step_end(self.step + (self.scheduler.last_epoch != schedule))
        self._count(gen, following, metrics, t0)
        if self.step % self.sync_every == 0:  # every step moves the weights (one without signal too: AdamW's momentum)
            self.publish_weights()
        return metrics

    def _count(self, gen: Generation, following: list, metrics: dict, t0: float) -> None:
        """The optimizer step is applied: count it, and keep its record until it is done."""
        gen.iterations_done += 1
        if gen.iterations_done >= self.uses:
            self.pending = following[0] if following else None
        if gen.iterations_done == 1:  # TRL's num_tokens: prompt and completion tokens of every generation so far
            seen = self.extra_state.get("num_input_tokens_seen", 0.0) + gen.metrics.get("tokens/generation", 0.0)
            self.extra_state["num_input_tokens_seen"] = seen
            if self.events is not None:
                self.events.state.num_input_tokens_seen = int(seen)
        metrics["num_tokens"] = self.extra_state.get("num_input_tokens_seen", 0.0)
        completions = gen.samples if gen.iterations_done == 1 and gen.samples and self.log_completions else None
        self._count_step(metrics, completions)
        if gen.iterations_done == 1 and gen.audit is not None:  # graded while the update ran (audit.py)
            audit = self.audit.collect(gen.audit, self.step)
            metrics.update(audit.metrics)
            self.unrecorded["audit"] = audit.rows
        self.last_samples = gen.samples
        self.kl.after_step(metrics)  # the beta this step used; adaptive KL: the next step's
        if self.batches.settings.sample_ahead or self.sync_every > 1:  # weight versions between the sampler's and the policy's
            metrics["sampling/staleness"] = gen.staleness
            metrics["sampling/weight_version"] = gen.weight_version
        metrics.update(self.rollout.metrics())
        self._timed(metrics, t0)
        if self.producer is not None and gen.iterations_done == 1:  # async_mode=free: where its time went, what it dropped
            # per token, against the policy the step trained (the version before its update)
            metrics["sampling/staleness_mean"], metrics["sampling/staleness_max"] = token_staleness(gen, self.step - 1)
            metrics.update(self.producer.since_take())
            metrics["timing/trainer_idle"] = self.waited
        elif following:  # where the overlapped step's time went: each side's wait for the other
            metrics["timing/trainer_idle"] = self.waited
            metrics["timing/sampler_idle"] = max(0.0, metrics["step_time"] - self.batches.ahead_seconds)
        for side, seconds, tokens in (("rollout", gen.metrics.get("timing/rollout"), gen.metrics.get("completions/num_tokens")),
                                      ("update", metrics.get("timing/update"), metrics.get("update_tokens"))):
            if seconds and tokens:
                metrics[f"timing/{side}_tokens_per_second"] = tokens / seconds
        # As TRL counts it: each optimizer step on a generation takes its share of the generation's prompts
        metrics["epoch"] = gen.epochs_after - gen.epochs_drawn * (1 - gen.iterations_done / self.uses)
        metrics["tokens_per_second"] = gen.metrics["completions/num_tokens"] / self.parts / metrics["step_time"]

    def _finish_ahead(self) -> list[Generation]:
        if self.batches.ahead is None:
            return []
        t0 = time.perf_counter()
        gen = self.batches.finish_ahead()
        self.waited = time.perf_counter() - t0  # the update, done, waited for it (serving its reward calls)
        gen.weight_version = self.synced_at  # the samplers get new weights only after the optimizer step
        return [gen]

    def _part(self, gen: Generation) -> Batch:
        """The rows this optimizer step trains on: the whole generation, or with steps_per_generation
        its next part in turn (contiguous rows, so groups stay together where the sizes allow)."""
        if self.parts == 1:
            return gen.batch
        rows = torch.tensor_split(torch.arange(len(gen.batch)), self.parts)[gen.iterations_done % self.parts]
        part = gen.batch.select(rows)
        part.generation_tokens, part.generation_parts = gen.batch.num_tokens, self.parts
        return part

    @property
    def poisoned(self) -> str | None:
        """Why the weights may no longer be saved (an update made them non-finite), or None."""
        return self.updater.poisoned

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.prompts.examples) / self.cfg.prompts_per_step) * self.uses

    # --- checkpoints: the KL state, the entropy bonus's, and each rank's pending generation ----------------------

    def _own_parts(self) -> dict:
        return {"kl": self.kl, "entropy_control": self.updater.entropy}

    def _own_shards(self) -> dict:
        return self.kl.shards()

    def _load_shards(self, shards: dict) -> None:
        super()._load_shards(shards)
        self.kl.load_shards(shards)

    def state_dict(self, collective: bool = True) -> dict:
        """With a free-running producer, it is stopped first (a generation being sampled is rewound), so that
        the prompt stream and the sampler's generator stand right after the generations it queued."""
        if self.producer is not None:
            self.producer.drain()
        return super().state_dict(collective)

    def _own_state(self, collective: bool) -> dict:
        pending = self.pending
        if self.world.enabled:
            pending = distributed.gather(self.pending, self.world) if collective else None
        queued = [copy.copy(g) for g in (self.producer.ready if self.producer is not None else self.queued)]
        for gen in queued:
            gen.audit = None  # a Future, which does not pickle: a queued generation's audit is not resumed
        carry = self.batches.carry  # partial rollouts: the groups carried on to the next generation
        return {"pending": pending, **({"queued": queued} if queued else {}), **({"carry": carry} if any(carry) else {})}

    def _load_own(self, state: dict) -> None:
        if self.producer is not None:
            self.producer.restore(state.get("queued") or [])
        elif not self.from_rank0:  # a free-running run's checkpoint resumed in lockstep: its queue is trained first, not lost
            self.queued = list(state.get("queued") or [])
        # partial rollouts: the groups carried on (a run resumed without partial_rollout_tokens does not use them)
        self.batches.restore_carry(state.get("carry") or ((), ()))
        self.pending = state["pending"]
        # Several processes save one pending batch per rank (a list, also when resumed in one process):
        # this rank's, or none where the count of ranks differs (then the generation is sampled again).
        if self.world.enabled or isinstance(self.pending, list):
            fits = isinstance(self.pending, list) and len(self.pending) == self.world.world_size
            self.pending = self.pending[self.world.rank] if fits else None

    def resume(self, checkpoint: Path) -> None:
        super().resume(checkpoint)  # with several processes free-running, every rank loads the samplers here
        if self.producer is not None:  # the samplers hold the checkpoint's weights, its version
            versions = self.producer.versions
            versions.current = versions.published = self.step
            if not self.from_rank0:
                versions.load_now()

    def whole_weights(self):
        """Evaluation samples with the samplers: a free-running producer stops for it (a generation being
        sampled is rewound), and the samplers take the current weights first."""
        if not self.free:
            return super().whole_weights()
        if self.producer is not None:
            self.producer.drain()
        if not self.from_rank0:
            self.producer.versions.catch_up()
        elif self.synced_at != self.step:  # every rank here: they load the samplers together
            self.publish_weights()
        return contextlib.nullcontext()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.scoring is not None:
            self.scoring.close()
        self.batches.close()
        if self.audit is not None:
            self.audit.close()
        super().close()


class Distiller(Trainer):
    """rlvr distill: GRPO's step (trainer.Trainer) with the teacher's divergence as the loss."""

    trains_every_completion = True  # no group is left out for equal rewards: the divergence needs none

    def __init__(self, *args, teacher=None, demonstrations=None, **kwargs):
        self.teacher_given = teacher  # a loaded teacher (DistillationTrainer(teacher_model=...)), else None
        super().__init__(*args, **kwargs)
        self.dataset_completions = None  # lmbda < 1: GKD's steps on the dataset's own completions
        if self.cfg.lmbda < 1:
            from rlvr.distill import DatasetCompletions

            cfg, world = self.cfg, self.world
            sequences = self._encode(demonstrations or [])
            if not sequences:
                raise DatasetError(f"lmbda={cfg.lmbda} trains some steps on the dataset's own completions, but none of its "
                                   f"{len(demonstrations or [])} keeps a completion token within max_length={cfg.max_length} "
                                   "(prompt + completion tokens): raise max_length, or set lmbda=1")
            self.dataset_completions = DatasetCompletions(sequences, cfg.completions_per_generation // cfg.processes,
                                                          cfg.lmbda, cfg.seed, self.rollout.pad_id, world.rank, world.world_size)

    def _encode(self, demonstrations: list) -> list:
        """rlvr sft's tokens of the demonstrations (finetune/data.py): the prompt as the rollout renders it, the completion, EOS."""
        from rlvr.finetune.data import Encoder

        encoder = Encoder.of(self.cfg.data_settings, self.cfg.finetune_settings, self.full_model, self.tokenizer)
        found = encoder.sequences([d.prompt for d in demonstrations], [d.completion for d in demonstrations], False,
                                  [d.whole for d in demonstrations])
        return [s for s in found if s is not None]

    @classmethod
    def load_data(cls, cfg, objects=None) -> RunData:
        """GRPO's prompts; with lmbda < 1 also the dataset's completions, as rlvr sft reads them."""
        data = super().load_data(cfg, objects)
        data.teacher = getattr(objects, "teacher", None)
        if cfg.lmbda < 1:
            from rlvr.finetune.data import load_data

            rows = getattr(objects, "train_rows", None)
            data.items = load_data(cfg.data_settings, cfg.finetune_settings, cfg.seed, "sft", rows)[0]
        return data

    @classmethod
    def for_run(cls, cfg, model, tokenizer, data: RunData, output_dir, reference, world, full_model=None) -> Distiller:
        total = total_steps_for(cfg, len(data.train_examples))
        return cls(cfg, model, tokenizer, data.train_examples, output_dir, total, reference, world, full_model, teacher=data.teacher,
                   demonstrations=data.items)

    def _prepare(self) -> Generation:
        if self.pending is None and self.dataset_completions is not None and self.dataset_completions.due():
            self.pending = self.dataset_completions.generation(self.prompts.epochs_done)
            self.pending.weight_version = self.synced_at
        gen = super()._prepare()
        if self.dataset_completions is not None:
            gen.metrics.setdefault("distill/on_policy", 1.0)
        return gen

    def _own_parts(self) -> dict:
        extra = {"dataset_completions": self.dataset_completions} if self.dataset_completions is not None else {}
        return {**super()._own_parts(), **extra}

    def _objective(self):
        from rlvr.distill import Distillation, load_teacher

        s = self.cfg.distill_settings
        device = next(self.full_model.parameters()).device
        teacher = load_teacher(s, self.cfg.model_settings, self.model, self.tokenizer, device, self.teacher_given)
        return Distillation(teacher, s.distill_beta, s.distill_reward_weight, self.logprobs)


def steps_for(cfg: Config, items: int, items_per_batch: int, steps_per_batch: int = 1) -> int:
    """max_steps when it is set, else as many optimizer steps as num_train_epochs passes over
    `items` take, `items_per_batch` at a time and `steps_per_batch` steps each (at least one)."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * items / items_per_batch) * steps_per_batch)


def total_steps_for(cfg: Config, num_train_examples: int) -> int:
    """GRPO's: a generation of prompts_per_step prompts is trained on num_iterations times, in its parts."""
    return steps_for(cfg, num_train_examples, cfg.prompts_per_step, cfg.num_iterations * cfg.steps_per_optimizer_step)
