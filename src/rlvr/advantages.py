"""Group-relative advantages (GRPO, https://arxiv.org/abs/2402.03300, section 4.1.2).

For a group of G completions of one prompt with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std + eps)

`scale` chooses the std:
  group  std of the group's rewards (GRPO; what TRL calls scale_rewards="group")
  batch  std of all rewards in the batch (more robust when groups are small)
  none   no division, A_i = r_i - mean(r) (Dr. GRPO, https://arxiv.org/abs/2503.20783)

The std is the sample std with Bessel's correction (divide by n - 1), as in TRL,
so numbers match TRL logs.  eps = 1e-4 keeps near-constant groups finite.

A group whose rewards are all equal gets advantage 0 for every member and is
flagged: it carries no learning signal, and the trainer leaves it out of the
update and reports the fraction as `frac_reward_zero_std`.  A reward that is NaN
(a completion no reward function could score: each returned None) is left out
of its group's mean and std and gets advantage 0, as in TRL 1.16.

`advantage_estimator` chooses the baseline (ESTIMATORS):
  grpo          the above
  rloo          r_i - mean of the group's other rewards (RLOO, https://arxiv.org/abs/2402.14740; TRL's
                RLOOTrainer): G / (G - 1) x the centred reward; `scale` none is RLOOTrainer's default,
                batch its normalize_advantages (the batch's mean and std), group the group's std
  reinforce_pp  r_i - group mean, then whitened over the batch's completion tokens (each completion's
                value weighed by its tokens; mean and sample variance, + 1e-8 as verl's masked_whiten):
                REINFORCE++ with a group baseline (https://arxiv.org/abs/2501.03262; verl's
                reinforce_plus_plus_baseline, OpenRLHF's reinforce_baseline).  The whitening is its
                scale; a group with equal rewards is flagged but may get a non-zero advantage.

`normalize_then_sum` (TRL's multi_objective_aggregation, GDPO) normalises each reward function's
scores within the group before the weighted sum; the sum is then normalised over the batch.

Process rewards (step_advantages) follow the paper's process supervision (section 4.1.3): each
completion's scores are steps, each ending at a token; the steps of a group are normalised
together, as the rewards of a group are above, and a token's advantage is the sum of the
normalised scores of its completion's steps that end at or after it (the return to go).  A reward
given as one number is a step that ends at the last token, so rewards without steps get exactly
group_advantages, on every token.
"""

from __future__ import annotations

import torch

EPS = 1e-4
SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = EPS):
    """rewards [N] (N = groups x group_size, group members contiguous) ->
    (advantages [N], zero_std [N / group_size] bool: True where a group's rewards are all equal)."""
    _check(rewards.numel(), group_size, scale)
    if rewards.numel() == 0:  # e.g. dynamic sampling found no group with signal
        return rewards.float(), torch.zeros(0, dtype=torch.bool)
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.nanmean(dim=1, keepdim=True)
    zero_std = without_signal(grouped)
    if scale == "group":
        centred = centred / (_nanstd(grouped, dim=1) + eps)
    elif scale == "batch":
        # A single number for the batch; a batch of one group is the group std.
        centred = centred / (_nanstd(rewards.float()) + eps)
    centred = centred.masked_fill(zero_std[:, None], 0.0)
    return centred.reshape(-1).nan_to_num(nan=0.0), zero_std


def rloo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "none", eps: float = EPS):
    """RLOO: A_i = r_i - (sum of the group's other scorable rewards) / (their number); then `scale`: none
    as is, batch (A - mean) / (std + eps) over the batch (RLOOTrainer's normalize_advantages), group / (the
    group's reward std + eps).  Same shapes as group_advantages; unscorable (NaN) rewards get 0."""
    _check(rewards.numel(), group_size, scale)
    if rewards.numel() == 0:
        return rewards.float(), torch.zeros(0, dtype=torch.bool)
    grouped = rewards.float().view(-1, group_size)
    counts = (~grouped.isnan()).sum(dim=1, keepdim=True)
    others = (grouped.nansum(dim=1, keepdim=True) - grouped) / (counts - 1)  # NaN where only one scored
    adv = grouped - others
    zero_std = without_signal(grouped)
    if scale == "group":
        adv = adv / (_nanstd(grouped, dim=1) + eps)
    elif scale == "batch":
        adv = (adv - adv.nanmean()) / (_nanstd(adv.reshape(-1)) + eps)
    return adv.reshape(-1).nan_to_num(nan=0.0), zero_std


def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, lengths: list[int], eps: float = 1e-8):
    """REINFORCE++ with the group mean as baseline: x_i = r_i - group mean, then whitened over the batch's
    tokens, (x_i - mu) / sqrt(var + eps) with mu and var (n - 1) of x over every completion token
    (`lengths`: each completion's loss tokens).  Unscorable (NaN) rewards take no part and get 0."""
    _check(rewards.numel(), group_size, "none")
    if rewards.numel() == 0:
        return rewards.float(), torch.zeros(0, dtype=torch.bool)
    grouped = rewards.float().view(-1, group_size)
    x = (grouped - grouped.nanmean(dim=1, keepdim=True)).reshape(-1)
    tokens = torch.tensor(lengths, dtype=torch.float) * (~x.isnan())
    n = tokens.sum()
    if n < 2:  # no tokens to train on (every completion masked): nothing to whiten
        return torch.zeros_like(x), without_signal(grouped)
    values = x.nan_to_num(nan=0.0)
    mean = (values * tokens).sum() / n.clamp(min=1)
    var = (((values - mean) ** 2) * tokens).sum() / (n - 1).clamp(min=1)
    adv = (values - mean) * torch.rsqrt(var + eps)
    return adv.masked_fill(x.isnan(), 0.0), without_signal(grouped)


def normalize_then_sum(per_func: torch.Tensor, weights: list[float], group_size: int, eps: float = EPS):
    """GDPO (TRL's multi_objective_aggregation=normalize_then_sum): per_func [N, F] (NaN: not scored) ->
    (advantages [N], zero_std [N / group_size]).  Each function's scores are normalised within the group,
    (s - mean) / (std + eps), the weighted sum taken (NaN counting 0), and the sums normalised over the
    batch, (x - mean) / (std + eps); a completion no function scored gets 0.  zero_std flags the groups
    whose weighted totals are all equal, as group_advantages does."""
    n, f = per_func.shape
    _check(n, group_size, "none")
    if n == 0:
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    grouped = per_func.float().view(-1, group_size, f)
    normalised = (grouped - grouped.nanmean(dim=1, keepdim=True)) / (_nanstd(grouped, dim=1) + eps)
    w = torch.tensor(weights, dtype=torch.float)
    summed = (normalised.reshape(n, f) * w).nansum(dim=1)
    unscored = per_func.isnan().all(dim=1)
    summed = summed.masked_fill(unscored, float("nan"))
    adv = (summed - summed.nanmean()) / (_nanstd(summed) + eps)
    totals = (per_func.float() * w).nansum(dim=1).masked_fill(unscored, float("nan"))
    return adv.nan_to_num(nan=0.0), without_signal(totals.view(-1, group_size))


def without_signal(grouped: torch.Tensor) -> torch.Tensor:
    """[groups, G] rewards (NaN: unscorable) -> True where fewer than two are scorable or all of those are equal."""
    high = grouped.nan_to_num(nan=-torch.inf).max(dim=1).values
    low = grouped.nan_to_num(nan=torch.inf).min(dim=1).values
    return ((~grouped.isnan()).sum(dim=1) < 2) | (high == low)


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample std (n - 1) of the values that are not NaN (keepdim along `dim`; NaN for fewer than two)."""
    if dim is None:
        x = x.reshape(-1)
        x = x[~x.isnan()]
        return x.std() if x.numel() > 1 else torch.tensor(float("nan"))
    count = (~x.isnan()).sum(dim=dim, keepdim=True)
    centred = (x - x.nanmean(dim=dim, keepdim=True)).nan_to_num(nan=0.0)
    return ((centred ** 2).sum(dim=dim, keepdim=True) / (count - 1)).sqrt()


def _check(n: int, group_size: int, scale: str, what: str = "rewards") -> None:
    """`scale` is one of SCALES and n `what` split into groups of group_size >= 2."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    if group_size < 2 or n % group_size:
        raise ValueError(f"{n} {what} do not split into groups of {group_size} (need group_size >= 2)")


# advantage_estimator -> (rewards, group_size, scale, loss tokens per completion) -> (advantages, zero_std)
ESTIMATORS = {
    "grpo": lambda rewards, size, scale, lengths: group_advantages(rewards, size, scale),
    "rloo": lambda rewards, size, scale, lengths: rloo_advantages(rewards, size, scale),
    "reinforce_pp": lambda rewards, size, scale, lengths: reinforce_pp_advantages(rewards, size, lengths),
}


def group_reward_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group sample std (n - 1) of the scorable (not NaN) rewards."""
    return _nanstd(rewards.float().view(-1, group_size), dim=1).reshape(-1)


def step_advantages(steps: list[dict[int, float]], lengths: list[int], group_size: int, scale: str = "group",
                    eps: float = EPS):
    """steps: per completion (groups contiguous, as above), its step scores by the index of the token each
    step ends at (every completion at least one step); lengths: each completion's tokens ->
    (advantages [N, max(lengths)], zero 0 past a completion's end; zero_std [N / group_size] bool: True
    where all the step scores of a group are equal)."""
    n = len(steps)
    _check(n, group_size, scale, "completions")
    if len(lengths) != n:
        raise ValueError(f"{len(lengths)} lengths for {n} completions")
    if any(not s for s in steps) or any(not 0 <= t < max(length, 1) for s, length in zip(steps, lengths) for t in s):
        raise ValueError("every completion needs a step, each ending at one of its tokens")
    width = max(lengths, default=0)
    advantages = torch.zeros(n, width)
    zero_std = torch.zeros(n // group_size, dtype=torch.bool)
    if n == 0:
        return advantages, zero_std
    batch_std = torch.tensor([v for s in steps for v in s.values()], dtype=torch.float).std()
    for g in range(n // group_size):
        members = range(g * group_size, (g + 1) * group_size)
        pool = torch.tensor([v for i in members for v in steps[i].values()], dtype=torch.float)
        zero_std[g] = bool((pool == pool[0]).all())
        if zero_std[g]:
            continue
        mean = pool.mean()
        div = pool.std() + eps if scale == "group" else batch_std + eps if scale == "batch" else 1.0
        for i in members:
            per_token = torch.zeros(max(width, 1))
            for t, v in steps[i].items():
                per_token[t] += (v - mean) / div
            # the return to go: a token's advantage sums the steps that end at or after it
            advantages[i, : lengths[i]] = per_token.flip(0).cumsum(0).flip(0)[: lengths[i]]
    return advantages, zero_std
