"""Every setting of TRL's GRPOConfig (TRL 1.16, with the TrainingArguments it inherits), and what
rlvr does with it, so that a TRL recipe loads unchanged:

- most are rlvr settings of the same name and meaning (`TRL_NAMES`, the Config fields of that name);
- some are TRL's spelling of an rlvr setting (`translate`: activation_checkpointing, fsdp="full_shard", ...);
- some have no meaning here (`IGNORED`: dataloader workers, logging levels, DeepSpeed's gather, ...):
  accepted, and named in one printed line at the start of a run;
- some would change training in a way rlvr does not do yet (`UNSUPPORTED`): accepted at their
  inert value (TRL's default: a recipe that dumps every setting still loads), refused otherwise.

`TRL_DEFAULTS_DIFFER` lists the settings whose default here is deliberately not TRL's, with why.
"""

from __future__ import annotations

from typing import Any

# Config fields that are TRL settings of the same name and meaning (and TRL's default, except
# TRL_DEFAULTS_DIFFER). The rest of Config is rlvr's own.
TRL_NAMES = frozenset("""
output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate lr_scheduler_type
lr_scheduler_kwargs warmup_steps optim weight_decay adam_beta1 adam_beta2 adam_epsilon gradient_accumulation_steps
max_grad_norm bf16 fp16 gradient_checkpointing logging_steps report_to run_name eval_strategy eval_steps
eval_on_start save_strategy save_steps save_total_limit push_to_hub hub_model_id hub_token hub_private_repo seed
use_cpu fsdp model_init_kwargs trust_remote_code disable_dropout num_generations max_completion_length
shuffle_dataset generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs
chat_template_kwargs repetition_penalty use_vllm vllm_mode vllm_server_base_url vllm_server_host vllm_server_port
vllm_server_timeout vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size beta
num_iterations epsilon delta epsilon_high importance_sampling_level reward_weights scale_rewards loss_type
mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile
vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_clip_max
vllm_importance_sampling_clip_min log_completions num_completions_to_print use_bias_correction_kl
router_aux_loss_coef load_best_model_at_end metric_for_best_model greater_is_better vllm_enable_sleep_mode
sapo_temperature_pos sapo_temperature_neg vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg
off_policy_mask_threshold multi_objective_aggregation entropy_coef use_adaptive_entropy entropy_coef_min
entropy_coef_max entropy_coef_delta entropy_target
""".split()) | frozenset(  # the ModelConfig / ScriptArguments of TRL's scripts (trl/scripts/grpo.py)
    "dtype use_peft lora_r lora_alpha lora_dropout lora_target_modules lora_target_parameters lora_modules_to_save "
    "lora_task_type use_rslora use_dora load_in_4bit bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage "
    "dataset_config dataset_train_split dataset_test_split reward_funcs".split()) | frozenset(  # DistillationConfig's own
    "teacher_model_name_or_path teacher_model_init_kwargs".split())

# Accepted and without effect in rlvr; the reason is what `rlvr train --help` and docs/settings.md say.
IGNORED = {
    **dict.fromkeys("""dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers
        dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order remove_unused_columns
        label_names train_sampling_strategy length_column_name pad_to_multiple_of""".split(),
                    "rlvr reads the prompts itself, with no DataLoader or collator"),
    **dict.fromkeys("""logging_strategy logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen
        log_level log_level_replica disable_tqdm skip_memory_metrics debug project trackio_space_id trackio_bucket_id
        trackio_static_space_id log_multimodal log_unique_prompts""".split(),
                    "rlvr logs every logging_steps steps to metrics.jsonl and the loggers of report_to"),
    **dict.fromkeys("""eval_delay per_device_eval_batch_size prediction_loss_only eval_do_concat_batches eval_use_gather_object
        eval_accumulation_steps include_for_metrics batch_eval_metrics bf16_full_eval fp16_full_eval num_generations_eval
        do_train do_eval do_predict""".split(),
                    "rlvr evaluates held-out accuracy with its own eval_* settings"),
    **dict.fromkeys("""ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout
        local_rank accelerator_config ds3_gather_for_generation average_tokens_across_devices
        save_on_each_node""".split(),
                    "rlvr sums gradients over processes itself and normalises by the totals of all of them"),
    **dict.fromkeys("""tf32 use_cache torch_empty_cache_steps cache_implementation use_transformers_continuous_batching
        transformers_continuous_batching_config use_transformers_paged torch_compile_backend torch_compile_mode
        liger_kernel_config gradient_checkpointing_kwargs activation_checkpointing_kwargs
        vllm_model_impl vllm_group_port""".split(),
                    "rlvr's own forward and sampler decide this"),
    **dict.fromkeys("""full_determinism data_seed ignore_data_skip restore_callback_states_from_checkpoint enable_jit_checkpoint
        hub_strategy hub_always_push hub_revision""".split(),
                    "rlvr is deterministic from seed, resumes exactly, saves on SIGTERM and pushes the final model"),
    "use_liger_kernel": ("rlvr's log-prob pass never holds the full logits (the memory Liger's fused kernels save): "
                         "it works a few rows at a time with a chunked log-softmax"),
    "optim_args": "transformers passes it to none of torch's AdamW variants (the adam_* settings are theirs)",
    "fsdp_config": ("rlvr's FSDP2 shards each decoder layer and the whole model itself; of fsdp_config only cpu_offload "
                    "(accelerate's offload_params) is read, as fsdp_offload_params"),
    # SFTConfig's and DPOConfig's own (TRL 1.16)
    "dataset_num_proc": "rlvr tokenises the rows itself, in one process",
    "eval_packing": "rlvr evaluates held-out accuracy by sampling, not a packed loss",
    "padding_free": "rlvr's forward keeps the sequences of a row apart already: the loss is the same without it",
    "pad_token": "only where the padding goes, which no loss reads; rlvr pads with the tokenizer's pad (or end-of-sequence) token",
    **dict.fromkeys("precompute_ref_log_probs precompute_ref_batch_size".split(),
                    "the reference's log-probs are computed in each step, the same numbers as precomputed ones"),
    **dict.fromkeys("discopop_tau f_alpha_divergence_coef".split(), "a knob of a DPO loss rlvr does not have (see loss_type)"),
    # AsyncGRPOConfig's own (TRL 1.16's trl.experimental.async_grpo; top-level from TRL 1.18)
    "fork_threshold_tokens": "rlvr keeps each turn's token ids as sampled and never re-tokenises a conversation",
    "max_inflight_tasks": ("rlvr sends a generation's prompts to the sampler or the servers at once and keeps max_staleness "
                           "generations in flight with async_mode=free (TRL's automatic value: max_staleness x a step's samples)"),
    "queue_maxsize": "rlvr's queue holds at most max_staleness generations (async_mode=free), the most that can still be trained on",
    "weight_sync_timeout": "a weight push is bounded by vllm_server_timeout",
    "heartbeat_stale_after_s": "rlvr samples ahead in a thread of the training process, whose errors reach the step that waits for it",
    # Older TRL / transformers versions' settings that recipes still carry.
    **dict.fromkeys("""logging_dir overwrite_output_dir use_mps_device past_index ray_scope jit_mode_eval use_ipex
        push_to_hub_model_id push_to_hub_organization push_to_hub_token mp_parameters include_inputs_for_metrics
        include_tokens_per_second split_batches dispatch_batches torchdynamo fsdp_min_num_params
        fsdp_transformer_layer_cls_to_wrap tpu_num_cores tpu_metrics_debug xpu_backend vllm_device vllm_dtype
        vllm_enable_prefix_caching wandb_log_unique_prompts use_liger_loss""".split(),
                    "a setting of an older TRL or transformers version, without effect in TRL 1.16 too"),
    **dict.fromkeys("""ignore_bias_buffers gradient_checkpointing_use_reentrant""".split(),
                    "a knob of TRL scripts' ModelConfig that rlvr's loading and LoRA decide"),
}

# Accepted only at an inert value (the first is TRL's default); any other refused with the reason.
UNSUPPORTED = {
    "deepspeed": ((None, ""), "DeepSpeed is not supported; for sharding use fsdp=true under torchrun (FSDP2)"),
    "parallelism_config": ((None,), "context / tensor parallelism is not supported; use fsdp=true"),
    "torch_compile": ((False,), "torch.compile of the trained model is not supported yet (rlvr's own forward is used instead)"),
    "neftune_noise_alpha": ((None, 0), "NEFTune noise is not supported"),
    "label_smoothing_factor": ((0.0,), "label smoothing has no meaning for a policy-gradient loss"),
    "optim_target_modules": ((None,), "optimizers for some modules only (GaLore, APOLLO) are not supported"),
    "auto_find_batch_size": ((False,), "a batch that shrinks on out-of-memory would split prompt groups (TRL refuses it too)"),
    "save_only_model": ((False,), "checkpoints always hold the optimizer state, so that resume is exact"),
    "cast_lm_head_to_fp32": ((False,), "an fp32 LM head under bf16 is not supported yet"),
    "vllm_structured_outputs_regex": ((None,), "structured outputs are not supported yet"),
    "log_completions_hub_repo": ((None,), "uploading completions to the Hub is not supported; they are in completions.jsonl"),
    "load_in_8bit": ((False,), "8-bit loading (LLM.int8) is not supported; QLoRA is load_in_4bit=true with use_peft=true"),
    "dataset_streaming": ((False,), "streamed datasets from the command line are not supported; GRPOTrainer takes an IterableDataset"),
    "token_budget": ((None,), "a micro-batch here is per_device_train_batch_size completions (packed into rows by rlvr's "
                              "forward), not a token budget; bound memory with per_device_train_batch_size"),
    # SFTConfig's and DPOConfig's own (TRL 1.16)
    "activation_offloading": ((False,), "offloading activations to the CPU is not supported yet; gradient_checkpointing saves memory"),
    "chat_template_path": ((None,), "give the tokenizer with its chat template as processing_class (or model=<dir>)"),
    "eos_token": ((None,), "each completion ends with the tokenizer's own end-of-sequence token"),
    "dataset_kwargs": ((None,), "skip_prepare_dataset is not supported: rlvr tokenises the rows it is given"),
    "packing_strategy": (("bfd",), "only bfd packing (best-fit decreasing, whole sequences); wrapped and bfd_split cut sequences"),
    "ld_alpha": ((None,), "LD-DPO's length weighting is not supported yet"),
    "f_divergence_type": (("reverse_kl",), "DPO with another f-divergence than reverse KL is not supported yet"),
    "use_weighting": ((False,), "WPO's weighting of pairs is not supported yet"),
}

# SFTConfig's and DPOConfig's settings that are rlvr settings of the same name and meaning (with
# their GRPOConfig ones); `loss_type` and DPO's `beta` are renamed for each method (methods.py).
FINETUNE_NAMES = frozenset("""max_length truncation_mode completion_only_loss assistant_only_loss dataset_text_field
packing label_smoothing loss_weights""".split())

# Settings whose rlvr default is deliberately not TRL 1.16's: name -> (TRL's default, why).
TRL_DEFAULTS_DIFFER = {
    "disable_dropout": (False, "dropout makes the log-probs of the same tokens differ between passes, so the policy ratio "
                               "is noise and resume is not exact"),
    "bf16": (True, "TRL's default assumes a GPU (its own TrainingArguments refuse bf16 on a CPU without use_cpu); "
                   "fp32 is exact and reproducible, bf16=true is one setting away"),
    "gradient_checkpointing": (True, "speed first: recomputing each layer made the update 20-30% slower on the default model; "
                                     "turn it on when memory binds (it kept 80 MB of activations instead of 1.66 GB for 8 "
                                     "completions of 128 tokens)"),
    "eval_on_start": (False, "held-out accuracy before and after training is the first thing a run should tell"),
    "log_completions": (False, "completions.jsonl is cheap and is where reward hacking is seen first"),
    "output_dir": ("trainer_output", "each run gets its own directory, runs/<run_name or task>-<date>-<time>, so runs never mix"),
}


# Where TRL's SFTConfig / DPOConfig default is not rlvr's for that method: method -> name -> (TRL's default, why).
# (The GRPO differences above hold for every method.)
METHOD_DEFAULTS_DIFFER = {
    "sft": {"shuffle_dataset": (False, "TRL's SFT samples the rows in random order anyway (transformers' Trainer); its "
                                       "shuffle_dataset only shuffles them once more before packing")},
}


def inert(value: Any, allowed: tuple = ()) -> bool:
    """An unset value (None, False, empty) or one of `allowed`; True is never 1 here."""
    if value is None or value is False or value in ("", [], {}, ()):
        return True
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


def translate(key: str, value: Any) -> list[tuple[str, Any]]:
    """A TRL setting as the rlvr settings it sets, [(rlvr name, value), ...]: empty when it has no effect
    here (IGNORED, or an inert value of UNSUPPORTED, or TRL's to_dict() placeholders), two for a
    `fsdp` string that asks for offloading too.  Raises ValueError for an UNSUPPORTED setting at a
    value that would change training.  Keys unknown to TRL are returned as they are."""
    if key in ("fsdp", "fsdp_config"):
        return fsdp_settings(key, value)
    one = _translate(key, value)
    return [] if one is None else [one]


def _translate(key: str, value: Any) -> tuple[str, Any] | None:
    if key in IGNORED or (key == "eos_token" and value == "<EOS_TOKEN>"):  # SFTConfig.to_dict()'s placeholder for None
        return None
    if key in UNSUPPORTED:
        allowed, why = UNSUPPORTED[key]
        if inert(value, allowed):
            return None
        raise ValueError(f"{key}={value!r} is not supported yet: {why}")
    if key == "activation_checkpointing":  # transformers 5's new name
        return "gradient_checkpointing", value
    if key == "evaluation_strategy":  # transformers' older name
        return "eval_strategy", value
    if key == "no_cuda":  # transformers' older name
        return "use_cpu", value
    if key in ("attn_implementation", "model_revision"):  # TRL scripts' ModelConfig: arguments of from_pretrained
        return f"model_init_kwargs.{key.removeprefix('model_')}", value
    if key == "teacher_model_revision":  # DistillationConfig's: an argument of the teacher's from_pretrained
        return None if value is None else ("teacher_model_init_kwargs.revision", value)
    if key in ("resume_from_checkpoint", "vllm_importance_sampling_cap") and value is None:
        return None  # TRL's default: nothing to resume; the deprecated cap unset
    if key == "hub_token" and value == "<HUB_TOKEN>":  # to_dict() hides the token behind this
        return None
    if key == "model_init_kwargs" and isinstance(value, dict) and value.get("token") == "<TOKEN>":  # ... and this one
        return key, {k: v for k, v in value.items() if k != "token"}
    if key == "request_timeout":  # AsyncGRPOConfig's bound on one request; rlvr's vllm_server_timeout bounds each
        return "vllm_server_timeout", value
    if key == "max_tool_calling_iterations":  # TRL counts the tool rounds; rlvr the model's turns
        return None if value is None else ("max_turns", value + 1 if isinstance(value, int) and not isinstance(value, bool) else value)
    if key == "warmup_steps" and isinstance(value, float) and 0 < value < 1:  # transformers 5: a float < 1 is a ratio
        return "warmup_ratio", value
    return key, value


# transformers' words for `fsdp` (trainer_utils.FSDPOption); rlvr's FSDP2 always shards fully and wraps
# each decoder layer, and "offload" is fsdp_offload_params.
FSDP_WORDS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard", "offload", "auto_wrap")
# fsdp_config's keys that ask for CPU offload: transformers 5's cpu_offload, accelerate's offload_params
# (`fsdp_offload_params` in its config file); transformers drops a leading "fsdp_" from each key, and so does rlvr.
FSDP_OFFLOAD_KEYS = ("cpu_offload", "offload_params")


def fsdp_settings(key: str, value: Any) -> list[tuple[str, Any]]:
    """TRL's `fsdp` (true, "", None, "full_shard auto_wrap offload" or a list of such words) and
    `fsdp_config` (a mapping, or the path of a JSON file of one) as rlvr's fsdp and fsdp_offload_params."""
    if key == "fsdp":
        if value is None or isinstance(value, bool):
            return [("fsdp", bool(value))]
        words = value.split() if isinstance(value, str) else list(value)
        unknown = [w for w in words if w not in FSDP_WORDS]
        if unknown:
            raise ValueError(f"fsdp={value!r}: unknown option {unknown[0]!r}; transformers' options are {', '.join(FSDP_WORDS)} "
                             "(or fsdp=true)")
        return [("fsdp", bool(words))] + ([("fsdp_offload_params", True)] if "offload" in words else [])
    if isinstance(value, str):  # transformers reads a path as a JSON file
        import json
        from pathlib import Path

        if not Path(value).is_file():
            raise ValueError(f"fsdp_config={value!r}: not a mapping, nor a JSON file of one")
        value = json.loads(Path(value).read_text())
    if not isinstance(value or {}, dict):
        raise ValueError(f"fsdp_config must be a mapping (or the path of a JSON file of one); got {value!r}")
    offload = [v for k, v in (value or {}).items() if k.removeprefix("fsdp_") in FSDP_OFFLOAD_KEYS]
    return [("fsdp_offload_params", _true(offload[-1]))] if offload else []


def _true(value: Any) -> bool:
    """A flag as transformers and accelerate read it: a bool, or a string such as "true" / "false"."""
    return value if isinstance(value, bool) else str(value).lower() in ("y", "yes", "t", "true", "on", "1")


def loss_note(loss) -> str | None:
    """TRL 1.16's warnings about a loss type's settings (LossSettings), as one line, else None: each is
    trained as given, as TRL trains it."""
    if loss.loss_type == "luspo" and loss.importance_sampling_level != "sequence":
        return "loss_type=luspo is the LUSPO paper's with importance_sampling_level=sequence (TRL warns the same)"
    if loss.loss_type == "vespo" and loss.importance_sampling_level != "token":
        return ("loss_type=vespo weighs each completion by its whole ratio itself: importance_sampling_level should be token, "
                "the default (TRL warns the same)")
    if loss.loss_type == "cispo" and loss.epsilon_high is None:
        return (f"loss_type=cispo caps its importance weights at epsilon_high, which is unset: epsilon ({loss.epsilon}) caps "
                "them, as in TRL; the paper's eps_max is larger (ScaleRL uses epsilon_high=5)")
    if loss.importance_sampling_level == "sequence" and loss.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        return (f"loss_type={loss.loss_type} sums per-token terms, so with importance_sampling_level=sequence each completion "
                "weighs by its length; GSPO's setup is loss_type=grpo (TRL warns the same)")
    return None


def meaning_note(method: str, dpo_loss_type: tuple, label_smoothing: float) -> str | None:
    """One line when a value given does what TRL 1.16 does not (docs/finetune.md's table), else None."""
    if method == "dpo" and label_smoothing > 0 and "sigmoid" in dpo_loss_type:
        return (f"label_smoothing={label_smoothing} smooths the sigmoid DPO loss (cDPO), as TRL before 1.0 did; "
                "TRL 1.16 reads it only for its robust and exo_pair losses")
    return None


def ignored_keys(*sources: dict[str, Any]) -> list[str]:
    """The keys of these mappings that rlvr accepts without effect, for the one line printed at the start
    (an UNSUPPORTED key that got this far had its inert value); fsdp_config when it holds more than its
    offload keys, or nothing at all."""
    return sorted({k for src in sources for k, v in src.items()
                   if k in UNSUPPORTED or k in IGNORED and not (k == "fsdp_config" and _offload_only(v))})


def _offload_only(fsdp_config: Any) -> bool:
    keys = [k.removeprefix("fsdp_") for k in fsdp_config] if isinstance(fsdp_config, dict) else [None]
    return bool(keys) and all(k in FSDP_OFFLOAD_KEYS for k in keys)


def ignored_line(keys: list[str]) -> str:
    return (f"ignored: {len(keys)} TRL setting{'s' * (len(keys) != 1)} with no effect in rlvr (see `rlvr train --help`): "
            + ", ".join(keys))


def known_names() -> list[str]:
    """Every TRL name rlvr accepts, for "did you mean" hints."""
    return sorted(TRL_NAMES | FINETUNE_NAMES | set(IGNORED) | set(UNSUPPORTED) | {"activation_checkpointing", "resume_from_checkpoint",
                                                                   "vllm_importance_sampling_cap", "evaluation_strategy", "no_cuda",
                                                                   "attn_implementation", "model_revision", "teacher_model_revision",
                                                                   "reward_model_name_or_path"})


def other_settings_markdown() -> str:
    """docs/settings.md: TRL's settings without an rlvr field of their name: ignored, or refused unless inert."""
    by_reason: dict[str, list[str]] = {}
    for key, why in IGNORED.items():
        by_reason.setdefault(why, []).append(key)
    rows = ["TRL settings accepted without effect (named in one line when a run starts):", ""]
    rows += [f"- {why}: " + ", ".join(f"`{k}`" for k in sorted(keys)) for why, keys in by_reason.items()]
    rows += ["", "TRL settings accepted only at TRL's default (any other value is refused with the reason):", ""]
    rows += [f"- `{key}`: {why}" for key, (_, why) in UNSUPPORTED.items()]
    return "\n".join(rows)


# `trl vllm-serve` flags -> rlvr settings, so a launch script's server line runs as `rlvr vllm-serve`.
SERVE_FLAGS = {"model": "model", "revision": "model_init_kwargs.revision", "tensor_parallel_size": "vllm_tensor_parallel_size",
               "host": "vllm_server_host", "port": "vllm_server_port", "gpu_memory_utilization": "vllm_gpu_memory_utilization",
               "dtype": "dtype", "max_model_len": "vllm_max_model_length", "enforce_eager": "vllm_enforce_eager",
               "trust_remote_code": "trust_remote_code", "enable_prefix_caching": None, "log_level": None,
               "kv_cache_dtype": None, "vllm_model_impl": None}
SERVE_BOOLEAN = {"enforce_eager", "trust_remote_code", "enable_prefix_caching"}


def serve_flags(args: list[str]) -> list[str]:
    """`--model Qwen/Qwen2.5-7B --port 8001 --tensor-parallel-size 2` (trl vllm-serve's flags, - or _) ->
    key=value settings; other arguments pass through.  --data-parallel-size > 1 is refused with how
    rlvr gets the same (one server per replica, listed in the trainer's vllm_server_host)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            out.append(arg)
            i += 1
            continue
        name, eq, value = arg[2:].replace("-", "_").partition("=")
        if name not in SERVE_FLAGS and name != "data_parallel_size":
            raise ValueError(f"rlvr vllm-serve: unknown flag {arg}; settings are key=value (TRL's flags understood: "
                             f"{', '.join('--' + k.replace('_', '-') for k in SERVE_FLAGS)})")
        if not eq and name in SERVE_BOOLEAN and (i + 1 >= len(args) or args[i + 1].startswith("--") or "=" in args[i + 1]):
            value = "true"
        elif not eq:
            if i + 1 >= len(args):
                raise ValueError(f"rlvr vllm-serve: {arg} needs a value")
            value, i = args[i + 1], i + 1
        i += 1
        if name == "data_parallel_size":
            if int(value) > 1:
                raise ValueError(f"--data-parallel-size {value}: start {value} `rlvr vllm-serve` (one per GPU or group of "
                                 "--tensor-parallel-size GPUs, each on its own port) and give the trainer all of them: "
                                 "vllm_server_host=[host:port,host:port,...]; requests are spread over them")
            continue
        if SERVE_FLAGS[name] is None or (name == "dtype" and value == "auto"):
            continue  # vLLM's own choice either way, or rlvr's default dtype
        out.append(f"{SERVE_FLAGS[name]}={value}")
    return out
