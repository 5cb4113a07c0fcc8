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
