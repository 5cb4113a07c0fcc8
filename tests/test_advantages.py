import math

import pytest
import torch

from rlvr.advantages import EPS, group_advantages, group_reward_std, normalize_then_sum, reinforce_pp_advantages, rloo_advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4


def test_group_scaling_matches_hand_computation():
    adv, zero_std = group_advantages(REWARDS, 4, "group")
    # group 1: mean 0.5; sample std = sqrt((4 * 0.25) / 3) = 0.577350; A = +-0.5 / (0.577350 + 1e-4)
    a = 0.5 / (0.5773503 + EPS)
    assert torch.allclose(adv[:4], torch.tensor([a, -a, -a, a]), atol=1e-6)
    # group 2: all rewards equal -> flagged, advantages exactly 0
    assert zero_std.tolist() == [False, True]
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_batch_scaling_uses_the_std_of_all_rewards():
    adv, _ = group_advantages(REWARDS, 4, "batch")
    # all 8: mean 1.25; squared deviations 0.0625 + 1.5625 + 1.5625 + 0.0625 + 4 * 0.5625 = 5.5; / 7 -> std 0.886405
    a = 0.5 / (0.8864053 + EPS)
    assert torch.allclose(adv[:4], torch.tensor([a, -a, -a, a]), atol=1e-6)
    assert adv[4:].abs().sum() == 0


def test_no_scaling_only_centres():
    adv, _ = group_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 0.0]), 3, "none")
    # group 1 mean 2 -> [1, -1, 0]; group 2 all equal -> 0
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_each_group_sums_to_zero(scale):
    rewards = torch.rand(5 * 6, generator=torch.Generator().manual_seed(0))
    adv, _ = group_advantages(rewards, 6, scale)
    assert torch.allclose(adv.view(5, 6).sum(dim=1), torch.zeros(5), atol=1e-5)


def test_near_constant_group_stays_finite():
    adv, zero_std = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0 + 1e-7]), 4, "group")
    assert torch.isfinite(adv).all() and not zero_std[0]


def test_bad_group_size_is_an_error():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(4), 1)


def test_reward_std_is_per_group_sample_std():
    std = group_reward_std(REWARDS, 4)
    assert torch.allclose(std, torch.tensor([0.5773503, 0.0]), atol=1e-6)


# --- a completion no reward function scored (NaN), as TRL 1.16 -------------------------------------

def test_an_unscorable_completion_is_left_out_of_its_groups_baseline_and_gets_zero():
    # group [1, 0, NaN]: mean and std of [1, 0] (0.5, sqrt(0.5)); the NaN gets 0, not (0 - mean) / std
    adv, zero_std = group_advantages(torch.tensor([1.0, 0.0, float("nan"), 2.0, float("nan"), 5.0]), 3, "group")
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert torch.allclose(adv[:3], torch.tensor([a, -a, 0.0]), atol=1e-6)
    assert zero_std.tolist() == [False, False]
    # one scorable completion in a group: no baseline, no signal
    adv, zero_std = group_advantages(torch.tensor([float("nan"), 1.0]), 2, "group")
    assert adv.tolist() == [0.0, 0.0] and zero_std.tolist() == [True]


# --- RLOO ---------------------------------------------------------------------------------------------

def test_rloo_subtracts_the_mean_of_the_other_rewards():
    # group [1, 0, 0, 1]: each baseline is the mean of the other three: 1/3, 2/3, 2/3, 1/3
    adv, zero_std = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4, "none")
    assert torch.allclose(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)
    assert zero_std.tolist() == [False, True]  # the equal group: baseline = its reward, advantage 0
    # a group of two: each completion's baseline is the other's reward
    adv, _ = rloo_advantages(torch.tensor([3.0, 1.0]), 2, "none")
    assert adv.tolist() == [2.0, -2.0]


def test_rloo_scales_as_asked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group: / (the group's reward std + eps): std of [1, 0, 0, 1] = sqrt(1/3)
    adv, _ = rloo_advantages(rewards, 4, "group")
    assert adv[0].item() == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + EPS), abs=1e-6)
    assert adv[4:].abs().sum() == 0
    # batch (RLOOTrainer's normalize_advantages): (A - mean) / (std + eps) over all 8: mean 0,
    # squares 4 x 4/9 = 16/9, / 7 -> std 0.503953
    adv, _ = rloo_advantages(rewards, 4, "batch")
    std = math.sqrt(16 / 9 / 7)
    assert adv[0].item() == pytest.approx((2 / 3) / (std + EPS), abs=1e-6)
    # an unscorable completion: out of its siblings' baselines, and 0 itself: [1, 0, NaN] -> 1 - 0, 0 - 1
    adv, _ = rloo_advantages(torch.tensor([1.0, 0.0, float("nan")]), 3, "none")
    assert adv.tolist() == [1.0, -1.0, 0.0]


# --- REINFORCE++ with a group baseline ------------------------------------------------------------------

def test_reinforce_pp_whitens_the_centred_rewards_over_the_batchs_tokens():
    # groups [1, 0] and [1, 1]: centred 0.5, -0.5, 0, 0; lengths 1, 3, 2, 2 tokens.
    # token-weighted mean: (0.5 x 1 - 0.5 x 3) / 8 = -0.125;
    # var (n - 1 = 7): (1 x 0.625^2 + 3 x 0.375^2 + 4 x 0.125^2) / 7 = (0.390625 + 0.421875 + 0.0625) / 7 = 0.125
    adv, zero_std = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, [1, 3, 2, 2])
    s = 1 / math.sqrt(0.125 + 1e-8)
    assert torch.allclose(adv, torch.tensor([0.625 * s, -0.375 * s, 0.125 * s, 0.125 * s]), atol=1e-5)
    assert zero_std.tolist() == [False, True]  # flagged, though its advantage is not 0 after the whitening
    # every completion masked out of the loss (cut, with mask_truncated_completions): no tokens, advantage 0
    adv, _ = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), 2, [0, 0])
    assert adv.tolist() == [0.0, 0.0]


# --- normalize_then_sum (GDPO) ------------------------------------------------------------------------

def test_normalize_then_sum_normalises_each_function_in_its_group_then_the_batch():
    # two groups of 2, two functions with weights 1 and 0.5.  Function a: [1, 0 | 1, 1]; b: [0, 4 | 2, 0].
    # In-group: a: [+q, -q | 0, 0], b: [-q, +q | +q, -q], q = 0.5 / (sqrt(0.5) + eps) (b's std is sqrt(8)
    # and sqrt(2) and its deviations 2 and 1: the same q' = d / (std + eps) per group, computed below).
    a = [1.0, 0.0, 1.0, 1.0]
    b = [0.0, 4.0, 2.0, 0.0]
    qa = 0.5 / (math.sqrt(0.5) + EPS)
    qb1, qb2 = 2 / (math.sqrt(8) + EPS), 1 / (math.sqrt(2) + EPS)
    sums = [qa - 0.5 * qb1, -qa + 0.5 * qb1, 0.5 * qb2, -0.5 * qb2]
    mean = sum(sums) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in sums) / 3)
    adv, zero_std = normalize_then_sum(torch.tensor([a, b]).T, [1.0, 0.5], 2)
    assert torch.allclose(adv, torch.tensor([(x - mean) / (std + EPS) for x in sums]), atol=1e-5)
    assert zero_std.tolist() == [False, False]  # totals 1, 2 | 2, 1
    # a completion no function scored gets 0 and is out of the batch's mean and std
    adv, _ = normalize_then_sum(torch.tensor([[1.0, float("nan")], [0.0, float("nan")], [float("nan")] * 2, [1.0, 2.0]]),
                                [1.0, 1.0], 2)
    assert adv[2].item() == 0.0
