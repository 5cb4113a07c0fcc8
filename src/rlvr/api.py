"""TRL's Python API on rlvr: a script that did `from trl import GRPOConfig, GRPOTrainer` runs
with `from rlvr import GRPOConfig, GRPOTrainer` instead, and trains with rlvr.

    args = GRPOConfig(output_dir="my-run", learning_rate=1e-5, max_steps=100)
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[my_reward, "accuracy"],
                          args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model("my-run/final")

GRPOConfig takes every TRL setting by its TRL name (trl_settings.py says what each does here)
and checks them when it is made.  GRPOTrainer takes what TRL's takes: the model as a name, a
path or a loaded model; reward functions as functions, callable objects, built-in names or
`module:function` paths; datasets as `datasets.Dataset` / `IterableDataset` (or lists of rows);
a tokenizer; a peft LoraConfig; TrainerCallback-like callbacks.  The run itself is rlvr's
(run.py), with its run directory, checkpoints, metrics and report.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlvr.config import Config, ConfigError, build_config, hide_secret
from rlvr.trl_settings import IGNORED, UNSUPPORTED, ignored_line


class GRPOConfig:
    """TRL's GRPOConfig: `GRPOConfig(output_dir=..., **settings)`, attributes read and set by TRL's
    names, `to_dict()`.  Every setting is checked when it is made or set (a ConfigError says what to fix)."""

    def __init__(self, output_dir: str | None = None, **settings: Any):
        given = {"output_dir": output_dir} if output_dir is not None else {}
        object.__setattr__(self, "_settings", {**given, **settings})
        self._resolve()

    def _resolve(self) -> None:
        ignored: list[str] = []
        object.__setattr__(self, "_config", build_config(self._settings, ignored=ignored))
        object.__setattr__(self, "_ignored", ignored)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if hasattr(self._config, name):
            return getattr(self._config, name)
        if name in self._settings:
            return self._settings[name]
        if name in IGNORED or name in UNSUPPORTED:
            return None  # a TRL setting without effect here, not given
        raise AttributeError(f"GRPOConfig has no setting {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        settings = {**self._settings, name: value}
        previous = self._settings
        object.__setattr__(self, "_settings", settings)
        try:
            self._resolve()
        except ConfigError:
            object.__setattr__(self, "_settings", previous)
            raise

    def to_dict(self) -> dict[str, Any]:
        """Every setting, a token as "<HUB_TOKEN>" as in TRL (the attribute holds the token itself)."""
        return self._config.to_dict()

    def __repr__(self) -> str:
        shown = (f"{k}={hide_secret(k, v)!r}" for k, v in self._settings.items())
        return f"{type(self).__name__}({', '.join(shown)})"


@dataclass
class TrainerState:
    """TRL's (transformers') TrainerState, the parts a script reads."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict] = field(default_factory=list)
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    """Set `should_training_stop` in a callback to end training after this step (it is saved)."""

    should_training_stop: bool = False
    should_save: bool = False
    should_log: bool = False
    should_evaluate: bool = False


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict


@dataclass
class RunObjects:
    """What the Python API gives the run as objects rather than names in the Config (run.py).
    After the run, `model` and `tokenizer` are the trained ones."""

    model: Any = None
    tokenizer: Any = None
    train_examples: list | None = None
    test_examples: list | None = None
    callbacks: "Callbacks | None" = None
    train_rows: list | None = None  # sft / dpo: the train_dataset's rows (finetune/data.py reads them)


def _multiturn_settings(tools, rollout_func, environment_factory) -> dict:
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
    if environment_factory is not None:
        out["environment"] = (environment_factory if isinstance(environment_factory, str)
                              else register_environment(environment_factory))
    return out


def _given_objects(cfg: Config) -> list[tuple[dict, str, Any]]:
    """(registry, name, object) for each name of cfg that resolves to an object given to GRPOTrainer.
    Registries are by name, shared by the process's trainers, and a trainer given another object of
    the same name takes the name over; each trainer puts its own back (_put_back) before it trains or
    evaluates, so it resolves exactly what it was given, under TRL's names."""
    from rlvr import environments, rewards, tools
    from rlvr.rollout import custom

    named = [(rewards.GIVEN, cfg.reward_funcs or ()), (tools.GIVEN, cfg.tools or ()),
             (environments.GIVEN, (cfg.environment,)), (custom.GIVEN, (cfg.rollout_func,))]
    return [(registry, name, registry[name]) for registry, names in named for name in names if name in registry]


def _put_back(given: list[tuple[dict, str, Any]]) -> None:
    for registry, name, obj in given:
        registry[name] = obj


class GRPOTrainer:
    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        for name, value in (("reward_processing_classes", reward_processing_classes), ("quantization_config", quantization_config)):
            if value is not None:
                raise ConfigError(f"GRPOTrainer({name}=...) is not supported yet")
        if any(o is not None for o in optimizers):
            raise ConfigError("GRPOTrainer(optimizers=...) is not supported: rlvr builds AdamW from the optim, learning_rate "
                              "and adam_* settings of GRPOConfig (and restores it exactly on resume)")
        if train_dataset is None:
            raise ConfigError("GRPOTrainer needs a train_dataset (a datasets.Dataset, an IterableDataset or a list of rows)")
        settings = dict(args._settings) if args is not None else {"output_dir": f"{_model_name(model)}-GRPO"}
        settings.setdefault("output_dir", f"{_model_name(model)}-GRPO")
        self.model = model if not isinstance(model, str) else None
        settings["model"] = model if isinstance(model, str) else getattr(model, "name_or_path", None) or "<model object>"
        if peft_config is not None:
            settings.update(_lora_settings(peft_config))
        from rlvr.rewards import register_reward

        if reward_funcs is None:
            raise ConfigError("GRPOTrainer needs reward_funcs: functions, callable objects, built-in names or module:function paths")
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        names: list[str] = []
        for f in funcs:
            names.append(f if isinstance(f, str) else register_reward(f, taken=set(names)))
        settings["reward_funcs"] = names
        settings.update(_multiturn_settings(tools, rollout_func, environment_factory))
        settings["dataset"] = "<train_dataset>"  # given as an object: the verifier is `accuracy`, as for any dataset
        settings.setdefault("text_prompts", "raw")  # TRL: a plain-text prompt is the model's input as it is
        if eval_dataset is None:  # as TRL: no evaluation without an eval_dataset
            settings.update(eval_on_start=False, eval_on_end=False, eval_strategy="no")
        if self.model is not None and settings.get("rollout_workers"):
            raise ConfigError("rollout_workers need the model by name or path, not a loaded model object")
        if settings.get("rollout_workers") and any(not isinstance(f, str) for f in funcs):
            raise ConfigError("rollout_workers need reward functions by name or module:function path "
                              "(the workers import them); functions given as objects run in this process only")
        self.args = GRPOConfig(**settings)
        self.cfg: Config = self.args._config
        self._settings = settings
        self._given = _given_objects(self.cfg)
        self.processing_class = processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.train_examples = _examples(train_dataset, self.cfg, "train_dataset")
        self.test_examples = _examples(eval_dataset, self.cfg, "eval_dataset") if eval_dataset is not None else []
        self.state = TrainerState(max_steps=self.cfg.max_steps)
        self.control = TrainerControl()
        self.callbacks = Callbacks(list(callbacks or []), self)
        self._objects = None

    # --- TRL's methods ------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **_unused) -> TrainOutput:
        """Train as configured (run.py); `resume_from_checkpoint` True continues from the newest
        checkpoint of output_dir, a path from that checkpoint."""
        from rlvr.run import train

        _put_back(self._given)
        cfg = self.cfg
        if resume_from_checkpoint:
            at = {} if resume_from_checkpoint is True else {"resume_checkpoint": str(resume_from_checkpoint)}
            cfg = build_config(self._settings, {"resume": True, **at})
        if self.args._ignored:
            print(ignored_line(self.args._ignored))
        objects = self._run_objects()
        summary = train(cfg, objects=objects)
        self._objects, self.model, self.processing_class = objects, objects.model, objects.tokenizer
        self.output_dir = Path(summary["output_dir"])
        self.state.log_history = _log_history(self.output_dir)
        self.state.global_step = summary["steps"]
        losses = [row["loss"] for row in self.state.log_history if "loss" in row]
        return TrainOutput(summary["steps"], sum(losses) / len(losses) if losses else 0.0, summary)

    def _run_objects(self) -> RunObjects:
        return RunObjects(self.model, self.processing_class, self.train_examples, self.test_examples, self.callbacks)

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model (with LoRA: as lora_save says) and its tokenizer in `output_dir`
        (default: the run's directory, where the run has already put it)."""
        from rlvr.rundir import save_final_model

        if self._objects is None:
            raise RuntimeError("save_model() before train(): there is no trained model yet")
        target = Path(output_dir or self.output_dir)
        target.mkdir(parents=True, exist_ok=True)
        save_final_model(self.model, self.processing_class, target, self.cfg.lora_save)

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Held-out accuracy (and pass@k etc., as configured) of the current model on the eval
        dataset, with the same verifier as training: {"eval_accuracy": ..., ...}."""
        from rlvr.evaluate import evaluate_model
        from rlvr.models import load_model, pick_device

        _put_back(self._given)
        examples = _examples(eval_dataset, self.cfg, "eval_dataset") if eval_dataset is not None else self.test_examples
        if not examples:
            raise ValueError("evaluate() needs an eval_dataset (given to GRPOTrainer or to evaluate)")
        model, tokenizer = self.model, self.processing_class
        if model is None:  # not trained yet, given by name
            model, tokenizer, _ = load_model(self.cfg.model, self.cfg.dtype, pick_device(self.cfg.use_cpu),
                                             self.cfg.model_init_kwargs, self.cfg.trust_remote_code)
            self.model, self.processing_class = model, self.processing_class or tokenizer
        result = evaluate_model(model, self.processing_class or tokenizer, examples[: self.cfg.eval_max_examples or None],
                                self.cfg, shot_pool=self.train_examples)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in result.metrics().items()}
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        self.callbacks.call("on_evaluate", metrics=metrics)
        return metrics

    def add_callback(self, callback) -> None:
        self.callbacks.callbacks.append(callback() if isinstance(callback, type) else callback)


class Callbacks:
    """transformers TrainerCallback-like objects, called with (args, state, control, **kwargs) at the
    points rlvr has: on_train_begin, on_step_end, on_log, on_save, on_evaluate, on_train_end."""

    def __init__(self, callbacks: list, trainer: GRPOTrainer):
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks]
        self.trainer = trainer

    def call(self, event: str, **kwargs) -> None:
        t = self.trainer
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is not None:
                method(t.args, t.state, t.control, model=t.model, processing_class=t.processing_class, **kwargs)

    # what run.py calls
    def begin(self, step: int, total: int) -> None:
        self.trainer.state.global_step, self.trainer.state.max_steps = step, total
        self.call("on_train_begin")

    def step_end(self, step: int, epoch: float, logged: dict | None) -> bool:
        """After each step; True when a callback asked training to stop."""
        state = self.trainer.state
        state.global_step, state.epoch = step, epoch
        if logged is not None:
            state.log_history.append(logged)
            self.call("on_log", logs=logged)
        self.call("on_step_end")
        return self.trainer.control.should_training_stop

    def saved(self, path) -> None:
        self.call("on_save", checkpoint=str(path))

    def end(self) -> None:
        self.call("on_train_end")


def _model_name(model) -> str:
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "") or "model"
    return str(name).rstrip("/").split("/")[-1]


def _lora_settings(peft_config) -> dict:
    """A peft LoraConfig as rlvr's lora_* settings."""
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(f"peft_config: only a LoraConfig is supported, got {type(peft_config).__name__}")
    targets = peft_config.target_modules
    out = {"use_peft": True, "lora_r": int(peft_config.r), "lora_alpha": int(peft_config.lora_alpha),
           "lora_dropout": float(peft_config.lora_dropout)}
    if targets and targets != "all-linear":
        out["lora_target_modules"] = sorted(targets) if not isinstance(targets, str) else [targets]
    return out


def _examples(dataset, cfg: Config, what: str) -> list:
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
    return examples_from_rows(rows, cfg.prompt_column, cfg.answer_column, what)


def _log_history(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["GRPOConfig", "GRPOTrainer", "TrainOutput", "TrainerState", "TrainerControl"]
