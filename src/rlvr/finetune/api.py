"""TRL's SFTConfig / SFTTrainer and DPOConfig / DPOTrainer on rlvr, as api.py does for GRPO:

    from rlvr import SFTConfig, SFTTrainer            # instead of: from trl import ...
    trainer = SFTTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", train_dataset=dataset,
                         args=SFTConfig(output_dir="sft", max_length=1024, packing=True))
    trainer.train()

    trainer = DPOTrainer(model="sft", train_dataset=pairs, args=DPOConfig(output_dir="dpo", beta=0.1))

The settings are rlvr's Config under TRL's names; where SFT or DPO gives a name another
meaning (DPO's `beta` and `loss_type`) or another default (SFT's learning rate), the
method's own applies (`method_settings`).  The run is rlvr's (run.py) with method=sft or dpo.
"""

from __future__ import annotations

from typing import Any

from rlvr.api import GRPOConfig, GRPOTrainer, RunObjects, TrainerControl, TrainerState, _lora_settings, _model_name
from rlvr.config import ConfigError, build_config
from rlvr.losses import LOSS_TYPES

RENAMES = {"dpo": {"beta": "dpo_beta", "loss_type": "dpo_loss_type"}}  # DPOConfig's names for rlvr's settings
DEFAULTS = {"sft": {"learning_rate": 2e-5}, "dpo": {"learning_rate": 1e-6}}  # TRL's SFTConfig / DPOConfig defaults


def method_settings(method: str, values: dict) -> dict:
    """`values` under rlvr's names for `method`; given {}, the method's defaults (and method itself)."""
    if not values:
        return {"method": method, **DEFAULTS.get(method, {})}
    renames = RENAMES.get(method, {})
    if method == "dpo" and values.get("loss_type") in LOSS_TYPES:  # a GRPO recipe's loss_type (the demo's grpo) is GRPO's
        renames = {k: v for k, v in renames.items() if k != "loss_type"}
    return {renames.get(k, k): v for k, v in values.items()}


class _MethodConfig(GRPOConfig):
    method = "grpo"

    def _resolve(self) -> None:
        ignored: list[str] = []
        settings = method_settings(self.method, self._settings)
        object.__setattr__(self, "_config", build_config(method_settings(self.method, {}), settings, ignored=ignored))
        object.__setattr__(self, "_ignored", ignored)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return super().__getattr__(RENAMES.get(self.method, {}).get(name, name))


class SFTConfig(_MethodConfig):
    """TRL's SFTConfig: max_length, packing, completion_only_loss, and every shared setting."""

    method = "sft"


class DPOConfig(_MethodConfig):
    """TRL's DPOConfig: beta, loss_type (sigmoid, ipo, hinge), label_smoothing, max_length, ..."""

    method = "dpo"


class _MethodTrainer(GRPOTrainer):
    config_class = SFTConfig
    suffix = "SFT"

    def __init__(self, model, args=None, train_dataset=None, eval_dataset=None, processing_class=None, callbacks=None,
                 peft_config=None, **unsupported):
        given = sorted(k for k, v in unsupported.items() if v is not None and k != "optimizers" or
                       k == "optimizers" and any(o is not None for o in v))
        if given:
            raise ConfigError(f"{type(self).__name__}({', '.join(given)}=...) is not supported: rlvr builds the data, "
                              "the collator, the loss and AdamW from the settings of its config")
        if train_dataset is None:
            raise ConfigError(f"{type(self).__name__} needs a train_dataset (a datasets.Dataset or a list of rows)")
        name = f"{_model_name(model)}-{self.suffix}"
        settings = dict(args._settings) if args is not None else {}
        settings.setdefault("output_dir", name)
        self.model = model if not isinstance(model, str) else None
        settings["model"] = model if isinstance(model, str) else getattr(model, "name_or_path", None) or "<model object>"
        if peft_config is not None:
            settings.update(_lora_settings(peft_config))
        settings["dataset"] = "<train_dataset>"
        settings.setdefault("text_prompts", "raw")  # as GRPOTrainer: a plain-text prompt is the model's input as it is
        if eval_dataset is None:
            settings.update(eval_on_start=False, eval_on_end=False, eval_strategy="no")
        self.args = self.config_class(**settings)
        self.cfg = self.args._config
        self._settings = {**method_settings(self.cfg.method, {}), **method_settings(self.cfg.method, settings)}
        self._given = []  # no objects by name: the data is rows, the rewards the verifier
        self.processing_class = processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.train_rows = _rows(train_dataset, "train_dataset")
        self.train_examples = None
        self.test_examples = _eval_examples(eval_dataset, self.cfg) if eval_dataset is not None else []
        self.state = TrainerState(max_steps=self.cfg.max_steps)
        self.control = TrainerControl()
        from rlvr.api import Callbacks

        self.callbacks = Callbacks(list(callbacks or []), self)
        self._objects = None

    def _run_objects(self) -> RunObjects:
        return RunObjects(self.model, self.processing_class, None, self.test_examples, self.callbacks, train_rows=self.train_rows)

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        if eval_dataset is not None:
            self.test_examples = _eval_examples(eval_dataset, self.cfg)
        return super().evaluate(None, metric_key_prefix)


class SFTTrainer(_MethodTrainer):
    """TRL's SFTTrainer(model, args=SFTConfig(...), train_dataset=..., eval_dataset=..., processing_class=...,
    peft_config=...): prompt/completion rows (or chat `messages`); with self_samples=true, rejection
    sampling on the train prompts."""

    config_class, suffix = SFTConfig, "SFT"


class DPOTrainer(_MethodTrainer):
    """TRL's DPOTrainer(model, ref_model=None, args=DPOConfig(...), train_dataset=...): prompt / chosen /
    rejected rows; the reference is a frozen copy of the starting model (with LoRA: the adapter off)."""

    config_class, suffix = DPOConfig, "DPO"

    def __init__(self, model, ref_model=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 callbacks=None, peft_config=None, **unsupported):
        if ref_model is not None:
            raise ConfigError("DPOTrainer(ref_model=...) is not supported: the reference is a frozen copy of `model` as "
                              "it starts (with peft_config: the model with its adapter off), which is TRL's default too")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks, peft_config, **unsupported)


def _rows(dataset, what: str) -> list:
    if isinstance(dataset, dict):
        raise ConfigError(f"{what}: a dict of several datasets is not supported; give one split, e.g. dataset['train']")
    rows = list(dataset)
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{what} must be a non-empty datasets.Dataset or list of rows (mappings of columns)")
    return rows


def _eval_examples(dataset, cfg) -> list:
    """Evaluation prompts with their reference answers, read the way training reads its rows."""
    from rlvr.finetune.data import load_data

    _, examples, _ = load_data(cfg, "sft" if cfg.self_samples or cfg.method == "sft" else cfg.method, _rows(dataset, "eval_dataset"))
    return examples


__all__ = ["SFTConfig", "SFTTrainer", "DPOConfig", "DPOTrainer", "method_settings"]
