"""The step of SFT (FinetuneTrainer) and of DPO (PreferenceTrainer), on the parts every method
shares (trainer.RunCore: optimizer, schedule, scaler, prompts, generator, log-probs, metrics,
alerts, checkpoints with exact resume).

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

import time
from pathlib import Path

import torch

from rlvr import distributed
from rlvr.finetune.data import Demonstration, Encoder, Pair, keep_correct, make_pairs, pack, to_batch
from rlvr.finetune.losses import combined_dpo_loss, sequence_logps, sft_loss
from rlvr.reference import KLReference, KLSettings
from rlvr.tasks import PromptStream, build_rewards, verifier_name
from rlvr.trainer import RunCore, RunData, rollout_stage, steps_for
from rlvr.types import Example, TrainerState
from rlvr.update import backward, optimizer_step, skip_step

__all__ = ["FinetuneTrainer", "PreferenceTrainer"]


class FinetuneTrainer(RunCore):
    """SFT on demonstrations, or with self_samples on the model's own verifier-correct samples (RFT)."""

    def __init__(self, cfg, model, tokenizer, data: list, train_examples: list[Example], output_dir: Path, ref_model=None,
                 world: distributed.World = distributed.SINGLE):
        """data: demonstrations (sft) or pairs (dpo) from finetune.data.load_data (empty with
        self_samples); train_examples: the prompts, for self_samples; ref_model: dpo's frozen
        reference (None with LoRA: the policy with its adapter off)."""
        if world.enabled:
            raise ValueError(f"rlvr {cfg.method} runs in one process; launch it without torchrun")
        super().__init__(cfg, model, tokenizer, output_dir, world)
        self.rollout = rollout_stage(cfg, model, model, tokenizer, world)  # evaluation; self_samples' rounds
        self.rollout.rewards = build_rewards(cfg.reward_settings, cfg.data_settings, with_verifier=True)  # a round keeps what the task's verifier scores 1
        self.weight_subscribers.append(self.rollout)
        self.encoder = Encoder.of(cfg.data_settings, cfg.finetune_settings, model, tokenizer, as_sampled=cfg.self_samples)
        self._reference(ref_model)
        self.full_loss = cfg.completion_only_loss is False
        self.units_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        self.train_examples = train_examples
        self.sequences: list = []  # tokenised data: sequences (sft) or (chosen, rejected) sequence pairs (dpo)
        self.units: list[list[int]] = []  # indices into sequences, one list per unit
        self.round, self.round_steps_left, self.round_metrics = 0, 0, {}
        if cfg.self_samples:  # the prompts to sample from; the round's units come with each round
            self._plan(train_examples, cfg.max_steps if cfg.max_steps > 0 else cfg.self_rounds * cfg.self_round_steps)
            self.stream = None
        else:
            self._set_data(data)
            self._plan(self.units, steps_for(cfg, len(self.units), self.units_per_step))
            self.stream = self.prompts

    @classmethod
    def load_data(cls, cfg, objects=None) -> RunData:
        """Demonstrations or pairs (finetune/data.py), from the settings or the rows given to SFTTrainer / DPOTrainer."""
        from rlvr.finetune.data import load_data

        items, train_examples, test_examples = load_data(cfg.data_settings, cfg.finetune_settings, cfg.seed, cfg.method,
                                                             objects.train_rows if objects is not None else None)
        if objects is not None and objects.test_examples is not None:
            test_examples = objects.test_examples
        return RunData(train_examples, test_examples, items)

    @classmethod
    def for_run(cls, cfg, model, tokenizer, data: RunData, output_dir: Path, reference, world: distributed.World,
                full_model=None) -> FinetuneTrainer:
        return cls(cfg, model, tokenizer, data.items, data.train_examples, output_dir, reference, world)

    @property
    def steps_per_epoch(self) -> int:
        if self.cfg.self_samples:  # a round of self_round_prompts prompts every self_round_steps steps
            return -(-len(self.prompts.examples) // self.cfg.self_round_prompts) * self.cfg.self_round_steps
        return -(-len(self.units) // self.units_per_step)

    # --- what differs between SFT and DPO ------------------------------------------------------

    def _reference(self, ref_model) -> None:
        self.reference = None

    def _tokenize(self, items: list) -> tuple[list, list[list[int]]]:
        """Demonstrations as (prompt, completion) sequences, grouped into units (packed rows with packing)."""
        cfg = self.cfg
        seqs = self.encoder.sequences([d.prompt for d in items], [d.completion for d in items], self.full_loss,
                                      [d.whole for d in items])
        sequences = [s for s in seqs if s is not None]
        if cfg.packing:
            return sequences, pack([len(p) + len(c) for p, c, _ in sequences], cfg.max_length)
        return sequences, [[i] for i in range(len(sequences))]

    def _keep(self, examples: list[Example], texts: list[list[str]], per_prompt: list, scores: list) -> dict:
        """A round's verifier-correct samples as demonstrations; its metrics."""
        kept = keep_correct(texts, per_prompt)
        self._set_data([Demonstration(examples[i].prompt, t) for i, t in kept])
        return {"self/kept": float(len(kept)), "self/keep_rate": len(kept) / max(len(scores), 1)}  # samples kept

    def _normaliser(self, units: list, rows: list[list[int]]) -> int:
        """What the step's loss is normalised by: its trained tokens."""
        return sum(len(c) if m is None else sum(m) for part in rows for _, c, m in (self.sequences[s] for s in part))

    def _micro(self, part: list[int], total_tokens: int):
        batch = to_batch([self.sequences[s] for s in part], self.rollout.pad_id).to(self.logprobs.device)
        logp, entropy, top1, _ = self.logprobs(self.model, batch, stats=True)
        loss = sft_loss(logp, batch.loss_mask, total_tokens, self.cfg.sft_loss_type)
        mask = batch.loss_mask
        return loss, {"entropy": torch.where(mask, entropy, 0.0).sum().item(), "correct": (top1 & mask).sum().item(),
                      "sequences": float(len(part)), "input_tokens": _input_tokens(batch)}

    def _summary(self, sums: dict, total: int) -> dict:
        """TRL's SFT metrics over the step's trained tokens: the entropy and how often the most likely
        token was the demonstrated one (mean_token_accuracy)."""
        return {"entropy": sums["entropy"] / max(total, 1), "mean_token_accuracy": sums["correct"] / max(total, 1),
                "sequences": sums["sequences"]}

    # --- data and rounds -----------------------------------------------------------------------

    def _set_data(self, items: list) -> None:
        """Tokenise demonstrations or pairs into sequences and group them into units."""
        self.encoder.dropped = 0
        self.sequences, self.units = self._tokenize(items)
        if items and not self.sequences:
            raise ValueError(f"no example fits max_length={self.cfg.max_length} with at least one trained token; raise max_length")
        if self.encoder.dropped and self.world.is_main:  # as TRL, which drops them too: one line, not a traceback
            print(f"dropped {self.encoder.dropped} of {len(items)} rows: no trained token fits max_length={self.cfg.max_length} "
                  f"(truncation_mode={self.cfg.truncation_mode}); raise max_length to keep them")

    def _new_round(self) -> dict:
        """Sample self_round_prompts prompts x num_generations with the current weights, keep the
        verifier-correct samples (sft) or correct / incorrect pairs (dpo); the round's metrics."""
        cfg, t0 = self.cfg, time.perf_counter()
        examples = self.prompts.take(cfg.self_round_prompts)
        self.publish_weights()  # engines outside this model (vLLM) get the current weights
        sampled = self.rollout.sample(examples, self.generator, TrainerState(self.step, self.total_steps))
        self.rollout.rest()  # the round's steps come next (vllm_enable_sleep_mode)
        scores = sampled.scores.per_func[verifier_name(cfg.data_settings)]
        g = len(sampled.groups[0]) if sampled.groups else 0
        texts = [[r.text for r in group] for group in sampled.groups]
        per_prompt = [scores[i * g:(i + 1) * g] for i in range(len(texts))]
        correct = sum(s == 1 for s in scores)
        kept = self._keep(examples, texts, per_prompt, scores)
        self.stream = PromptStream(self.units or [[0]], cfg.seed + self.round, shuffle=cfg.shuffle_dataset)
        self.round += 1
        self.round_steps_left = cfg.self_round_steps
        self.last_samples = [{"prompt": examples[i // g].prompt, "completion": t, "reward": s}
                             for i, (t, s) in enumerate(zip([t for ts in texts for t in ts], scores))][:16]
        return {"self/round": float(self.round), "self/samples": float(len(scores)), "self/correct_rate": correct / max(len(scores), 1),
                **kept, "timing/sampling": time.perf_counter() - t0}

    # --- the step (RunCore.train_step) ---------------------------------------------------------

    def _prepare(self) -> dict:
        """A new round of samples first, when one is due; its metrics go into the step's."""
        if self.cfg.self_samples and self.round_steps_left == 0:
            self.round_metrics = self._new_round()
            return dict(self.round_metrics)
        return {}

    def _step(self, metrics: dict, t0: float) -> dict:
        if self.cfg.self_samples:
            self.round_steps_left -= 1
            metrics["self/keep_rate"] = self.round_metrics["self/keep_rate"]
        metrics.update(self._update())
        self._count_step(metrics)  # the record finishes it, now or on resume (trainer.StepRecord)
        self._timed(metrics, t0)
        return metrics

    def _update(self) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        if not self.sequences:  # a round that kept nothing: the schedule moves on
            lr = self.scheduler.get_last_lr()[0]
            skip_step(self.scheduler)
            return {"learning_rate": lr, "skipped_update": 1.0, "loss": 0.0}
        # a dataset epoch's last step may be short, as in TRL; a round of self-samples fills its steps from them
        units = self.stream.take(self.units_per_step, within_epoch=not cfg.self_samples)
        size = cfg.per_device_train_batch_size
        rows = [[s for u in units[i:i + size] for s in u] for i in range(0, len(units), size)]
        total = self._normaliser(units, rows)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict = {}
        for i, part in enumerate(rows):
            if i:  # the previous micro-batch's backward pass is done and another follows (transformers' substep)
                self._event("on_substep_end")
            loss, m = self._micro(part, total)
            backward(loss, self.scaler)
            for k, v in {"loss": loss.item(), **m}.items():
                sums[k] = sums.get(k, 0.0) + v
        try:
            grad_norm, lr = optimizer_step(self.model, self.optimizer, self.scheduler, cfg.max_grad_norm, sums["loss"],
                                           self.step + 1, self.world, scaler=self.scaler, on_event=self._event)
        except Exception as e:
            self.poisoned = getattr(e, "poisoned", None)
            raise
        out = {"loss": sums.pop("loss"), "grad_norm": grad_norm, "learning_rate": lr, "timing/update": time.perf_counter() - t0}
        self._count_input_tokens(sums.pop("input_tokens", 0.0))
        out["num_tokens"] = self.extra_state["num_input_tokens_seen"]
        out.update(self._summary(sums, total))
        out["tokens_per_second"] = sums.get("tokens", total) / out["timing/update"]
        return out

    def _count_input_tokens(self, tokens: float) -> None:
        """TRL's num_tokens: the tokens of every sequence trained on so far (prompt and completion, no
        padding; over all processes), kept across resumes."""
        [here] = distributed.sum_counts([int(tokens)], self.world)
        seen = self.extra_state.get("num_input_tokens_seen", 0.0) + here
        self.extra_state["num_input_tokens_seen"] = seen
        if self.events is not None:
            self.events.state.num_input_tokens_seen = int(seen)

    # --- checkpoints: the stream of a round's units, and the round itself ---------------------

    def _own_parts(self) -> dict:
        return {"stream": self.stream} if self.stream is not None and self.stream is not self.prompts else {}

    def _own_state(self, collective: bool) -> dict:
        rounds = {"round": self.round, "round_steps_left": self.round_steps_left, "round_metrics": self.round_metrics,
                  "sequences": self.sequences, "units": self.units} if self.cfg.self_samples else {}
        return {"rounds": rounds}

    def _load_own(self, state: dict) -> None:
        rounds = state.get("rounds") or {}
        if rounds:  # the round being trained on, as it was sampled
            self.round, self.round_steps_left, self.round_metrics = rounds["round"], rounds["round_steps_left"], rounds["round_metrics"]
            self.sequences, self.units = rounds["sequences"], rounds["units"]
            self.stream = PromptStream(self.units or [[0]], self.cfg.seed + self.round - 1, shuffle=self.cfg.shuffle_dataset)


class PreferenceTrainer(FinetuneTrainer):
    """DPO (IPO, hinge) on preference pairs, or with self_samples on pairs of the model's own correct
    and incorrect samples; the reference is a frozen copy of the starting model (with LoRA: the
    adapter off)."""

    def _reference(self, ref_model) -> None:
        self.reference = KLReference(KLSettings(beta=1.0), self.model, ref_model, self.logprobs)

    def _tokenize(self, items: list) -> tuple[list, list[list[int]]]:
        """Pairs as (chosen, rejected) sequence pairs, each pair a unit."""
        pairs = self.encoder.pairs([p.prompt for p in items], [p.chosen for p in items], [p.rejected for p in items])
        sequences = [pair for pair in pairs if pair is not None]
        return sequences, [[i] for i in range(len(sequences))]

    def _keep(self, examples: list[Example], texts: list[list[str]], per_prompt: list, scores: list) -> dict:
        pairs = make_pairs(texts, per_prompt)
        self._set_data([Pair(examples[i].prompt, c, r) for i, c, r in pairs])
        keep_rate = len({i for i, _, _ in pairs}) / max(len(texts), 1)  # prompts that gave a pair
        return {"self/pairs": float(len(pairs)), "self/keep_rate": keep_rate}

    def _normaliser(self, units: list, rows: list[list[int]]) -> int:
        """Its pairs."""
        return len(units)

    def _micro(self, part: list[int], total_pairs: int):
        """Chosen and rejected of each pair as rows 2i and 2i+1, sharing their prompt; TRL's metric names."""
        seqs = [seq for s in part for seq in self.sequences[s]]
        shared = all(seqs[i][0] == seqs[i + 1][0] for i in range(0, len(seqs), 2))  # keep_end may cut them apart
        batch = to_batch(seqs, self.rollout.pad_id, group_size=2 if shared else None).to(self.logprobs.device)
        logp, entropy, top1, mean_logit = self.logprobs(self.model, batch, stats=True)
        ref = self.reference.ref_logprobs(batch).to(logp.device)
        loss, chosen_r, rejected_r = combined_dpo_loss(logp, ref, batch.loss_mask, self.cfg.dpo_beta,
                                                       self.cfg.dpo_loss_type, self.cfg.loss_weights, self.cfg.label_smoothing)
        totals = sequence_logps(logp.detach(), batch.loss_mask)
        metrics = {"pairs": float(len(part)), "rewards/chosen": chosen_r.sum().item(), "rewards/rejected": rejected_r.sum().item(),
                   "rewards/accuracies": (chosen_r > rejected_r).float().sum().item(),
                   "rewards/margins": (chosen_r - rejected_r).sum().item(),
                   "logps/chosen": totals[0::2].sum().item(), "logps/rejected": totals[1::2].sum().item(),
                   "tokens": float(batch.num_tokens), "input_tokens": _input_tokens(batch)}
        mask = batch.loss_mask
        for side, rows in (("chosen", slice(0, None, 2)), ("rejected", slice(1, None, 2))):  # sums over tokens
            metrics[f"per_token/{side}/tokens"] = mask[rows].sum().item()
            metrics[f"per_token/{side}/entropy"] = torch.where(mask[rows], entropy[rows], 0.0).sum().item()
            metrics[f"per_token/{side}/logits"] = torch.where(mask[rows], mean_logit[rows], 0.0).sum().item()
        metrics["per_token/chosen/correct"] = (top1[0::2] & mask[0::2]).sum().item()
        return loss * len(part) / total_pairs, metrics

    def _summary(self, sums: dict, total: int) -> dict:
        """TRL's DPO metrics: rewards and log-probs averaged over pairs; the entropy over every completion
        token, the mean logit over each side's tokens, mean_token_accuracy over the chosen ones."""
        n = sums.pop("pairs")
        t = {k.removeprefix("per_token/"): sums.pop(k) for k in list(sums) if k.startswith("per_token/")}
        chosen, rejected = max(t["chosen/tokens"], 1), max(t["rejected/tokens"], 1)
        return {**{k: v / n for k, v in sums.items()}, "num_pairs": n,
                "entropy": (t["chosen/entropy"] + t["rejected/entropy"]) / max(t["chosen/tokens"] + t["rejected/tokens"], 1),
                "logits/chosen": t["chosen/logits"] / chosen, "logits/rejected": t["rejected/logits"] / rejected,
                "mean_token_accuracy": t["chosen/correct"] / chosen}


def _input_tokens(batch) -> float:
    """The batch's prompt and completion tokens without padding (a shared prompt counted in each row), as
    TRL counts its inputs' attention mask."""
    return float(batch.prompt_mask.sum().item() + batch.completion_mask.sum().item())
