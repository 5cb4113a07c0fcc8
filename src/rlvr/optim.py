"""AdamW and the learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based).

    Warmup rises linearly from 1/(warmup+1) to 1; afterwards `constant` stays at
    1, `linear` falls to 0 at total_steps, `cosine` follows half a cosine to 0.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_scheduler_type must be constant, linear or cosine; got {kind!r}")


def warmup_steps_for(cfg, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def build_optimizer(model, cfg, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
    )
    warmup = warmup_steps_for(cfg, total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, cfg.lr_scheduler_type)
    )
    return optimizer, scheduler


def apply_optimizer_settings(optimizer, scheduler, cfg) -> None:
    """The learning rate, weight decay and Adam settings of `cfg` on a resumed optimizer and
    schedule (resume_override=true), the schedule's position kept."""
    scheduler.base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=cfg.learning_rate, lr=cfg.learning_rate * factor(scheduler.last_epoch),
                     weight_decay=cfg.weight_decay, eps=cfg.adam_epsilon, betas=(cfg.adam_beta1, cfg.adam_beta2))
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
