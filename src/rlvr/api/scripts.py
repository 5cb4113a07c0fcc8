"""What TRL's training scripts (trl/scripts/grpo.py, sft.py, dpo.py, and open-r1's grpo.py) import
from TRL besides the configs and trainers, so that such a script runs with `trl` replaced by `rlvr`:

    TrlParser            transformers' HfArgumentParser, plus `--config recipe.yaml` (with its `env:`)
    ScriptArguments      the dataset to load: dataset_name, dataset_config, splits, streaming
    ModelConfig          the model and its LoRA: model_name_or_path, dtype, use_peft, lora_* ...
    DatasetMixtureConfig, DatasetConfig, get_dataset    several datasets loaded as one
    get_peft_config      ModelConfig -> peft.LoraConfig, or None without use_peft
    get_quantization_config    BitsAndBytesConfig for load_in_4bit (QLoRA), as TRL's; 8-bit loading is refused
    get_kbit_device_map        None: rlvr places the model itself

The fields are TRL 1.16's (tests/test_trl_scripts.py compares them with the installed TRL).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import HfArgumentParser

from rlvr.api.configs import _TrlConfig
from rlvr.errors import ConfigError
from rlvr.trl_settings import UNSUPPORTED

__all__ = ["TrlParser", "ScriptArguments", "ModelConfig", "DatasetConfig", "DatasetMixtureConfig", "get_dataset",
           "get_peft_config", "get_quantization_config", "get_kbit_device_map", "init_zero_verbose"]


@dataclass
class ScriptArguments:
    """The dataset a script trains on (ignored when DatasetMixtureConfig's `datasets` is given)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Dataset name on the Hub, or a local path."})
    dataset_config: str | None = field(default=None, metadata={"help": "The dataset's configuration (load_dataset's name)."})
    dataset_train_split: str = field(default="train", metadata={"help": "The split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "The split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset (not supported by rlvr)."})
    ignore_bias_buffers: bool = field(default=False, metadata={"help": "DDP workaround in TRL; no effect in rlvr."})


@dataclass
class ModelConfig:
    """The model a script loads and the LoRA adapter it trains (use_peft)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Model name on the Hub, or a local path."})
    model_revision: str = field(default="main", metadata={"help": "The model's branch, tag or commit."})
    dtype: str | None = field(default="float32", metadata={
        "help": "The dtype to load the model in.", "choices": ["auto", "bfloat16", "float16", "float32"]})
    attn_implementation: str | None = field(default=None, metadata={"help": "transformers' attention implementation."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Modules LoRA adapts."})
    lora_target_parameters: list[str] | None = field(default=None, metadata={"help": "Parameters LoRA adapts."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={"help": "Modules trained in full and saved."})
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "peft's task type."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA (alpha / sqrt(r))."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "8-bit loading (not supported by rlvr)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "4-bit loading of the base model (QLoRA). Works only with LoRA."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit quantization type.", "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Nested 4-bit quantization."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "4-bit storage dtype."})
    # TRL 0.x's names, which scripts written for it read (open-r1's get_model): kept beside TRL 1.16's fields
    torch_dtype: str | None = field(default=None, metadata={
        "help": "TRL 0.x's name of dtype (read back as dtype when not given).", "choices": ["auto", "bfloat16", "float16", "float32"]})
    # TRL 0.x's field, now the trainer config's (a field here would clash with it in a parser of both):
    # TrlParser copies the config's value here, for scripts that pass it to their own from_pretrained calls
    trust_remote_code: ClassVar[bool] = False

    def __post_init__(self):
        if self.torch_dtype is not None and self.torch_dtype != self.dtype:
            if self.dtype != "float32":  # TRL 1.16's default: dtype was not given
                raise ValueError(f"dtype={self.dtype!r} and torch_dtype={self.torch_dtype!r} disagree; give one of them")
            self.dtype = self.torch_dtype
        self.torch_dtype = self.dtype
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("load_in_8bit and load_in_4bit cannot both be set")
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]  # a single name may be peft's "all-linear"


@dataclass
class DatasetConfig:
    """One dataset of a mixture: the arguments of datasets.load_dataset, the columns kept, its share."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """Several datasets trained on as one (a recipe's `datasets:` list)."""

    datasets: list[DatasetConfig] = field(default_factory=list, metadata={"help": "The datasets of the mixture."})
    streaming: bool = field(default=False, metadata={"help": "Stream the datasets."})
    test_split_size: float | None = field(default=None, metadata={"help": "Share (or count) of rows held out as `test`."})

    def __post_init__(self):
        self.datasets = [DatasetConfig(**d) if isinstance(d, dict) else d for d in self.datasets]


def get_dataset(mixture: DatasetMixtureConfig):
    """The mixture as a DatasetDict: `train`, and `test` when test_split_size is set.  With fractions
    (all or none), each dataset's first rows in those shares, as many as no dataset runs out."""
    import datasets

    parts = []
    for d in mixture.datasets:
        part = datasets.load_dataset(path=d.path, name=d.name, data_dir=d.data_dir, data_files=d.data_files, split=d.split,
                                     streaming=mixture.streaming)
        parts.append(part.select_columns(d.columns) if d.columns is not None else part)
    if not parts:
        raise ValueError("get_dataset: the mixture has no datasets")
    fractions = [d.fraction for d in mixture.datasets]
    if any(f is not None for f in fractions):
        if None in fractions or mixture.streaming:
            raise ValueError("fraction must be set for every dataset of the mixture or none, and not with streaming")
        shares = [f / sum(fractions) for f in fractions]
        total = min(len(p) / s for p, s in zip(parts, shares) if s > 0)
        parts = [p.select(range(round(s * total))) for p, s in zip(parts, shares)]
    combined = parts[0] if len(parts) == 1 else (datasets.interleave_datasets(parts) if mixture.streaming
                                                  else datasets.concatenate_datasets(parts))
    if mixture.test_split_size is not None:
        return combined.train_test_split(test_size=mixture.test_split_size)
    return datasets.DatasetDict({"train": combined}) if not mixture.streaming else datasets.IterableDatasetDict({"train": combined})


def get_peft_config(model_args: ModelConfig):
    """peft's LoraConfig for ModelConfig's lora_* fields, or None without use_peft."""
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    extra = {"target_parameters": model_args.lora_target_parameters} if model_args.lora_target_parameters is not None else {}
    return LoraConfig(task_type=model_args.lora_task_type, r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                      lora_dropout=model_args.lora_dropout, target_modules=model_args.lora_target_modules, bias="none",
                      use_rslora=model_args.use_rslora, use_dora=model_args.use_dora,
                      modules_to_save=model_args.lora_modules_to_save, **extra)


def _refuse_8bit(model_args: Any) -> None:
    if getattr(model_args, "load_in_8bit", False):
        raise ConfigError(f"load_in_8bit=True: {UNSUPPORTED['load_in_8bit'][1]}")


def get_quantization_config(model_args: ModelConfig):
    """transformers' BitsAndBytesConfig for load_in_4bit, as TRL's (computing in the model's dtype), which
    the trainers take as quantization_config; None without it.  8-bit loading is refused with the reason."""
    _refuse_8bit(model_args)
    if not model_args.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=model_args.dtype,
                              bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
                              bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage)


def get_kbit_device_map(model_args: ModelConfig | None = None) -> None:
    """None: rlvr places the model itself (a 4-bit one on the device it trains on).  8-bit loading is refused."""
    _refuse_8bit(model_args)
    return None


def init_zero_verbose() -> None:
    """TRL's quiet logging for its command line: errors only."""
    import logging

    logging.basicConfig(format="%(message)s", level=logging.ERROR)


def _hints(cls) -> list[tuple]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _or_none(read):
    """A command-line reader that also takes "none" or "null" (any case) as None."""

    def parse(text: str):
        return None if text.lower() in ("none", "null") else read(text)

    parse.__name__ = read.__name__  # argparse names the type in its error messages
    return parse


class TrlParser(HfArgumentParser):
    """transformers' HfArgumentParser over the script's dataclasses, which also reads `--config
    recipe.yaml`: the recipe's keys are the defaults, the command line overrides them, and its
    `env:` mapping is set in the environment first."""

    def __init__(self, dataclass_types=None, **kwargs):
        types = [] if dataclass_types is None else list(dataclass_types) if isinstance(dataclass_types, Iterable) else [dataclass_types]
        for t in types:
            if "config" in t.__dataclass_fields__:
                raise ValueError(f"{t.__name__} has a field named 'config', which TrlParser keeps for --config <recipe.yaml>")
        super().__init__(dataclass_types=types, **kwargs)
        optional = {f.name for t in types for f, hint in _hints(t) if type(None) in typing.get_args(hint)}
        for action in self._actions:  # as TRL's parser: `--max_length none` unsets a number that may be None
            if action.type in (int, float) and action.dest in optional:
                action.type = _or_none(action.type)

    def parse_args_and_config(self, args: Iterable[str] | None = None, return_remaining_strings: bool = False,
                              fail_with_unknown_args: bool = True, separate_remaining_strings: bool = False):
        """The dataclasses from the recipe (--config) and the command line; with return_remaining_strings,
        the strings neither used (the recipe's and the command line's, or both lists with separate_remaining_strings).

        A key that no dataclass has but the script's GRPOConfig, SFTConfig or DPOConfig takes as a setting
        (rlvr's own, such as max_prompt_length, or an older TRL's that recipes carry, such as warmup_ratio)
        is set on that config after parsing: open-r1's recipes, written for TRL 0.18, run as they are."""
        args = list(sys.argv[1:] if args is None else args)
        recipe: dict[str, Any] = {}
        if "--config" in args:
            at = args.index("--config")
            if at + 1 >= len(args):
                raise ValueError("--config needs the path of a YAML recipe")
            path = args[at + 1]
            del args[at: at + 2]
            recipe = self._unused(self._read_recipe(path))
        *parsed, rest = self.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
        config = next((p for p in parsed if isinstance(p, _TrlConfig)), None)
        if config is not None:  # the recipe's first, so that the command line overrides it
            recipe = self._give(config, recipe)
            rest = self._give_strings(config, rest)
            for model in (p for p in parsed if isinstance(p, ModelConfig)):
                model.trust_remote_code = config.trust_remote_code
        from_recipe = [s for key, value in recipe.items() for s in (f"--{key}", str(value))]
        if return_remaining_strings:
            return (*parsed, *((from_recipe, rest) if separate_remaining_strings else (from_recipe + rest,)))
        if fail_with_unknown_args and (from_recipe or rest):
            where = f"the recipe has keys no dataclass of this script takes: {list(recipe)}" if recipe else \
                f"arguments no dataclass of this script takes: {rest}"
            raise ValueError(f"{where}; remove them, or parse with fail_with_unknown_args=False")
        return tuple(parsed)

    @staticmethod
    def _give(config, values: dict[str, Any]) -> dict[str, Any]:
        """Set on `config` the values it takes as settings (a wrong value raises its ConfigError); the others back."""
        rest = {}
        for key, value in values.items():
            if config.takes(key):
                setattr(config, key, value)
            else:
                rest[key] = value
        return rest

    @staticmethod
    def _give_strings(config, strings: list[str]) -> list[str]:
        """The command line's `--key value...` (or `--key=value`, or a bare `--flag` for true) that `config`
        takes, set on it; the other strings back, in their order."""
        rest, at = [], 0
        while at < len(strings):
            key, eq, inline = strings[at].removeprefix("--").partition("=")
            end = at + 1
            while not eq and end < len(strings) and not strings[end].startswith("--"):
                end += 1
            if not strings[at].startswith("--") or not config.takes(key):
                rest += strings[at:end]
            else:
                words = [inline] if eq else strings[at + 1:end]
                values = [_word(w) for w in words]
                setattr(config, key, True if not values else values[0] if len(values) == 1 else values)
            at = end
        return rest

    @staticmethod
    def _read_recipe(path: str) -> dict:
        import yaml

        with open(path) as f:
            recipe = yaml.safe_load(f)
        if not isinstance(recipe, dict):
            raise ValueError(f"{path}: a recipe is a YAML mapping of settings")
        env = recipe.pop("env", {})
        if not isinstance(env, dict):
            raise ValueError(f"{path}: `env` is a mapping of environment variables")
        os.environ.update({k: str(v) for k, v in env.items()})
        return recipe

    def set_defaults_with_config(self, **values) -> list[str]:
        """Make `values` the defaults of the arguments they name (in subcommands too; a required argument
        given a value is no longer required); returns the others as ["--key", "value", ...]."""
        return [s for key, value in self._unused(values).items() for s in (f"--{key}", str(value))]

    def _unused(self, values: dict[str, Any]) -> dict[str, Any]:
        """set_defaults_with_config's work: the values that no argument takes are returned."""
        used: set[str] = set()

        def apply(parser: argparse.ArgumentParser) -> None:
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for sub in action.choices.values():
                        apply(sub)
                elif action.dest in values:
                    action.default, action.required = values[action.dest], False
                    used.add(action.dest)

        apply(self)
        return {key: value for key, value in values.items() if key not in used}


def _word(text: str) -> Any:
    """A command-line value as argparse's types would read it: a number (512, 1e-5), true / false, TRL's
    "none" for None, or else the text."""
    if text.lower() in ("none", "null"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text
