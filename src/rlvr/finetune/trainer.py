"""One optimizer step of SFT or DPO, with the interface run.py drives (`train_step`, `save`,
`resume`, `step`, `prompts`, `log`, `alerts`, `rollout.sampler` for evaluation).

A step takes per_device_train_batch_size x gradient_accumulation_steps *units* from a seeded
stream (a demonstration, a packed row of demonstrations, or a pair), runs the model over them a
micro-batch of per_device_train_batch_size units at a time, backpropagates the loss normalised
by the whole step's totals (SFT: its trained tokens; DPO: its pairs), so the gradient does not
depend on the split, and takes one optimizer step (update.optimizer_step: clipping, non-finite
checks, the schedule).  Log-probs are taken at temperature 1 by logprobs.LogProbs (the fast
path where the model supports it).

With self_samples, training goes in rounds: each round samples num_generations completions for
self_round_prompts train prompts with the current weights (the rollout stage of rlvr train:
in-process engine or vLLM), scores them with the task's verifier, keeps the correct ones (SFT:
rejection-sampling fine-tuning) or pairs correct with incorrect (DPO), and trains
self_round_steps steps on what it kept.  A round's data is part of the checkpoint, so a resumed
run continues the same round.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from rlvr import distributed, interrupts
from rlvr.alerts import AlertMonitor
from rlvr.checkpoint import GeneratorState, load_checkpoint, restore_trainer_state, save_checkpoint, trainer_state
from rlvr.finetune.data import Demonstration, Encoder, Pair, keep_correct, make_pairs, pack, to_batch
from rlvr.finetune.losses import dpo_loss, sequence_logps, sft_loss
from rlvr.llama import on_fast_path
from rlvr.logprobs import LogProbs
from rlvr.models import eos_token_ids
from rlvr.monitor import MetricsLog
from rlvr.optim import apply_optimizer_settings, autocast_dtype, build_optimizer, loss_scaler
from rlvr.reference import KLReference, KLSettings
from rlvr.rollout.stage import RolloutStage
from rlvr.tasks import PromptStream, build_rewards, verifier_name
from rlvr.trainer import StepRecord
from rlvr.types import Example, TrainerState
from rlvr.update import backward, optimizer_step, skip_step

__all__ = ["FinetuneTrainer"]


class FinetuneTrainer(StepRecord):
    def __init__(self, cfg, model, tokenizer, data: list, train_examples: list[Example], output_dir: Path, ref_model=None,
                 world: distributed.World = distributed.SINGLE):
        """data: demonstrations (sft) or pairs (dpo) from finetune.data.load_data (empty with
        self_samples); train_examples: the prompts, for self_samples; ref_model: dpo's frozen
        reference (None with LoRA: the policy with its adapter off)."""
        if world.enabled:
            raise ValueError(f"rlvr {cfg.method} runs in one process; launch it without torchrun")
        self.cfg, self.model, self.tokenizer, self.world = cfg, model, tokenizer, world
        self.dpo = cfg.method == "dpo"
        self.output_dir, self.step = Path(output_dir), 0
        self.full_model = model
        self.rollout = RolloutStage(cfg, model, model, tokenizer, world)  # evaluation; self_samples' rounds
        self.rollout.rewards = build_rewards(cfg, with_verifier=True)  # a round keeps what the task's verifier scores 1
        eos = eos_token_ids(model, tokenizer)
        self.encoder = Encoder(cfg, tokenizer, tokenizer.eos_token_id if tokenizer.eos_token_id in eos else eos[0])
        device = next(model.parameters()).device
        self.logprobs = LogProbs(on_fast_path(model), 1.0, autocast_dtype(cfg), cfg.per_device_train_batch_size, device)
        self.reference = KLReference(KLSettings(beta=1.0), model, ref_model, self.logprobs) if self.dpo else None
        self.full_loss = cfg.completion_only_loss is False
        self.units_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        self.train_examples = train_examples
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.sequences: list = []  # tokenised data: sequences (sft) or (chosen, rejected) sequence pairs (dpo)
        self.units: list[list[int]] = []  # indices into sequences, one list per unit
        self.round, self.round_steps_left, self.round_metrics = 0, 0, {}
        if cfg.self_samples:
            self.prompts = PromptStream(train_examples, cfg.seed, shuffle=cfg.shuffle_dataset)  # prompts to sample
            self.stream = None
        else:
            self._set_data(data)
            self.prompts = self.stream = PromptStream(self.units, cfg.seed, shuffle=cfg.shuffle_dataset)
        self.total_steps = self._total_steps()
        self.optimizer, self.scheduler = build_optimizer(model, cfg, self.total_steps)
        self.scaler = loss_scaler(cfg, device)
        self.log = MetricsLog(self.output_dir, cfg.logging_steps)
        self.alerts = AlertMonitor(cfg, self.output_dir / "alerts.jsonl")
        self.last_samples: list[dict] = []
        self.extra_state: dict = {}
        self.poisoned: str | None = None

    # --- data ----------------------------------------------------------------------------------

    def _set_data(self, items: list) -> None:
        """Tokenise demonstrations or pairs into sequences and group them into units."""
        cfg, enc = self.cfg, self.encoder
        if self.dpo:
            chosen = enc.sequences([p.prompt for p in items], [p.chosen for p in items])
            rejected = enc.sequences([p.prompt for p in items], [p.rejected for p in items])
            self.sequences = [(c, r) for c, r in zip(chosen, rejected) if c is not None and r is not None]
            self.units = [[i] for i in range(len(self.sequences))]
        else:
            seqs = enc.sequences([d.prompt for d in items], [d.completion for d in items], self.full_loss)
            self.sequences = [s for s in seqs if s is not None]
            if cfg.packing:
                self.units = pack([len(p) + len(c) for p, c in self.sequences], cfg.max_length)
            else:
                self.units = [[i] for i in range(len(self.sequences))]
        if items and not self.sequences:
            raise ValueError(f"no example fits max_length={cfg.max_length} with at least one completion token; raise max_length")

    def _total_steps(self) -> int:
        cfg = self.cfg
        if cfg.max_steps > 0:
            return cfg.max_steps
        if cfg.self_samples:
            return cfg.self_rounds * cfg.self_round_steps
        return max(1, math.ceil(cfg.num_train_epochs * len(self.units) / self.units_per_step))

    def _new_round(self) -> dict:
        """Sample self_round_prompts prompts x num_generations with the current weights, keep the
        verifier-correct samples (sft) or correct / incorrect pairs (dpo); the round's metrics."""
        cfg, t0 = self.cfg, time.perf_counter()
        examples = self.prompts.take(cfg.self_round_prompts)
        self.rollout.update_weights(self.model)  # engines outside this model (vLLM) get the current weights
        sampled = self.rollout.sample(examples, self.generator, TrainerState(self.step, self.total_steps))
        scores = sampled.scores.per_func[verifier_name(cfg)]
        g = len(sampled.groups[0]) if sampled.groups else 0
        texts = [[r.text for r in group] for group in sampled.groups]
        per_prompt = [scores[i * g:(i + 1) * g] for i in range(len(texts))]
        correct = sum(s == 1 for s in scores)
        if self.dpo:
            pairs = make_pairs(texts, per_prompt)
            self._set_data([Pair(examples[i].prompt, c, r) for i, c, r in pairs])
            kept, keep_rate = len(pairs), len({i for i, _, _ in pairs}) / max(len(texts), 1)  # prompts that gave a pair
        else:
            kept_rows = keep_correct(texts, per_prompt)
            self._set_data([Demonstration(examples[i].prompt, t) for i, t in kept_rows])
            kept, keep_rate = len(kept_rows), len(kept_rows) / max(len(scores), 1)  # samples kept
        self.stream = PromptStream(self.units or [[0]], cfg.seed + self.round, shuffle=cfg.shuffle_dataset)
        self.round += 1
        self.round_steps_left = cfg.self_round_steps
        self.last_samples = [{"prompt": examples[i // g].prompt, "completion": t, "reward": s}
                             for i, (t, s) in enumerate(zip([t for ts in texts for t in ts], scores))][:16]
        return {"self/round": float(self.round), "self/samples": float(len(scores)), "self/correct_rate": correct / max(len(scores), 1),
                f"self/{'pairs' if self.dpo else 'kept'}": float(kept),
                "self/keep_rate": keep_rate,
                "timing/sampling": time.perf_counter() - t0}

    # --- the step ------------------------------------------------------------------------------

    def train_step(self, on_step=None) -> dict:
        """One optimizer step (a new round of samples first, when one is due); `on_step(metrics)`
        records it, with no Ctrl-C or SIGTERM cutting in between the update and its record."""
        t0 = time.perf_counter()
        metrics = {}
        if self.cfg.self_samples and self.round_steps_left == 0:
            self.round_metrics = self._new_round()
            metrics.update(self.round_metrics)
        with interrupts.deferred(f"step {self.step + 1} (its update and its record)"):
            if self.cfg.self_samples:
                self.round_steps_left -= 1
                metrics["self/keep_rate"] = self.round_metrics["self/keep_rate"]
            metrics.update(self._update())
            self.step += 1  # counted: the record below finishes it, now or on resume (trainer.StepRecord)
            metrics["epoch"] = self.prompts.epochs_done
            metrics["step_time"] = time.perf_counter() - t0
            self.unrecorded = {"step": self.step, "metrics": metrics, "completions": None}
            self.finish_record(on_step)
        return metrics

    def _update(self) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        if not self.sequences:  # a round that kept nothing: the schedule moves on
            lr = self.scheduler.get_last_lr()[0]
            skip_step(self.scheduler)
            return {"learning_rate": lr, "skipped_update": 1.0, "loss": 0.0}
        units = self.stream.take(self.units_per_step)
        micro = [units[i:i + cfg.per_device_train_batch_size] for i in range(0, len(units), cfg.per_device_train_batch_size)]
        rows = [[s for u in part for s in u] for part in micro]
        total = len(units) if self.dpo else sum(len(self.sequences[s][1]) for part in rows for s in part)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict = {}
        for part in rows:
            loss, m = self._dpo_micro(part, total) if self.dpo else self._sft_micro(part, total)
            backward(loss, self.scaler)
            for k, v in {"loss": loss.item(), **m}.items():
                sums[k] = sums.get(k, 0.0) + v
        try:
            grad_norm, lr = optimizer_step(self.model, self.optimizer, self.scheduler, cfg.max_grad_norm, sums["loss"],
                                           self.step + 1, self.world, scaler=self.scaler)
        except Exception as e:
            self.poisoned = getattr(e, "poisoned", None)
            raise
        out = {"loss": sums.pop("loss"), "grad_norm": grad_norm, "learning_rate": lr, "timing/update": time.perf_counter() - t0}
        if self.dpo:
            n = sums.pop("pairs")
            out.update({k: v / n for k, v in sums.items()})
            out["num_pairs"] = n
        else:
            out["num_tokens"] = float(total)
            out["entropy"] = sums["entropy"] / max(total, 1)
            out["sequences"] = sums["sequences"]
        out["tokens_per_second"] = sums.get("tokens", total) / out["timing/update"]
        return out

    def _sft_micro(self, part: list[int], total_tokens: int):
        batch = to_batch([self.sequences[s] for s in part], self.rollout.pad_id).to(self.logprobs.device)
        logp, entropy = self.logprobs(self.model, batch)
        loss = sft_loss(logp, batch.completion_mask, total_tokens)
        ent = torch.where(batch.completion_mask, entropy, 0.0).sum().item()
        return loss, {"entropy": ent, "sequences": float(len(part))}

    def _dpo_micro(self, part: list[int], total_pairs: int):
        """Chosen and rejected of each pair as rows 2i and 2i+1, sharing their prompt; TRL's metric names."""
        seqs = [seq for s in part for seq in self.sequences[s]]
        batch = to_batch(seqs, self.rollout.pad_id, group_size=2).to(self.logprobs.device)
        logp, _ = self.logprobs(self.model, batch)
        ref = self.reference.ref_logprobs(batch).to(logp.device)
        average = self.cfg.dpo_loss_type == "ipo"  # IPO compares mean per-token log-probs, as TRL does
        policy = sequence_logps(logp, batch.completion_mask, average)
        reference = sequence_logps(ref, batch.completion_mask, average)
        losses, chosen_r, rejected_r = dpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], self.cfg.dpo_beta,
                                                self.cfg.dpo_loss_type, self.cfg.label_smoothing)
        totals = sequence_logps(logp.detach(), batch.completion_mask)
        metrics = {"pairs": float(len(part)), "rewards/chosen": chosen_r.sum().item(), "rewards/rejected": rejected_r.sum().item(),
                   "rewards/accuracies": (chosen_r > rejected_r).float().sum().item(),
                   "rewards/margins": (chosen_r - rejected_r).sum().item(),
                   "logps/chosen": totals[0::2].sum().item(), "logps/rejected": totals[1::2].sum().item(),
                   "tokens": float(batch.num_tokens)}
        return losses.sum() / total_pairs, metrics

    # --- checkpoints ---------------------------------------------------------------------------

    def _parts(self) -> dict:
        parts = {"optimizer": self.optimizer, "scheduler": self.scheduler, "prompts": self.prompts,
                 "generator": GeneratorState(self.generator), "log": self.log, "alerts": self.alerts}
        if self.stream is not None and self.stream is not self.prompts:
            parts["stream"] = self.stream
        if self.scaler.is_enabled():
            parts["scaler"] = self.scaler
        return parts

    def save(self, collective: bool = True) -> Path | None:
        if self.poisoned:
            return None
        rounds = {"round": self.round, "round_steps_left": self.round_steps_left, "round_metrics": self.round_metrics,
                  "sequences": self.sequences, "units": self.units} if self.cfg.self_samples else {}
        state = trainer_state(self.step, self._parts(), extra=self.extra_state, rounds=rounds, unrecorded=self.unrecorded)
        return save_checkpoint(self.output_dir, self.step, self.model, self.tokenizer, state, self.cfg.save_total_limit)

    def resume(self, checkpoint: Path) -> None:
        state = load_checkpoint(checkpoint, self.model)
        rounds = state.get("rounds") or {}
        if rounds:  # the round being trained on, as it was sampled
            self.round, self.round_steps_left, self.round_metrics = rounds["round"], rounds["round_steps_left"], rounds["round_metrics"]
            self.sequences, self.units = rounds["sequences"], rounds["units"]
            self.stream = PromptStream(self.units or [[0]], self.cfg.seed + self.round - 1, shuffle=self.cfg.shuffle_dataset)
        restore_trainer_state(state, self._parts())
        if self.cfg.resume_override:
            apply_optimizer_settings(self.optimizer, self.scheduler, self.cfg)
        self.step, self.extra_state = state["step"], state.get("extra", {})
        self.unrecorded = state.get("unrecorded")
        self.rollout.update_weights(self.model)

    def close(self) -> None:
        self.rollout.close()
