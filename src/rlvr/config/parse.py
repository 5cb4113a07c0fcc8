"""A Config from its sources: a YAML file and `key=value` overrides (values parsed as YAML;
`task_args.digits=2` reaches into a mapping), TRL's names and older spellings translated
(trl_settings.py), types checked, merged onto the defaults, then the value rules (rules.py)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from rlvr import trl_settings
from rlvr.config.rules import validate
from rlvr.config.schema import FIELDS, Config
from rlvr.errors import ConfigError

# TRL / open-r1 spellings accepted for our names.
ALIASES = {
    "model_name_or_path": "model",
    "torch_dtype": "dtype",
    "dataset_name": "dataset",
    "dataset_config_name": "dataset_config",
    "resume_from_checkpoint": "resume",
    "teacher": "teacher_model_name_or_path",  # rlvr distill teacher=...
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",  # TRL's older name
}

_TUPLE_FIELDS = {"stop_strings", "tools", "reward_funcs", "reward_weights", "report_to", "lora_target_modules",
                 "lora_target_parameters", "lora_modules_to_save", "dpo_loss_type", "loss_weights"}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["beta=0.04", "task_args.digits=2"]` -> {"beta": 0.04, "task_args.digits": 2}."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"expected key=value, got {item!r}")
        out[key.strip()] = _parse_value(raw)
    return out


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw  # a string YAML can't read as anything else, e.g. "a: b"


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of settings, got {type(data).__name__}")
    return data


def build_config(*sources: dict[str, Any], ignored: list[str] | None = None) -> Config:
    """Merge mappings left to right onto the defaults, then validate.  TRL settings that have no
    effect here are dropped, and their names appended to `ignored` when it is given."""
    if ignored is not None:
        ignored.extend(trl_settings.ignored_keys(*sources))
    values: dict[str, Any] = {}
    for src in sources:
        for key, value in src.items():
            _set(values, str(key), value)
    for name in ("vllm_server_host", "vllm_server_base_url"):  # several servers: a list, kept as "a,b"
        if isinstance(values.get(name), (list, tuple)):
            values[name] = ",".join(str(v).strip() for v in values[name])
    reward_model = values.pop(_REWARD_MODEL, None)
    if reward_model:
        funcs = values.get("reward_funcs") or ()
        values["reward_funcs"] = [str(reward_model), *([funcs] if isinstance(funcs, str) else funcs)]
    for name in _TUPLE_FIELDS:
        if name in values and values[name] is not None:
            v = values[name]
            values[name] = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    if values.get("scale_rewards") is True:  # TRL's older boolean form
        values["scale_rewards"] = "group"
    elif values.get("scale_rewards") is False:
        values["scale_rewards"] = "none"
    for name in ("save_strategy", "eval_strategy"):  # YAML reads a bare `no` as false
        if values.get(name) is False:
            values[name] = "no"
    if values.get("top_k") is None and "top_k" in values:
        values["top_k"] = 0
    if values.get("load_best_model_at_end") and values.get("metric_for_best_model") is None:
        values["metric_for_best_model"] = "loss"  # transformers' TrainingArguments default (refused by the rules: no eval_loss)
    if values.get("greater_is_better") is None and values.get("metric_for_best_model") is not None:
        values["greater_is_better"] = not str(values["metric_for_best_model"]).endswith("loss")  # ... and this one
    if isinstance(values.get("resume"), str):  # TRL's resume_from_checkpoint=<path>
        values["resume_checkpoint"], values["resume"] = values["resume"], True
    if values.get("num_processes") is None and _launched() > 1:  # as TRL reads it: the launcher's processes
        values["num_processes"] = _launched()
    _check_types(values)
    cfg = Config(**values)
    validate(cfg)
    return cfg


def _launched() -> int:
    """The training processes the launcher started (torchrun's and accelerate's WORLD_SIZE), 1 without one."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1  # distributed.world_from_env says what is wrong with it


_REWARD_MODEL = " reward_model_name_or_path"  # held aside until every source is read (build_config)
_MAPPINGS = {"task_args", "reward_args", "reward_audit_args", "on_alert", "model_init_kwargs", "teacher_model_init_kwargs", "chat_template_kwargs", "generation_kwargs",
             "lr_scheduler_kwargs"}


def _set(values: dict[str, Any], key: str, value: Any) -> None:
    if "." in key:  # a key inside one of rlvr's mappings
        return _store(values, key, value)
    if key == "reward_model_name_or_path":  # TRL's grpo script's: that reward model first among reward_funcs
        values[_REWARD_MODEL] = value
        return
    try:  # TRL's settings without an rlvr field of their name (trl_settings.py): none, one or several of rlvr's
        translated = trl_settings.translate(key, value)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name, setting in translated:
        _store(values, name, setting)


def _store(values: dict[str, Any], key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    head = ALIASES.get(head, head)
    if head not in FIELDS:
        close = difflib.get_close_matches(head, list(FIELDS) + list(ALIASES) + trl_settings.known_names(), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown setting {head!r}{hint} (see `rlvr train --help` for the list)")
    if head not in _MAPPINGS:
        if rest:
            raise ConfigError(f"{head!r} is not a mapping, so {key!r} cannot set a key inside it")
        values[head] = value
        return
    if value is None and not rest:  # TRL's "unset" for its dict settings
        value = {}
    if not rest and not isinstance(value, dict):
        raise ConfigError(f"{head} must be a mapping, got {value!r}")
    merged = _merge(values.get(head) or {}, value if not rest else _nest(rest.split("."), value))
    values[head] = merged


def _nest(path: list[str], value: Any) -> dict:
    return {path[0]: value} if len(path) == 1 else {path[0]: _nest(path[1:], value)}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


_TYPES = {"float": float, "int": int, "str": str, "bool": bool, "tuple": tuple, "dict": dict}


def _check_types(values: dict[str, Any]) -> None:
    for name, value in values.items():
        if value is None:
            if "None" not in FIELDS[name].type:
                raise ConfigError(f"{name} cannot be null")
            continue
        kinds = [_TYPES[t.strip()] for t in FIELDS[name].type.split("|") if t.strip() != "None"]  # annotations are strings
        want = next((k for k in kinds if isinstance(value, k)), kinds[0])  # "str | dict | None": either
        if want is float and isinstance(value, str):
            value = values[name] = _yaml_float(value)  # YAML 1.1 reads 3e-6 (no dot) as a string
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
        elif want is int and isinstance(value, float) and value.is_integer():
            values[name] = int(value)
        elif want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = str(value)
        elif not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
            raise ConfigError(f"{name} must be {want.__name__}, got {value!r}")


def _yaml_float(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True))
