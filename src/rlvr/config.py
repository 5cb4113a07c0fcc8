"""The whole run configuration: one frozen dataclass, defaults defined once.

Names follow TRL's GRPOConfig wherever TRL has the setting, with TRL's defaults,
so a TRL recipe ports unchanged.  A config is built from a YAML file, then
`key=value` overrides (values parsed as YAML, `task_args.digits=2` reaches into
a mapping), and validated before any model is loaded.  settings.py resolves a config from
the command line and checks it against the launch and the environment (check_runnable).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlvr import trl_settings


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


@dataclass(frozen=True)
class Config:
    # --- model ---------------------------------------------------------------
    model: str = "default"  # "default" (embedded SmolLM2-135M-Instruct), a local dir, a run dir, or a hub id
    dtype: str = "float32"  # weights: float32 | bfloat16
    use_cpu: bool = False  # stay on the CPU even where a CUDA GPU is visible (else cuda:LOCAL_RANK)
    model_init_kwargs: dict = field(default_factory=dict)  # keyword arguments for from_pretrained, e.g. {attn_implementation: sdpa, revision: main}
    trust_remote_code: bool = False  # run the model repository's own code (a hub model with custom modelling files)

    # --- lora ----------------------------------------------------------------
    use_peft: bool = False  # train a LoRA adapter (peft) instead of every weight
    lora_r: int = 16  # adapter rank
    lora_alpha: int = 32  # adapter scale alpha / r
    lora_dropout: float = 0.0  # dropout on the adapter input; 0 like disable_dropout: it makes log-probs noisy and resume inexact
    lora_target_modules: tuple | None = None  # module names to adapt; default: every linear layer of attention and MLP
    lora_save: str = "adapter"  # final save: adapter (peft format) | merged (a plain model)

    # --- data ----------------------------------------------------------------
    task: str = "arithmetic"  # a built-in task: arithmetic, countdown, reasoning_gym, humaneval; or gsm8k, math500, aime, which read `dataset` (default: from the hub). Unset, `dataset` is a plain dataset
    task_args: dict = field(default_factory=dict)  # the task's own knobs, e.g. {digits: 2, operands: 3}
    dataset: str | None = None  # hub id, or a local .jsonl / .json / .parquet / .csv file
    dataset_config: str | None = None  # the dataset's configuration (subset) name
    dataset_train_split: str = "train"  # the split to train on
    dataset_test_split: str = "test"  # held out from train when the dataset has no such split
    prompt_column: str | None = None  # default: the first of prompt, question, problem
    answer_column: str | None = None  # default: the first of answer, solution, ground_truth
    system_prompt: str | None = None  # text, or "r1" for the built-in think/answer prompt
    text_prompts: str = "chat"  # a plain-text prompt: chat = one user message of the chat template | raw = the text as it is (TRL's; GRPOTrainer's default)
    max_prompt_length: int | None = 512  # longer prompts are cut from the left
    shuffle_dataset: bool = True  # draw the train prompts in a new random order each epoch; false: in file order
    chat_template_kwargs: dict = field(default_factory=dict)  # extra arguments for the chat template, e.g. {enable_thinking: false} (Qwen3)

    # --- rollout -------------------------------------------------------------
    num_generations: int = 8  # G: completions per prompt (one group)
    max_completion_length: int = 512  # new tokens per completion at most
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = 0  # 0 = no top-k filtering
    min_p: float | None = None  # drop tokens less likely than min_p x the most likely one; null = off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or completion (CTRL's penalty); 1 = off
    generation_kwargs: dict = field(default_factory=dict)  # more sampling settings by their transformers / vLLM names
    stop_strings: tuple = ()  # generation also stops at any of these (text is cut before it)
    generation_batch_size: int | None = None  # completions per generation; default per_device_train_batch_size x steps_per_generation
    steps_per_generation: int | None = None  # micro-batches each generation feeds; default gradient_accumulation_steps (one optimizer step)
    cuda_graphs: bool = True  # on a CUDA GPU the in-process sampler replays its decode step from CUDA graphs (fast-path models); false = eager
    use_vllm: bool = False  # sample with vLLM instead of the in-process engine
    vllm_mode: str = "colocate"  # server: a separate `rlvr vllm-serve` | colocate: vLLM inside the training process
    vllm_gpu_memory_utilization: float = 0.3  # colocate: the share of accelerator memory vLLM may take
    vllm_kv_cache_gb: float = 0.0  # vLLM's KV cache in GiB; 0 = from vllm_gpu_memory_utilization (on CPU: that share of RAM, minus the whole process)
    vllm_tensor_parallel_size: int = 1  # GPUs vLLM shards the model over (colocate, and `rlvr vllm-serve`)
    vllm_max_model_length: int | None = None  # vLLM's context length; default the model's
    vllm_enforce_eager: bool = True  # run vLLM without torch.compile: starts in seconds instead of minutes on CPU
    vllm_server_host: str = "0.0.0.0"  # server mode: where `rlvr vllm-serve` listens; the trainer: one host or several (a list, or host,host:port,...)
    vllm_server_port: int = 8000  # server mode (rlvr vllm-serve: 0 listens on any free port and prints it)
    vllm_server_base_url: str | None = None  # server mode: e.g. http://host:8000, or several (a list); overrides host and port
    vllm_server_timeout: float = 240.0  # seconds to wait for the server (start, generation, weight push) before failing
    vllm_weight_transfer: str = "http"  # server mode: http (one stream relayed by the servers) | collective (a torch.distributed broadcast: NCCL on GPU, gloo on CPU)
    vllm_importance_sampling_correction: bool = True  # correct for the trainer / sampler probability ratio of vLLM's tokens
    vllm_importance_sampling_mode: str = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | sequence_mask
    vllm_importance_sampling_clip_max: float | None = 3.0  # truncate: ratios capped here; mask: ratios above it zero the weight
    vllm_importance_sampling_clip_min: float | None = None  # mask modes: ratios below it zero the weight; null = no lower bound
    rollout_workers: int = 0  # Ray actors that sample and score; 0 = in the training process
    ray_address: str | None = None  # an existing Ray cluster ("auto" or host:port); null = start a local one
    max_staleness: int = 0  # 1: the next step's rollouts are sampled while this step trains (one step off-policy)

    # --- multi-turn ----------------------------------------------------------
    tools: tuple = ()  # functions the model may call: python, calculator (built in) or package.module:function
    environment: str | None = None  # package.module:Class the model talks to turn by turn (environments.py)
    max_turns: int = 4  # model turns per rollout with tools or an environment (TRL: max_tool_calling_iterations + 1)
    tool_timeout: float = 10.0  # seconds a tool call may run; past it the model reads an error
    max_tool_output_chars: int = 2000  # a tool's output is cut to this many characters, with a note saying so
    rollout_func: str | None = None  # package.module:function that samples the completions itself (TRL's rollout_func)

    # --- reward --------------------------------------------------------------
    reward_funcs: tuple | None = None  # built-in names or `package.module:function`; default: the task's verifier
    reward_weights: tuple | None = None  # one per reward function; default all 1.0
    reward_args: dict = field(default_factory=dict)  # keyword arguments per reward, e.g. {soft_overlong: {cache: 32}}
    reward_timeout: float = 60.0  # seconds one call of one of your own reward functions may take; past it, its scores of that batch are None (0 = no limit)
    reward_isolation: str = "process"  # process: your own reward functions run in a worker process, killed with what it started past reward_timeout | inline: in the trainer's process (functions that need its memory or CUDA)

    # --- advantage -----------------------------------------------------------
    scale_rewards: str = "group"  # group | batch | none
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and sample more prompts
    max_sampling_rounds: int = 3  # dynamic sampling: extra generation rounds per step at most

    # --- loss ----------------------------------------------------------------
    loss_type: str = "dapo"  # grpo | dapo | dr_grpo | bnpo
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(policy || reference))
    kl_penalty: str = "loss"  # loss: beta * KL added to the loss | reward: beta * KL subtracted from each reward
    kl_target: float | None = None  # adaptive KL: move beta toward this KL each step; null = fixed beta
    sync_ref_model: bool = False  # TR-DPO: move the reference toward the policy every ref_model_sync_steps
    ref_model_mixup_alpha: float = 0.6  # sync: reference = alpha x policy + (1 - alpha) x reference
    ref_model_sync_steps: int = 512  # sync: steps between reference updates
    kl_horizon: int = 100  # adaptive KL: steps over which beta may change by about e-fold (Ziegler et al.)
    epsilon: float = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # default: epsilon
    delta: float | None = None  # two-sided clipping: the ratio of negative-advantage tokens is also capped at delta (> 1 + epsilon); null = off
    top_entropy_quantile: float = 1.0  # train only on the tokens whose entropy is in this top fraction per batch (1 = all)
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    num_iterations: int = 1  # updates per generated batch
    mask_truncated_completions: bool = False  # completions cut at max length get no loss

    # --- optimisation --------------------------------------------------------
    optim: str = "adamw_torch_fused"  # adamw_torch | adamw_torch_fused | adamw_torch_foreach (torch's AdamW implementations)
    learning_rate: float = 1e-6  # AdamW peak learning rate
    lr_scheduler_type: str = "linear"  # constant | linear | cosine | constant_with_warmup | cosine_with_min_lr | polynomial
    lr_scheduler_kwargs: dict = field(default_factory=dict)  # the schedule's own knobs, e.g. {min_lr_rate: 0.1} for cosine_with_min_lr
    warmup_ratio: float = 0.0  # fraction of the steps spent warming up linearly
    warmup_steps: int = 0  # overrides warmup_ratio when > 0
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_beta1: float = 0.9  # AdamW
    adam_beta2: float = 0.999  # AdamW
    adam_epsilon: float = 1e-8  # AdamW
    max_grad_norm: float = 1.0  # 0 = no clipping
    per_device_train_batch_size: int = 8  # completions per micro-batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = -1  # optimizer steps; -1 = derive from num_train_epochs
    num_train_epochs: float = 3.0  # passes over the train prompts when max_steps is -1
    bf16: bool = False  # bf16 autocast for forward passes; weights and optimizer stay fp32
    fp16: bool = False  # fp16 autocast with loss scaling, where the device runs fp16 (a CUDA GPU); weights stay fp32
    gradient_checkpointing: bool = False  # recompute activations in the backward pass to save memory
    fsdp: bool = False  # with torchrun: shard weights, gradients and optimizer state across processes (FSDP2); sampling keeps a full copy
    disable_dropout: bool = True  # dropout off in every pass, so log-probs are comparable
    seed: int = 42  # data order, sampling and task generation

    # --- sft and dpo ---------------------------------------------------------
    method: str = "grpo"  # what is trained; set by the command: grpo (rlvr train) | sft (rlvr sft, rlvr rft) | dpo (rlvr dpo)
    max_length: int | None = 1024  # sft / dpo: prompt + completion tokens at most; a longer completion loses its end
    completion_only_loss: bool | None = None  # sft: loss on the completion's tokens only (null: true); false: on the prompt's too
    packing: bool = False  # sft: a micro-batch holds per_device_train_batch_size rows of max_length tokens, each filled with whole sequences
    completion_column: str | None = None  # sft: the demonstration; default the first of completion, solution, answer
    self_samples: bool = False  # sft / dpo: train on the model's own samples scored by the verifier (sft: the correct ones, RFT; dpo: correct vs incorrect pairs)
    self_rounds: int = 3  # self_samples: rounds of sampling, then training on what was kept (with max_steps set: until it)
    self_round_prompts: int = 64  # self_samples: train prompts per round, num_generations samples each
    self_round_steps: int = 20  # self_samples: optimizer steps on each round's data
    dpo_beta: float = 0.1  # dpo: `beta` of rlvr dpo and DPOConfig; how far the policy may move from the reference
    dpo_loss_type: str = "sigmoid"  # dpo: `loss_type` of rlvr dpo and DPOConfig: sigmoid (DPO) | ipo | hinge
    label_smoothing: float = 0.0  # dpo sigmoid: the assumed chance that a pair's preference is flipped (cDPO)

    # --- run -----------------------------------------------------------------
    output_dir: str | None = None  # default: runs/<run_name or task>-<date>-<time>
    run_name: str | None = None  # the run's name in loggers (wandb, trackio, tensorboard) and in its default output_dir
    max_train_seconds: float = 0.0  # stop (saved, evaluated) after the step during which training time passes this; 0 = no limit
    resume: bool = False  # continue from the newest checkpoint in output_dir that verifies (or start over there if it has none)
    resume_checkpoint: str | None = None  # continue from this checkpoint directory (TRL: resume_from_checkpoint=<path>)
    resume_override: bool = False  # resume even though settings that change the run's course differ from the checkpoint's run
    on_save_error: str = "stop"  # a checkpoint that cannot be written (disk full): stop the run, or continue without it
    trust_unverified_checkpoint: bool = False  # load a checkpoint without manifest.json (nothing to check its files against)
    logging_steps: int = 10  # one metrics.jsonl line per this many steps (their average)
    save_strategy: str = "steps"  # steps: every save_steps | epoch: at each pass over the prompts | no: only at the end and when stopped
    save_steps: int = 500  # a checkpoint every this many steps
    save_total_limit: int | None = None  # keep only the newest checkpoints; null = all
    log_completions: bool = True  # write sample completions to completions.jsonl
    num_completions_to_print: int | None = None  # completions logged per logging step; null = all of the step's
    report_to: tuple = ()  # extra loggers: tensorboard, wandb, trackio (metrics.jsonl is always written)
    push_to_hub: bool = False  # upload the final model to the Hugging Face Hub (needs network and a token)
    hub_model_id: str | None = None  # the repository, e.g. user/my-grpo-model; default: the output_dir's name
    hub_token: str | None = None  # default: HF_TOKEN or the token of `hf auth login`
    hub_private_repo: bool | None = None  # create the repository private
    report_steps: int = 50  # redraw the run's plots and report.html every this many steps; 0 = at the end only

    # --- alerts --------------------------------------------------------------
    alert_window: int = 20  # steps in each rule's rolling window
    alert_reward_flat_steps: int = 200  # reward mean not improving for this many steps
    alert_reward_std_low: float = 0.1  # reward std below this (guide: normal 0.3-1.0)
    alert_reward_std_high: float = 2.0  # reward std above this
    alert_kl_high: float = 0.1  # KL above this and rising
    alert_loss_zero: float = 1e-4  # |policy loss| and grad norm below this while reward is not improving
    alert_throughput_fraction: float = 0.5  # tokens/s below this fraction of the run's early throughput
    alert_zero_std_high: float = 0.8  # fraction of zero-signal groups above this
    on_alert: dict = field(default_factory=dict)  # rule -> warn | stop, e.g. {kl_high: stop}; stop exits non-zero

    # --- evaluation ----------------------------------------------------------
    eval_on_start: bool = True  # held-out accuracy before training
    eval_on_end: bool = True  # ... and after it
    eval_strategy: str = "no"  # no | steps: also evaluate every eval_steps during training
    eval_steps: int | None = None  # default: logging_steps (as TRL)
    eval_num_samples: int = 1  # k completions per problem; > 1 reports pass@k, maj@k, mean@k
    eval_num_shots: int = 0  # worked examples from the train split put before each eval prompt
    eval_max_examples: int = 200  # 0 = the whole test split
    eval_temperature: float = 0.0  # 0 = greedy
    eval_batch_size: int = 64  # prompts per generation call
    eval_output: str | None = None  # `rlvr eval` result file; default <run dir>/eval.json or ./eval.json

    @property
    def completions_per_generation(self) -> int:
        """Completions sampled in one generation (TRL's generation_batch_size, over all processes)."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        return self.per_device_train_batch_size * (self.steps_per_generation or self.gradient_accumulation_steps)

    @property
    def prompts_per_step(self) -> int:
        """Prompts sampled for one generation (TRL: generation batch / num_generations)."""
        return self.completions_per_generation // self.num_generations

    @property
    def steps_per_optimizer_step(self) -> int:
        """Optimizer steps one generation feeds (per use, see num_iterations): steps_per_generation / gradient_accumulation_steps."""
        return self.completions_per_generation // (self.per_device_train_batch_size * self.gradient_accumulation_steps)

    @property
    def command(self) -> str:
        """The rlvr command that trains this method: train, sft, rft (sft with self_samples) or dpo."""
        return {"grpo": "train", "dpo": "dpo"}.get(self.method, "rft" if self.self_samples else "sft")

    @property
    def epsilon_high_value(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def to_dict(self) -> dict[str, Any]:
        """Every setting, tuples as lists and secrets hidden (hide_secret); the token itself is cfg.hub_token."""
        out = {}
        for f in dataclasses.fields(self):
            v = hide_secret(f.name, getattr(self, f.name))
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

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

# TRL / open-r1 spellings accepted for our names.
ALIASES = {
    "model_name_or_path": "model",
    "torch_dtype": "dtype",
    "dataset_name": "dataset",
    "dataset_config_name": "dataset_config",
    "resume_from_checkpoint": "resume",
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",  # TRL's older name
}

_TUPLE_FIELDS = {"stop_strings", "tools", "reward_funcs", "reward_weights", "report_to", "lora_target_modules"}
_CHOICES = {
    "dtype": ("float32", "bfloat16"),
    "scale_rewards": ("group", "batch", "none"),
    "importance_sampling_level": ("token", "sequence"),
    "lr_scheduler_type": ("constant", "linear", "cosine", "constant_with_warmup", "cosine_with_min_lr", "polynomial"),
    "optim": ("adamw_torch", "adamw_torch_fused", "adamw_torch_foreach"),
    "save_strategy": ("steps", "epoch", "no"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "kl_estimator": ("k1", "k2", "k3"),
    "kl_penalty": ("loss", "reward"),
    "reward_isolation": ("process", "inline"),
    "eval_strategy": ("no", "steps"),
    "lora_save": ("adapter", "merged"),
    "vllm_mode": ("server", "colocate"),
    "vllm_weight_transfer": ("http", "collective"),
    "on_save_error": ("stop", "continue"),
    "text_prompts": ("chat", "raw"),
    "method": ("grpo", "sft", "dpo"),
}


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
    if isinstance(values.get("resume"), str):  # TRL's resume_from_checkpoint=<path>
        values["resume_checkpoint"], values["resume"] = values["resume"], True
    _check_types(values)
    cfg = Config(**values)
    validate(cfg)
    return cfg


_MAPPINGS = {"task_args", "reward_args", "on_alert", "model_init_kwargs", "chat_template_kwargs", "generation_kwargs",
             "lr_scheduler_kwargs"}


def _set(values: dict[str, Any], key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    if not rest:  # TRL's settings without an rlvr field of their name (trl_settings.py)
        try:
            translated = trl_settings.translate(head, value)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if translated is None:
            return
        if "." in translated[0]:  # a TRL setting that is a key of one of rlvr's mappings
            return _set(values, *translated)
        head, value = translated
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
        want = _TYPES[FIELDS[name].type.split("|")[0].strip()]  # annotations are strings: "float | None"
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


def validate(cfg: Config) -> None:
    """Raise ConfigError listing every problem; touches no model or dataset."""
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for name, choices in _CHOICES.items():
        need(getattr(cfg, name) in choices, f"{name} must be one of {', '.join(choices)}; got {getattr(cfg, name)!r}")
    from rlvr.losses import LOSS_TYPES

    need(cfg.loss_type in LOSS_TYPES, f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {cfg.loss_type!r}")
    need(cfg.num_generations >= 2, f"num_generations must be at least 2 (a group of one has no relative advantage); got {cfg.num_generations}")
    need(cfg.per_device_train_batch_size >= 1, "per_device_train_batch_size must be at least 1")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be at least 1")
    if cfg.method == "grpo":  # how generations feed optimizer steps; sft and dpo take whole examples
        problems += _check_generation_batch(cfg)
    problems += _check_finetune(cfg)
    problems += _check_multiturn(cfg)
    need(cfg.max_completion_length >= 1, "max_completion_length must be at least 1")
    need(cfg.max_prompt_length is None or cfg.max_prompt_length >= 1, "max_prompt_length must be at least 1 (or null for no limit)")
    from rlvr.rollout import generation_settings

    sampling, bad = generation_settings(cfg)  # the sampling settings, generation_kwargs applied over them
    problems += bad
    need(sampling["temperature"] > 0, f"temperature must be > 0 for training rollouts; got {sampling['temperature']}")
    need(cfg.eval_temperature >= 0, "eval_temperature must be >= 0 (0 = greedy)")
    need(0 < sampling["top_p"] <= 1, f"top_p must be in (0, 1]; got {sampling['top_p']}")
    need(sampling["top_k"] >= 0, f"top_k must be >= 0 (0 = off); got {sampling['top_k']}")
    need(sampling["min_p"] is None or 0 <= sampling["min_p"] <= 1, f"min_p must be in [0, 1] (or null: off); got {sampling['min_p']}")
    need(sampling["repetition_penalty"] > 0,
         f"repetition_penalty must be > 0 (1 = off, > 1 discourages repeated tokens); got {sampling['repetition_penalty']}")
    need(all(isinstance(s, str) and s for s in sampling["stop_strings"]), "stop_strings must be non-empty strings")
    reserved = sorted({"add_generation_prompt", "tokenize", "conversation"} & set(cfg.chat_template_kwargs))
    need(not reserved, f"chat_template_kwargs cannot set {', '.join(reserved)}: rlvr sets it when it renders a prompt")
    need(cfg.beta >= 0, f"beta must be >= 0; got {cfg.beta}")
    need(cfg.epsilon > 0, f"epsilon must be > 0; got {cfg.epsilon}")
    need(cfg.epsilon_high is None or cfg.epsilon_high >= cfg.epsilon, "epsilon_high must be >= epsilon")
    need(cfg.delta is None or cfg.delta > 1 + cfg.epsilon_high_value,
         f"delta caps the unclipped ratio above the clip range: it must be > 1 + epsilon_high = {1 + cfg.epsilon_high_value:g} (or null); got {cfg.delta}")
    need(0 <= cfg.top_entropy_quantile <= 1, f"top_entropy_quantile must be in [0, 1] (1 = train on every token); got {cfg.top_entropy_quantile}")
    need(cfg.num_iterations >= 1, "num_iterations must be at least 1")
    need(cfg.learning_rate > 0 and math.isfinite(cfg.learning_rate), f"learning_rate must be a finite number > 0; got {cfg.learning_rate}")
    need(0 <= cfg.warmup_ratio < 1, "warmup_ratio must be in [0, 1)")
    need(cfg.warmup_steps >= 0, "warmup_steps must be >= 0")
    from rlvr.optim import schedule_problems

    problems += schedule_problems(cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs, cfg.learning_rate)
    need(not (cfg.fp16 and cfg.bf16), "fp16 and bf16 cannot both be true: choose one autocast precision (bf16 needs no loss scaling)")
    need(not (cfg.fp16 and cfg.fsdp), "fp16 with fsdp is not supported (its loss scaling would decide per shard); use bf16=true")
    if cfg.sync_ref_model:
        need(cfg.beta > 0, "sync_ref_model=true moves the reference model toward the policy, but beta=0 loads no reference; "
             "set beta > 0 (e.g. beta=0.04) or sync_ref_model=false")
        need(not cfg.use_peft, "sync_ref_model=true is not supported with use_peft (as in TRL): the reference is the policy "
             "with its adapter switched off, not a model of its own to move; set one of them")
        need(0 <= cfg.ref_model_mixup_alpha <= 1, f"ref_model_mixup_alpha must be in [0, 1]; got {cfg.ref_model_mixup_alpha}")
        need(cfg.ref_model_sync_steps >= 1, f"ref_model_sync_steps must be at least 1; got {cfg.ref_model_sync_steps}")
    need(cfg.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 = no clipping)")
    need(cfg.max_steps == -1 or cfg.max_steps >= 1, "max_steps must be -1 (use num_train_epochs) or at least 1")
    need(cfg.max_steps != -1 or cfg.num_train_epochs > 0, "num_train_epochs must be > 0 when max_steps is -1")
    need(cfg.logging_steps >= 1, "logging_steps must be at least 1")
    need(cfg.save_steps >= 1, "save_steps must be at least 1")
    need(cfg.save_strategy != "best", "save_strategy=best (TRL: keep the checkpoint with the best metric_for_best_model) "
         "is not supported yet; use steps, epoch or no, and compare the runs' held-out accuracy (eval_strategy=steps)")
    for key in ("dtype", "torch_dtype"):
        value = cfg.model_init_kwargs.get(key, cfg.dtype)
        need(value == cfg.dtype, f"model_init_kwargs.{key}={value!r} differs from dtype={cfg.dtype!r}: the weights' dtype is "
             f"rlvr's own dtype setting (float32 or bfloat16; vLLM and `rlvr plan` read it too), so set dtype there and "
             f"drop {key} from model_init_kwargs")
    need(cfg.save_total_limit is None or cfg.save_total_limit >= 1, "save_total_limit must be at least 1 (or null to keep all)")
    need(cfg.eval_max_examples >= 0, "eval_max_examples must be >= 0 (0 = all)")
    need(cfg.eval_batch_size >= 1, "eval_batch_size must be at least 1")
    need(cfg.num_completions_to_print is None or cfg.num_completions_to_print >= 0, "num_completions_to_print must be >= 0 (or null for all)")
    need(cfg.reward_funcs is None or len(cfg.reward_funcs) >= 1, "reward_funcs must name at least one reward function")
    if cfg.reward_weights is not None and cfg.reward_funcs is None:
        problems.append("reward_weights needs reward_funcs: name the functions the weights belong to")
    elif cfg.reward_weights is not None:
        need(
            len(cfg.reward_weights) == len(cfg.reward_funcs),
            f"reward_weights has {len(cfg.reward_weights)} values but reward_funcs has {len(cfg.reward_funcs)}; give one weight per function",
        )
        need(all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in cfg.reward_weights), "reward_weights must be numbers")
    named = set(cfg.reward_funcs or ()) | {n.rpartition(":")[2] for n in cfg.reward_funcs or ()}
    for name, args in cfg.reward_args.items():
        if cfg.reward_funcs is not None and name not in named:
            problems.append(f"reward_args names {name!r}, which is not in reward_funcs {list(cfg.reward_funcs)}")
        if not isinstance(args, dict):
            problems.append(f"reward_args.{name} must be a mapping of keyword arguments, got {args!r}")
    need(cfg.reward_timeout >= 0 and math.isfinite(cfg.reward_timeout), f"reward_timeout must be >= 0 seconds (0 = no limit); got {cfg.reward_timeout}")
    need(cfg.kl_horizon >= 1, f"kl_horizon must be at least 1; got {cfg.kl_horizon}")
    if cfg.kl_target is not None:
        need(cfg.kl_target > 0, f"kl_target must be > 0 (or null for a fixed beta); got {cfg.kl_target}")
        need(cfg.beta > 0, "kl_target (adaptive KL) adjusts beta from its starting value: set beta > 0, e.g. beta=0.04")
    need(cfg.max_sampling_rounds >= 0, "max_sampling_rounds must be >= 0")
    for name in cfg.report_to:
        need(name in REPORT_TO, f"report_to: unknown logger {name!r}; choose from {', '.join(REPORT_TO)}")
    need(cfg.report_steps >= 0, "report_steps must be >= 0 (0 = the report is written at the end only)")
    problems += _check_alerts(cfg)
    problems += _check_reward_args(cfg)
    need(cfg.eval_steps is None or cfg.eval_steps >= 1, "eval_steps must be at least 1 (or null for logging_steps)")
    need(cfg.lora_r >= 1 and cfg.lora_alpha > 0, "lora_r must be at least 1 and lora_alpha > 0")
    need(0 <= cfg.lora_dropout < 1, "lora_dropout must be in [0, 1)")
    need(0 < cfg.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1]")
    need(cfg.vllm_tensor_parallel_size >= 1, f"vllm_tensor_parallel_size must be at least 1; got {cfg.vllm_tensor_parallel_size}")
    if cfg.vllm_max_model_length is not None:
        longest = (cfg.max_prompt_length or 1) + cfg.max_completion_length
        sizes = "max_prompt_length + max_completion_length" if cfg.max_prompt_length else "1 + max_completion_length"
        need(cfg.vllm_max_model_length >= longest,
             f"vllm_max_model_length={cfg.vllm_max_model_length} has no room for a longest prompt and a full completion "
             f"({sizes} = {longest} tokens); set it to at least {longest}, or null")
    for url in cfg.vllm_server_base_url.split(",") if cfg.vllm_server_base_url is not None else ():
        need(url.strip().startswith(("http://", "https://")),
             f"vllm_server_base_url must start with http:// or https://, e.g. http://host:8000 (several: a list); got {url.strip()!r}")
    need(0 <= cfg.vllm_server_port <= 65535,
         f"vllm_server_port must be a port number, 1 to 65535 (0: any free port, for rlvr vllm-serve); got {cfg.vllm_server_port}")
    need(cfg.vllm_server_timeout > 0, "vllm_server_timeout must be > 0 seconds")
    need(cfg.vllm_kv_cache_gb >= 0, "vllm_kv_cache_gb must be >= 0 (0 = from vllm_gpu_memory_utilization)")
    need(cfg.vllm_importance_sampling_clip_max is None or cfg.vllm_importance_sampling_clip_max > 0,
         "vllm_importance_sampling_clip_max must be > 0 (or null)")
    clip_min, clip_max = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    need(clip_min is None or clip_max is None or clip_min < clip_max,
         f"vllm_importance_sampling_clip_min ({clip_min}) must be less than vllm_importance_sampling_clip_max ({clip_max})")
    need(not (cfg.vllm_importance_sampling_correction and cfg.vllm_importance_sampling_mode.endswith("_truncate")
              and clip_min is None and clip_max is None),
         f"vllm_importance_sampling_mode={cfg.vllm_importance_sampling_mode} truncates the ratio: set "
         "vllm_importance_sampling_clip_max (e.g. 3.0) or vllm_importance_sampling_clip_min")
    need(cfg.rollout_workers >= 0, "rollout_workers must be >= 0 (0 = sample in the training process)")
    if cfg.rollout_workers > 0:
        import importlib.util

        need(importlib.util.find_spec("ray") is not None,
             "rollout_workers > 0 needs Ray, which is not installed. Install it with: pip install 'rlvr[ray]'  (or: pip install 'ray>=2.9')")
        need(not (cfg.use_vllm and cfg.vllm_mode == "server"),
             "rollout_workers with use_vllm=true runs vLLM inside each Ray worker, not on `rlvr vllm-serve` servers: "
             "set vllm_mode=colocate (the default), or rollout_workers=0 to sample on the servers")
    need(cfg.max_staleness in (0, 1), f"max_staleness must be 0 (on-policy) or 1 (one step off-policy), got {cfg.max_staleness}")
    need(not (cfg.max_staleness and cfg.use_peft and cfg.beta > 0 and cfg.kl_penalty == "reward"),
         "max_staleness=1 with use_peft and kl_penalty=reward is not supported: the reward's KL would need the adapter "
         "switched off while the update trains it; use kl_penalty=loss")
    need(cfg.eval_num_samples >= 1, "eval_num_samples must be at least 1")
    need(cfg.eval_num_samples == 1 or cfg.eval_temperature > 0,
         f"eval_num_samples={cfg.eval_num_samples} with eval_temperature=0 (greedy) would give identical completions; "
         "set eval_temperature > 0 to sample (e.g. eval_temperature=0.6), or eval_num_samples=1 for greedy pass@1")
    need(cfg.eval_num_shots >= 0, "eval_num_shots must be >= 0")
    need(not (cfg.text_prompts == "raw" and cfg.system_prompt), "system_prompt needs text_prompts=chat: a raw text prompt has no "
         "system message to put it in (put the instruction in the prompt text instead)")
    problems += _check_names(cfg)
    problems += _check_paths(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _check_finetune(cfg: Config) -> list[str]:
    """The settings of rlvr sft and rlvr dpo."""
    from rlvr.finetune.losses import DPO_LOSS_TYPES

    problems = []
    if cfg.max_length is not None and cfg.max_length < 2:
        problems.append(f"max_length must be at least 2 (a prompt token and a completion token), or null; got {cfg.max_length}")
    if cfg.dpo_loss_type not in DPO_LOSS_TYPES:
        problems.append(f"loss_type for rlvr dpo must be one of {', '.join(DPO_LOSS_TYPES)}; got {cfg.dpo_loss_type!r}")
    if not cfg.dpo_beta > 0:
        problems.append(f"beta for rlvr dpo must be > 0; got {cfg.dpo_beta}")
    if not 0 <= cfg.label_smoothing < 0.5:
        problems.append(f"label_smoothing must be in [0, 0.5); got {cfg.label_smoothing}")
    elif cfg.label_smoothing > 0 and cfg.dpo_loss_type != "sigmoid":
        problems.append(f"label_smoothing applies to loss_type=sigmoid only; got loss_type={cfg.dpo_loss_type}")
    for name in ("self_rounds", "self_round_prompts", "self_round_steps"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be at least 1; got {getattr(cfg, name)}")
    if cfg.max_train_seconds < 0 or not math.isfinite(cfg.max_train_seconds):
        problems.append(f"max_train_seconds must be >= 0 (0 = no limit); got {cfg.max_train_seconds}")
    if cfg.method != "grpo":
        if cfg.packing and cfg.method == "dpo":
            problems.append("packing applies to rlvr sft only")
        if cfg.packing and cfg.max_length is None:
            problems.append("packing=true fills rows of max_length tokens: set max_length (e.g. 1024)")
        if cfg.fsdp or cfg.rollout_workers or cfg.max_staleness:
            problems.append(f"rlvr {cfg.method} trains in one process: fsdp, rollout_workers and max_staleness are for rlvr train")
    return problems


def _check_generation_batch(cfg: Config) -> list[str]:
    """TRL's rules: generation_batch_size or steps_per_generation (not both) sets the completions of one
    generation, a whole number of optimizer steps' batches and of groups."""
    if cfg.generation_batch_size is not None and cfg.steps_per_generation is not None and \
            cfg.generation_batch_size != cfg.per_device_train_batch_size * cfg.steps_per_generation:
        return [f"generation_batch_size={cfg.generation_batch_size} and steps_per_generation={cfg.steps_per_generation} disagree "
                f"(per_device_train_batch_size x steps_per_generation = {cfg.per_device_train_batch_size * cfg.steps_per_generation}); "
                "set one of them: the other follows"]
    if cfg.per_device_train_batch_size < 1 or cfg.gradient_accumulation_steps < 1 or cfg.num_generations < 2:
        return []  # reported above
    if (cfg.generation_batch_size or 1) < 1 or (cfg.steps_per_generation or 1) < 1:
        return ["generation_batch_size and steps_per_generation must be at least 1"]
    b, g, step = cfg.completions_per_generation, cfg.num_generations, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    problems = []
    if b % step:
        what = "generation_batch_size" if cfg.generation_batch_size is not None else \
            "per_device_train_batch_size x steps_per_generation"
        problems.append(f"{what} = {b} completions is not a whole number of optimizer steps of per_device_train_batch_size x "
                        f"gradient_accumulation_steps = {step} completions; make it a multiple of {step}")
    if b % g:
        if cfg.generation_batch_size is None and cfg.steps_per_generation is None:
            problems.append(
                f"per_device_train_batch_size x gradient_accumulation_steps = {b} completions is not divisible by "
                f"num_generations = {g}; make it a multiple of {g}, e.g. per_device_train_batch_size={_round_up(b, g)}")
        else:
            problems.append(f"a generation of {b} completions is not divisible by num_generations = {g}; make it a multiple of {g}")
    return problems


REPORT_TO = ("jsonl", "tensorboard", "wandb", "trackio", "none")


def _check_reward_args(cfg: Config) -> list[str]:
    """Knobs of built-in rewards: known names and valid values (rewards.check_reward_args)."""
    builtin = [(name, args) for name, args in cfg.reward_args.items() if ":" not in name and isinstance(args, dict) and args]
    if not builtin:
        return []
    from rlvr.rewards import check_reward_args

    return [problem for name, args in builtin for problem in check_reward_args(name, args)]


def _check_alerts(cfg: Config) -> list[str]:
    from rlvr.alerts import RULES

    problems = []
    if cfg.alert_window < 1 or cfg.alert_reward_flat_steps < 1:
        problems.append("alert_window and alert_reward_flat_steps must be at least 1")
    if not 0 <= cfg.alert_reward_std_low < cfg.alert_reward_std_high:
        problems.append("alert_reward_std_low must be >= 0 and below alert_reward_std_high")
    for name in ("alert_throughput_fraction", "alert_zero_std_high"):
        if not 0 < getattr(cfg, name) <= 1:
            problems.append(f"{name} must be in (0, 1]; got {getattr(cfg, name)}")
    if cfg.alert_kl_high <= 0 or cfg.alert_loss_zero < 0:
        problems.append("alert_kl_high must be > 0 and alert_loss_zero >= 0")
    for rule, action in cfg.on_alert.items():
        if rule not in RULES:
            problems.append(f"on_alert: unknown rule {rule!r}; rules: {', '.join(RULES)}")
        if action not in ("warn", "stop"):
            problems.append(f"on_alert.{rule} must be warn or stop; got {action!r}")
    return problems


def _check_multiturn(cfg: Config) -> list[str]:
    """Tools, environment and rollout_func: each can be found and used, and where it can run."""
    problems = []
    multi = bool(cfg.tools or cfg.environment)
    if cfg.tools and cfg.environment:
        problems.append("tools and environment cannot both be set: tools are an environment of their own "
                        "(give your environment the tools it runs)")
    if cfg.rollout_func and multi:
        problems.append("rollout_func samples the completions itself: it cannot be combined with tools or environment")
    if cfg.max_turns < 1:
        problems.append(f"max_turns must be at least 1; got {cfg.max_turns}")
    if cfg.tool_timeout <= 0 or cfg.max_tool_output_chars < 1:
        problems.append("tool_timeout must be > 0 and max_tool_output_chars at least 1")
    if (multi or cfg.rollout_func) and cfg.rollout_workers > 0:
        problems.append("tools, environment and rollout_func run in the training processes: rollout_workers > 0 is "
                        "not supported with them yet (use torchrun, or vLLM servers, to spread the sampling)")
    if (multi or cfg.rollout_func) and cfg.method != "grpo":
        problems.append(f"tools, environment and rollout_func are for rlvr train (GRPO), not rlvr {cfg.command}")
    if cfg.tools:
        from rlvr.tools import Tool, ToolError

        for spec in cfg.tools:
            try:
                Tool.of(spec)
            except ToolError as e:
                problems.append(str(e))
    if cfg.environment:
        from rlvr.environments import load_environment

        try:
            load_environment(cfg.environment)
        except ValueError as e:
            problems.append(str(e))
    if cfg.rollout_func:
        from rlvr.rollout.custom import load_rollout_func

        try:
            load_rollout_func(cfg.rollout_func)
        except ValueError as e:
            problems.append(str(e))
    return problems


def _check_names(cfg: Config) -> list[str]:
    from rlvr.rewards import resolve_reward
    from rlvr.tasks import check_task

    problems = []
    for name in cfg.reward_funcs or ():
        try:
            resolve_reward(name)
        except (ValueError, ImportError, AttributeError) as e:
            problems.append(str(e))
    return problems + check_task(cfg)


def _check_paths(cfg: Config) -> list[str]:
    problems = []
    if _looks_local(cfg.model) and not Path(cfg.model).expanduser().exists():
        problems.append(f"model directory not found: {cfg.model}")
    if cfg.dataset and _looks_local(cfg.dataset) and not Path(cfg.dataset).expanduser().exists():
        problems.append(f"dataset file not found: {cfg.dataset}")
    if cfg.resume and cfg.output_dir and not cfg.resume_checkpoint and not Path(cfg.output_dir).is_dir():
        problems.append(f"resume=true but output_dir {cfg.output_dir} does not exist")
    if cfg.resume_checkpoint and not Path(cfg.resume_checkpoint).is_dir():
        problems.append(f"resume_from_checkpoint: {cfg.resume_checkpoint} is not a directory")
    return problems


def _looks_local(name: str) -> bool:
    """A path rather than a hub id: starts like a path, has a file suffix, or exists."""
    if name == "default":
        return False
    if name.startswith((".", "/", "~")) or Path(name).suffix in {".jsonl", ".json", ".parquet", ".csv"}:
        return True
    return Path(name).exists() or name.count("/") > 1


def _round_up(n: int, k: int) -> int:
    return ((n + k - 1) // k) * k


def describe_settings() -> list[tuple[str, str, str, str]]:
    """(section, name, default, help) for every setting, read from the comments of Config above,
    so `rlvr train --help` and the README's reference cannot drift from the code."""
    import inspect
    import re

    rows, section = [], ""
    for line in inspect.getsource(Config).splitlines():
        header = re.match(r"\s{4}# --- (\w[\w ]*?) -+$", line)
        field_line = re.match(r"\s{4}(\w+): [^=]+= (.+?)(?:\s+#\s*(.*))?$", line)
        if header:
            section = header.group(1)
        elif field_line:
            name, default, help_text = field_line.groups()
            rows.append((section, name, default.replace("field(default_factory=dict)", "{}"), help_text or ""))
    return rows


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True))


def settings_markdown() -> str:
    """The configuration reference as a Markdown table (README: `python -m rlvr.config`), then
    what rlvr does with TRL's other settings (trl_settings.py)."""
    out, section = ["| setting | default | meaning | from |", "|---|---|---|---|"], None
    for sec, name, default, help_text in describe_settings():
        if sec != section:
            out.append(f"| **{sec}** | | | |")
            section = sec
        origin = "TRL" if name in trl_settings.TRL_NAMES else "rlvr"
        out.append(f"| `{name}` | `{default}` | {help_text.replace('|', '&#124;')} | {origin} |")
    return "\n".join(out) + "\n\n" + trl_settings.other_settings_markdown()


if __name__ == "__main__":
    print(settings_markdown())
