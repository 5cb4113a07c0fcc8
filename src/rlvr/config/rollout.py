"""Settings of stage 1, the rollout: sampling, vLLM, Ray workers and multi-turn."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlvr.config.section import Section, choices


@dataclass(frozen=True)
class SamplingSettings(Section):
    # --- rollout --------------------------------------------------------------------
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

    def _rules(self) -> list[str]:
        problems = []
        if self.num_generations < 1:  # at least 2 where the method compares a group (config/rules.py)
            problems.append(f"num_generations must be at least 1; got {self.num_generations}")
        if self.max_completion_length < 1:
            problems.append("max_completion_length must be at least 1")
        return problems + sampling_problems(vars(self))


def sampling_problems(values: dict) -> list[str]:
    """The rules of the sampling settings, on the values sampling will use: the fields, or (launch
    check) the fields with generation_kwargs applied over them."""
    rules = [
        (values["temperature"] > 0, f"temperature must be > 0 for training rollouts; got {values['temperature']}"),
        (0 < values["top_p"] <= 1, f"top_p must be in (0, 1]; got {values['top_p']}"),
        (values["top_k"] >= 0, f"top_k must be >= 0 (0 = off); got {values['top_k']}"),
        (values["min_p"] is None or 0 <= values["min_p"] <= 1, f"min_p must be in [0, 1] (or null: off); got {values['min_p']}"),
        (values["repetition_penalty"] > 0,
         f"repetition_penalty must be > 0 (1 = off, > 1 discourages repeated tokens); got {values['repetition_penalty']}"),
        (all(isinstance(s, str) and s for s in values["stop_strings"]), "stop_strings must be non-empty strings"),
    ]
    return [message for ok, message in rules if not ok]


@dataclass(frozen=True)
class VLLMSettings(Section):
    # --- vllm -----------------------------------------------------------------------
    use_vllm: bool = False  # sample with vLLM instead of the in-process engine
    vllm_mode: str = "colocate"  # server: a separate `rlvr vllm-serve` | colocate: vLLM inside the training process
    vllm_gpu_memory_utilization: float = 0.3  # colocate: the share of accelerator memory vLLM may take
    vllm_kv_cache_gb: float = 0.0  # vLLM's KV cache in GiB; 0 = from vllm_gpu_memory_utilization (on CPU: that share of RAM, minus the whole process)
    vllm_tensor_parallel_size: int = 1  # GPUs vLLM shards the model over (colocate, and `rlvr vllm-serve`)
    vllm_max_model_length: int | None = None  # vLLM's context length; default the model's
    vllm_enforce_eager: bool = True  # run vLLM without torch.compile: starts in seconds instead of minutes on CPU
    vllm_enable_sleep_mode: bool = False  # colocate, CUDA GPUs: vLLM sleeps while the policy trains (its weights offloaded to CPU memory, its KV cache freed) and wakes to take new weights and sample
    vllm_server_host: str = "0.0.0.0"  # server mode: where `rlvr vllm-serve` listens; the trainer: one host or several (a list, or host,host:port,...)
    vllm_server_port: int = 8000  # server mode (rlvr vllm-serve: 0 listens on any free port and prints it)
    vllm_server_base_url: str | None = None  # server mode: e.g. http://host:8000, or several (a list); overrides host and port
    vllm_server_timeout: float = 240.0  # seconds to wait for the server (start, generation, weight push) before failing
    vllm_server_impl: str = "rlvr"  # rlvr vllm-serve: rlvr (rlvr's HTTP server around vLLM's engine, one request at a time) | vllm (vLLM's own OpenAI server with rlvr's weight-transfer plugin: concurrent requests batched); the trainer finds which it talks to
    vllm_weight_transfer: str = "http"  # server mode: http (one stream relayed by the servers) | collective (a torch.distributed broadcast: NCCL on GPU, gloo on CPU)
    vllm_importance_sampling_correction: bool = True  # correct for the trainer / sampler probability ratio of vLLM's tokens
    vllm_importance_sampling_mode: str = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | sequence_mask
    vllm_importance_sampling_clip_max: float | None = 3.0  # truncate: ratios capped here; mask: ratios above it zero the weight
    vllm_importance_sampling_clip_min: float | None = None  # mask modes: ratios below it zero the weight; null = no lower bound

    def _rules(self) -> list[str]:
        problems = choices(self, vllm_mode=("server", "colocate"), vllm_weight_transfer=("http", "collective"),
                           vllm_server_impl=("rlvr", "vllm"),
                           vllm_importance_sampling_mode=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"))
        clip_min, clip_max = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        rules = [
            (0 < self.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1]"),
            (self.vllm_tensor_parallel_size >= 1, f"vllm_tensor_parallel_size must be at least 1; got {self.vllm_tensor_parallel_size}"),
            (0 <= self.vllm_server_port <= 65535,
             f"vllm_server_port must be a port number, 1 to 65535 (0: any free port, for rlvr vllm-serve); got {self.vllm_server_port}"),
            (self.vllm_server_timeout > 0, "vllm_server_timeout must be > 0 seconds"),
            (self.vllm_kv_cache_gb >= 0, "vllm_kv_cache_gb must be >= 0 (0 = from vllm_gpu_memory_utilization)"),
            (clip_max is None or clip_max > 0, "vllm_importance_sampling_clip_max must be > 0 (or null)"),
            (clip_min is None or clip_max is None or clip_min < clip_max,
             f"vllm_importance_sampling_clip_min ({clip_min}) must be less than vllm_importance_sampling_clip_max ({clip_max})"),
            (not (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("_truncate")
                  and clip_min is None and clip_max is None),
             f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode} truncates the ratio: set "
             "vllm_importance_sampling_clip_max (e.g. 3.0) or vllm_importance_sampling_clip_min"),
        ]
        for url in self.vllm_server_base_url.split(",") if self.vllm_server_base_url is not None else ():
            rules.append((url.strip().startswith(("http://", "https://")),
                          f"vllm_server_base_url must start with http:// or https://, e.g. http://host:8000 (several: a list); got {url.strip()!r}"))
        return problems + [message for ok, message in rules if not ok]


@dataclass(frozen=True)
class WorkerSettings(Section):
    # --- rollout workers ------------------------------------------------------------
    rollout_workers: int = 0  # Ray actors that sample and score; 0 = in the training process
    ray_address: str | None = None  # an existing Ray cluster ("auto" or host:port); null = start a local one
    max_staleness: int = 0  # weight versions a sample may lag the policy; >= 1: the next generation is sampled while this step trains
    weight_sync_steps: int = 1  # optimizer steps between weight syncs to a sampler of its own (vLLM, Ray workers, the copy sampling ahead)
    async_mode: str = "lockstep"  # with max_staleness >= 1: lockstep (one generation ahead, reproducible) | free (a producer thread keeps up to max_staleness generations in flight; stale ones dropped) | auto (free where the producer can run: one process, or several with vLLM servers; else lockstep)
    in_flight_weight_updates: bool = True  # async_mode=free, in-process engine: load newer weights between decode steps of a running generation (false: between generations only)
    partial_rollout_tokens: int = 0  # async_mode=free, one turn (in-process engine or vLLM): the most tokens a completion is given per sampling round; one not done is carried to the next round instead of holding the step (partial rollouts); 0 = off

    def _rules(self) -> list[str]:
        problems = []
        if self.rollout_workers < 0:
            problems.append("rollout_workers must be >= 0 (0 = sample in the training process)")
        if self.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0 (0: on-policy), got {self.max_staleness}")
        if self.async_mode not in ("lockstep", "free", "auto"):
            problems.append(f"async_mode must be lockstep, free or auto, got {self.async_mode!r}")
        elif self.async_mode == "free" and self.max_staleness < 1:
            problems.append("async_mode=free keeps up to max_staleness generations in flight: set max_staleness >= 1 "
                            "(0 is on-policy, sampled between the steps)")
        if self.partial_rollout_tokens < 0:
            problems.append(f"partial_rollout_tokens must be >= 0 (0: off), got {self.partial_rollout_tokens}")
        elif self.partial_rollout_tokens and (self.async_mode == "lockstep" or self.max_staleness < 1):
            problems.append("partial_rollout_tokens carries unfinished completions from one generation to the next, which "
                            "the free-running producer does: set async_mode=free (or auto) and max_staleness >= 2 (a carried "
                            "token is at least one version older than its generation)")
        if self.weight_sync_steps < 1:
            problems.append(f"weight_sync_steps must be >= 1 (1: after every optimizer step), got {self.weight_sync_steps}")
        elif self.max_staleness >= 0 and self.staleness_bound > self.max_staleness:
            ahead = self.max_staleness >= 1
            problems.append(
                f"weight_sync_steps={self.weight_sync_steps} lets a sample lag up to {self.staleness_bound} weight versions "
                f"({'sampled one generation ahead, ' if ahead else ''}from weights sent every {self.weight_sync_steps} steps), "
                f"more than max_staleness={self.max_staleness}: set max_staleness >= {self.weight_sync_steps} "
                f"or weight_sync_steps <= {max(self.max_staleness, 1)}")
        return problems

    @property
    def staleness_bound(self) -> int:
        """The most weight versions a sample lags the policy it trains: weight_sync_steps - 1 from the
        sync schedule, one more when it was sampled ahead (max_staleness >= 1).  With async_mode=free the
        producer may run further ahead; a generation beyond max_staleness is dropped, so the bound is that
        (auto is held to lockstep's bound, which it may fall back to)."""
        if self.async_mode == "free":
            return max(self.max_staleness, self.weight_sync_steps)
        return self.weight_sync_steps - 1 + (1 if self.max_staleness >= 1 else 0)


TOOL_CALL_FORMATS = ("auto", "tags", "llama", "mistral")  # auto and tool_formats.FORMATS (a test keeps them equal)
TURN_ADVANTAGES = ("rollout", "return")


@dataclass(frozen=True)
class MultiTurnSettings(Section):
    # --- multi-turn -----------------------------------------------------------------
    tools: tuple = ()  # functions the model may call: python, calculator (built in) or package.module:function
    environment: str | dict | None = None  # package.module:Class the model talks to turn by turn (environments.py); TRL's several: {name: package.module:Class}, picked by each row's `environment` column
    max_turns: int = 4  # model turns per rollout with tools or an environment (TRL: max_tool_calling_iterations + 1)
    tool_timeout: float = 10.0  # seconds a tool call may run; past it the model reads an error
    max_tool_output_chars: int = 2000  # a tool's output is cut to this many characters, with a note saying so
    tool_call_format: str = "auto"  # how the model writes tool calls: auto (its chat template's family), tags, llama or mistral
    rollout_func: str | None = None  # package.module:function that samples the completions itself (TRL's rollout_func)
    env_timeout: float = 60.0  # seconds an environment's constructor, reset or step, or a rollout_func's own work (its sampling not counted), may take; 0 = no bound
    turn_advantage: str = "rollout"  # how the rewards turns give (an environment's Step.reward, a tool's ToolResult) train: rollout (summed into env_rewards; one advantage for every token of the rollout) | return (each credited on its turn: a token's advantage is the sum of the group-normalised rewards from its turn on; docs/multiturn.md)
    turn_cache: bool = True  # in-process engine: keep each rollout's KV cache between its turns, and with partial_rollout_tokens each carried completion's between its rounds, so a later turn or round runs only the new tokens (false: prefill the whole history each time)

    def _rules(self) -> list[str]:
        problems = []
        if isinstance(self.environment, dict) and (not self.environment or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.environment.items())):
            problems.append(f"environment as a mapping names each environment: {{name: package.module:Class}}, got "
                            f"{self.environment!r}")
        if self.rollout_func and (self.tools or self.environment):
            problems.append("rollout_func samples the completions itself: it cannot be combined with tools or environment")
        if self.max_turns < 1:
            problems.append(f"max_turns must be at least 1; got {self.max_turns}")
        if self.env_timeout < 0:
            problems.append(f"env_timeout must be >= 0 seconds (0: no bound), got {self.env_timeout}")
        if self.tool_timeout <= 0 or self.max_tool_output_chars < 1:
            problems.append("tool_timeout must be > 0 and max_tool_output_chars at least 1")
        problems += choices(self, tool_call_format=TOOL_CALL_FORMATS, turn_advantage=TURN_ADVANTAGES)
        return problems

    @property
    def multi_turn(self) -> bool:
        """Tools, an environment or a rollout_func: the rollout is not plain sampling."""
        return bool(self.tools or self.environment or self.rollout_func)


@dataclass(frozen=True)
class RolloutSettings(MultiTurnSettings, WorkerSettings, VLLMSettings, SamplingSettings):
    """Stage 1 as a whole: what the samplers, the Ray rollout workers and the multi-turn loop read."""


def free_running_obstacles(section, processes: int, fsdp: bool) -> list[str]:
    """What keeps a free-running producer (rollout/producer.py) from running in this layout, a line each
    (none: it can run): async_mode=free is refused with them (config/rules.py; settings.check_runnable for
    the processes a launch has), async_mode=auto falls back to lockstep.  In one process the producer
    samples with any engine and loads the weights itself; with several (fsdp too) it runs on rank 0 alone
    and samples every process's share on vLLM servers, as TRL's AsyncGRPOTrainer does, and the trainers
    load the servers together (every rank joins fsdp's gathers)."""
    found = []
    if section.rollout_workers:
        found.append("async_mode=free is not supported with rollout_workers yet (the workers sample a whole "
                     "step at a time): use vLLM servers, or async_mode=lockstep")
    if (processes > 1 or fsdp) and not (section.use_vllm and section.vllm_mode == "server"):
        launch = "fsdp" if fsdp else f"{processes} training processes"
        found.append(f"async_mode=free with {launch} samples every process's share on rank 0, on vLLM servers (as TRL's "
                     "AsyncGRPOTrainer): set use_vllm=true vllm_mode=server, or use async_mode=lockstep (each process then "
                     "samples its own share; auto does this)")
    return found


def free_running(section, processes: int, fsdp: bool) -> bool:
    """Whether a run samples with a free-running producer (rollout/producer.py): async_mode=free, or auto
    where nothing keeps it from running (free_running_obstacles), with max_staleness >= 1."""
    if not section.max_staleness or section.async_mode == "lockstep":
        return False
    return section.async_mode == "free" or not free_running_obstacles(section, processes, fsdp)
