"""The rules between sections, in one short place; each section's own value rules live beside its
fields.  Rules that need a registry or load user code (reward names, tasks, tools, environments,
rollout_func, loss types, alert rules, paths) are the launch check's (settings.check_settings)."""

from __future__ import annotations

from rlvr import methods
from rlvr.config.rollout import free_running_obstacles
from rlvr.errors import ConfigError


def validate(cfg) -> None:
    """Raise ConfigError listing every problem of the values: each section's, then across sections.
    Touches no model, dataset, registry or user code."""
    problems = cfg.problems() + cross_section_problems(cfg)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def cross_section_problems(cfg) -> list[str]:
    method = methods.METHODS.get(cfg.method)  # an unknown method is the finetune section's problem
    online = method is None or method.online  # samples generations each step (GRPO)
    rules = [
        (not (cfg.sync_ref_model and cfg.use_peft),
         "sync_ref_model=true is not supported with use_peft (as in TRL): the reference is the policy "
         "with its adapter switched off, not a model of its own to move; set one of them"),
        (not (cfg.rollout_workers > 0 and cfg.use_vllm and cfg.vllm_mode == "server"),
         "rollout_workers with use_vllm=true runs vLLM inside each Ray worker, not on `rlvr vllm-serve` servers: "
         "set vllm_mode=colocate (the default), or rollout_workers=0 to sample on the servers"),
        (not (cfg.max_staleness and cfg.use_peft and cfg.beta > 0 and cfg.kl_penalty == "reward"),
         "max_staleness >= 1 with use_peft and kl_penalty=reward is not supported: the reward's KL would need the adapter "
         "switched off while the update trains it; use kl_penalty=loss"),
        (not (cfg.multi_turn and not online),
         f"tools, environment and rollout_func are for rlvr train (GRPO), not rlvr {method and method.command_for(cfg.self_samples)}"),
        (not (not online and cfg.sync_ref_model),
         f"sync_ref_model (TR-DPO) is not supported for rlvr {cfg.method} yet: its reference stays the starting model"),
        (not (not online and (cfg.fsdp or cfg.rollout_workers or cfg.max_staleness)),
         f"rlvr {cfg.method} trains in one process: fsdp, rollout_workers and max_staleness are for rlvr train"),
        (not (cfg.turn_advantage == "return" and (cfg.advantage_estimator != "grpo" or cfg.multi_objective_aggregation != "sum_then_normalize")),
         "turn_advantage=return normalises the turns' rewards by GRPO's rule only (advantages.step_advantages): set "
         "advantage_estimator=grpo and multi_objective_aggregation=sum_then_normalize"),
    ] + qlora_rules(cfg) + sleep_mode_rules(cfg)
    problems = [message for ok, message in rules if not ok] + best_model_problems(cfg)
    if cfg.async_mode == "free":
        problems += free_running_obstacles(cfg.rollout_settings, cfg.processes, cfg.fsdp)
    problems += partial_rollout_problems(cfg)
    if cfg.num_generations < (method.min_generations if method is not None else 2):
        problems.append(f"num_generations must be at least 2 (a group of one has no relative advantage); got {cfg.num_generations}")
    if cfg.distill_reward_weight > 0 and cfg.num_generations < 2:
        problems.append(f"distill_reward_weight > 0 adds GRPO's loss on the verifier's rewards, whose advantage compares "
                        f"a prompt's completions: set num_generations >= 2; got {cfg.num_generations}")
    if cfg.method != "distill" and (cfg.teacher_model_name_or_path or cfg.distill_reward_weight or cfg.lmbda != 1):
        problems.append("teacher_model_name_or_path, distill_reward_weight and lmbda are for rlvr distill (DistillationTrainer)")
    if cfg.method == "distill":
        problems += distill_problems(cfg)
    option = lora_beyond_vllm(cfg)
    if cfg.use_peft and (cfg.use_vllm or cfg.rollout_workers) and option:
        problems.append(f"LoRA with {option} cannot be sampled by vLLM or the rollout workers, which take plain "
                        "LoRA adapters of linear layers only: sample in the training process (use_vllm=false, rollout_workers=0)")
    if cfg.vllm_max_model_length is not None:
        longest = (cfg.max_prompt_length or 1) + cfg.max_completion_length
        sizes = "max_prompt_length + max_completion_length" if cfg.max_prompt_length else "1 + max_completion_length"
        if cfg.vllm_max_model_length < longest:
            problems.append(f"vllm_max_model_length={cfg.vllm_max_model_length} has no room for a longest prompt and a full "
                            f"completion ({sizes} = {longest} tokens); set it to at least {longest}, or null")
    if online:  # how generations feed optimizer steps; sft and dpo take whole examples
        problems += generation_batch_problems(cfg)
    return problems


def distill_problems(cfg) -> list[str]:
    """What rlvr distill needs, and what it does not do yet."""
    rules = [
        (not cfg.fsdp, "rlvr distill with fsdp is not supported yet: the teacher's and the student's whole output "
                       "distributions are compared in one process; train with one process per GPU (torchrun without fsdp)"),
        (not cfg.multi_turn, "rlvr distill with tools, an environment or a rollout_func is not supported yet: it distils "
                             "single-turn completions"),
        (cfg.beta == 0, "rlvr distill has no KL term to a reference (as TRL's DistillationTrainer): its `beta` is distill_beta"),
        (cfg.lmbda == 1 or not cfg.max_staleness, "lmbda < 1 draws each step's source (samples or the dataset's completions) "
                                                 "when the step starts: set max_staleness=0"),
        (not (cfg.entropy_coef or cfg.use_adaptive_entropy or cfg.top_entropy_quantile < 1 or cfg.dynamic_sampling),
         "entropy_coef, use_adaptive_entropy, top_entropy_quantile and dynamic_sampling shape GRPO's loss, not the "
         "divergence of rlvr distill: leave them at their defaults"),
    ]
    return [message for ok, message in rules if not ok]


def qlora_rules(cfg) -> list[tuple[bool, str]]:
    """load_in_4bit with what would copy or shard the 4-bit weights."""
    if not cfg.load_in_4bit:
        return []
    return [
        (not cfg.fsdp, "load_in_4bit (QLoRA) with fsdp is not supported: FSDP2 would shard bitsandbytes' packed 4-bit weights; "
                       "train without fsdp (each process holds the whole 4-bit model, the adapter's gradients are summed)"),
        (not cfg.rollout_workers, "load_in_4bit (QLoRA) with rollout_workers is not supported: the Ray workers rebuild the model "
                                  "from the trainer's weights, which are packed 4-bit ones; sample in the training process"),
        (not (cfg.max_staleness and not cfg.use_vllm),
         "load_in_4bit (QLoRA) with max_staleness >= 1 and the in-process sampler is not supported: sampling ahead copies the "
         "policy's weights, which are packed 4-bit ones; use max_staleness=0, or use_vllm=true"),
    ]


def sleep_mode_rules(cfg) -> list[tuple[bool, str]]:
    """vllm_enable_sleep_mode: the colocated engine sleeps while the policy trains, so nothing may sample then."""
    if not (cfg.vllm_enable_sleep_mode and cfg.use_vllm and cfg.vllm_mode == "colocate"):
        return []  # without vLLM in this process (use_vllm=false, or servers) it has no effect, as in TRL
    return [
        (not cfg.max_staleness, "vllm_enable_sleep_mode=true puts vLLM to sleep while the policy trains, but with max_staleness >= 1 "
                                "it samples the next batch during the update: set one of them"),
        (not cfg.rollout_workers, "vllm_enable_sleep_mode=true is for vLLM colocated with the training process; with "
                                  "rollout_workers vLLM runs in the Ray workers, beside no training: set vllm_enable_sleep_mode=false"),
    ]


def best_model_problems(cfg) -> list[str]:
    """transformers' rule for load_best_model_at_end: a checkpoint at every evaluation, so the best one
    is there to load (eval_strategy = save_strategy; with steps, save_steps a multiple of eval_steps)."""
    if not cfg.load_best_model_at_end:
        return []
    if cfg.eval_strategy != cfg.save_strategy:
        no_eval = " (GRPOTrainer without an eval_dataset evaluates nothing: eval_strategy=no)" if cfg.eval_strategy == "no" else ""
        return [f"load_best_model_at_end needs the save and eval strategies to match (as in transformers): eval_strategy="
                f"{cfg.eval_strategy}{no_eval}, save_strategy={cfg.save_strategy}"]
    eval_steps = cfg.eval_steps or cfg.logging_steps
    if cfg.save_strategy == "steps" and cfg.save_steps % eval_steps:
        return [f"load_best_model_at_end needs save_steps to be a multiple of eval_steps (as in transformers): save_steps="
                f"{cfg.save_steps}, eval_steps={eval_steps}"]
    return []


def generation_batch_problems(cfg) -> list[str]:
    """TRL's rules: generation_batch_size or steps_per_generation (not both) sets the completions of one
    generation, a whole number of optimizer steps' batches and of groups."""
    batch, each = cfg.per_device_train_batch_size * cfg.processes, _per_device(cfg)
    if cfg.generation_batch_size is not None and cfg.steps_per_generation is not None and \
            cfg.generation_batch_size != batch * cfg.steps_per_generation:
        return [f"generation_batch_size={cfg.generation_batch_size} and steps_per_generation={cfg.steps_per_generation} disagree "
                f"({each} x steps_per_generation = {batch * cfg.steps_per_generation}); "
                "set one of them: the other follows"]
    if cfg.per_device_train_batch_size < 1 or cfg.gradient_accumulation_steps < 1 or cfg.num_generations < 1:
        return []  # reported by the sections
    if (cfg.generation_batch_size or 1) < 1 or (cfg.steps_per_generation or 1) < 1:
        return ["generation_batch_size and steps_per_generation must be at least 1"]
    b, g, step = cfg.completions_per_generation, cfg.num_generations, batch * cfg.gradient_accumulation_steps
    problems = []
    if b % step:
        what = "generation_batch_size" if cfg.generation_batch_size is not None else f"{each} x steps_per_generation"
        problems.append(f"{what} = {b} completions is not a whole number of optimizer steps of {each} x "
                        f"gradient_accumulation_steps = {step} completions; make it a multiple of {step}")
    if b % g:
        if cfg.generation_batch_size is None and cfg.steps_per_generation is None:
            n = cfg.per_device_train_batch_size  # the next micro-batch size that makes whole groups
            per_device = next(k for k in range(n, n + g + 1) if k * cfg.processes * cfg.gradient_accumulation_steps % g == 0)
            problems.append(
                f"{each} x gradient_accumulation_steps = {b} completions is not divisible by "
                f"num_generations = {g}; make it a multiple of {g}, e.g. per_device_train_batch_size={per_device}")
        else:
            problems.append(f"a generation of {b} completions is not divisible by num_generations = {g}; make it a multiple of {g}")
    return problems


def _per_device(cfg) -> str:
    """How the rules name the batch of one micro-batch step over every process."""
    return "per_device_train_batch_size" + (f" x {cfg.processes} processes" if cfg.processes > 1 else "")


def lora_beyond_vllm(cfg) -> str | None:
    """The LoRA option that makes the adapter more than low-rank updates of linear layers, or None."""
    given = cfg.lora_config or {}
    options = [(given.get("use_dora", cfg.use_dora), "use_dora"), (given.get("modules_to_save", cfg.lora_modules_to_save), "modules_to_save"),
               (given.get("bias", "none") != "none" or given.get("lora_bias"), "a trained bias"),
               (given.get("target_parameters", cfg.lora_target_parameters), "target_parameters")]
    return next((name for value, name in options if value), None)


def partial_rollout_problems(cfg) -> list[str]:
    """partial_rollout_tokens > 0 where the run could not carry a completion on (a line each): it takes the
    free-running producer (async_mode=auto falling back to lockstep here too) and completions of one turn
    (the samplers' `resume`: HFSampler's, and vLLM's through rollout/vllm_partial.py); dynamic sampling's
    rounds have their own rule."""
    if not cfg.partial_rollout_tokens:
        return []
    found = [f"partial_rollout_tokens needs the free-running producer, which this run cannot have: {line}"
             for line in free_running_obstacles(cfg.rollout_settings, cfg.processes, cfg.fsdp) if cfg.async_mode == "auto"]
    if cfg.multi_turn:
        found.append("partial_rollout_tokens is for completions of one turn: not with tools, environment or rollout_func")
    if cfg.dynamic_sampling:
        found.append("partial_rollout_tokens and dynamic_sampling both decide how many rounds a generation samples: "
                     "use one of them")
    return found
