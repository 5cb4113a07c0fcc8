"""A run's settings, resolved and checked: the one place that turns the command line into a
Config (`resolve_config`) and decides whether that Config can run here (`check_runnable`).

config.py says what a setting is (the dataclass, parsing, merging, each setting's own rules);
this module adds what lies outside one config: the built-in demo, the saved config of a run
being resumed or evaluated, the launch (how many processes) and the environment (optional
packages, the Hugging Face Hub).  Both are called before any directory is made or model loaded.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from rlvr import methods
from rlvr.config import Config, build_config, free_running, free_running_obstacles, load_yaml, parse_overrides, sampling_problems, validate
from rlvr.errors import ConfigError

if TYPE_CHECKING:
    from rlvr.distributed import World


def split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`["run.yaml", "beta=0.04"]` -> ("run.yaml", ["beta=0.04"]); at most one config file."""
    files = [a for a in args if "=" not in a]
    if len(files) > 1:
        raise ConfigError(f"expected at most one config file, got {files}; settings are key=value")
    return (files[0] if files else None), [a for a in args if "=" in a]


def demo_config_path() -> Path:
    return packaged_config_path("demo")


def packaged_config_path(name: str) -> Path | None:
    """rlvr/configs/NAME.yaml for a bare name that is one (demo, tools_demo), else None."""
    if not name.replace("_", "").replace("-", "").isalnum():
        return None
    path = Path(str(resources.files("rlvr") / "configs" / f"{name}.yaml"))
    return path if path.is_file() else None


def resolve_config(args: list[str], default_file: str | None = None, run_base: bool = False,
                   ignored: list[str] | None = None, method: str | None = None) -> Config:
    """defaults <- (the method's defaults) <- (a run's saved config) <- CONFIG_FILE <- key=value.

    `method` (sft, dpo): the command's own defaults and names, as TRL's SFTConfig / DPOConfig
    have them (methods.py: DPO's `beta` and `loss_type` are dpo_beta and dpo_loss_type).

    The saved config of a run is the base when resuming it, and (run_base) when
    its directory is the model, so `rlvr eval model=runs/x` evaluates on the
    task and settings the run trained with.  `ignored` collects the TRL settings given that
    have no effect here (config.build_config).
    """
    config_file, overrides = split_args(args)
    config_file = config_file or default_file
    if config_file and packaged_config_path(config_file):  # `rlvr train demo`, `rlvr train tools_demo`
        config_file = str(packaged_config_path(config_file))
    file_values = load_yaml(config_file) if config_file else {}
    override_values = parse_overrides(overrides)
    base, defaults = {}, {}
    if method is not None:
        own = methods.get(method).settings
        defaults = own({})  # below a resumed run's own settings, as for rlvr train
        # Given {}, Method.settings answers with the defaults: only what the user gave is renamed.
        file_values = own(file_values) if file_values else {}
        override_values = own(override_values) if override_values else {}
    merged = {**file_values, **override_values}
    model = merged.get("model") or merged.get("model_name_or_path")
    if run_base and isinstance(model, str) and (Path(model) / "config.yaml").is_file():
        base = _saved_settings(Path(model))
    resume = merged.get("resume", merged.get("resume_from_checkpoint"))
    if resume:
        from rlvr.rundir import latest_run_dir

        if merged.get("output_dir"):
            run_dir = Path(merged["output_dir"])
        else:
            run_dir = Path(resume).parent if isinstance(resume, str) else latest_run_dir()
        if (run_dir / "config.yaml").is_file():
            base = _saved_settings(run_dir)
        base["output_dir"] = str(run_dir)
    if method is not None and base.get("method", method) != method:
        raise ConfigError(f"{base.get('output_dir') or 'the run'} was trained with method={base['method']}; "
                          f"continue it with rlvr {methods.get(base['method']).command}")
    return check_settings(build_config(defaults, base, file_values, override_values, ignored=ignored))


def _saved_settings(run_dir: Path) -> dict:
    """A run's saved config.yaml, without the settings that say where and how to run, which are
    never inherited from a saved run."""
    run_control = ("output_dir", "resume", "resume_checkpoint", "resume_override")
    return {k: v for k, v in load_yaml(run_dir / "config.yaml").items() if k not in run_control}


def check_runnable(cfg: Config, world: World) -> None:
    """Raise, before any directory is made or model loaded, if this config cannot train in this
    launch and environment: the settings' own rules (config.validate, every problem listed), the
    rules of several processes, then the packages and the model the settings need.  Libraries are
    imported here, inside, so importing this module stays as light as importing config."""
    validate(cfg)
    check_settings(cfg)
    if cfg.fsdp and not world.enabled:
        raise ConfigError("fsdp=true shards the model across several processes: launch with "
                          "torchrun --nproc_per_node N -m rlvr.cli train ... (or set fsdp=false)")
    if cfg.fp16 and not world.device.startswith("cuda"):
        raise ConfigError(f"fp16=true needs a CUDA GPU (fp16 autocast with loss scaling), and this run is on {world.device}"
                          f"{' (use_cpu=true)' if cfg.use_cpu else ''}; on a CPU use bf16=true")
    _check_gpu_only(cfg, world.device)
    if world.enabled:
        if cfg.prompts_per_step % world.world_size:
            each = cfg.completions_per_generation / world.world_size
            raise ConfigError(
                f"each of the {world.world_size} processes gets {each:g} completions of a generation (per_device_train_batch_size x "
                f"steps_per_generation), not a whole number of groups of num_generations={cfg.num_generations}: each process "
                "samples and trains on whole groups; make per_device_train_batch_size x steps_per_generation a multiple of "
                f"{cfg.num_generations}"
            )
        obstacles = free_running_obstacles(cfg.rollout_settings, world.world_size, cfg.fsdp)
        if cfg.async_mode == "free" and obstacles:
            raise ConfigError("; ".join(obstacles))
        if free_running(cfg.rollout_settings, world.world_size, cfg.fsdp) and cfg.fsdp and cfg.beta > 0 and cfg.kl_penalty == "reward":
            raise ConfigError("async_mode=free with fsdp and kl_penalty=reward is not supported: the reward's KL would be "
                              "computed on rank 0's sampling thread from a reference sharded over every process; use "
                              "kl_penalty=loss, or async_mode=lockstep")
        if cfg.rollout_workers > 0:
            raise ConfigError(
                "rollout_workers is not supported with several training processes: the Ray workers already sample "
                "and score for the whole step; train in one process with rollout_workers=N, or use several "
                "processes with use_vllm=true vllm_mode=server and `rlvr vllm-serve` on the rollout machines"
            )
    if "python" in cfg.tools:  # the tool runs the model's programs in the sandbox: one must work here
        from rlvr.tools import ToolError, require_sandbox

        try:
            require_sandbox()
        except ToolError as e:
            raise ConfigError(str(e)) from None
    from rlvr.models import require_hub_model

    require_hub_model(cfg.model, cfg.model_init_kwargs.get("revision"))  # offline, a hub id not in the cache fails now
    if cfg.push_to_hub:
        from rlvr.hub import check_push
        from rlvr.rundir import default_output_dir

        # a token and a valid repository name now, not after training
        check_push(cfg.run_settings, default_output_dir(cfg.run_settings, cfg.data_settings, cfg.command))
    if cfg.use_peft:
        from rlvr.lora import require_peft

        require_peft()
    if cfg.use_vllm:
        from rlvr.rollout.vllm import require_vllm

        require_vllm()
    if cfg.load_in_4bit:
        from rlvr.qlora import require_bitsandbytes

        require_bitsandbytes()


def _check_gpu_only(cfg: Config, device: str) -> None:
    """The settings that move memory off a GPU, refused where there is none to free."""
    if device.startswith("cuda"):
        return
    here = f"this run is on {device}{' (use_cpu=true)' if cfg.use_cpu else ''}"
    if cfg.fsdp_offload_params:
        raise ConfigError(f"fsdp_offload_params=true keeps FSDP's shards in CPU memory and copies each layer's to the GPU for its "
                          f"use, but {here}, where they are in CPU memory already (and torch's CPUOffloadPolicy pins that "
                          "memory, which needs a GPU): set fsdp_offload_params=false")
    if cfg.vllm_enable_sleep_mode and cfg.use_vllm and cfg.vllm_mode == "colocate":
        raise ConfigError(f"vllm_enable_sleep_mode=true needs a GPU: vLLM has sleep mode on CUDA, ROCm and XPU only "
                          f"(current_platform.is_sleep_mode_available()), and {here}; set vllm_enable_sleep_mode=false")


def check_settings(cfg: Config, rewards_later: bool = False) -> Config:
    """The rules that need a registry or load user code, every problem listed in one ConfigError:
    loss types, sampling settings with generation_kwargs, schedules, reward names and their knobs,
    alert rules, the task, tools, environment and rollout_func, local paths, Ray.  Run by
    check_runnable and by GRPOConfig(...) at construction, before any model loads.
    rewards_later: the reward functions come later (GRPOConfig, whose trainer is given them), so
    reward_weights without reward_funcs are checked then; so do DistillationConfig's teacher and the tools
    or environment that turn_advantage=return needs."""
    from rlvr.alerts import RULES
    from rlvr.finetune.losses import DPO_LOSS_TYPES, TRL_ONLY_DPO_LOSS_TYPES
    from rlvr.losses import LOSS_TYPES
    from rlvr.optim import schedule_problems
    from rlvr.rollout import generation_settings

    problems = []
    if cfg.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {cfg.loss_type!r}")
    if cfg.multi_objective_aggregation == "normalize_then_sum" and cfg.beta > 0 and cfg.kl_penalty == "reward":
        problems.append("multi_objective_aggregation=normalize_then_sum normalises each reward function's scores, so a KL "
                        "charged to the total reward would be lost: use kl_penalty=loss (TRL's) with it")
    for name in cfg.dpo_loss_type:
        if name not in DPO_LOSS_TYPES:
            known = "is one of TRL's DPO losses that rlvr does not have yet" if name in TRL_ONLY_DPO_LOSS_TYPES else "is unknown"
            problems.append(f"loss_type {name!r} for rlvr dpo {known}; rlvr has {', '.join(DPO_LOSS_TYPES)} "
                            "(several as a list, weighted by loss_weights)")
    sampling, bad = generation_settings(cfg.rollout_settings)  # the sampling settings, generation_kwargs applied over them
    problems += bad + (sampling_problems(sampling) if cfg.generation_kwargs else [])
    problems += schedule_problems(cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs, cfg.learning_rate)
    problems += [f"on_alert: unknown rule {rule!r}; rules: {', '.join(RULES)}" for rule in cfg.on_alert if rule not in RULES]
    problems += _reward_problems(cfg, rewards_later) + _multiturn_problems(cfg) + _path_problems(cfg)
    if cfg.turn_advantage == "return" and not (cfg.tools or cfg.environment) and not rewards_later:  # GRPOTrainer gives them later
        problems.append("turn_advantage=return credits the rewards tools or an environment give per turn: set tools or "
                        "environment (GRPOTrainer: tools= or environment_factory=)")
    if cfg.method == "distill" and not cfg.teacher_model_name_or_path and not rewards_later:  # DistillationTrainer gives it later
        problems.append("rlvr distill needs a teacher: teacher=<local directory or Hub id> "
                        "(DistillationConfig.teacher_model_name_or_path, or DistillationTrainer(teacher_model=...))")
    if cfg.rollout_workers > 0:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            problems.append("rollout_workers > 0 needs Ray, which is not installed. Install it with: "
                            "pip install 'rlvr[ray]'  (or: pip install 'ray>=2.9')")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return cfg


def _reward_problems(cfg: Config, rewards_later: bool = False) -> list[str]:
    """Reward names that resolve, one weight per function (without reward_funcs, the task's verifier
    is the one function), built-in rewards' knobs (rewards.check_reward_args), the task."""
    from rlvr.rewards import check_reward_args, resolve_reward
    from rlvr.tasks import check_task, verifier_name

    problems = []
    weights, funcs = cfg.reward_weights, cfg.reward_funcs
    if weights is not None and not (funcs is None and rewards_later):
        names = list(funcs) if funcs is not None else [verifier_name(cfg.data_settings)]
        if len(weights) != len(names):
            named = f"reward_funcs has {len(names)}" if funcs is not None else \
                f"without reward_funcs the one reward is the task's verifier ({names[0]}); name the functions in reward_funcs"
            problems.append(f"reward_weights has {len(weights)} values but {named}; give one weight per function")
    for name in cfg.reward_funcs or ():
        try:
            resolve_reward(name)
        except (ValueError, ImportError, AttributeError) as e:
            problems.append(str(e))
    for name, args in cfg.reward_args.items():
        if ":" not in name and isinstance(args, dict) and args:
            problems += check_reward_args(name, args)
    if cfg.reward_audit is not None:  # the auditing verifier (audit.py): found, its arguments known
        try:
            resolve_reward(cfg.reward_audit)
            problems += [f"reward_audit_args: {p.partition(': ')[2]}"
                         for p in check_reward_args(cfg.reward_audit, dict(cfg.reward_audit_args))]
        except (ValueError, ImportError, AttributeError) as e:
            problems.append(f"reward_audit: {e}")
    return problems + check_task(cfg.data_settings)


def _multiturn_problems(cfg: Config) -> list[str]:
    """Tools, environment and rollout_func: each can be found and used."""
    problems = []
    if cfg.tools:
        from rlvr.tools import Tool, ToolError

        for spec in cfg.tools:
            try:
                Tool.of(spec)
            except ToolError as e:
                problems.append(str(e))
    if cfg.environment:
        from rlvr.rollout.multiturn import check_environments

        problems += check_environments(cfg.environment, cfg.tools, cfg.env_timeout or None)
    if cfg.rollout_func:
        from rlvr.rollout.custom import load_rollout_func

        try:
            load_rollout_func(cfg.rollout_func)
        except ValueError as e:
            problems.append(str(e))
    return problems


TEACHER_OBJECT = "<teacher object>"  # teacher_model_name_or_path of a teacher given to DistillationTrainer as a loaded model


def _path_problems(cfg: Config) -> list[str]:
    problems = []
    if _looks_local(cfg.model) and not Path(cfg.model).expanduser().exists():
        problems.append(f"model directory not found: {cfg.model}")
    teacher = cfg.teacher_model_name_or_path
    if teacher and teacher != TEACHER_OBJECT and _looks_local(teacher) and not Path(teacher).expanduser().exists():
        problems.append(f"teacher model directory not found: {teacher}")
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
