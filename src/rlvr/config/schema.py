"""The whole run configuration: one flat, frozen Config under TRL's names, made of the parts'
settings sections (model.py, rollout.py, update.py, run.py), each part's fields written once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlvr.config.model import DataSettings, ModelSettings
from rlvr.config.rollout import RolloutSettings
from rlvr.config.run import RunSettings
from rlvr.config.update import DistillSettings, FinetuneSettings, RewardSettings, UpdateSettings
from rlvr.errors import ConfigError


@dataclass(frozen=True, repr=False)
class Config(RunSettings, DistillSettings, FinetuneSettings, UpdateSettings, RewardSettings, RolloutSettings, DataSettings, ModelSettings):
    """Every setting of a run, flat (cfg.temperature), in the order of the sections; a part is
    given its own section (cfg.rollout_settings), never the whole Config."""

    @property
    def model_settings(self) -> ModelSettings:
        return self.section(ModelSettings)

    @property
    def data_settings(self) -> DataSettings:
        return self.section(DataSettings)

    @property
    def rollout_settings(self) -> RolloutSettings:
        return self.section(RolloutSettings)

    @property
    def reward_settings(self) -> RewardSettings:
        return self.section(RewardSettings)

    @property
    def update_settings(self) -> UpdateSettings:
        return self.section(UpdateSettings)

    @property
    def run_settings(self) -> RunSettings:
        return self.section(RunSettings)

    @property
    def finetune_settings(self) -> FinetuneSettings:
        return self.section(FinetuneSettings)

    @property
    def distill_settings(self) -> DistillSettings:
        return self.section(DistillSettings)

    def for_processes(self, launched: int) -> Config:
        """These settings for the processes launched: as in TRL, per_device_train_batch_size is each
        one's, so the run's batch is per_device_train_batch_size x processes x steps_per_generation.
        A num_processes given must be the launch's (a resumed run whose count differs is refused by
        rundir.compare_settings: its batch would change)."""
        if self.num_processes is not None and self.num_processes != launched:
            raise ConfigError(
                f"num_processes={self.num_processes}, but {launched} {'processes were' if launched > 1 else 'process was'} launched: "
                "per_device_train_batch_size is per process, so the run's batch depends on how many; launch "
                f"{self.num_processes} (torchrun --nproc_per_node {self.num_processes}) or leave num_processes unset")
        return dataclasses.replace(self, num_processes=launched if launched > 1 else None)

    @property
    def processes(self) -> int:
        """The training processes the run's batch is for (num_processes, 1 when not filled in)."""
        return self.num_processes or 1

    @property
    def completions_per_generation(self) -> int:
        """Completions sampled in one generation (TRL's generation_batch_size, over all processes):
        per_device_train_batch_size x processes x steps_per_generation, as TRL computes it."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        return self.per_device_train_batch_size * self.processes * (self.steps_per_generation or self.gradient_accumulation_steps)

    @property
    def prompts_per_step(self) -> int:
        """Prompts sampled for one generation (TRL: generation batch / num_generations)."""
        return self.completions_per_generation // self.num_generations

    @property
    def steps_per_optimizer_step(self) -> int:
        """Optimizer steps one generation feeds (per use, see num_iterations): steps_per_generation / gradient_accumulation_steps."""
        return self.completions_per_generation // (self.per_device_train_batch_size * self.processes * self.gradient_accumulation_steps)

    def to_dict(self) -> dict[str, Any]:
        """Every setting, tuples as lists and secrets hidden (hide_secret); the token itself is cfg.hub_token."""
        out = {}
        for f in dataclasses.fields(self):
            v = hide_secret(f.name, getattr(self, f.name))
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def without_secrets(self) -> Config:
        """This config with the Hub token unset: what is saved to config.yaml and logged."""
        kwargs = {k: v for k, v in self.model_init_kwargs.items() if not is_secret(k)}
        return dataclasses.replace(self, hub_token=None, model_init_kwargs=kwargs)

    def __repr__(self) -> str:  # the dataclass's own, with secrets hidden
        shown = (f"{f.name}={hide_secret(f.name, getattr(self, f.name))!r}" for f in dataclasses.fields(self))
        return f"Config({', '.join(shown)})"


def is_secret(name: str) -> bool:
    """A setting that holds a credential: as transformers' TrainingArguments has it, a name ending in
    _token (hub_token); and from_pretrained's `token` in model_init_kwargs."""
    return name == "token" or name.endswith("_token")


def hide_secret(name: str, value: Any) -> Any:
    """`value` as repr, str and to_dict show it: a secret that is set as "<HUB_TOKEN>" (its name in
    capitals, as transformers' to_dict writes it), in model_init_kwargs too."""
    key = name.rpartition(".")[2]  # a dotted key reaches into a mapping: model_init_kwargs.token
    if key == "model_init_kwargs" and isinstance(value, dict):
        return {k: hide_secret(k, v) for k, v in value.items()}
    return f"<{key.upper()}>" if is_secret(key) and value is not None else value


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
