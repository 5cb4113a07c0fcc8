"""The data passed between the four stages of a step.

    Example  --rollout-->  Rollout (x G per example, one group)  --reward-->  rewards
             --advantage-->  advantages  --update-->  loss

An Example is one dataset row: the prompt, the reference answer and every other
column (those reach the reward functions as keyword arguments, as in TRL).
A Rollout is one sampled completion of one prompt.  A Batch is what the update
stage consumes: padded token tensors plus one advantage per completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Union

import torch

from rlvr.advantages import without_signal  # the rule the advantages use

Message = dict[str, str]
Prompt = Union[str, list[Message]]
# What a reward function receives for one completion: plain text when the prompt
# was plain text, a one-message list [{"role": "assistant", "content": ...}] when
# the prompt was a list of chat messages (TRL's convention, so TRL reward
# functions work unchanged).
Completion = Union[str, list[Message]]


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer and any extra dataset columns."""

    prompt: Prompt
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)

    @property
    def is_conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class Rollout:
    """One sampled completion.

    `logprobs[t]` is the log-probability of `completion_ids[t]` under the
    sampling distribution softmax(logits / temperature), before top-k / top-p
    truncation (the same quantity the update computes, so the two can be
    compared).  `finish_reason` is "stop" (EOS or a stop string), "length"
    (hit max_completion_length) or, for a completion a partial rollout carries on to a later
    round, "partial".  `text` is the decoded completion without the
    EOS token and cut before a matched stop string.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    # Multi-turn rollouts (rollout/multiturn.py): which completion tokens the policy wrote (False:
    # an observation between turns, left out of the loss); the turns as chat messages; counters
    # (turns, tool_calls, tool_errors, env_reward, env_error) and turn_rewards, (the turn's last token, the
    # reward its step gave) per turn that gave one.  None for a single-turn rollout.
    mask: list[bool] | None = None
    messages: list[Message] | None = None
    info: dict | None = None
    # The weight version that sampled each completion token, where the engine records it (async_mode=free,
    # rollout/producer.py: weights may change while a completion is decoded); None: not recorded.
    versions: list[int] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def _prompt_groups(rollouts: list, group_size: int) -> list[int]:
    """Per rollout, an id shared by the rollouts of its group that start from the same prompt ids: a whole
    group, unless its completions started apart (TRL's environments may give each its own task)."""
    ids: dict = {}
    return [ids.setdefault((i // group_size, tuple(r.prompt_ids)), len(ids)) for i, r in enumerate(rollouts)]


@dataclass
class Batch:
    """Completions ready for the update: prompts left-padded, completions right-padded.

    Row i is prompt_ids[i] (masked by prompt_mask) followed by completion_ids[i]
    (masked by completion_mask).  `advantages` holds one value per completion, or with process rewards
    one per completion token ([B, T], advantages.step_advantages).
    `old_logprobs` is filled before the first update when num_iterations > 1
    (otherwise the current log-probs, detached, stand in for them);
    `ref_logprobs` when beta > 0.  `sampler_logprobs` are the log-probs the sampler
    reported for the tokens it drew (for the importance correction of an external sampler).
    """

    prompt_ids: torch.Tensor  # [B, P] long
    prompt_mask: torch.Tensor  # [B, P] bool
    completion_ids: torch.Tensor  # [B, T] long
    completion_mask: torch.Tensor  # [B, T] bool
    advantages: torch.Tensor  # [B] float, or [B, T] (process rewards)
    old_logprobs: torch.Tensor | None = None  # [B, T]
    ref_logprobs: torch.Tensor | None = None  # [B, T]
    group_ids: torch.Tensor | None = None  # [B] long: rows with the same id share their prompt
    sampler_logprobs: torch.Tensor | None = None  # [B, T]
    # [B, T]: False at completion tokens the policy did not write (a multi-turn rollout's observations):
    # they are in the sequence the model reads, but not in the loss.  None: the policy wrote them all.
    policy_mask: torch.Tensor | None = None
    # Completions of groups without signal left out of the batch (their advantage is 0, so they would add
    # nothing to the policy term): still counted where the loss normalises, so the step is TRL's.
    skipped_rows: int = 0
    skipped_tokens: int = 0
    # One of several optimizer steps on a generation (steps_per_generation): the generation's loss tokens on
    # this process, whose share per step is dapo's normaliser, as TRL's (0: the batch is the whole generation).
    generation_tokens: int = 0
    generation_parts: int = 1  # how many steps share it

    @property
    def loss_mask(self) -> torch.Tensor:
        """The tokens the loss, the KL and the importance weights cover: present, and written by the policy."""
        return self.completion_mask if self.policy_mask is None else self.completion_mask & self.policy_mask

    @classmethod
    def from_rollouts(cls, rollouts: list[Rollout], advantages: torch.Tensor, keep: torch.Tensor, pad_id: int,
                      mask_truncated: bool, group_size: int | None = None, skipped: torch.Tensor | None = None) -> "Batch":
        """The rollouts where `keep` is True; with mask_truncated, a truncated completion is fully masked.
        With group_size, rollouts i*G .. i*G+G-1 are one group (they share a prompt).  `skipped`: the
        rollouts left out for want of signal, counted in skipped_rows and skipped_tokens."""
        rows = [r for r, k in zip(rollouts, keep.tolist()) if k]
        left_out = [r for r, k in zip(rollouts, skipped.tolist()) if k] if skipped is not None else []
        n = len(rows)
        p_width = max((len(r.prompt_ids) for r in rows), default=0)
        c_width = max((len(r.completion_ids) for r in rows), default=0)
        prompt_ids = torch.full((n, p_width), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_width), dtype=torch.bool)
        completion_ids = torch.full((n, c_width), pad_id, dtype=torch.long)
        completion_mask = torch.zeros((n, c_width), dtype=torch.bool)
        sampler_logprobs = torch.zeros((n, c_width))
        policy_mask = torch.ones((n, c_width), dtype=torch.bool) if any(r.mask is not None for r in rows) else None
        for i, r in enumerate(rows):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            prompt_ids[i, p_width - p :] = torch.tensor(r.prompt_ids)
            prompt_mask[i, p_width - p :] = True
            completion_ids[i, :c] = torch.tensor(r.completion_ids)
            completion_mask[i, :c] = not (mask_truncated and r.truncated)
            if r.mask is not None:  # a multi-turn rollout: the observations between turns are not the policy's
                policy_mask[i, :c] = torch.tensor(r.mask[:c], dtype=torch.bool)
            reported = r.logprobs[:c]
            sampler_logprobs[i, : len(reported)] = torch.tensor(reported, dtype=torch.float)
        groups = None if group_size is None else torch.tensor(_prompt_groups(rollouts, group_size), dtype=torch.long)[keep]
        skipped_tokens = sum(0 if mask_truncated and r.truncated else sum(r.mask) if r.mask is not None else len(r.completion_ids)
                             for r in left_out)
        advantages = advantages[keep].float()
        if advantages.dim() == 2:  # per token: as wide as the kept completions
            advantages = torch.nn.functional.pad(advantages, (0, max(c_width - advantages.shape[1], 0)))[:, :c_width]
        return cls(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, group_ids=groups,
                   sampler_logprobs=sampler_logprobs, policy_mask=policy_mask, skipped_rows=len(left_out),
                   skipped_tokens=skipped_tokens)

    @classmethod
    def empty(cls, pad_id: int = 0) -> "Batch":
        """One row with no completion token: a forward (and backward) that contributes zero loss and
        zero gradient, for a rank with fewer micro-batches than the others where every forward of a
        sharded model is a collective (fsdp)."""
        one = torch.full((1, 1), pad_id, dtype=torch.long)
        return cls(one, torch.ones((1, 1), dtype=torch.bool), one.clone(), torch.zeros((1, 1), dtype=torch.bool),
                   torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.long), sampler_logprobs=torch.zeros((1, 1)))

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def to(self, device) -> "Batch":
        """The same batch on `device` (itself when it is there already)."""
        if self.completion_ids.device == torch.device(device):
            return self
        return Batch(**{f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                        else getattr(self, f.name) for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def select(self, index: torch.Tensor | slice) -> "Batch":
        """The rows `index`, with the padding columns that no selected row uses removed."""
        def pick(t):
            return None if t is None else t[index]

        prompt_mask = self.prompt_mask[index]
        completion_mask = self.completion_mask[index]
        # Prompts are left-padded: drop leading columns that are padding in every row.
        p_start = _first_used_column(prompt_mask)
        t_end = _last_used_column(completion_mask)
        sub = Batch(
            prompt_ids=self.prompt_ids[index][:, p_start:],
            prompt_mask=prompt_mask[:, p_start:],
            completion_ids=self.completion_ids[index][:, :t_end],
            completion_mask=completion_mask[:, :t_end],
            advantages=self.advantages[index],
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            group_ids=pick(self.group_ids),
            sampler_logprobs=pick(self.sampler_logprobs),
            policy_mask=pick(self.policy_mask),
        )
        for name in ("old_logprobs", "ref_logprobs", "sampler_logprobs", "policy_mask") + \
                (("advantages",) if self.advantages.dim() == 2 else ()):
            if getattr(sub, name) is not None:
                setattr(sub, name, getattr(sub, name)[:, :t_end])
        return sub


def _first_used_column(mask: torch.Tensor) -> int:
    used = mask.any(dim=0).nonzero()
    return int(used[0]) if len(used) else mask.shape[1]


def _last_used_column(mask: torch.Tensor) -> int:
    used = mask.any(dim=0).nonzero()
    return int(used[-1]) + 1 if len(used) else 0


@dataclass
class SampledGroup:
    """The G completions of one prompt with their rewards (the total after any KL penalty, and per function)."""

    example: Example
    rollouts: list[Rollout]
    rewards: list[float]
    per_func: dict[str, list]
    kl: list[float] | None = None  # per completion, summed over tokens (kl_penalty=reward)
    rank: int = 0  # the process that sampled it, and trains on it (distributed.py)
    extra: dict = field(default_factory=dict)  # columns reward functions logged (log_extra), per completion
    # Process rewards: per completion, its step scores by the token each ends at (rollout/steps.py); None
    # where every score was one number per completion.
    steps: list[dict[int, float]] | None = None
    # per completion: whether any reward function scored it (False: every one returned None); None: all were
    scorable: list[bool] | None = None

    @property
    def scored_rewards(self) -> list[float]:
        """The rewards, NaN for a completion no reward function scored (left out of the baseline, as in TRL)."""
        if self.scorable is None:
            return list(self.rewards)
        return [r if ok else float("nan") for r, ok in zip(self.rewards, self.scorable)]

    @property
    def has_signal(self) -> bool:
        if self.steps is not None:  # the step scores are what is normalised (advantages.step_advantages)
            pool = [v for s in self.steps for v in s.values()]
            return max(pool) > min(pool)
        return not bool(without_signal(torch.tensor([self.scored_rewards], dtype=torch.float))[0])

    def token_steps(self) -> list[dict[int, float]]:
        """Each completion's steps; a reward given as one number is one step, at the last token."""
        if self.steps is not None:
            return self.steps
        return [{max(len(r.completion_ids) - 1, 0): reward} for r, reward in zip(self.rollouts, self.rewards)]


@dataclass(frozen=True)
class PartialGroup:
    """Partial rollouts: a prompt's G completions while some of them is not done (finish_reason "partial"),
    carried from one sampling round to the next (rollout/generation.py)."""

    example: Example
    text: str  # the rendered prompt, as the reward functions are given it
    rollouts: tuple[Rollout, ...]
    # The group's own token, kept from round to round (dataclasses.replace): its completions' caches are
    # kept between rounds under (key, member) (rollout/stage.py).  A new object is unique while it lives.
    key: object = field(default_factory=object, repr=False, compare=False)

    @property
    def done(self) -> bool:
        return all(r.finish_reason != "partial" for r in self.rollouts)


def oldest_token_version(rollouts) -> int | None:
    """The oldest weight version among the rollouts' recorded token versions (None: none recorded)."""
    seen = [min(r.versions) for r in rollouts if r.versions]
    return min(seen) if seen else None


@dataclass
class Round:
    """One round of sampling: prompts_per_step groups (several rounds with dynamic_sampling)."""

    groups: list[SampledGroup]
    counters: dict  # per reward function: timeouts, errors
    rollout_seconds: float
    reward_seconds: float
    logged: dict = field(default_factory=dict)  # scalars reward functions logged (log_metric), by name


@dataclass
class Generation:
    """One generated, scored batch (stages 1-3) and how many optimizer steps have used it."""

    batch: Batch
    metrics: dict
    samples: list[dict] = field(default_factory=list)  # the first completions, for completions.jsonl
    iterations_done: int = 0
    weight_version: int = 0  # the optimizer steps in the weights that sampled it (the sampler's, synced every weight_sync_steps)
    staleness: int = 0  # the optimizer steps the policy had taken since those weights at the generation's first use
    epochs_after: float = 0.0  # passes over the train prompts once its prompts were drawn
    epochs_drawn: float = 0.0  # the share of a pass its prompts are
    audit: object = None  # the reward audit of its completions under way (audit.py), a Future
    groups: int = 0  # the groups it holds (trained or left out for equal rewards)
    # {weight version: completion tokens it sampled} over the groups it holds; None (or None keys): tokens
    # whose engine did not record it (rollout/producer.py counts them at the generation's first version)
    token_versions: dict | None = None
    # Partial rollouts, and generations rank 0 samples for every process: (the groups chosen, every group
    # sampled, its sampling rounds, prompts drawn), from which it is made again (Generations.reassemble)
    # without the groups too old to train when it is taken, or with another rank's share as the batch;
    # the groups dropped as too old while it was sampled.  None / 0 otherwise.
    parts: tuple | None = None
    stale_groups: int = 0


class ScoreList(list):
    """What a reward function returns: a list of float | None, plus counts of the completions it
    could not score (grading that timed out, code that could not run) and of checks it ran twice
    (one that ran out of its bound once).  A plain list works too; these counters are reported as
    rewards/<fn>/timeouts, rewards/<fn>/errors and rewards/<fn>/retries."""

    def __init__(self, values=(), timeouts: int = 0, errors: int = 0, retries: int = 0):
        super().__init__(values)
        self.timeouts = timeouts
        self.errors = errors
        self.retries = retries


@dataclass(frozen=True)
class TrainerState:
    """Passed to reward functions as `trainer_state` (TRL's name): where training is."""

    global_step: int = 0
    max_steps: int = 0


def completion_text(completion: Completion) -> str:
    """The text of a completion in either of the two shapes reward functions receive."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return ""
