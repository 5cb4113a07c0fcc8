import math

import pytest
import torch

from rlvr.kl import kl_estimate
from rlvr.logprobs import selective_logprobs
from rlvr.losses import (
    IMPORTANCE_SAMPLING_MODES,
    LOSS_TYPES,
    LossKnobs,
    LossNorm,
    entropy_threshold,
    high_entropy_mask,
    off_policy_mask,
    policy_loss,
    sampler_importance_weights,
)

LN = math.log


def loss_of(logprobs, old, adv, mask, loss_type="dapo", **kw):
    mask = torch.tensor(mask, dtype=torch.bool)
    norm = LossNorm(num_sequences=len(adv), num_tokens=int(mask.sum()), max_completion_length=kw.pop("max_len", 4))
    return policy_loss(torch.as_tensor(logprobs), torch.as_tensor(old), torch.tensor(adv), mask, norm, loss_type=loss_type, **kw)


# --- aggregation with ratio 1 (old == new): each token's loss is -A_i -------------------

LOGP = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.1, 0.9, 0.9]]))
MASK = [[1, 1, 1], [1, 0, 0]]
ADV = [2.0, -1.0]


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("grpo", (-2.0 + 1.0) / 2),  # per-completion means -2 and +1, averaged over 2 completions
        ("dapo", (-2.0 * 3 + 1.0) / 4),  # token sum -5 over 4 tokens
        ("dr_grpo", (-2.0 * 3 + 1.0) / (2 * 4)),  # token sum -5 over N * max_completion_length = 2 * 4
        ("bnpo", (-2.0 * 3 + 1.0) / 4),  # one micro-batch: its own 4 tokens
    ],
)
def test_aggregation_by_loss_type(loss_type, expected):
    loss, _ = loss_of(LOGP, LOGP, ADV, MASK, loss_type)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_every_registered_loss_type_is_tested():
    # the first four above; cispo, sapo, vespo and luspo below (each with its own term)
    assert set(LOSS_TYPES) == {"grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"}


# --- clipping -------------------------------------------------------------------------

RATIOS = [1.5, 0.5, 1.1]


def test_token_clipping_with_epsilon_high_positive_advantage():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([RATIOS]))
    loss, m = loss_of(logp, old, [1.0], [[1, 1, 1]], "dapo", epsilon=0.2, epsilon_high=0.28)
    # A > 0: min(r, clip(r, 0.8, 1.28)) -> 1.28, 0.5, 1.1; loss is their negated mean
    assert loss.item() == pytest.approx(-(1.28 + 0.5 + 1.1) / 3, abs=1e-6)
    assert m["clip_ratio/high"].item() == 1  # 1.5 > 1.28 with A > 0
    assert m["clip_ratio/low"].item() == 0  # 0.5 < 0.8 but A > 0: the unclipped term is taken
    assert m["clip_ratio/region"].item() == 1


def test_token_clipping_negative_advantage():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([RATIOS]))
    loss, m = loss_of(logp, old, [-1.0], [[1, 1, 1]], "dapo", epsilon=0.2, epsilon_high=0.28)
    # A < 0: min(-r, -clip(r)) -> -1.5, -0.8, -1.1; loss = (1.5 + 0.8 + 1.1) / 3
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.1) / 3, abs=1e-6)
    assert m["clip_ratio/low"].item() == 1 and m["clip_ratio/high"].item() == 0


def test_clip_ratio_counts_by_hand():
    # epsilon = 0.2, epsilon_high = 0.28: the clip range is [0.8, 1.28]. A token counts as clipped
    # only where the clipped term is the one taken, i.e. its gradient is cut:
    #   low  = ratio < 0.8 with A < 0,   high = ratio > 1.28 with A > 0,   region = low or high.
    #   row 0, A = +1: 1.5 high; 0.5 below but A > 0, not clipped; 1.1 inside; 2.0 masked, not counted
    #   row 1, A = -1: 0.5 low; 1.5 above but A < 0, not clipped; 0.7 low; 1.0 inside
    #   row 2, A =  0: 0.5 and 1.5 out of range, but A = 0 takes neither side: not clipped
    # 3 + 4 + 2 = 9 tokens; low 2, high 1, region 3.
    ratios = torch.tensor([[1.5, 0.5, 1.1, 2.0], [0.5, 1.5, 0.7, 1.0], [0.5, 1.5, 1.0, 1.0]])
    mask = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    loss, m = loss_of(torch.log(ratios), torch.zeros(3, 4), [1.0, -1.0, 0.0], mask, "dapo", epsilon=0.2, epsilon_high=0.28)
    assert (m["clip_ratio/low"].item(), m["clip_ratio/high"].item(), m["clip_ratio/region"].item()) == (2, 1, 3)
    # the trainer logs sum / tokens as clip_ratio/<kind>_mean: 2/9, 1/9, 3/9
    assert [m[f"clip_ratio/{k}"].item() / 9 for k in ("low", "high", "region")] == pytest.approx([2 / 9, 1 / 9, 3 / 9])
    # per-token loss -min(r A, clip(r) A): row 0: -1.28, -0.5, -1.1; row 1: max(r, clip(r)) = 0.8, 1.5, 0.8, 1.0;
    # row 2: 0. Sum -2.88 + 4.1 = 1.22 over 9 tokens (dapo) = 0.135556
    assert loss.item() == pytest.approx(1.22 / 9, abs=1e-6)


def test_sequence_level_clip_ratio_counts_clipped_completions():
    # One ratio per completion, w = exp(mean_t log r_t); clip range [0.8, 1.2]. As TRL, a completion is
    # clipped or not as a whole, and the counts are of completions (the caller divides by their number):
    #   row 0, A = +1: tokens 1.5, 1.5, 1.5 -> w = 1.5 > 1.2: high
    #   row 1, A = -1: tokens 0.5, 0.5 (third masked, ratio 9 ignored) -> w = 0.5 < 0.8: low
    #   row 2, A = -1: tokens 2.0, 0.5, 1.0 -> w = (2 * 0.5 * 1) ** (1/3) = 1: inside, though 2.0 and 0.5 are not
    # low 1, high 1, region 2.
    ratios = torch.tensor([[1.5, 1.5, 1.5], [0.5, 0.5, 9.0], [2.0, 0.5, 1.0]])
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    _, m = loss_of(torch.log(ratios), torch.zeros(3, 3), [1.0, -1.0, -1.0], mask, "grpo", importance_sampling_level="sequence")
    assert (m["clip_ratio/low"].item(), m["clip_ratio/high"].item(), m["clip_ratio/region"].item()) == (1, 1, 2)


def test_clipped_tokens_get_no_gradient():
    logp = torch.log(torch.tensor([RATIOS])).requires_grad_()
    loss, _ = loss_of(logp, torch.zeros(1, 3), [1.0], [[1, 1, 1]], "dapo", epsilon=0.2, epsilon_high=0.28)
    loss.backward()
    # d(-r A / 3)/d logp = -r A / 3 where unclipped; 0 for the clipped first token
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3]]), atol=1e-6)


def test_sequence_level_importance_ratio():
    logp = torch.log(torch.tensor([RATIOS])).requires_grad_()
    loss, _ = loss_of(logp, torch.zeros(1, 3), [1.0], [[1, 1, 1]], "grpo", importance_sampling_level="sequence")
    # w = exp(mean log r) = (1.5 * 0.5 * 1.1) ** (1/3) = 0.825 ** (1/3) = 0.937894, inside [0.8, 1.2]
    w = 0.825 ** (1 / 3)
    assert loss.item() == pytest.approx(-w, abs=1e-6)
    loss.backward()
    # every token shares the sequence weight: d(-w)/d logp_t = -w / 3
    assert torch.allclose(logp.grad, torch.full((1, 3), -w / 3), atol=1e-6)


def test_sequence_level_ratio_ignores_masked_tokens():
    logp = torch.log(torch.tensor([[1.5, 0.5, 123.0]]))
    loss, _ = loss_of(logp, torch.zeros(1, 3), [1.0], [[1, 1, 0]], "grpo", importance_sampling_level="sequence", epsilon=0.5)
    # w = sqrt(1.5 * 0.5) = 0.866025 from the two real tokens only
    assert loss.item() == pytest.approx(-math.sqrt(0.75), abs=1e-6)


# --- two-sided clipping (delta) -----------------------------------------------------------

DELTA_RATIOS = [0.5, 2.0, 4.0]


def test_delta_caps_the_unclipped_ratio_of_negative_advantages():
    logp = torch.log(torch.tensor([DELTA_RATIOS])).requires_grad_()
    loss, m = loss_of(logp, torch.zeros(1, 3), [-1.0], [[1, 1, 1]], "dapo", epsilon=0.2, delta=3.0)
    # A = -1, clip range [0.8, 1.2]: -min(-min(r, 3), -clip(r)) = max(min(r, 3), clip(r))
    #   0.5 -> max(0.5, 0.8) = 0.8;  2.0 -> max(2.0, 1.2) = 2.0;  4.0 -> max(3.0, 1.2) = 3.0 (without delta: 4.0)
    # dapo: (0.8 + 2.0 + 3.0) / 3 = 1.933333
    assert loss.item() == pytest.approx(5.8 / 3, abs=1e-6)
    loss.backward()
    # d/dlogp: 0 for the clipped 0.8; r / 3 = 2/3 for 2.0; 0 for the capped 4.0 (4/3 without delta)
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]), atol=1e-6)
    assert m["clip_ratio/low"].item() == 1 and m["clip_ratio/high"].item() == 0  # the clip metrics do not change


def test_delta_leaves_positive_advantages_alone():
    logp = torch.log(torch.tensor([DELTA_RATIOS]))
    # A = +1: -min(min(r, 3), clip(r, 0.8, 1.28)) -> -0.5, -1.28, -1.28, with or without delta
    with_delta, _ = loss_of(logp, torch.zeros(1, 3), [1.0], [[1, 1, 1]], "dapo", epsilon_high=0.28, delta=3.0)
    without, _ = loss_of(logp, torch.zeros(1, 3), [1.0], [[1, 1, 1]], "dapo", epsilon_high=0.28)
    assert with_delta.item() == without.item() == pytest.approx(-(0.5 + 1.28 + 1.28) / 3, abs=1e-6)


def test_delta_caps_the_sequence_ratio():
    # w = exp(mean(ln 4, ln 4)) = 4, A = -1: max(min(4, 3), 1.2) = 3 per token; grpo: mean 3 over the one completion
    logp = torch.log(torch.tensor([[4.0, 4.0]]))
    loss, _ = loss_of(logp, torch.zeros(1, 2), [-1.0], [[1, 1]], "grpo", importance_sampling_level="sequence", delta=3.0)
    assert loss.item() == pytest.approx(3.0, abs=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_delta_none_and_a_huge_delta_give_the_same_loss_and_gradient(level):
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 4, generator=g) * 3
    new = (old + torch.randn(3, 4, generator=g)).requires_grad_()
    mask = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
    results = []
    for delta in (None, 1e9):
        loss, _ = loss_of(new, old, [1.0, -1.0, -0.5], mask, "dapo", importance_sampling_level=level, delta=delta)
        results.append((loss.item(), torch.autograd.grad(loss, new)[0]))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


# --- training on the high-entropy tokens only (top_entropy_quantile) ---------------------------


@pytest.mark.parametrize(
    "top_quantile,expected",
    [
        # sorted entropies 0.1, 0.3, 0.5, 0.9; the (1 - rho) quantile at position (1 - rho) * 3, linearly interpolated
        (0.5, 0.4),  # position 1.5: 0.3 + 0.5 * (0.5 - 0.3)
        (0.2, 0.66),  # position 2.4: 0.5 + 0.4 * (0.9 - 0.5)
        (0.0, 0.9),  # the largest
        (1.0, 0.1),  # the smallest: every token is kept
    ],
)
def test_entropy_threshold_by_hand(top_quantile, expected):
    assert entropy_threshold(torch.tensor([0.1, 0.5, 0.9, 0.3]), top_quantile).item() == pytest.approx(expected, abs=1e-6)


def test_entropy_threshold_of_no_tokens_keeps_none():
    assert entropy_threshold(torch.zeros(0), 0.2).item() == math.inf
    assert not high_entropy_mask(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), math.inf).any()


def test_high_entropy_mask_by_hand():
    # Threshold 0.4 over the real tokens 0.1, 0.5, 0.9, 0.3: 0.5 and 0.9 are kept (>= 0.4); the
    # padded 7.0 is above it but never kept.
    entropy = torch.tensor([[0.1, 0.5, 7.0], [0.9, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    tau = entropy_threshold(entropy[mask], 0.5)
    assert high_entropy_mask(entropy, mask, tau).tolist() == [[False, True, False], [True, False, False]]
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [[False, True, False], [True, False, False]]  # ties are kept


def test_the_entropy_mask_drops_the_policy_term_only():
    logp = torch.full((1, 2), LN(0.5)).requires_grad_()
    ref = torch.full((1, 2), LN(0.25))
    loss, m = loss_of(logp, logp.detach(), [1.0], [[1, 1]], "dapo", beta=0.1, ref_logprobs=ref,
                      entropy_mask=torch.tensor([[True, False]]))
    # ratio 1, A = 1. Token 0: -1 + 0.1 * k3; token 1 (left out): 0.1 * k3 only, with k3 = 0.193147 (above).
    # dapo over the 2 tokens (the left-out one still counts): (-1 + 2 * 0.0193147) / 2 = -0.480685
    assert loss.item() == pytest.approx((-1 + 2 * 0.01931472) / 2, abs=1e-6)
    assert m["kl"].item() == pytest.approx(2 * 0.1931472, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp) = 1 - 0.5 = 0.5. Token 0: (-1 + 0.1 * 0.5) / 2 = -0.475;
    # token 1: 0.1 * 0.5 / 2 = 0.025
    assert torch.allclose(logp.grad, torch.tensor([[-0.475, 0.025]]), atol=1e-6)


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_top_entropy_quantile_one_is_no_masking(loss_type):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 4, generator=g) * 3
    new = (old + 0.5 * torch.randn(3, 4, generator=g)).requires_grad_()
    entropy = torch.rand(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    keep = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 1.0))
    assert torch.equal(keep, mask)
    results = []
    for entropy_mask in (None, keep):
        loss, _ = loss_of(new, old, [1.0, -1.0, 0.5], mask.int().tolist(), loss_type, entropy_mask=entropy_mask)
        results.append((loss.item(), torch.autograd.grad(loss, new)[0]))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])


def test_tokens_left_out_by_the_entropy_mask_get_zero_gradient():
    # Token-level ratios: a token's loss depends on its own log-prob only.  (With sequence-level
    # ratios, as in TRL, a kept token's loss depends on every token of its completion through w.)
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(2, 4, generator=g) * 3
    new = (old + 0.02 * torch.randn(2, 4, generator=g)).requires_grad_()  # ratios inside the clip range
    entropy = torch.tensor([[0.2, 1.5, 0.1, 2.0], [1.1, 0.3, 0.9, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    # real entropies sorted: 0.1 0.2 0.3 0.9 1.1 1.5 2.0; the median (position 3) is 0.9: 1.5, 2.0, 1.1, 0.9 kept
    keep = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 0.5))
    assert keep.tolist() == [[False, True, False, True], [True, False, True, False]]
    loss, _ = loss_of(new, old, [1.0, -1.0], mask.int().tolist(), "grpo", entropy_mask=keep)
    loss.backward()
    assert (new.grad[~keep] == 0).all() and (new.grad[keep] != 0).all()


# --- KL ---------------------------------------------------------------------------------


def test_k3_value_by_hand():
    # r = ln 0.25 - ln 0.5 = -ln 2; exp(r) - r - 1 = 0.5 + 0.693147 - 1 = 0.193147
    assert kl_estimate(torch.tensor(LN(0.5)), torch.tensor(LN(0.25)), "k3").item() == pytest.approx(0.1931472, abs=1e-6)
    assert kl_estimate(torch.tensor(-1.3), torch.tensor(-1.3), "k3").item() == 0.0


def test_kl_term_in_the_loss():
    logp = torch.full((1, 2), LN(0.5))
    ref = torch.full((1, 2), LN(0.25))
    loss, m = loss_of(logp, logp, [0.0], [[1, 1]], "dapo", beta=0.1, ref_logprobs=ref)
    # A = 0 leaves only beta * k3 = 0.1 * 0.193147 per token
    assert loss.item() == pytest.approx(0.1 * 0.1931472, abs=1e-6)
    assert m["kl"].item() == pytest.approx(2 * 0.1931472, abs=1e-6)  # a sum over the 2 tokens


def test_bias_corrected_kl_gradient_by_hand():
    # One token on-policy: logp = a = -1, old = a (ratio 1 in value), ref = -1.5, so r = ref - a = -0.5.
    # k3 = e^r - r - 1 = 0.606531 + 0.5 - 1 = 0.106531, and d k3 / da = 1 - e^r = 0.393469.
    # Bias-corrected, the term is k3 * exp(a - old): d/da = 0.393469 + k3 * 1 = 0.5 (= -r exactly).
    # With A = 0, beta = 1 and dapo over one token, the loss is the term itself.
    for corrected, grad in ((False, 0.3934693), (True, 0.5)):
        a = torch.tensor([[-1.0]], requires_grad=True)
        loss, m = loss_of(a, a.detach(), [0.0], [[1]], "dapo", beta=1.0, ref_logprobs=torch.tensor([[-1.5]]),
                          bias_correction_kl=corrected)
        loss.backward()
        assert loss.item() == pytest.approx(0.1065307, abs=1e-6)  # the same value: the ratio is 1
        assert a.grad.item() == pytest.approx(grad, abs=1e-6)
        assert m["kl"].item() == pytest.approx(0.1065307, abs=1e-6)


def test_bias_corrected_kl_weights_each_token_by_its_ratio():
    # Off-policy: logp - old = ln 2 for the token, so the KL term doubles: 2 * k3(r = ln 0.25 - ln 0.5).
    logp = torch.full((1, 1), LN(0.5))
    loss, _ = loss_of(logp, torch.full((1, 1), LN(0.25)), [0.0], [[1]], "dapo", beta=1.0,
                      ref_logprobs=torch.full((1, 1), LN(0.25)), bias_correction_kl=True)
    assert loss.item() == pytest.approx(2 * 0.1931472, abs=1e-6)


def test_beta_without_reference_is_an_error():
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_of(LOGP, LOGP, ADV, MASK, "dapo", beta=0.1)


# --- invariants ---------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_tokens_give_zero_loss_and_zero_gradient(loss_type, level):
    mask = [[1, 1, 0], [1, 0, 0]]
    masked = ~torch.tensor(mask, dtype=torch.bool)
    kw = dict(importance_sampling_level=level, beta=0.04)
    # Garbage (huge ratios) at padded positions...
    logp = torch.tensor([[-1.0, -2.0, 500.0], [-0.5, 800.0, -900.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.1, -500.0], [-0.4, -800.0, 900.0]])
    loss, _ = loss_of(logp, old, [1.0, -1.0], mask, loss_type, ref_logprobs=-old, **kw)
    loss.backward()
    assert (logp.grad[masked] == 0).all()
    # ...gives exactly the loss of the same rows with harmless padding.
    clean_logp, clean_old = logp.detach().masked_fill(masked, -1.0), old.masked_fill(masked, -1.0)
    clean, _ = loss_of(clean_logp, clean_old, [1.0, -1.0], mask, loss_type, ref_logprobs=-clean_old, **kw)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(clean.item(), rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_ratio_one_is_plain_policy_gradient(loss_type):
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.1, 0.9, 0.9]])).requires_grad_()
    loss, _ = loss_of(logp, logp.detach(), ADV, MASK, loss_type)
    loss.backward()
    # Plain policy gradient: the gradient of -sum A_i * logp_it * weight_it
    mask = torch.tensor(MASK, dtype=torch.float)
    adv = torch.tensor(ADV)[:, None]
    weight = {
        "grpo": mask / mask.sum(1, keepdim=True) / 2,  # 1 / (|o_i| N)
        "dapo": mask / mask.sum(),  # 1 / tokens
        "dr_grpo": mask / (2 * 4),  # 1 / (N * max_completion_length)
    }[loss_type]
    assert torch.allclose(logp.grad, -adv * weight, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_sum_to_the_full_batch_gradient(loss_type, level):
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 5, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    kw = dict(loss_type=loss_type, importance_sampling_level=level)
    full_norm = LossNorm(4, int(mask.sum()), 5, num_micro_batches=1)
    full, _ = policy_loss(logp, old, adv, mask, full_norm, **kw)
    (full_grad,) = torch.autograd.grad(full, logp)
    norm = LossNorm(4, int(mask.sum()), 5, num_micro_batches=4)
    total, grad = 0.0, torch.zeros_like(logp)
    for i in range(4):
        part, _ = policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], norm, **kw)
        total += part.item()
        grad += torch.autograd.grad(part, logp)[0]
    assert total == pytest.approx(full.item(), rel=1e-6)
    assert torch.allclose(grad, full_grad, rtol=1e-6, atol=1e-8)


def test_selective_logprobs_matches_log_softmax_in_chunks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 11, generator=g)
    ids = torch.randint(0, 11, (5, 3), generator=g)
    logp, ent = selective_logprobs(logits, ids, chunk=2)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(logp, ref, atol=1e-6)
    p = torch.softmax(logits, -1)
    assert torch.allclose(ent, -(p * torch.log(p)).sum(-1), atol=1e-5)


# --- importance weights for another sampler (vllm_importance_sampling_mode) ------------------

# old - sampler log-prob per token; the third token of row 0 is padding (garbage there is ignored)
#   row 0: ln 2, ln 2           -> token ratios 2, 2;    sequence ratio exp(ln 4) = 4 (a sum: the mean would give 2)
#   row 1: ln 2, ln 0.25        -> token ratios 2, 0.25; sequence ratio exp(ln 0.5) = 0.5
#   row 2: ln 1.5               -> token ratio 1.5;      sequence ratio 1.5
IS_OLD = torch.tensor([[LN(0.5), LN(0.5), 9.0], [LN(0.5), LN(0.25), 0.0], [LN(0.75), 0.0, 0.0]])
IS_SAMPLER = torch.tensor([[LN(0.25), LN(0.25), -9.0], [LN(0.25), LN(1.0), 0.0], [LN(0.5), 0.0, 0.0]])
IS_MASK = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    "mode,clip_min,clip_max,expected",
    [
        # truncate: clamp to [clip_min, clip_max]; padding keeps weight 1
        ("token_truncate", None, 1.5, [[1.5, 1.5, 1.0], [1.5, 0.25, 1.0], [1.5, 1.0, 1.0]]),
        ("token_truncate", 0.5, 1.5, [[1.5, 1.5, 1.0], [1.5, 0.5, 1.0], [1.5, 1.0, 1.0]]),
        # mask: a ratio outside [clip_min, clip_max] becomes 0, one inside stays as it is
        ("token_mask", None, 1.5, [[0.0, 0.0, 1.0], [0.0, 0.25, 1.0], [1.5, 1.0, 1.0]]),
        ("token_mask", 0.5, None, [[2.0, 2.0, 1.0], [2.0, 0.0, 1.0], [1.5, 1.0, 1.0]]),
        # sequence: one weight per completion, [B, 1]
        ("sequence_truncate", None, 3.0, [[3.0], [0.5], [1.5]]),
        ("sequence_truncate", 0.8, 3.0, [[3.0], [0.8], [1.5]]),
        ("sequence_mask", None, 3.0, [[0.0], [0.5], [1.5]]),
        ("sequence_mask", 0.8, 3.0, [[0.0], [0.0], [1.5]]),
        ("sequence_mask", None, None, [[4.0], [0.5], [1.5]]),  # no bound: the plain ratio
    ],
)
def test_sampler_importance_weights_by_hand(mode, clip_min, clip_max, expected):
    w = sampler_importance_weights(IS_OLD, IS_SAMPLER, IS_MASK, mode, clip_min, clip_max)
    assert w.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


def test_every_importance_sampling_mode_is_tested_and_unknown_modes_are_refused():
    assert set(IMPORTANCE_SAMPLING_MODES) == {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}
    with pytest.raises(ValueError, match="token_truncate, token_mask, sequence_truncate, sequence_mask"):
        sampler_importance_weights(IS_OLD, IS_SAMPLER, IS_MASK, "sequence_clip")


def test_sampler_importance_weights_carry_no_gradient_and_treat_an_unreported_logprob_as_a_match():
    old = torch.tensor([[LN(0.5), LN(0.5)]], requires_grad=True)
    sampler = torch.tensor([[float("nan"), LN(0.25)]])  # the sampler did not report token 1
    w = sampler_importance_weights(old, sampler, torch.ones(1, 2, dtype=torch.bool), "token_truncate", None, 3.0)
    assert not w.requires_grad
    assert w.tolist() == [pytest.approx([1.0, 2.0])]  # log-ratio 0 for the NaN, ln 2 for the other


def test_sequence_weights_scale_every_token_and_a_masked_out_completion_gets_no_gradient():
    # Ratio 1 (old == new), A = 1 for all; sequence_mask weights with clip_max 3: 0, 0.5, 1.5 (see above).
    # dapo: per-token loss -A * v: row 0: 0, 0; row 1: -0.5, -0.5; row 2: -1.5 -> -2.5 over 5 tokens = -0.5
    w = sampler_importance_weights(IS_OLD, IS_SAMPLER, IS_MASK, "sequence_mask", None, 3.0)
    logp = IS_OLD.clone().requires_grad_()
    loss, _ = loss_of(logp, IS_OLD, [1.0, 1.0, 1.0], IS_MASK.int().tolist(), "dapo", importance_weights=w)
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    loss.backward()
    # d(-v * exp(logp - old)) / d logp = -v at ratio 1, over 5 tokens: row 0 -> 0, row 1 -> -0.1, row 2 -> -0.3
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [-0.1, -0.1, 0.0], [-0.3, 0.0, 0.0]]), atol=1e-7)


def test_importance_weights_scale_the_policy_term_only():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    norm = LossNorm(1, 2, 2)
    ref = torch.tensor([[-1.0, -1.0]])
    w = torch.tensor([[0.5, 1.5]])
    loss, m = policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, norm, loss_type="dapo",
                          importance_weights=w, beta=0.1, ref_logprobs=ref)
    # ratio 1, A = 1: policy terms -0.5 and -1.5; KL k3 of token 2: r = -1 - (-2) = 1 -> e - 2 = 0.718282
    # dapo: (-0.5 + -1.5 + 0.1 * 0.718282) / 2 = -0.964086
    assert loss.item() == pytest.approx(-0.964086, abs=1e-6)
    loss.backward()
    # d/dlogp of -w * exp(logp - old) at ratio 1 is -w; divided by the 2 tokens
    assert logp.grad[0, 0].item() == pytest.approx(-0.25, abs=1e-6)


# --- cispo, sapo, vespo, luspo: value and gradient by hand ---------------------------------------
# Two completions of two tokens.  Row 0: A = +1, token ratios 2 and 0.5 (log-probs log 0.5, log 0.25);
# row 1: A = -2, ratios 3 and 1 (log-probs log 0.8, log 0.1).  old = logp - log(ratio).

P = [[0.5, 0.25], [0.8, 0.1]]
R = [[2.0, 0.5], [3.0, 1.0]]
A2 = [1.0, -2.0]


def _two_rows(loss_type, mask=((1, 1), (1, 1)), **kw):
    logp = torch.log(torch.tensor(P)).requires_grad_()
    old = (logp - torch.log(torch.tensor(R))).detach()
    loss, m = loss_of(logp, old, A2, [list(r) for r in mask], loss_type, **kw)
    loss.backward()
    return loss.item(), logp.grad, m


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    # weights sg(min(r, eps_high = 1.5)): [1.5, 0.5], [1.5, 1.0]; per token -w A logp; dapo: / 4 tokens
    value, grad, m = _two_rows("cispo", epsilon_high=1.5)
    expected = -(1.5 * LN(0.5) + 0.5 * LN(0.25) + 1.5 * -2 * LN(0.8) + 1.0 * -2 * LN(0.1)) / 4
    assert value == pytest.approx(expected, abs=1e-6)
    # d/dlogp = -w A / 4: even the token whose ratio 2 is above the cap keeps a gradient (1.5 x A / 4)
    assert torch.allclose(grad, torch.tensor([[-0.375, -0.125], [0.75, 0.5]]), atol=1e-6)
    assert m["cispo_clip_ratio"].item() == 1  # ratio 2 > 1.5 with A > 0; row 1's 3 > 1.5 has A < 0
    assert "clip_ratio/low" not in m


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_gates_softly_with_a_temperature_per_sign():
    # tau = 1 (A > 0), 1.05 (A <= 0); per token -(4 / tau) sigmoid(tau (r - 1)) A; grpo: mean per row, / 2 rows
    tau = [1.0, 1.05]
    terms = [[-(4 / tau[i]) * _sig(tau[i] * (R[i][t] - 1)) * A2[i] for t in range(2)] for i in range(2)]
    value, grad, m = _two_rows("sapo")
    assert value == pytest.approx((sum(terms[0]) / 2 + sum(terms[1]) / 2) / 2, abs=1e-6)
    # d/dlogp = -4 sig (1 - sig) r A, / (2 tokens x 2 rows); at r = 1 that is -A / 4, the plain gradient
    g = [[-4 * _sig(tau[i] * (R[i][t] - 1)) * (1 - _sig(tau[i] * (R[i][t] - 1))) * R[i][t] * A2[i] / 4 for t in range(2)]
         for i in range(2)]
    assert torch.allclose(grad, torch.tensor(g), atol=1e-6)
    assert grad[1, 1].item() == pytest.approx(2 / 4)  # ratio 1: -A / 4
    assert m == {}  # no clip to count (TRL logs none for sapo)


def test_vespo_weighs_each_completion_by_a_gamma_of_its_whole_ratio():
    # W = product of the ratios: row 0: 2 x 0.5 = 1, phi = exp(3 + 2 ln 1 - 3 x 1) = 1 (k, lambda = 2, 3 for A >= 0);
    # row 1: W = 3, phi = exp(2 + 3 ln 3 - 2 x 3) = 27 e^-4 (k, lambda = 3, 2 for A < 0).  Per token -phi A logp; / 4
    phi1 = 27 * math.exp(-4)
    value, grad, m = _two_rows("vespo")
    assert value == pytest.approx(-(LN(0.5) + LN(0.25) - 2 * phi1 * (LN(0.8) + LN(0.1))) / 4, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.25, -0.25], [2 * phi1 / 4, 2 * phi1 / 4]]), atol=1e-6)
    assert m["vespo/phi_seq"].item() == pytest.approx(1 + phi1)
    # the knobs are the settings': k_neg = 1, lambda_neg = 1 -> phi = exp(1 + ln 3 - 3) = 3 e^-2
    _, _, m = _two_rows("vespo", knobs=LossKnobs(vespo_k_neg=1.0, vespo_lambda_neg=1.0))
    assert m["vespo/phi_seq"].item() == pytest.approx(1 + 3 * math.exp(-2))


def test_vespo_takes_the_samplers_weights_into_its_ratio():
    # a sampler weight of 0.5 on row 1's first token: W = 3 x 0.5 = 1.5; phi = exp(2 + 3 ln 1.5 - 3) = 3.375 e^-1
    v = torch.tensor([[1.0, 1.0], [0.5, 1.0]])
    _, grad, m = _two_rows("vespo", importance_weights=v)
    phi1 = 3.375 * math.exp(-1)
    assert m["vespo/phi_seq"].item() == pytest.approx(1 + phi1)
    assert torch.allclose(grad[1], torch.tensor([2 * phi1 / 4] * 2), atol=1e-6)  # not multiplied by v a second time


def test_luspo_sums_each_completions_tokens():
    # sequence ratios: row 0 exp(mean(ln 2, ln 0.5)) = 1; row 1 (second token masked) exp(ln 3) = 3.
    # Clipped term per token: row 0 -min(1, 1) = -1; row 1 -min(3 x -2, 1.2 x -2) = 6.  luspo: each row's
    # sum over its tokens (2 x -1, 1 x 6), over 2 completions: (-2 + 6) / 2 = 2.  (grpo would average
    # each row's tokens first: (-1 + 6) / 2.)
    value, grad, m = _two_rows("luspo", mask=((1, 1), (1, 0)), importance_sampling_level="sequence")
    assert value == pytest.approx(2.0, abs=1e-6)
    # row 0: d(2 x -w A)/dlogp_t = -2 A w / 2 per token, / 2 rows = -0.5; row 1: -A w x 1 / 2 = 3; masked: 0
    assert torch.allclose(grad, torch.tensor([[-0.5, -0.5], [3.0, 0.0]]), atol=1e-6)
    assert m["clip_ratio/low"].item() == 0  # row 1's 3 is above the range with A < 0: the unclipped term, not clipped
    grpo, _, _ = _two_rows("grpo", mask=((1, 1), (1, 0)), importance_sampling_level="sequence")
    assert grpo == pytest.approx(2.5, abs=1e-6)


def test_off_policy_mask_drops_only_far_completions_with_a_negative_advantage():
    # mean per-token KL from the sampler, mean(sampling - logp): row 0 1.0 (A > 0: kept), row 1 1.0 (A < 0:
    # dropped at threshold 0.5), row 2 0.2 (kept); the masked token's 9.0 does not count
    logp = torch.zeros(3, 2)
    sampling = torch.tensor([[1.0, 1.0], [0.5, 1.5], [0.2, 9.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    keep = off_policy_mask(torch.tensor([1.0, -1.0, -1.0]), logp, sampling, mask, 0.5)
    assert keep.tolist() == [[True], [False], [True]]
    assert off_policy_mask(torch.tensor([1.0, -1.0, -1.0]), logp, sampling, mask, 1.0).tolist() == [[True]] * 3
    # in the loss: the dropped row's policy term is 0, its KL term stays
    lp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.25]] * 3))
    loss, _ = loss_of(lp, lp.detach(), [1.0, -1.0, -1.0], mask.tolist(), "dapo", beta=0.1, ref_logprobs=ref,
                      sequence_mask=keep)
    kl = 0.5 - math.log(0.5) - 1  # k3 with ref - logp = ln 0.5
    assert loss.item() == pytest.approx((-1 * 2 + 1 * 1 + 0.1 * kl * 5) / 5, abs=1e-6)
