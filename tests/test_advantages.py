import pytest
import torch

from rlvr.advantages import EPS, group_advantages, group_reward_std

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
