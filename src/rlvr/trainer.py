"""The training loop, top to bottom: sample, score, advantage, update, log, save.

One *generation* samples G completions for each of `prompts_per_step` prompts
(stages 1-3), then `num_iterations` optimizer steps train on it (stage 4).
A step is one optimizer step, as in TRL, so max_steps and save_steps mean
what they mean there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlvr.advantages import group_advantages, group_reward_std
from rlvr.chat import render_prompts, tokenize_prompts
from rlvr.checkpoint import load_checkpoint, save_checkpoint
from rlvr.config import Config, save_config
from rlvr.losses import LossNorm, policy_loss, selective_logprobs
from rlvr.evaluate import EvalResult, evaluate, write_result
from rlvr.models import disable_dropout, eos_token_ids, latest_checkpoint, load_model, make_reference
from rlvr.monitor import MetricsLog, format_log_line, make_console, make_progress
from rlvr.optim import build_optimizer
from rlvr.rollout import SamplingParams
from rlvr.llama import LlamaRunner, batch_logprobs, supports
from rlvr.rollout.engine import make_sampler
from rlvr.tasks import PromptStream, build_rewards, load_splits, verifier_name
from rlvr.types import Batch, Example, Rollout, TrainerState


@dataclass
class Generation:
    """One generated, scored batch and how many optimizer steps have used it."""

    batch: Batch
    metrics: dict
    samples: list[dict] = field(default_factory=list)
    iterations_done: int = 0


class Trainer:
    def __init__(self, cfg: Config, model, tokenizer, train_examples: list[Example], output_dir: Path, total_steps: int, ref_model=None):
        self.cfg, self.model, self.tokenizer, self.ref_model = cfg, model, tokenizer, ref_model
        self.output_dir, self.total_steps = Path(output_dir), total_steps
        self.rewards = build_rewards(cfg)
        self.sampler = make_sampler(model, tokenizer, eos_token_ids(model, tokenizer), bf16=cfg.bf16)
        self.fast = supports(model)  # rlvr's own forward (llama.py) for log-probs; else the generic one
        self._runners: dict[int, LlamaRunner] = {}
        self.sampling = SamplingParams(
            n=cfg.num_generations,
            max_tokens=cfg.max_completion_length,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_strings=cfg.stop_strings,
        )
        self.prompts = PromptStream(train_examples, cfg.seed)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_steps)
        self.log = MetricsLog(self.output_dir, cfg.logging_steps)
        self.step = 0
        self.pending: Generation | None = None
        self.extra_state: dict = {}  # e.g. the accuracy before training, kept across resumes

    # --- stages 1-3: one generation ----------------------------------------------------

    def generate(self) -> Generation:
        cfg, t0 = self.cfg, time.perf_counter()
        examples = self.prompts.take(cfg.prompts_per_step)
        texts = render_prompts(self.tokenizer, [ex.prompt for ex in examples], cfg.system_prompt)
        prompt_ids = tokenize_prompts(self.tokenizer, texts, cfg.max_prompt_length)
        groups = self.sampler.generate(prompt_ids, self.sampling, self.generator)  # 1. rollout
        t1 = time.perf_counter()
        state = TrainerState(global_step=self.step, max_steps=self.total_steps)
        scores = self.rewards.score_groups(examples, groups, texts, state, cfg.max_completion_length)  # 2. reward
        t2 = time.perf_counter()
        rewards = torch.tensor(scores.total)
        advantages, zero_std = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)  # 3. advantage
        rollouts = [r for group in groups for r in group]
        keep = (~zero_std).repeat_interleave(cfg.num_generations)  # groups without signal are left out
        batch = Batch.from_rollouts(rollouts, advantages, keep, self.sampler.pad_id, cfg.mask_truncated_completions, cfg.num_generations)
        if len(batch):
            self._fill_reference_logprobs(batch)

        lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float)
        metrics = {
            "reward": rewards.mean().item(),
            "reward_std": group_reward_std(rewards, cfg.num_generations).mean().item(),
            "frac_reward_zero_std": zero_std.float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": sum(r.truncated for r in rollouts) / len(rollouts),
            "num_tokens": lengths.sum().item(),
            "timing/rollout": t1 - t0,
            "timing/reward": t2 - t1,
        }
        for name, values in scores.per_func.items():
            vals = torch.tensor([v for v in values if v is not None] or [math.nan])
            metrics[f"rewards/{name}/mean"] = vals.mean().item()
            metrics[f"rewards/{name}/std"] = vals.std().item() if len(vals) > 1 else 0.0
            for counter, count in scores.counters.get(name, {}).items():
                if count:
                    metrics[f"rewards/{name}/{counter}"] = count
        owners = [ex for ex in examples for _ in range(cfg.num_generations)]
        samples = [
            {"prompt": owners[i].prompt, "answer": owners[i].answer, "completion": rollouts[i].text,
             "reward": scores.total[i], "advantage": advantages[i].item(), "finish_reason": rollouts[i].finish_reason}
            for i in range(min(cfg.num_completions_to_print, len(rollouts)))
        ]
        return Generation(batch, metrics, samples)

    @torch.no_grad()
    def _fill_reference_logprobs(self, batch: Batch) -> None:
        """old_logprobs (only needed when a batch is trained on more than once) and ref_logprobs."""
        if self.cfg.num_iterations > 1:
            batch.old_logprobs = self._logprobs_in_chunks(self.model, batch)
        if self.cfg.beta > 0:
            batch.ref_logprobs = self._logprobs_in_chunks(self.ref_model, batch)

    def _logprobs_in_chunks(self, model, batch: Batch) -> torch.Tensor:
        out = torch.zeros(batch.completion_ids.shape)
        size = self.cfg.per_device_train_batch_size
        for lo in range(0, len(batch), size):
            sub = batch.select(slice(lo, lo + size))
            logprobs, _ = self.completion_logprobs(model, sub)
            out[lo : lo + size, : logprobs.shape[1]] = logprobs.float()
        return out

    # --- stage 4: one optimizer step ----------------------------------------------------

    def update(self, batch: Batch) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        if len(batch) == 0:  # every group had equal rewards: nothing to learn from
            with warnings.catch_warnings():  # stepping the schedule without an optimizer step is intended
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            return {"learning_rate": lr, "skipped_update": 1.0, "timing/update": 0.0}
        sums = self.accumulate_gradients(batch)
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.optimizer.step()
        self.scheduler.step()
        tokens = max(batch.num_tokens, 1)
        metrics = {"loss": sums["loss"], "entropy": sums["entropy"] / tokens, "grad_norm": grad_norm, "learning_rate": lr,
                   "update_tokens": sums["update_tokens"], "update_flops": sums["update_flops"]}
        for k in ("low", "high", "region"):
            metrics[f"clip_ratio/{k}_mean"] = sums[f"clip_ratio/{k}"] / tokens
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / tokens
        metrics["timing/update"] = time.perf_counter() - t0
        return metrics

    def accumulate_gradients(self, batch: Batch) -> dict:
        """Backward over micro-batches of per_device_train_batch_size completions; returns metric sums.

        The loss of each micro-batch is normalised by totals over the whole batch
        (LossNorm), so the accumulated gradient does not depend on the split."""
        cfg = self.cfg
        self.model.train()
        size = cfg.per_device_train_batch_size
        norm = LossNorm(len(batch), batch.num_tokens, cfg.max_completion_length, math.ceil(len(batch) / size))
        sums = {"loss": 0.0, "entropy": 0.0, "update_tokens": 0.0, "update_flops": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for lo in range(0, len(batch), size):
            micro = batch.select(slice(lo, lo + size))
            tokens, flops = self._work(micro)
            sums["update_tokens"] += tokens
            sums["update_flops"] += flops
            logprobs, entropy = self.completion_logprobs(self.model, micro)
            old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
            loss, m = policy_loss(
                logprobs, old, micro.advantages, micro.completion_mask, norm,
                loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta, ref_logprobs=micro.ref_logprobs,
            )
            loss.backward()
            sums["loss"] += loss.item()
            sums["entropy"] += torch.where(micro.completion_mask, entropy, 0.0).sum().item()
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v.item()
        return sums

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

    def train_step(self) -> dict:
        """One optimizer step, generating a new batch when the previous one is used up."""
        t0 = time.perf_counter()
        if self.pending is None:
            position, sampler_rng = self.prompts.state_dict(), self.generator.get_state()
            try:
                self.pending = self.generate()
            except BaseException:  # leave data and sampler where they were, so a checkpoint saved now resumes exactly
                self.prompts.load_state_dict(position)
                self.generator.set_state(sampler_rng)
                raise
        gen = self.pending
        metrics = {**gen.metrics, **self.update(gen.batch)}
        gen.iterations_done += 1
        if gen.iterations_done == 1 and gen.samples and self.cfg.log_completions:
            self.log.add_completions(self.step + 1, gen.samples)
        if gen.iterations_done >= self.cfg.num_iterations:
            self.pending = None
        self.step += 1
        metrics["epoch"] = self.prompts.epochs_done
        metrics["step_time"] = time.perf_counter() - t0
        metrics["tokens_per_second"] = gen.metrics["num_tokens"] / metrics["step_time"]
        return metrics

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "prompts": self.prompts.state_dict(),
            "generator": self.generator.get_state(),
            "log": self.log.state_dict(),
            "pending": self.pending,
            "extra": self.extra_state,
        }

    def save(self) -> Path:
        return save_checkpoint(self.output_dir, self.step, self.model, self.tokenizer, self.state_dict(), self.cfg.save_total_limit)

    def resume(self, checkpoint: Path) -> None:
        state = load_checkpoint(checkpoint, self.model)
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["prompts"])
        self.generator.set_state(state["generator"])
        self.log.load_state_dict(state["log"])
        self.pending = state["pending"]
        self.extra_state = state.get("extra", {})


def total_steps_for(cfg: Config, num_train_examples: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    generations = math.ceil(cfg.num_train_epochs * num_train_examples / cfg.prompts_per_step)
    return max(1, generations * cfg.num_iterations)


# --- the whole run -------------------------------------------------------------------------


def train(cfg: Config, console=None) -> dict:
    """Train as configured: before/after evaluation, checkpoints, final model. Returns the summary."""
    console = console or make_console()
    cfg, output_dir, checkpoint = prepare_output_dir(cfg)
    train_examples, test_examples = load_splits(cfg)
    test_examples = test_examples[: cfg.eval_max_examples or None]
    model, tokenizer, model_path = load_model(cfg.model, cfg.dtype)
    if cfg.disable_dropout:
        disable_dropout(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    total = total_steps_for(cfg, len(train_examples))
    trainer = Trainer(cfg, model, tokenizer, train_examples, output_dir, total, make_reference(model, cfg.beta))
    if checkpoint is not None:
        trainer.resume(checkpoint)
        console.print(f"resumed from {checkpoint} at step {trainer.step}")
    save_config(cfg, output_dir / "config.yaml")
    console.print(f"[bold]rlvr train[/] -> {output_dir}  model: {model_path}  train/test: {len(train_examples)}/{len(test_examples)}  steps: {total}")

    verifier = verifier_name(cfg)
    scorer = build_rewards(cfg, with_verifier=True)

    def held_out(label: str) -> EvalResult:
        console.print(f"held-out evaluation ({label}, {len(test_examples)} problems)...")
        result = evaluate(trainer.sampler, tokenizer, test_examples, scorer, verifier, cfg)
        write_result(result, output_dir / f"eval_{label}.json", {"model": str(model_path), "step": trainer.step})
        console.print(f"  accuracy {result.accuracy:.1%}  mean length {result.mean_completion_length:.1f} tokens")
        return result

    if cfg.eval_on_start and "eval_before" not in trainer.extra_state:
        trainer.extra_state["eval_before"] = _brief(held_out("before"))
    started, seconds_before = time.perf_counter(), trainer.extra_state.get("train_seconds", 0.0)
    saved_step = trainer.step

    def save() -> Path:
        trainer.extra_state["train_seconds"] = seconds_before + time.perf_counter() - started
        return trainer.save()

    try:
        with make_progress(console) as progress:
            bar = progress.add_task("train", total=total, completed=trainer.step, reward="-")
            while trainer.step < total:
                metrics = trainer.train_step()
                line = trainer.log.add(trainer.step, metrics, force=trainer.step == total)
                progress.update(bar, completed=trainer.step, reward=f"{metrics['reward']:.3f}")
                if line:
                    progress.console.print(format_log_line(line, total))
                # Also after the last step, so that resume=true with a larger max_steps can continue.
                if trainer.step % cfg.save_steps == 0 or trainer.step == total:
                    save()
                    saved_step = trainer.step
    except BaseException:
        if trainer.step > saved_step:
            path = save()
            console.print(f"[red]stopped at step {trainer.step}[/]; saved {path}. Continue with: rlvr train resume=true output_dir={output_dir}")
        raise
    train_seconds = seconds_before + time.perf_counter() - started
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    after = _brief(held_out("after")) if cfg.eval_on_end else None
    summary = {
        "output_dir": str(output_dir),
        "steps": trainer.step,
        "train_seconds": round(train_seconds, 1),
        "eval_before": trainer.extra_state.get("eval_before"),
        "eval_after": after,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(console, summary)
    return summary


def _brief(result: EvalResult) -> dict:
    return {k: v for k, v in result.to_dict().items() if k != "samples"}


def prepare_output_dir(cfg: Config):
    """(cfg with a concrete output_dir, that dir, the checkpoint to resume from or None)."""
    if cfg.resume:
        output_dir = Path(cfg.output_dir) if cfg.output_dir else latest_run_dir()
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"resume=true but {output_dir} has no checkpoint-* to resume from")
        return dataclasses.replace(cfg, output_dir=str(output_dir)), output_dir, checkpoint
    name = cfg.output_dir or f"runs/{_run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"
    output_dir = Path(name)
    if output_dir.is_dir() and ((output_dir / "metrics.jsonl").exists() or latest_checkpoint(output_dir)):
        raise FileExistsError(
            f"{output_dir} already holds a training run; continue it with resume=true, or pick another output_dir"
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    return dataclasses.replace(cfg, output_dir=str(output_dir)), output_dir, None


def latest_run_dir(root: Path = Path("runs")) -> Path:
    runs = [p for p in root.glob("*") if p.is_dir() and latest_checkpoint(p) is not None]
    if not runs:
        raise FileNotFoundError(f"resume=true without output_dir, and no run with a checkpoint under {root}/")
    return max(runs, key=lambda p: latest_checkpoint(p).stat().st_mtime)


def _run_name(cfg: Config) -> str:
    return Path(cfg.dataset).stem.replace("/", "-") if cfg.dataset else cfg.task


def print_summary(console, summary: dict) -> None:
    from rich.table import Table

    table = Table(title="rlvr run summary", show_header=False)
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before or after:
        n = (after or before)["n"]
        b = f"{before['accuracy']:.1%}" if before else "-"
        a = f"{after['accuracy']:.1%}" if after else "-"
        delta = f"  ({(after['accuracy'] - before['accuracy']) * 100:+.1f} points)" if before and after else ""
        table.add_row(f"held-out accuracy (n={n})", f"before {b}  ->  after {a}{delta}")
    table.add_row("steps", str(summary["steps"]))
    minutes, seconds = divmod(int(summary["train_seconds"]), 60)
    table.add_row("training wall time", f"{minutes}m {seconds:02d}s")
    table.add_row("output", summary["output_dir"])
    console.print(table)
