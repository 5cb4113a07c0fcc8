"""TRL's GRPOConfig, SFTConfig, DPOConfig, AsyncGRPOConfig and DistillationConfig: dataclasses with every field of TRL 1.16's class
(name, type, default: trl_fields.py), which transformers' HfArgumentParser and TrlParser read,
resolved into rlvr's Config of their method (methods.py) when made and whenever a field is set.

- A field reads back TRL's default, except where rlvr's deliberately differs (TRL_DEFAULTS_DIFFER,
  METHOD_DEFAULTS_DIFFER in trl_settings.py): then the field's default is rlvr's, so that what a
  field shows is what the run does.
- The settings given are the fields that differ from their default, and any rlvr setting besides
  (`GRPOConfig(output_dir="x", task="countdown")`): they are checked at once (ConfigError says what
  to fix), a refused change leaving the config as it was.
- A method's names are TRL's (DPOConfig.beta is rlvr's dpo_beta); a field that rlvr turns into
  something else (a hub_token placeholder, fsdp="full_shard") reads back rlvr's value, as before.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rlvr import methods
from rlvr.api import trl_fields
from rlvr.api.outputs import Processes
from rlvr.config import ALIASES, FIELDS, ConfigError, build_config, hide_secret
from rlvr.settings import check_settings
from rlvr.trl_settings import IGNORED, METHOD_DEFAULTS_DIFFER, TRL_DEFAULTS_DIFFER, UNSUPPORTED, inert, known_names

__all__ = ["GRPOConfig", "SFTConfig", "DPOConfig", "AsyncGRPOConfig", "DistillationConfig"]


def _same(ours: Any, theirs: Any) -> bool:
    """Equal as a user means it: an unset list or mapping however spelled, "none" for no loggers."""
    unset = (None, (), [], {}, "none")
    if (ours in unset or ours is None) and (theirs in unset or theirs is None):
        return True
    return list(ours) == list(theirs) if isinstance(ours, (tuple, list)) and isinstance(theirs, (tuple, list)) else ours == theirs


class _TrlConfig:
    """GRPOConfig's behaviour, over the fields each subclass gets from TRL's table (_make)."""

    _method = "grpo"  # the method whose defaults and names these settings have (methods.py)
    _trl_class = "GRPOConfig"  # the TRL class whose fields these are (trl_fields.json)
    _backed: frozenset = frozenset()  # the fields that are rlvr settings of the same meaning (set by _make)
    _defaults: dict = {}  # each TRL field's default here (set by _make)
    _base: dict = {}  # settings this class always gives, under the given ones (AsyncGRPOConfig's defaults)

    def __init__(self, output_dir: str | None = None, **settings: Any):
        given = {"output_dir": output_dir} if output_dir is not None else {}
        given.update(settings)
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, given.pop(f.name) if f.name in given else self._default(f))
        object.__setattr__(self, "_extra", given)  # rlvr's own settings, or keys rlvr will name as unknown
        self.__post_init__()

    def __post_init__(self) -> None:
        """The fields are set (by __init__, or by the __init__ that @dataclass writes for a subclass, such
        as open-r1's GRPOConfig with fields of its own): read them, resolve the settings."""
        self.__dict__.setdefault("_extra", {})
        object.__setattr__(self, "_names", {f.name for f in dataclasses.fields(self)})
        for name in self._trl_fields():
            object.__setattr__(self, name, self._read(name, self.__dict__[name]))
        self._resolve()

    @classmethod
    def takes(cls, name: str) -> bool:
        """Whether `name` is a setting of this method besides the fields: rlvr's own (max_prompt_length),
        or an older TRL's or transformers' that recipes still carry (warmup_ratio, overwrite_output_dir)."""
        own = methods.get(cls._method).trl_name(name)
        return own in FIELDS or ALIASES.get(own) in FIELDS or name in known_names()

    def _trl_fields(self) -> dict[str, dict]:
        """TRL's fields (a subclass's own fields are its script's, never rlvr settings)."""
        return trl_fields.table()[self._trl_class]

    @staticmethod
    def _default(f: dataclasses.Field) -> Any:
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    def _read(self, name: str, value: Any) -> Any:
        """A mapping given on a command line is a JSON string, as transformers reads it."""
        spelled = self._trl_fields()[name]["type"]
        if isinstance(value, str) and value.lstrip().startswith("{") and trl_fields.takes_mapping(spelled):
            return json.loads(value)
        return value

    def _given(self) -> dict[str, Any]:
        """The settings given: fields away from their default, then rlvr's own settings."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name not in self._trl_fields():
                continue
            value, default = self.__dict__[f.name], self._defaults[f.name]  # TRL's (or rlvr's), not a subclass's
            if f.name in IGNORED and inert(value, ("no", "none")):
                continue  # a command line's spelling of "not set" (None for "", False for "no")
            if not _same(value, default) if f.name in self._backed else value != default:
                out[f.name] = value
        return {**out, **self._extra}

    def _resolve(self) -> None:
        ignored: list[str] = []
        settings = {**self._base, **self._given()}
        method = methods.get(self._method)
        cfg = build_config(method.settings({}), method.settings(settings), ignored=ignored)
        # the rules that need a registry, at once too; the functions that reward_weights weigh come with the trainer
        cfg = check_settings(cfg, rewards_later=True)
        for name in self._backed:  # what rlvr made of a field reads back (a placeholder token is unset)
            ours = getattr(cfg, method.trl_name(name))
            if not _same(ours, self.__dict__[name]):
                object.__setattr__(self, name, list(ours) if isinstance(ours, tuple) else ours)  # TRL's fields hold lists
        object.__setattr__(self, "_config", cfg)
        object.__setattr__(self, "_settings", settings)
        object.__setattr__(self, "_ignored", ignored)

    def __getattr__(self, name: str) -> Any:  # only for names that are not TRL's fields
        if name.startswith("_"):
            raise AttributeError(name)
        own = methods.get(self._method).trl_name(name)
        if hasattr(self._config, own):
            return getattr(self._config, own)
        if name in self._extra:
            return self._extra[name]
        if name in IGNORED or name in UNSUPPORTED:
            return None  # an older TRL's setting without effect here, not given
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or "_config" not in self.__dict__:  # a name of ours, or a subclass's __init__ at work
            object.__setattr__(self, name, value)
            return
        before = (dict(self.__dict__), dict(self._extra))
        if name in self._names:
            object.__setattr__(self, name, self._read(name, value) if name in self._trl_fields() else value)
        else:
            self._extra[name] = value
        try:
            self._resolve()
        except ConfigError:
            self.__dict__.clear()
            self.__dict__.update(before[0])
            object.__setattr__(self, "_extra", before[1])
            raise

    # --- transformers' TrainingArguments properties that scripts read (open-r1's logging line) --------

    def _processes(self) -> Processes:
        return Processes(self._config.use_cpu)

    @property
    def device(self):
        return self._processes().device

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a GPU (rlvr runs one process per GPU), else 0."""
        return int(self._processes().device.type == "cuda")

    @property
    def world_size(self) -> int:
        return self._processes().num_processes

    @property
    def process_index(self) -> int:
        return self._processes().process_index

    @property
    def local_process_index(self) -> int:
        return self._processes().local_process_index

    def get_process_log_level(self) -> int:
        """The logging level of this process: log_level on the first process, log_level_replica on the others
        (transformers' names: debug, info, warning, error, critical; "passive" is warning)."""
        import logging

        name = self.log_level if self.process_index == 0 else self.log_level_replica
        return logging.WARNING if name in (None, "passive") else logging.getLevelName(str(name).upper())

    def to_dict(self) -> dict[str, Any]:
        """Every setting, a token as "<HUB_TOKEN>" as in TRL (the attribute holds the token itself)."""
        return self._config.to_dict()

    def __repr__(self) -> str:
        shown = (f"{k}={hide_secret(k, v)!r}" for k, v in self._settings.items())
        return f"{type(self).__name__}({', '.join(shown)})"


def _make(name: str, method_name: str, doc: str, base: dict | None = None) -> type:
    """The dataclass of TRL's `name`: TRL's fields, rlvr's default where it deliberately differs.
    `base`: settings the class always gives (under the given ones), where its TRL defaults are not
    the method's (AsyncGRPOConfig's)."""
    method = methods.get(method_name)
    defaults_cfg = build_config(method.settings(dict(base or {})))
    differ = set(TRL_DEFAULTS_DIFFER) | set(METHOD_DEFAULTS_DIFFER.get(method_name, {}))
    rows = trl_fields.table()[name]
    ours, backed = {}, set()
    for field_name, row in rows.items():
        own = method.trl_name(field_name)
        if not hasattr(defaults_cfg, own) or field_name in IGNORED or field_name in UNSUPPORTED:
            continue
        value = getattr(defaults_cfg, own)
        trl_value = row["default"]
        if field_name in differ or _same(value, trl_value):
            backed.add(field_name)
            if field_name in differ and field_name != "output_dir":
                ours[field_name] = list(value) if isinstance(value, tuple) else value
    cls = dataclasses.make_dataclass(name, trl_fields.dataclass_fields(name, ours), bases=(_TrlConfig,), init=False,
                                     repr=False, eq=False, namespace={"__doc__": doc, "__module__": __name__})
    cls._method, cls._trl_class, cls._backed, cls._base = method_name, name, frozenset(backed), dict(base or {})
    cls._defaults = {f.name: cls._default(f) for f in dataclasses.fields(cls)}
    return cls


GRPOConfig = _make("GRPOConfig", "grpo", """TRL's GRPOConfig: `GRPOConfig(output_dir=..., **settings)`, every field of
    TRL's with TRL's default (rlvr's where trl_settings.TRL_DEFAULTS_DIFFER says why), attributes read and set by
    TRL's names, `to_dict()`.  Every setting is checked when it is made or set (a ConfigError says what to fix).""")
SFTConfig = _make("SFTConfig", "sft", """TRL's SFTConfig: max_length, packing, completion_only_loss, and every shared setting.""")
DPOConfig = _make("DPOConfig", "dpo", """TRL's DPOConfig: beta, loss_type (sigmoid, ipo, hinge, or a list of them
    weighed by loss_weights), label_smoothing, max_length, ...""")

DistillationConfig = _make("DistillationConfig", "distill", """TRL's DistillationConfig: teacher_model_name_or_path, beta (0 forward
    KL, 1 reverse KL, between: generalised JSD; rlvr's distill_beta), temperature, and every shared setting; rlvr adds
    distill_reward_weight (the verifier's GRPO loss mixed in) and num_generations (default 1, as TRL's).""")


# Where TRL's AsyncGRPOConfig's defaults are not its GRPOConfig's (TRL 1.16), and what it always does:
# generate on a vLLM server (`rlvr vllm-serve`; use_vllm=false samples in the training process instead).
ASYNC_DEFAULTS = {"lr_scheduler_type": "constant", "logging_steps": 1, "max_completion_length": 2048,
                  "vllm_server_base_url": "http://localhost:8000", "max_staleness": 4, "use_vllm": True, "vllm_mode": "server", "async_mode": "auto"}
AsyncGRPOConfig = _make("AsyncGRPOConfig", "grpo", """TRL's AsyncGRPOConfig: GRPO sampled on vLLM servers by a producer that
    keeps up to max_staleness generations in flight while the trainer trains (async_mode=auto: free, with several
    processes rank 0 sampling for all as in TRL; one generation ahead in lockstep where the producer cannot run; max_staleness, default 4: the
    most weight versions a sample may lag, older ones dropped; weight_sync_steps, default 1: steps between weight pushes to
    the servers), with TRL's defaults for it (a constant learning rate, logging every step,
    completions of up to 2048 tokens, the server at http://localhost:8000).  docs/trl.md says what its other fields do here.""",
                        base=ASYNC_DEFAULTS)
