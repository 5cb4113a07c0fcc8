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
update and reports the fraction as `frac_reward_zero_std`.

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
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (need group_size >= 2)")
    if rewards.numel() == 0:  # e.g. dynamic sampling found no group with signal
        return rewards.float(), torch.zeros(0, dtype=torch.bool)
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    zero_std = (grouped == grouped[:, :1]).all(dim=1)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        # A single number for the batch; a batch of one group is the group std.
        centred = centred / (rewards.float().std() + eps)
    centred = centred.masked_fill(zero_std[:, None], 0.0)
    return centred.reshape(-1), zero_std


def group_reward_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group sample std (n - 1), the `reward_std` TRL logs is its mean."""
    return rewards.float().view(-1, group_size).std(dim=1)


def step_advantages(steps: list[dict[int, float]], lengths: list[int], group_size: int, scale: str = "group",
                    eps: float = EPS):
    """steps: per completion (groups contiguous, as above), its step scores by the index of the token each
    step ends at (every completion at least one step); lengths: each completion's tokens ->
    (advantages [N, max(lengths)], zero 0 past a completion's end; zero_std [N / group_size] bool: True
    where all the step scores of a group are equal)."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    n = len(steps)
    if group_size < 2 or n % group_size or len(lengths) != n:
        raise ValueError(f"{n} completions do not split into groups of {group_size} (need group_size >= 2)")
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
