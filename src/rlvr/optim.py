"""The optimizer, its learning-rate schedule and fp16's loss scaling, as TRL (transformers' Trainer) sets them up.

AdamW in one of torch's three implementations (`optim`): adamw_torch (torch's default, a loop
over the parameters on CPU), adamw_torch_foreach (one multi-tensor kernel per operation) or
adamw_torch_fused (one kernel for the whole update; TRL's default).  They compute the same
update, up to floating-point rounding.

The schedule multiplies the learning rate by lr_factor(step) for optimizer step `step`
(0-based), with transformers' formulas (transformers/optimization.py), w = warmup steps,
T = total steps:

    warmup (step < w)       step / w                 (so the first step of a warmup has lr 0)
    constant                1                        (no warmup at all, as in transformers)
    constant_with_warmup    1 after the warmup
    linear                  max(0, (T - step) / (T - w))
    cosine                  max(0, (1 + cos(2 pi c p)) / 2),  p = (step - w) / (T - w), c = num_cycles (0.5)
    cosine_with_min_lr      the cosine, lifted to m + (1 - m) x cosine, m = min_lr_rate or min_lr / lr
    polynomial              ((lr - e) (1 - p)^power + e) / lr,  e = lr_end (1e-7), power 1; e / lr after T

Each schedule's knobs (`lr_scheduler_kwargs`) are the keyword-only arguments of its function
below; others are refused before the model loads (`schedule_problems`).
"""

from __future__ import annotations

import inspect
import math
import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlvr.config import OptimizerSettings


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str, learning_rate: float = 1.0, **kwargs) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based); `kwargs` are the
    schedule's own knobs (lr_scheduler_kwargs), `learning_rate` is needed by the ones given as a
    learning rate (min_lr, lr_end)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}; got {kind!r}")
    if kind != "constant" and step < warmup_steps:
        return step / max(1, warmup_steps)
    return SCHEDULES[kind](step, total_steps, warmup_steps, learning_rate, **kwargs)


def _constant(step, total, warmup, lr) -> float:
    return 1.0


def _linear(step, total, warmup, lr) -> float:
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step, total, warmup, lr, *, num_cycles: float = 0.5) -> float:
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))


def _cosine_with_min_lr(step, total, warmup, lr, *, num_cycles: float = 0.5, min_lr: float | None = None,
                        min_lr_rate: float | None = None) -> float:
    floor = min_lr / lr if min_lr is not None else min_lr_rate
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, cosine * (1.0 - floor) + floor)


def _polynomial(step, total, warmup, lr, *, lr_end: float = 1e-7, power: float = 1.0) -> float:
    if step > total:
        return lr_end / lr
    remaining = 1.0 - (step - warmup) / max(1, total - warmup)
    return ((lr - lr_end) * remaining**power + lr_end) / lr


def schedule_problems(kind: str, kwargs: dict, learning_rate: float) -> list[str]:
    """What is wrong with `lr_scheduler_kwargs` for schedule `kind` (empty: nothing)."""
    if kind not in SCHEDULES:
        return []  # config.validate reports the name
    known = [p.name for p in inspect.signature(SCHEDULES[kind]).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        takes = f"it takes {', '.join(known)}" if known else "it takes none"
        return [f"lr_scheduler_kwargs {', '.join(map(repr, unknown))} not known to lr_scheduler_type={kind} ({takes})"]
    problems = [f"lr_scheduler_kwargs.{k} must be a number; got {v!r}" for k, v in kwargs.items()
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
    if problems:
        return problems
    if kind == "cosine_with_min_lr" and (kwargs.get("min_lr") is None) == (kwargs.get("min_lr_rate") is None):
        problems.append("lr_scheduler_type=cosine_with_min_lr needs one of lr_scheduler_kwargs.min_lr (a learning rate) "
                        "or lr_scheduler_kwargs.min_lr_rate (a fraction of learning_rate), e.g. {min_lr_rate: 0.1}")
    if kind == "polynomial" and not kwargs.get("lr_end", 1e-7) < learning_rate:
        problems.append(f"lr_scheduler_kwargs.lr_end ({kwargs.get('lr_end', 1e-7)}, default 1e-7) must be below "
                        f"learning_rate ({learning_rate}): the polynomial schedule decays from one to the other")
    return problems


def warmup_steps_for(settings: OptimizerSettings, total_steps: int) -> int:
    return settings.warmup_steps if settings.warmup_steps > 0 else math.ceil(settings.warmup_ratio * total_steps)


# transformers' rule (Trainer.get_decay_parameter_names), so weight_decay means what it means in TRL:
# no decay for biases and normalisation weights.
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def param_groups(model, weight_decay: float) -> list[dict]:
    """The trainable parameters as AdamW groups: one group without weight decay; with it, the
    decayed weights and a group of biases and norm weights at weight_decay 0 (marked no_decay)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if weight_decay == 0:
        return [{"params": [p for _, p in named]}]
    in_layer_norm = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters(recurse=False)}
    exempt = [_NO_DECAY.search(n.lower()) is not None or id(p) in in_layer_norm for n, p in named]
    groups = [{"params": [p for (_, p), e in zip(named, exempt) if not e], "weight_decay": weight_decay},
              {"params": [p for (_, p), e in zip(named, exempt) if e], "weight_decay": 0.0, "no_decay": True}]
    return [g for g in groups if g["params"]]


def build_optimizer(model, settings: OptimizerSettings, total_steps: int):
    optimizer = torch.optim.AdamW(
        param_groups(model, settings.weight_decay),
        lr=settings.learning_rate,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_epsilon,
        weight_decay=settings.weight_decay,
        **OPTIMIZERS[settings.optim],
    )
    if optimizer.defaults.get("fused"):
        optimizer.register_step_post_hook(_mark_written)
    warmup = warmup_steps_for(settings, total_steps)
    kind, kwargs, lr = settings.lr_scheduler_type, dict(settings.lr_scheduler_kwargs), settings.learning_rate
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, warmup, kind, lr, **kwargs))
    return optimizer, scheduler


def _mark_written(optimizer, args, kwargs) -> None:
    """The fused kernel writes the parameters without bumping their version counters, by which
    llama.py's sampler sees that the weights changed (and rebuilds its copy): bump them here."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            torch.autograd.graph.increment_version(p)


def apply_optimizer_settings(optimizer, scheduler, settings: OptimizerSettings) -> None:
    """The learning rate, weight decay and Adam settings of `settings` on a resumed optimizer and
    schedule (resume_override=true), the schedule's position kept."""
    scheduler.base_lrs = [settings.learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=settings.learning_rate, lr=settings.learning_rate * factor(scheduler.last_epoch),
                     weight_decay=0.0 if group.get("no_decay") else settings.weight_decay, eps=settings.adam_epsilon,
                     betas=(settings.adam_beta1, settings.adam_beta2))
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def autocast_dtype(settings: OptimizerSettings) -> torch.dtype | None:
    """The dtype of the matmuls under autocast: bfloat16 (bf16), float16 (fp16), or None (the weights' own)."""
    return torch.bfloat16 if settings.bf16 else torch.float16 if settings.fp16 else None


def loss_scaler(settings: OptimizerSettings, device) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling: the loss is multiplied by a scale before the backward pass, so
    that small gradients do not vanish in fp16, and the gradients are divided by it before the
    step; a step whose gradients overflowed is skipped and the scale halved.  Without fp16 the
    scaler is disabled and changes nothing (update.backward, update.optimizer_step)."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=settings.fp16)


# The schedules by lr_scheduler_type; a function's keyword-only arguments are its lr_scheduler_kwargs.
SCHEDULES = {
    "constant": _constant,
    "constant_with_warmup": _constant,
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_min_lr": _cosine_with_min_lr,
    "polynomial": _polynomial,
}

# torch.optim.AdamW's keyword arguments by optim.
OPTIMIZERS = {
    "adamw_torch": {},
    "adamw_torch_foreach": {"foreach": True},
    "adamw_torch_fused": {"fused": True},
}
