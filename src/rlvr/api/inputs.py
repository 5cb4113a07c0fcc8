"""What TRL's trainers are given as objects, as rlvr has them: a model as a name, a peft LoraConfig
as lora_* settings, tools / rollout_func / environment_factory as registered names, datasets as
Examples or rows; and RunObjects, what the run (run.py) takes as objects rather than settings."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from rlvr.config import Config, ConfigError


@dataclass
class RunObjects:
    """What the Python API gives the run as objects rather than names in the Config (run.py).
    After the run, `model` and `tokenizer` are the trained ones."""

    model: Any = None
    tokenizer: Any = None
    train_examples: list | None = None
    test_examples: list | None = None
    callbacks: Any = None  # events.TrainerEvents: the trainer's callbacks, state and control
    train_rows: list | None = None  # sft / dpo: the train_dataset's rows (finetune/data.py reads them)
    teacher: Any = None  # distill: a teacher given as a loaded model


def model_name(model) -> str:
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or "model"
    return str(name).rstrip("/").split("/")[-1]


def lora_settings(peft_config) -> dict:
    """A peft LoraConfig as rlvr settings, used exactly as given: every option, peft's own defaults
    for what it leaves unset (lora.as_settings)."""
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(f"peft_config: only a LoraConfig is supported, got {type(peft_config).__name__}")
    from rlvr.lora import as_settings

    return as_settings(peft_config)


def quantization_settings(config, dtype: str) -> dict:
    """transformers' BitsAndBytesConfig (TRL's get_quantization_config) as rlvr settings: load_in_4bit and
    its bnb_4bit_* knobs.  Its compute dtype must be `dtype`, the weights' dtype setting, which rlvr
    computes the 4-bit layers in (as TRL's get_quantization_config sets it)."""
    if type(config).__name__ != "BitsAndBytesConfig":
        raise ConfigError(f"quantization_config: only a transformers BitsAndBytesConfig is supported, got {type(config).__name__}")
    if config.load_in_8bit:
        raise ConfigError("quantization_config with load_in_8bit: 8-bit loading (LLM.int8) is not supported; QLoRA is "
                          "BitsAndBytesConfig(load_in_4bit=True) with a peft_config")
    if not config.load_in_4bit:
        return {}
    compute = str(config.bnb_4bit_compute_dtype).removeprefix("torch.")
    if compute != dtype:
        raise ConfigError(f"quantization_config computes in {compute} but dtype={dtype}: rlvr computes the 4-bit layers in "
                          f"the weights' dtype; make them agree (BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.{dtype}), "
                          f"or dtype={compute} if it is float32 or bfloat16)")
    storage = str(config.bnb_4bit_quant_storage).removeprefix("torch.")
    return {"load_in_4bit": True, "bnb_4bit_quant_type": config.bnb_4bit_quant_type,
            "use_bnb_nested_quant": bool(config.bnb_4bit_use_double_quant),
            "bnb_4bit_quant_storage": None if storage == "uint8" else storage}


def multiturn_settings(tools, rollout_func, environment_factory) -> dict:
    """tools (functions or names), rollout_func and environment_factory given as objects, as the
    names the Config holds (the objects are registered where those names resolve)."""
    from rlvr.environments import register_environment
    from rlvr.rollout.custom import register_rollout_func
    from rlvr.tools import register_tool

    out = {}
    if tools:
        out["tools"] = [t if isinstance(t, str) else register_tool(t) for t in tools]
    if rollout_func is not None:
        out["rollout_func"] = rollout_func if isinstance(rollout_func, str) else register_rollout_func(rollout_func)
    def name(factory):
        return factory if isinstance(factory, str) else register_environment(factory)

    if isinstance(environment_factory, dict):  # TRL's several: each row's `environment` column picks one
        if not environment_factory or not all(isinstance(k, str) and k for k in environment_factory):
            raise ConfigError("environment_factory as a dict maps names (the values of the rows' `environment` column) "
                              f"to factories; got {list(environment_factory)!r}")
        out["environment"] = {key: name(factory) for key, factory in environment_factory.items()}
    elif environment_factory is not None:
        out["environment"] = name(environment_factory)
    return out


def environment_rewards(environment_factory) -> list:
    """TRL's reward source per environment class with get_reward() (environments.EnvironmentReward), in order."""
    from rlvr.environments import EnvironmentReward, reward_sources

    if environment_factory is None or isinstance(environment_factory, str):
        return []
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    try:
        return [EnvironmentReward(cls) for cls in reward_sources([f for f in factories if not isinstance(f, str)])]
    except Exception as e:  # noqa: BLE001 - a factory called to see what it makes
        raise ConfigError(f"environment_factory: making one environment to read its methods raised {type(e).__name__}: {e}") from None


PLACEHOLDER = [{"role": "user", "content": ""}]  # TRL's prompt of a row that has none: the environment's reset writes it


def environment_rows(environment_factory, cfg: Config) -> list[dict]:
    """TRL's train_dataset when only the environment has the tasks (its reset writes each prompt): rows of an
    empty prompt, one step's worth, cycled for max_steps steps."""
    if environment_factory is None:
        raise ConfigError("GRPOTrainer needs a train_dataset (a datasets.Dataset, an IterableDataset or a list of rows), "
                          "unless an environment_factory writes the prompts (its reset returning each task)")
    if isinstance(environment_factory, dict):
        raise ConfigError("environment_factory as a dict of several environments needs a train_dataset with an "
                          "`environment` column naming each row's (as TRL); give a dataset, or one environment factory")
    if cfg.max_steps <= 0:
        raise ConfigError("without a train_dataset (the environment's reset writes each prompt) set max_steps to a positive "
                          "number of steps (as TRL requires): it is the run's length")
    return [{"prompt": PLACEHOLDER} for _ in range(cfg.prompts_per_step)]


def given_objects(cfg: Config) -> list[tuple[dict, str, Any]]:
    """(registry, name, object) for each name of cfg that resolves to an object given to GRPOTrainer.
    Registries are by name, shared by the process's trainers, and a trainer given another object of
    the same name takes the name over; each trainer puts its own back (put_back) before it trains or
    evaluates, so it resolves exactly what it was given, under TRL's names."""
    from rlvr import environments, rewards, tools
    from rlvr.rollout import custom

    named = [(rewards.GIVEN, cfg.reward_funcs or ()), (tools.GIVEN, cfg.tools or ()),
             (environments.GIVEN, environments.environment_specs(cfg.environment).values()), (custom.GIVEN, (cfg.rollout_func,))]
    return [(registry, name, registry[name]) for registry, names in named for name in names if name in registry]


def put_back(given: list[tuple[dict, str, Any]]) -> None:
    for registry, name, obj in given:
        registry[name] = obj


def examples(dataset, cfg: Config, what: str) -> list:
    """A datasets.Dataset / IterableDataset / list of rows as Examples: the prompt column, the
    answer column (copied into `answer`) and every other column for the reward functions."""
    from rlvr.tasks.dataset import DatasetError, examples_from_rows

    if isinstance(dataset, dict):  # a DatasetDict
        raise DatasetError(f"{what}: a dict of several datasets is not supported; give one split, e.g. dataset['train']")
    if hasattr(dataset, "num_rows") or isinstance(dataset, list):
        rows = list(dataset)
    elif hasattr(dataset, "__iter__"):  # an IterableDataset: as many rows as training can use
        if cfg.max_steps < 1:
            raise DatasetError(f"{what} is an IterableDataset, which has no length: set max_steps (as TRL requires)")
        need = cfg.max_steps * cfg.prompts_per_step if what == "train_dataset" else cfg.eval_max_examples or None
        rows = list(itertools.islice(dataset, need))
    else:
        raise DatasetError(f"{what} must be a datasets.Dataset, an IterableDataset or a list of rows, got {type(dataset).__name__}")
    if not rows:
        raise DatasetError(f"{what} has no rows")
    if cfg.environment and not cfg.prompt_column and all(isinstance(r, dict) and "prompt" not in r for r in rows):
        rows = [{"prompt": PLACEHOLDER, **r} for r in rows]  # TRL: the environment's reset writes the prompt
    if isinstance(cfg.environment, dict):
        _check_routes(rows, cfg.environment, what)
    return examples_from_rows(rows, cfg.prompt_column, cfg.answer_column, what)


def _check_routes(rows: list, environments: dict, what: str) -> None:
    """Each row names one of the environments given, in its `environment` column."""
    from rlvr.tasks.dataset import DatasetError

    for i, row in enumerate(rows):
        key = row.get("environment") if isinstance(row, dict) else None
        if key not in environments:
            raise DatasetError(f"{what} row {i}: its environment column is {key!r}; with environment_factory as a dict, "
                               f"each row names one of its environments ({', '.join(environments)})")


def rows(dataset, what: str) -> list:
    """A datasets.Dataset or list of rows, as the rows SFT and DPO read (finetune/data.py)."""
    if isinstance(dataset, dict):
        raise ConfigError(f"{what}: a dict of several datasets is not supported; give one split, e.g. dataset['train']")
    out = list(dataset)
    if not out or not all(isinstance(r, dict) for r in out):
        raise ConfigError(f"{what} must be a non-empty datasets.Dataset or list of rows (mappings of columns)")
    return out


def eval_examples(dataset, cfg: Config) -> list:
    """SFT's / DPO's evaluation prompts with their reference answers, read the way training reads its rows."""
    from rlvr.finetune.data import load_data

    _, out, _ = load_data(cfg.data_settings, cfg.finetune_settings, cfg.seed, cfg.method, rows(dataset, "eval_dataset"))
    return out
