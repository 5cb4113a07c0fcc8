"""TRL's GRPOTrainer, SFTTrainer and DPOTrainer: one construction (GRPOTrainer's), each method
adding what its TRL trainer takes besides (GRPO: reward functions, tools, rollout_func,
environment_factory; DPO: no ref_model), then the run itself is rlvr's (run.py), with its run
directory, checkpoints, metrics and report.  What a script calls besides (log_metrics, save_state,
push_to_hub, accelerator, ...) is outputs.py's."""

from __future__ import annotations

from pathlib import Path

from rlvr import methods
from rlvr.api import inputs
from rlvr.api.outputs import ScriptMethods
from rlvr.api.configs import AsyncGRPOConfig, DistillationConfig, DPOConfig, GRPOConfig, SFTConfig
from rlvr.config import Config, ConfigError, ModelSettings, RewardSettings, build_config
from rlvr.events import TrainerEvents
from rlvr.trl_settings import ignored_line

__all__ = ["GRPOTrainer", "AsyncGRPOTrainer", "SFTTrainer", "DPOTrainer", "DistillationTrainer"]


def _is_model(f) -> bool:
    """A loaded model given as a reward function (TRL: a PreTrainedModel, or any torch Module)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(f, torch.nn.Module)


def _given_as_objects(reward_funcs: list, tools, rollout_func, environment_factory) -> list[str]:
    """Which of GRPOTrainer's arguments hold objects rather than names (built-in names or module:name paths)."""
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    given = [("reward_funcs", reward_funcs), ("tools", tools or ()), ("rollout_func", [rollout_func]),
             ("environment_factory", factories)]
    return [what for what, values in given if any(v is not None and not isinstance(v, str) for v in values)]


class GRPOTrainer(ScriptMethods):
    config_class: type[GRPOConfig] = GRPOConfig
    suffix = "GRPO"  # of the default output_dir: <model name>-GRPO

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        if any(o is not None for o in optimizers):
            raise ConfigError("GRPOTrainer(optimizers=...) is not supported: rlvr builds AdamW from the optim, learning_rate "
                              "and adam_* settings of GRPOConfig (and restores it exactly on resume)")
        settings = self._model_settings(model, args, peft_config, quantization_config)
        if train_dataset is None:  # only where the environment writes the prompts (TRL)
            train_dataset = inputs.environment_rows(environment_factory, (args or self.config_class())._config)
        owned = inputs.environment_rewards(environment_factory)  # TRL: get_reward() is a reward source, at weight 1
        funcs = self._reward_settings(settings, reward_funcs, reward_processing_classes, owned)
        settings.update(inputs.multiturn_settings(tools, rollout_func, environment_factory))
        self._data_settings(settings, eval_dataset)
        if self.model is not None and settings.get("rollout_workers"):
            raise ConfigError("rollout_workers need the model by name or path, not a loaded model object")
        objects = _given_as_objects(funcs[: len(funcs) - len(owned)], tools, rollout_func, environment_factory)
        if settings.get("rollout_workers") and objects:
            raise ConfigError(f"rollout_workers need {', '.join(objects)} by name or package.module:name path (the "
                              "workers import them); objects given run in this process only")
        self._setup(settings, processing_class, train_dataset, eval_dataset, callbacks)

    # --- the construction every method's trainer shares ----------------------------------------

    def _model_settings(self, model, args: GRPOConfig | None, peft_config, quantization_config=None) -> dict:
        """The settings of `args`, with the model (a name, a path or a loaded model), its LoRA and its
        quantization (QLoRA; for a model given by name, as TRL)."""
        settings = dict(args._settings) if args is not None else {}
        settings.setdefault("output_dir", f"{inputs.model_name(model)}-{self.suffix}")
        self.model = model if not isinstance(model, str) else None
        settings["model"] = model if isinstance(model, str) else getattr(model, "name_or_path", None) or "<model object>"
        if peft_config is not None:
            settings.update(inputs.lora_settings(peft_config))
        if quantization_config is not None and isinstance(model, str):  # TRL ignores it for a loaded model, as here
            settings.update(inputs.quantization_settings(quantization_config, settings.get("dtype", ModelSettings.dtype)))
        return settings

    @staticmethod
    def _data_settings(settings: dict, eval_dataset) -> None:
        settings["dataset"] = "<train_dataset>"  # given as an object: the verifier is `accuracy`, as for any dataset
        settings.setdefault("text_prompts", "raw")  # TRL: a plain-text prompt is the model's input as it is
        if eval_dataset is None:  # as TRL: no evaluation without an eval_dataset
            settings.update(eval_on_start=False, eval_on_end=False, eval_strategy="no")

    def _setup(self, settings: dict, processing_class, train_dataset, eval_dataset, callbacks) -> None:
        self.args = self.config_class(**settings)
        self.cfg: Config = self.args._config
        method = methods.get(self.args._method)
        self._settings = {**method.settings({}), **method.settings(settings)}  # under rlvr's names
        self._given = self._objects_given()
        self.processing_class = processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self._read_data(train_dataset, eval_dataset)
        self.callbacks = TrainerEvents(list(callbacks or []), args=self.args)  # with transformers' TrainerState and TrainerControl
        self.callbacks.bind(self.model, processing_class, None, None)  # a model given by name is loaded by train()
        self._objects = None
        self.callbacks.fire("on_init_end")

    @property
    def state(self):
        """transformers' TrainerState of the run (a new one for each train(), as in transformers)."""
        return self.callbacks.state

    @state.setter
    def state(self, state) -> None:
        self.callbacks.state = state

    @property
    def control(self):
        return self.callbacks.control

    @control.setter
    def control(self, control) -> None:
        self.callbacks.control = control

    @property
    def callback_handler(self) -> TrainerEvents:
        """transformers' name for the callbacks (`.callbacks` lists them)."""
        return self.callbacks

    # --- what GRPO takes besides ---------------------------------------------------------------

    @staticmethod
    def _reward_settings(settings: dict, reward_funcs, processing_classes=None, owned: list = ()) -> list:
        """reward_funcs (functions, callable objects, built-in names, module:function paths, reward
        models by id, path or object) as the names the Config holds; the functions as given.
        processing_classes: TRL's reward_processing_classes, the tokenizer of each reward model (None
        for the others, and where a model's own is used).  `owned`: the environments' own rewards
        (get_reward), added after them at weight 1 (reward_weights weigh reward_funcs only, as TRL's)."""
        from rlvr.rewards import register_reward
        from rlvr.rewards.model import RewardModel, is_model_reference

        if reward_funcs is None and not owned:
            raise ConfigError("GRPOTrainer needs reward_funcs: functions, callable objects, built-in names, module:function "
                              "paths or reward models (or an environment_factory whose environment has get_reward)")
        funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        classes = processing_classes if isinstance(processing_classes, (list, tuple)) else [processing_classes] * len(funcs)
        if len(classes) != len(funcs):
            raise ConfigError(f"reward_processing_classes has {len(classes)} entries but reward_funcs has {len(funcs)}; "
                              "give one per reward function (None for the functions)")
        device = settings.get("reward_model_device", RewardSettings.reward_model_device)
        batch = settings.get("reward_model_batch_size", RewardSettings.reward_model_batch_size)
        names: list[str] = []
        for f, tokenizer in zip(funcs, classes):
            if _is_model(f) or (tokenizer is not None and isinstance(f, str) and is_model_reference(f)):
                try:  # a loaded model, or one by id or path with its own tokenizer: an object the run looks up by name
                    f = RewardModel(**({"model": f} if _is_model(f) else {"name": f}), tokenizer=tokenizer,
                                    device=device, batch_size=batch)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            names.append(f if isinstance(f, str) else register_reward(f, taken=set(names)))
        names += [register_reward(f, taken=set(names)) for f in owned]
        if owned and settings.get("reward_weights") is not None:
            settings["reward_weights"] = [*settings["reward_weights"], *[1.0] * len(owned)]
        settings["reward_funcs"] = names
        return [*funcs, *owned]

    def _objects_given(self) -> list:
        return inputs.given_objects(self.cfg)

    def _read_data(self, train_dataset, eval_dataset) -> None:
        self.train_rows = None
        self.train_examples = inputs.examples(train_dataset, self.cfg, "train_dataset")
        self.test_examples = inputs.examples(eval_dataset, self.cfg, "eval_dataset") if eval_dataset is not None else []

    def _eval_set(self, eval_dataset) -> list:
        return inputs.examples(eval_dataset, self.cfg, "eval_dataset")

    # --- TRL's methods ------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **_unused):
        """Train as configured (run.py); `resume_from_checkpoint` True continues from the newest
        checkpoint of output_dir, a path from that checkpoint.  Returns transformers' TrainOutput
        (global_step, training_loss, metrics: train_runtime, train_samples_per_second,
        train_steps_per_second, total_flos, train_loss, epoch)."""
        from transformers.trainer_utils import TrainOutput

        from rlvr.run import train

        inputs.put_back(self._given)
        cfg = self.cfg
        if resume_from_checkpoint:
            at = {} if resume_from_checkpoint is True else {"resume_checkpoint": str(resume_from_checkpoint)}
            cfg = build_config(self._settings, {"resume": True, **at})
        if self.args._ignored:
            print(ignored_line(self.args._ignored))
        objects = inputs.RunObjects(self.model, self.processing_class, self.train_examples, self.test_examples, self.callbacks,
                                    train_rows=self.train_rows, teacher=getattr(self, "teacher_model", None))
        summary = train(cfg, objects=objects)
        self._objects, self.model, self.processing_class = objects, objects.model, objects.tokenizer
        self.output_dir = Path(summary["output_dir"])
        metrics = summary["train_metrics"]
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

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
        """The current model on the eval dataset: TRL's GRPO evaluation metrics (eval_reward,
        eval_reward_std, eval_rewards/<function>/mean and /std, eval_completions/..., see
        evaluate.trl_metrics) beside rlvr's held-out accuracy (eval_accuracy, eval_pass@1, ... with the
        same verifier as training), transformers' eval_runtime, eval_samples_per_second and
        eval_steps_per_second, and the epoch; logged (log_history, on_log), then on_evaluate."""
        from rlvr.loop import evaluate_model
        from rlvr.distributed import pick_device
        from rlvr.models import load_model

        inputs.put_back(self._given)
        examples = self._eval_set(eval_dataset) if eval_dataset is not None else self.test_examples
        if not examples:
            raise ValueError("evaluate() needs an eval_dataset (given to GRPOTrainer or to evaluate)")
        model, tokenizer = self.model, self.processing_class
        if model is None:  # not trained yet, given by name
            model, tokenizer, _ = load_model(self.cfg.model, self.cfg.dtype, pick_device(self.cfg.use_cpu),
                                             self.cfg.model_init_kwargs, self.cfg.trust_remote_code)
            self.model, self.processing_class = model, self.processing_class or tokenizer
        result = evaluate_model(model, self.processing_class or tokenizer, examples[: self.cfg.eval_max_examples or None],
                                self.cfg, shot_pool=self.train_examples)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in result.logged().items()}
        if self.callbacks.model is None:
            self.callbacks.model, self.callbacks.processing_class = model, self.processing_class or tokenizer
        self.callbacks.evaluated(metrics)  # adds the epoch, as transformers' evaluate() does
        return metrics


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL's AsyncGRPOTrainer(model, reward_funcs, args=AsyncGRPOConfig(...), train_dataset=..., ...): GRPO
    sampled on vLLM servers one generation ahead of the update (AsyncGRPOConfig says how), on GRPOTrainer's
    construction.  TRL's rollout_worker and weight_transfer (protocols of its own worker process) are refused:
    rlvr samples with its rollout stage, on `rlvr vllm-serve` servers or in-process (use_vllm=false)."""

    config_class = AsyncGRPOConfig
    suffix = "AsyncGRPO"

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, rollout_worker=None, weight_transfer=None, eval_dataset=None):
        for name, given in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if given is not None:
                raise ConfigError(f"AsyncGRPOTrainer({name}=...) is not supported: rlvr samples and sends the weights with "
                                  "its own rollout stage (vLLM servers: `rlvr vllm-serve`; Ray rollout workers: rollout_workers)")
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, tools=tools, environment_factory=environment_factory)


class DistillationTrainer(GRPOTrainer):
    """TRL's DistillationTrainer(model, teacher_model, args=DistillationConfig(...), train_dataset=...): on-policy
    distillation (distill.py).  The student samples completions of the dataset's prompts, the teacher (a name,
    a path or a loaded model with the student's vocabulary) scores the same tokens, and the loss is the
    divergence `beta` picks.  rlvr adds `reward_funcs` (optional): the verifier's rewards, logged, and with
    distill_reward_weight > 0 trained on too; without them a dataset's answer column is scored by `accuracy`."""

    config_class = DistillationConfig
    suffix = "Distillation"

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None, tools=None, reward_funcs=None):
        if any(o is not None for o in optimizers):
            raise ConfigError("DistillationTrainer(optimizers=...) is not supported: rlvr builds AdamW from the settings "
                              "of DistillationConfig (and restores it exactly on resume)")
        if tools is not None:
            raise ConfigError("DistillationTrainer(tools=...) is not supported yet: rlvr distill distils single-turn completions")
        if train_dataset is None:
            raise ConfigError("DistillationTrainer needs a train_dataset (a datasets.Dataset or a list of rows with a prompt)")
        settings = self._model_settings(model, args, peft_config, quantization_config)
        self.teacher_model = None if teacher_model is None or isinstance(teacher_model, str) else teacher_model
        if isinstance(teacher_model, str):
            settings["teacher_model_name_or_path"] = teacher_model
        elif teacher_model is not None:
            from rlvr.settings import TEACHER_OBJECT

            settings["teacher_model_name_or_path"] = TEACHER_OBJECT
        if reward_funcs is not None:
            self._reward_settings(settings, reward_funcs)
        self._data_settings(settings, eval_dataset)
        self._setup(settings, processing_class, train_dataset, eval_dataset, callbacks)

    def _read_data(self, train_dataset, eval_dataset) -> None:
        super()._read_data(train_dataset, eval_dataset)
        if self.cfg.lmbda < 1:  # GKD's steps on the dataset's own completions read its rows as SFTTrainer does
            self.train_rows = inputs.rows(train_dataset, "train_dataset")


class _FinetuneTrainer(GRPOTrainer):
    """SFTTrainer's and DPOTrainer's: GRPOTrainer's construction with rows of data for the method
    and no reward functions (a round of self_samples keeps what the task's verifier scores 1)."""

    def __init__(self, model, args=None, train_dataset=None, eval_dataset=None, processing_class=None, callbacks=None,
                 peft_config=None, quantization_config=None, **unsupported):
        given = sorted(k for k, v in unsupported.items() if v is not None and k != "optimizers" or
                       k == "optimizers" and any(o is not None for o in v))
        if given:
            raise ConfigError(f"{type(self).__name__}({', '.join(given)}=...) is not supported: rlvr builds the data, "
                              "the collator, the loss and AdamW from the settings of its config")
        if train_dataset is None:
            raise ConfigError(f"{type(self).__name__} needs a train_dataset (a datasets.Dataset or a list of rows)")
        settings = self._model_settings(model, args, peft_config, quantization_config)
        self._data_settings(settings, eval_dataset)
        self._setup(settings, processing_class, train_dataset, eval_dataset, callbacks)

    def _objects_given(self) -> list:
        return []  # no objects by name: the data is rows, the rewards the verifier

    def _read_data(self, train_dataset, eval_dataset) -> None:
        self.train_rows = inputs.rows(train_dataset, "train_dataset")
        self.train_examples = None
        self.test_examples = inputs.eval_examples(eval_dataset, self.cfg) if eval_dataset is not None else []

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        if eval_dataset is not None:  # kept: a later train() evaluates on it too
            self.test_examples = inputs.eval_examples(eval_dataset, self.cfg)
        return super().evaluate(None, metric_key_prefix)


class SFTTrainer(_FinetuneTrainer):
    """TRL's SFTTrainer(model, args=SFTConfig(...), train_dataset=..., eval_dataset=..., processing_class=...,
    peft_config=...): prompt/completion rows (or chat `messages`); with self_samples=true, rejection
    sampling on the train prompts."""

    config_class, suffix = SFTConfig, "SFT"


class DPOTrainer(_FinetuneTrainer):
    """TRL's DPOTrainer(model, ref_model=None, args=DPOConfig(...), train_dataset=...): prompt / chosen /
    rejected rows; the reference is a frozen copy of the starting model (with LoRA: the adapter off)."""

    config_class, suffix = DPOConfig, "DPO"

    def __init__(self, model, ref_model=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 callbacks=None, peft_config=None, quantization_config=None, **unsupported):
        if ref_model is not None:
            raise ConfigError("DPOTrainer(ref_model=...) is not supported: the reference is a frozen copy of `model` as "
                              "it starts (with peft_config: the model with its adapter off), which is TRL's default too")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, callbacks, peft_config, quantization_config,
                         **unsupported)
