"""Settings of stages 2 to 4: the rewards, the advantage, the loss with its KL term, the optimizer;
and the supervised methods (rlvr sft, rft, dpo)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlvr.config.section import Section, choices


@dataclass(frozen=True)
class RewardSettings(Section):
    # --- reward ---------------------------------------------------------------------
    reward_funcs: tuple | None = None  # built-in names, `package.module:function`, or a reward model's Hub id or local directory; default: the task's verifier
    reward_weights: tuple | None = None  # one per reward function; default all 1.0
    reward_args: dict = field(default_factory=dict)  # keyword arguments per reward, e.g. {soft_overlong: {cache: 32}}
    reward_timeout: float = 60.0  # seconds one call of one of your own reward functions may take; past it, its scores of that batch are None (0 = no limit)
    reward_model_device: str = "auto"  # where reward models given by id or path score: auto (the GPU this process trains on, else cpu), cpu, cuda:1, ...
    reward_model_batch_size: int = 32  # completions a reward model scores at once
    reward_audit: str | None = None  # a second verifier (any reward name) that re-grades a sample of each step's completions off the training loop; audit/* metrics, audit.jsonl, the reward_audit_disagreement alert
    reward_audit_args: dict = field(default_factory=dict)  # its keyword arguments, e.g. {compare: plain, sources: [boxed]} (the textbook's rule) for accuracy
    reward_audit_fraction: float = 0.1  # the share of each step's completions it re-grades (at least one)
    reward_audit_target: str | None = None  # the reward function whose verdicts it checks; default: the first of reward_funcs (the task's verifier without them)
    reward_isolation: str = "process"  # process: your own reward functions run in a worker process, killed with what it started past reward_timeout | inline: in the trainer's process (functions that need its memory or CUDA)

    def _rules(self) -> list[str]:
        problems = choices(self, reward_isolation=("process", "inline"))
        if self.reward_funcs is not None and len(self.reward_funcs) < 1:
            problems.append("reward_funcs must name at least one reward function")
        if self.reward_weights is not None:  # their number is checked with the functions (settings.check_settings)
            if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.reward_weights):
                problems.append("reward_weights must be numbers")
        named = set(self.reward_funcs or ()) | {n.rpartition(":")[2] for n in self.reward_funcs or ()}
        for name, args in self.reward_args.items():
            if self.reward_funcs is not None and name not in named:
                problems.append(f"reward_args names {name!r}, which is not in reward_funcs {list(self.reward_funcs)}")
            if not isinstance(args, dict):
                problems.append(f"reward_args.{name} must be a mapping of keyword arguments, got {args!r}")
        if not 0 < self.reward_audit_fraction <= 1:
            problems.append(f"reward_audit_fraction must be in (0, 1]; got {self.reward_audit_fraction}")
        if self.reward_audit is None and (self.reward_audit_args or self.reward_audit_target):
            problems.append("reward_audit_args and reward_audit_target need reward_audit: the verifier that audits")
        if self.reward_audit_target is not None and self.reward_funcs is not None and self.reward_audit_target not in named:
            problems.append(f"reward_audit_target {self.reward_audit_target!r} is not in reward_funcs {list(self.reward_funcs)}")
        if self.reward_model_batch_size < 1:
            problems.append(f"reward_model_batch_size must be at least 1; got {self.reward_model_batch_size}")
        if not (self.reward_model_device in ("auto", "cpu") or self.reward_model_device.split(":")[0] in ("cuda", "xpu", "mps")):
            problems.append(f"reward_model_device must be auto, cpu or a torch device such as cuda:1; got {self.reward_model_device!r}")
        if not (self.reward_timeout >= 0 and math.isfinite(self.reward_timeout)):
            problems.append(f"reward_timeout must be >= 0 seconds (0 = no limit); got {self.reward_timeout}")
        return problems


@dataclass(frozen=True)
class AdvantageSettings(Section):
    # --- advantage ------------------------------------------------------------------
    scale_rewards: str = "group"  # group | batch | none
    advantage_estimator: str = "grpo"  # the baseline: grpo (group mean) | rloo (leave-one-out, TRL's RLOOTrainer) | reinforce_pp (group mean, whitened over the batch: verl's reinforce_plus_plus_baseline)
    multi_objective_aggregation: str = "sum_then_normalize"  # several reward functions: sum_then_normalize (the weighted sum, then the advantage) | normalize_then_sum (each normalised in its group first, GDPO)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and sample more prompts
    max_sampling_rounds: int = 3  # dynamic sampling: extra generation rounds per step at most

    def _rules(self) -> list[str]:
        problems = choices(self, scale_rewards=("group", "batch", "none"), advantage_estimator=("grpo", "rloo", "reinforce_pp"),
                           multi_objective_aggregation=("sum_then_normalize", "normalize_then_sum"))
        if self.max_sampling_rounds < 0:
            problems.append("max_sampling_rounds must be >= 0")
        if self.advantage_estimator == "reinforce_pp" and self.scale_rewards != "group":
            problems.append(f"advantage_estimator=reinforce_pp normalises over the batch's tokens itself (REINFORCE++): "
                            f"leave scale_rewards at its default; got scale_rewards={self.scale_rewards}")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator != "grpo":
            problems.append("multi_objective_aggregation=normalize_then_sum is GRPO's (as in TRL): it needs advantage_estimator=grpo; "
                            f"got {self.advantage_estimator}")
        return problems


@dataclass(frozen=True)
class LossSettings(Section):
    # --- loss -----------------------------------------------------------------------
    loss_type: str = "dapo"  # grpo | dapo | dr_grpo | bnpo | cispo | sapo | luspo | vespo (TRL's eight; docs/training.md)
    epsilon: float = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # default: epsilon; cispo: the cap of its importance weight (the paper's eps_max; ScaleRL uses 5)
    delta: float | None = None  # two-sided clipping: the ratio of negative-advantage tokens is also capped at delta (> 1 + epsilon); null = off
    sapo_temperature_pos: float = 1.0  # sapo: the soft gate's temperature for tokens with a positive advantage
    sapo_temperature_neg: float = 1.05  # sapo: ... with a zero or negative advantage
    vespo_k_pos: float = 2.0  # vespo: the Gamma weight's power for completions with a non-negative advantage
    vespo_lambda_pos: float = 3.0  # vespo: ... its decay
    vespo_k_neg: float = 3.0  # vespo: the power for completions with a negative advantage
    vespo_lambda_neg: float = 2.0  # vespo: ... its decay
    entropy_coef: float = 0.0  # an entropy bonus: the loss minus entropy_coef x the mean entropy of the trained tokens; the adaptive controller's start value (0 = off)
    use_adaptive_entropy: bool = False  # Skywork-OR1's control: entropy_coef moves by entropy_coef_delta each step toward entropy_target, applied only while the entropy is at or below it
    entropy_coef_min: float = 0.0  # use_adaptive_entropy: the coefficient's floor
    entropy_coef_max: float = 1.0  # use_adaptive_entropy: its ceiling
    entropy_coef_delta: float = 0.005  # use_adaptive_entropy: its step
    entropy_target: float = 0.2  # use_adaptive_entropy: the mean token entropy (nats) it holds the policy at or above
    off_policy_mask_threshold: float | None = None  # leave out completions with a negative advantage whose mean KL from the sampling policy exceeds this (DeepSeek-V3.2); null = off
    top_entropy_quantile: float = 1.0  # train only on the tokens whose entropy is in this top fraction per batch (1 = all)
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    num_iterations: int = 1  # updates per generated batch
    mask_truncated_completions: bool = False  # completions cut at max length get no loss
    router_aux_loss_coef: float | None = None  # Mixture-of-Experts models: weight of the routers' load-balancing loss in the loss; null: the model's own (its config's router_aux_loss_coef), 0 = off

    @property
    def epsilon_high_value(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has an entropy bonus: a coefficient, or its adaptive control (TRL's rule)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    def _rules(self) -> list[str]:
        rules = [
            (self.epsilon > 0, f"epsilon must be > 0; got {self.epsilon}"),
            (self.epsilon_high is None or self.epsilon_high >= self.epsilon, "epsilon_high must be >= epsilon"),
            (self.delta is None or self.delta > 1 + self.epsilon_high_value,
             f"delta caps the unclipped ratio above the clip range: it must be > 1 + epsilon_high = "
             f"{1 + self.epsilon_high_value:g} (or null); got {self.delta}"),
            (0 <= self.top_entropy_quantile <= 1,
             f"top_entropy_quantile must be in [0, 1] (1 = train on every token); got {self.top_entropy_quantile}"),
            (self.num_iterations >= 1, "num_iterations must be at least 1"),
            (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0,
             f"sapo_temperature_pos and sapo_temperature_neg must be > 0; got {self.sapo_temperature_pos}, {self.sapo_temperature_neg}"),
            (self.entropy_coef_min <= self.entropy_coef_max and self.entropy_coef_delta >= 0,
             f"entropy_coef_min must be <= entropy_coef_max and entropy_coef_delta >= 0; got {self.entropy_coef_min}, "
             f"{self.entropy_coef_max}, {self.entropy_coef_delta}"),
            (self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
             f"off_policy_mask_threshold is a KL: >= 0, or null for off; got {self.off_policy_mask_threshold}"),
        ]
        return choices(self, importance_sampling_level=("token", "sequence")) + [m for ok, m in rules if not ok]


@dataclass(frozen=True)
class KLSettings(Section):
    # --- kl -------------------------------------------------------------------------
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(policy || reference))
    kl_penalty: str = "loss"  # loss: beta * KL added to the loss | reward: beta * KL subtracted from each reward
    use_bias_correction_kl: bool = True  # kl_penalty=loss: each token's KL weighted by its policy ratio, which corrects for sampling from the old policy (TRL's default)
    kl_target: float | None = None  # adaptive KL: move beta toward this KL each step; null = fixed beta
    sync_ref_model: bool = False  # TR-DPO: move the reference toward the policy every ref_model_sync_steps
    ref_model_mixup_alpha: float = 0.6  # sync: reference = alpha x policy + (1 - alpha) x reference
    ref_model_sync_steps: int = 512  # sync: steps between reference updates
    kl_horizon: int = 100  # adaptive KL: steps over which beta may change by about e-fold (Ziegler et al.)

    def _rules(self) -> list[str]:
        problems = choices(self, kl_estimator=("k1", "k2", "k3"), kl_penalty=("loss", "reward"))
        if self.beta < 0:
            problems.append(f"beta must be >= 0; got {self.beta}")
        if self.sync_ref_model:
            if not self.beta > 0:
                problems.append("sync_ref_model=true moves the reference model toward the policy, but beta=0 loads no reference; "
                                "set beta > 0 (e.g. beta=0.04) or sync_ref_model=false")
            if not 0 <= self.ref_model_mixup_alpha <= 1:
                problems.append(f"ref_model_mixup_alpha must be in [0, 1]; got {self.ref_model_mixup_alpha}")
            if self.ref_model_sync_steps < 1:
                problems.append(f"ref_model_sync_steps must be at least 1; got {self.ref_model_sync_steps}")
        if self.kl_horizon < 1:
            problems.append(f"kl_horizon must be at least 1; got {self.kl_horizon}")
        if self.kl_target is not None:
            if not self.kl_target > 0:
                problems.append(f"kl_target must be > 0 (or null for a fixed beta); got {self.kl_target}")
            if not self.beta > 0:
                problems.append("kl_target (adaptive KL) adjusts beta from its starting value: set beta > 0, e.g. beta=0.04")
        return problems


@dataclass(frozen=True)
class OptimizerSettings(Section):
    # --- optimisation ---------------------------------------------------------------
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
    num_processes: int | None = None  # training processes (torchrun's WORLD_SIZE), filled in when a run starts: as in TRL, per_device_train_batch_size is per process, so the batch grows with them; given, it must match the launch
    max_steps: int = -1  # optimizer steps; -1 = derive from num_train_epochs
    num_train_epochs: float = 3.0  # passes over the train prompts when max_steps is -1
    bf16: bool = False  # bf16 autocast for forward passes; weights and optimizer stay fp32
    fp16: bool = False  # fp16 autocast with loss scaling, where the device runs fp16 (a CUDA GPU); weights stay fp32
    gradient_checkpointing: bool = False  # recompute activations in the backward pass to save memory
    fsdp: bool = False  # with torchrun: shard weights, gradients and optimizer state across processes (FSDP2); sampling keeps a full copy
    fsdp_offload_params: bool = False  # fsdp on GPUs: the shards of the weights, gradients and AdamW state live in CPU memory, each layer's copied to the GPU for its use; the optimizer steps on the CPU (FSDP2's CPUOffloadPolicy). accelerate's name; TRL's fsdp="full_shard offload" and fsdp_config {cpu_offload: true} set it
    disable_dropout: bool = True  # dropout off in every pass, so log-probs are comparable
    seed: int = 42  # data order, sampling and task generation

    def _rules(self) -> list[str]:
        problems = choices(self, optim=("adamw_torch", "adamw_torch_fused", "adamw_torch_foreach"),
                           lr_scheduler_type=("constant", "linear", "cosine", "constant_with_warmup", "cosine_with_min_lr", "polynomial"))
        rules = [
            (self.per_device_train_batch_size >= 1, "per_device_train_batch_size must be at least 1"),
            (self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be at least 1"),
            (self.num_processes is None or self.num_processes >= 1, "num_processes must be at least 1 (or null: the launch's)"),
            (self.learning_rate > 0 and math.isfinite(self.learning_rate), f"learning_rate must be a finite number > 0; got {self.learning_rate}"),
            (0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)"),
            (self.warmup_steps >= 0, "warmup_steps must be >= 0"),
            (not (self.fp16 and self.bf16), "fp16 and bf16 cannot both be true: choose one autocast precision (bf16 needs no loss scaling)"),
            (not (self.fp16 and self.fsdp), "fp16 with fsdp is not supported (its loss scaling would decide per shard); use bf16=true"),
            (self.fsdp or not self.fsdp_offload_params,
             "fsdp_offload_params=true offloads the shards of fsdp to the CPU: set fsdp=true too (under torchrun)"),
            (self.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 = no clipping)"),
            (self.max_steps == -1 or self.max_steps >= 1, "max_steps must be -1 (use num_train_epochs) or at least 1"),
            (self.max_steps != -1 or self.num_train_epochs > 0, "num_train_epochs must be > 0 when max_steps is -1"),
        ]
        return problems + [message for ok, message in rules if not ok]


@dataclass(frozen=True)
class UpdateSettings(OptimizerSettings, KLSettings, LossSettings, AdvantageSettings):
    """Stages 3 and 4 as a whole: advantage, loss, KL and optimizer."""


@dataclass(frozen=True)
class DistillSettings(Section):
    # --- distill --------------------------------------------------------------------
    teacher_model_name_or_path: str | None = None  # distill: the teacher (`teacher` for short): a local directory or Hub id of a model with the student's vocabulary
    teacher_model_init_kwargs: dict = field(default_factory=dict)  # distill: keyword arguments for the teacher's from_pretrained (its revision, ...)
    distill_beta: float = 1.0  # distill: `beta` of rlvr distill and DistillationConfig: 0 forward KL(teacher || student) | 1 reverse KL(student || teacher) | between: generalised JSD with that mixture weight
    distill_reward_weight: float = 0.0  # distill: the weight of GRPO's policy-gradient loss on the verifier's rewards added to the divergence (0 = pure distillation; needs num_generations >= 2)
    lmbda: float = 1.0  # distill: GKD's share of steps on the student's own samples; the others train on the dataset's completions (sft's columns; 1 = on-policy only, TRL's DistillationTrainer)

    def _rules(self) -> list[str]:
        problems = []
        if not 0 <= self.distill_beta <= 1:
            problems.append(f"beta for rlvr distill (distill_beta) must be in [0, 1]; got {self.distill_beta}")
        if not 0 <= self.lmbda <= 1:
            problems.append(f"lmbda must be in [0, 1] (the share of on-policy steps); got {self.lmbda}")
        if not (self.distill_reward_weight >= 0 and math.isfinite(self.distill_reward_weight)):
            problems.append(f"distill_reward_weight must be a finite number >= 0; got {self.distill_reward_weight}")
        return problems


@dataclass(frozen=True)
class FinetuneSettings(Section):
    # --- sft and dpo ----------------------------------------------------------------
    method: str = "grpo"  # what is trained; set by the command: grpo (rlvr train) | sft (rlvr sft, rlvr rft) | dpo (rlvr dpo) | distill (rlvr distill)
    max_length: int | None = 1024  # sft / dpo: prompt + completion tokens at most; a longer sequence is cut as truncation_mode says
    truncation_mode: str = "keep_start"  # sft / dpo: keep_start cuts a sequence's end | keep_end its start (TRL's)
    completion_only_loss: bool | None = None  # sft: loss on the completion's tokens only (null: true); false: on the prompt's too
    assistant_only_loss: bool = False  # sft, chat data: loss on the assistant's tokens only, every turn (the chat template's {% generation %} marks them)
    dataset_text_field: str = "text"  # sft: the column of plain text trained on as a whole (TRL's language-modelling format)
    sft_loss_type: str = "nll"  # sft: `loss_type` of SFTConfig: nll (negative log-likelihood) | dft (each token's weighted by its probability)
    packing: bool = False  # sft: a micro-batch holds per_device_train_batch_size rows of max_length tokens, each filled with whole sequences
    completion_column: str | None = None  # sft: the demonstration; default the first of completion, solution, answer
    self_samples: bool = False  # sft / dpo: train on the model's own samples scored by the verifier (sft: the correct ones, RFT; dpo: correct vs incorrect pairs)
    self_rounds: int = 3  # self_samples: rounds of sampling, then training on what was kept (with max_steps set: until it)
    self_round_prompts: int = 64  # self_samples: train prompts per round, num_generations samples each
    self_round_steps: int = 20  # self_samples: optimizer steps on each round's data
    dpo_beta: float = 0.1  # dpo: `beta` of rlvr dpo and DPOConfig; how far the policy may move from the reference
    dpo_loss_type: tuple = ("sigmoid",)  # dpo: `loss_type` of rlvr dpo and DPOConfig, one or several: sigmoid (DPO) | ipo | hinge
    loss_weights: tuple | None = None  # dpo: the weight of each of loss_type's losses in their sum; default all 1.0
    label_smoothing: float = 0.0  # dpo sigmoid: the assumed chance that a pair's preference is flipped (cDPO)

    @property
    def command(self) -> str:
        """The rlvr command that trains this method: train, sft, rft (sft with self_samples) or dpo."""
        from rlvr import methods

        return methods.get(self.method).command_for(self.self_samples)

    def _rules(self) -> list[str]:
        from rlvr import methods

        problems = choices(self, method=tuple(methods.METHODS))
        if self.max_length is not None and self.max_length < 2:
            problems.append(f"max_length must be at least 2 (a prompt token and a completion token), or null; got {self.max_length}")
        if not self.dpo_beta > 0:
            problems.append(f"beta for rlvr dpo must be > 0; got {self.dpo_beta}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing must be in [0, 0.5); got {self.label_smoothing}")
        elif self.label_smoothing > 0 and set(self.dpo_loss_type) != {"sigmoid"}:
            problems.append(f"label_smoothing applies to loss_type=sigmoid only; got loss_type={list(self.dpo_loss_type)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.dpo_loss_type):
            problems.append(f"loss_weights needs one weight per loss_type: {len(self.loss_weights)} weights for "
                            f"loss_type={list(self.dpo_loss_type)}")
        problems += choices(self, truncation_mode=("keep_start", "keep_end"), sft_loss_type=("nll", "dft"))
        for name in ("self_rounds", "self_round_prompts", "self_round_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1; got {getattr(self, name)}")
        method = methods.METHODS.get(self.method)
        if method is not None and not method.online:
            if self.packing and method.pairs:
                problems.append("packing applies to rlvr sft only")
            if self.packing and self.max_length is None:
                problems.append("packing=true fills rows of max_length tokens: set max_length (e.g. 1024)")
        return problems
