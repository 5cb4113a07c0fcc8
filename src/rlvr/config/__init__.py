"""The run's configuration, read once where a run is assembled.

One flat, frozen `Config` under TRL's names (`cfg.temperature`), made of per-part sections, each
with its fields, defaults, comments and value rules written once:

    model.py    ModelSettings (model, LoRA), DataSettings
    rollout.py  RolloutSettings = sampling + vLLM + Ray workers + multi-turn
    update.py   RewardSettings; UpdateSettings = advantage + loss + KL + optimizer; FinetuneSettings; DistillSettings
    run.py      RunSettings = output, checkpoints, logging, Hub + evaluation + alerts
    schema.py   Config, the union of the sections; cfg.rollout_settings etc. give a part its own
    parse.py    YAML file + key=value overrides + TRL's names -> Config (build_config)
    rules.py    the rules between sections (validate)
    reference.py  the settings reference, generated from the sections' source

Rules that need a registry or load user code are the launch check's (settings.check_settings).
"""

from rlvr.config.model import DataSettings, ModelSettings
from rlvr.config.parse import ALIASES, build_config, load_yaml, parse_overrides, save_config
from rlvr.config.reference import defaults_markdown, describe_settings, settings_markdown
from rlvr.config.rollout import (MultiTurnSettings, RolloutSettings, SamplingSettings, VLLMSettings, WorkerSettings,
                                 free_running, free_running_obstacles, sampling_problems)
from rlvr.config.rules import validate
from rlvr.config.run import REPORT_TO, AlertSettings, EvalSettings, OutputSettings, RunSettings
from rlvr.config.schema import FIELDS, Config, hide_secret, is_secret
from rlvr.config.update import (AdvantageSettings, DistillSettings, FinetuneSettings, KLSettings, LossSettings, OptimizerSettings,
                                RewardSettings, UpdateSettings)
from rlvr.errors import ConfigError

__all__ = ["ALIASES", "FIELDS", "REPORT_TO", "AdvantageSettings", "AlertSettings", "Config", "ConfigError", "DataSettings", "DistillSettings",
           "EvalSettings", "FinetuneSettings", "KLSettings", "LossSettings", "ModelSettings", "MultiTurnSettings",
           "OptimizerSettings", "OutputSettings", "RewardSettings", "RolloutSettings", "RunSettings", "SamplingSettings",
           "UpdateSettings", "VLLMSettings", "WorkerSettings", "build_config", "defaults_markdown", "describe_settings",
           "free_running", "free_running_obstacles", "hide_secret", "is_secret", "load_yaml", "parse_overrides", "sampling_problems", "save_config",
           "settings_markdown", "validate"]
