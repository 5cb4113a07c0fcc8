"""The training methods, in one registry: everything that differs between what `rlvr train`
(GRPO), `rlvr sft`, `rlvr rft`, `rlvr dpo` and `rlvr distill` train, and the one place that dispatches on it.

A method is its command, its settings as TRL's <Method>Config has them (the defaults that differ
from GRPOConfig's, and the names it gives rlvr's settings: DPOConfig's `beta` is dpo_beta), its
trainer (a class with `load_data(cfg, objects)` and `for_run(...)`, which adds its step to the
parts every method shares, trainer.RunCore), the setting whose beta needs a frozen reference
model, and what the progress bar shows.  Nothing else compares method names.

This module is low in the import graph (rlvr.errors only): settings.py and the config read it
before anything heavy is imported; the trainers are imported when a run is assembled.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from rlvr.errors import ConfigError

__all__ = ["Method", "METHODS", "DEFAULT_METHOD", "get", "commands", "method_settings"]

DEFAULT_METHOD = "grpo"  # Config's own: its settings are TRL's GRPOConfig, as they are
SELF_SAMPLES = ("self_samples=true",)  # what a method's self-samples command (rlvr rft) adds to its settings


def _frozen(values: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(values or {}))


@dataclass(frozen=True)
class Method:
    name: str  # Config.method
    command: str  # the rlvr command that trains it
    trainer: str  # "module:Class": its load_data(cfg, objects) and for_run(...), imported when a run is assembled
    progress: str  # what the progress bar shows for a step: "reward" or "loss"
    reference: str | None = None  # the setting whose beta > 0 needs a frozen copy of the starting model
    defaults: Mapping = field(default_factory=_frozen)  # TRL's <Method>Config defaults that differ from GRPOConfig's
    renames: Mapping = field(default_factory=_frozen)  # TRL's <Method>Config names for rlvr's settings
    self_samples_command: str | None = None  # the command that trains it on the model's own verified samples
    pairs: bool = False  # trains on preference pairs (prompt, chosen, rejected) rather than demonstrations
    online: bool = False  # samples and trains on generations each step: several processes, rollout workers,
    # sampling ahead and multi-turn rollouts are for it; a method without trains in one process
    min_generations: int = 2  # num_generations at least: a group to compare (1: each completion is trained on alone)

    @property
    def is_default(self) -> bool:
        """Config's own method: its settings are the Config's, under TRL's GRPOConfig names (rlvr train)."""
        return self.name == DEFAULT_METHOD

    def command_for(self, self_samples: bool) -> str:
        """The rlvr command that trains this method (rft: sft with self_samples)."""
        return self.self_samples_command if self_samples and self.self_samples_command else self.command

    def settings(self, values: Mapping) -> dict:
        """`values` under rlvr's names; given {}, the method's defaults (and the method itself)."""
        if not values:
            return {"method": self.name, **self.defaults}
        renames = dict(self.renames)
        if "loss_type" in renames:  # a GRPO recipe's loss_type (the demo's grpo) stays GRPO's
            from rlvr.losses import LOSS_TYPES

            if isinstance(values.get("loss_type"), str) and values["loss_type"] in LOSS_TYPES:
                del renames["loss_type"]
        return {renames.get(k, k): v for k, v in values.items()}

    def trl_name(self, name: str) -> str:
        """rlvr's setting that TRL's <Method>Config calls `name` (DPOConfig.beta: dpo_beta)."""
        return self.renames.get(name, name)

    def reference_beta(self, cfg) -> float:
        """The beta of the method's reference term, 0.0 without one (then no reference is made)."""
        return float(getattr(cfg, self.reference)) if self.reference else 0.0

    def trainer_class(self) -> type:
        module, name = self.trainer.split(":")
        return getattr(importlib.import_module(module), name)

    def load_data(self, cfg, objects=None):
        """The run's data (trainer.RunData), from the settings or from the objects given to the Python API."""
        return self.trainer_class().load_data(cfg, objects)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("grpo", command="train", trainer="rlvr.trainer:Trainer", progress="reward", reference="beta", online=True),
    Method("sft", command="sft", trainer="rlvr.finetune.trainer:FinetuneTrainer", progress="loss",
           defaults=_frozen({"learning_rate": 2e-5}), renames=_frozen({"loss_type": "sft_loss_type"}),
           self_samples_command="rft"),
    Method("dpo", command="dpo", trainer="rlvr.finetune.trainer:PreferenceTrainer", progress="loss", reference="dpo_beta",
           defaults=_frozen({"learning_rate": 1e-6}), renames=_frozen({"beta": "dpo_beta", "loss_type": "dpo_loss_type"}),
           pairs=True),
    # On-policy distillation: GRPO's rollout stage, a teacher's divergence as the loss (distill.py).  TRL's
    # DistillationConfig samples one completion per prompt and has no reference model (its beta is distill_beta).
    Method("distill", command="distill", trainer="rlvr.trainer:Distiller", progress="loss",
           defaults=_frozen({"num_generations": 1}), renames=_frozen({"beta": "distill_beta"}), online=True, min_generations=1),
)}


def get(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; one of {', '.join(METHODS)}")
    return METHODS[name]


def commands() -> dict[str, tuple[Method, tuple[str, ...]]]:
    """Each rlvr command that trains: its method and the settings it adds (rlvr rft: self_samples=true)."""
    out = {}
    for method in METHODS.values():
        out[method.command] = (method, ())
        if method.self_samples_command:
            out[method.self_samples_command] = (method, SELF_SAMPLES)
    return out


def method_settings(method: str, values: Mapping) -> dict:
    """`values` under rlvr's names for `method`; given {}, the method's defaults (and method itself)."""
    return get(method).settings(values)
