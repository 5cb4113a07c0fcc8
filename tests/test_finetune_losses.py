import pytest
import torch

from rlvr.finetune.losses import DPO_LOSS_TYPES, dpo_loss, sequence_logps, sft_loss

INF = float("inf")

# Two rows of three tokens; masked-out positions hold -inf, as a padded log-prob may.
LOGP = [[-1.0, -2.0, -INF], [-INF, -0.5, -1.5]]
MASK = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)


def leaf(values):
    return torch.tensor(values, requires_grad=True)


# --- sft_loss -------------------------------------------------------------------------


def test_sft_loss_value_and_gradient_by_hand():
    logp = leaf(LOGP)
    loss = sft_loss(logp, MASK, num_tokens=4)
    # (1 + 2 + 0.5 + 1.5) / 4 = 5 / 4
    assert loss.item() == pytest.approx(1.25)
    loss.backward()
    # d loss / d logp = -1 / num_tokens = -0.25 where trained, exactly 0 where masked (no NaN from -inf)
    expected = torch.tensor([[-0.25, -0.25, 0.0], [0.0, -0.25, -0.25]])
    assert torch.equal(logp.grad, expected)
    assert not torch.isnan(logp.grad).any()


def test_sft_micro_batches_add_up_to_the_whole_batch():
    whole = leaf(LOGP)
    sft_loss(whole, MASK, num_tokens=4).backward()
    parts = [leaf(LOGP[:1]), leaf(LOGP[1:])]
    # each micro-batch divides by the batch's 4 tokens: (1 + 2) / 4 + (0.5 + 1.5) / 4 = 0.75 + 0.5 = 1.25
    losses = [sft_loss(p, MASK[i : i + 1], num_tokens=4) for i, p in enumerate(parts)]
    assert losses[0].item() == pytest.approx(0.75) and losses[1].item() == pytest.approx(0.5)
    sum(losses).backward()
    assert sum(losses).item() == pytest.approx(1.25)
    assert torch.equal(torch.cat([p.grad for p in parts]), whole.grad)


def test_sft_loss_with_no_tokens_is_zero_and_backward_works():
    logp = leaf([[-INF, -1.0], [-2.0, -INF]])
    loss = sft_loss(logp, torch.zeros(2, 2, dtype=torch.bool), num_tokens=0)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 2))


def test_sft_loss_rejects_negative_num_tokens():
    with pytest.raises(ValueError, match="num_tokens"):
        sft_loss(torch.zeros(1, 2), torch.ones(1, 2), num_tokens=-1)


# --- sequence_logps -------------------------------------------------------------------


def test_sequence_logps_sum_and_average_by_hand():
    logp = leaf(LOGP)
    # sums: -1 - 2 = -3 and -0.5 - 1.5 = -2; averages over 2 tokens each: -1.5 and -1.0
    assert sequence_logps(logp, MASK).tolist() == [-3.0, -2.0]
    assert sequence_logps(logp, MASK, average=True).tolist() == [-1.5, -1.0]
    sequence_logps(logp, MASK, average=True).sum().backward()
    # d avg / d logp = 1 / (row's count) = 0.5 where masked in, 0 at the -inf positions
    assert torch.equal(logp.grad, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]))


def test_sequence_logps_int_mask_and_empty_row():
    logp = torch.tensor([[-1.0, -3.0, -INF], [-INF, -INF, -INF]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])  # an int mask; the second row has no tokens
    # row 0: -1 - 3 = -4, average -4 / 2 = -2; the empty row gives 0 either way
    assert sequence_logps(logp, mask).tolist() == [-4.0, 0.0]
    assert sequence_logps(logp, mask, average=True).tolist() == [-2.0, 0.0]


# --- dpo_loss: sigmoid ------------------------------------------------------------------


def dpo(chosen, rejected, ref_chosen, ref_rejected, beta, **kw):
    chosen, rejected = leaf(chosen), leaf(rejected)
    out = dpo_loss(chosen, rejected, torch.tensor(ref_chosen), torch.tensor(ref_rejected), beta, **kw)
    return out, chosen, rejected


def test_sigmoid_known_margin_value_rewards_and_gradient():
    (losses, r_chosen, r_rejected), chosen, rejected = dpo([-3.0], [-5.0], [-4.0], [-4.0], beta=0.1)
    # h = (-3 - -5) - (-4 - -4) = 2; beta * h = 0.2
    # loss = -log sigmoid(0.2) = log(1 + e^-0.2) = log(1 + 0.818730753) = log(1.818730753) = 0.598138869
    assert losses.item() == pytest.approx(0.598138869, abs=1e-6)
    # rewards: 0.1 * (-3 - -4) = 0.1 and 0.1 * (-5 - -4) = -0.1, with no gradient
    assert r_chosen.item() == pytest.approx(0.1) and r_rejected.item() == pytest.approx(-0.1)
    assert not r_chosen.requires_grad and not r_rejected.requires_grad
    losses.sum().backward()
    # d loss / d chosen = -beta * sigmoid(-beta h) = -0.1 / (1 + e^0.2) = -0.1 / 2.221402758 = -0.045016600
    assert chosen.grad.item() == pytest.approx(-0.045016600, abs=1e-7)
    assert rejected.grad.item() == pytest.approx(0.045016600, abs=1e-7)  # h falls as rejected rises


def test_sigmoid_zero_margin_is_log_two_per_pair():
    # h = 0 for both pairs whatever the log-probs: -log sigmoid(0) = -log(1/2) = log 2 = 0.693147
    (losses, _, _), _, _ = dpo([-1.0, -7.0], [-2.0, -3.0], [-1.0, -7.0], [-2.0, -3.0], beta=0.5)
    assert losses.tolist() == pytest.approx([0.693147, 0.693147], abs=1e-6)


def test_sigmoid_label_smoothing_by_hand():
    (losses, _, _), chosen, _ = dpo([-3.0], [-5.0], [-4.0], [-4.0], beta=0.1, label_smoothing=0.1)
    # -log sigmoid(0.2) = 0.598138869; -log sigmoid(-0.2) = log(1 + e^0.2) = 0.598138869 + 0.2 = 0.798138869
    # loss = 0.9 * 0.598138869 + 0.1 * 0.798138869 = 0.538324982 + 0.079813887 = 0.618138869
    assert losses.item() == pytest.approx(0.618138869, abs=1e-6)
    losses.sum().backward()
    # d loss / d h = -beta * (sigmoid(-0.2) - ls) = -0.1 * (0.450166003 - 0.1) = -0.035016600
    assert chosen.grad.item() == pytest.approx(-0.035016600, abs=1e-7)


def test_sigmoid_is_finite_for_huge_margins():
    # beta * h = +1000: loss = log(1 + e^-1000) = 0 to float precision; beta * h = -1000: loss = 1000
    (losses, _, _), chosen, _ = dpo([0.0, 0.0], [-1000.0, 1000.0], [0.0, 0.0], [0.0, 0.0], beta=1.0)
    assert losses.tolist() == pytest.approx([0.0, 1000.0])
    losses.sum().backward()
    # gradients -sigmoid(-1000) = -0 and -sigmoid(1000) = -1
    assert chosen.grad.tolist() == pytest.approx([0.0, -1.0])
    (smoothed, _, _), _, _ = dpo([0.0], [1000.0], [0.0], [0.0], beta=1.0, label_smoothing=0.1)
    # 0.9 * 1000 + 0.1 * log(1 + e^-1000) = 900
    assert smoothed.item() == pytest.approx(900.0)


# --- dpo_loss: ipo and hinge ------------------------------------------------------------


def test_ipo_by_hand():
    # beta = 0.5, target margin 1 / (2 * 0.5) = 1: h = 2 -> (2 - 1)^2 = 1; h = 1 -> 0; h = -1 -> (-2)^2 = 4
    zeros = [0.0] * 3
    (losses, _, _), chosen, _ = dpo([0.0, -1.0, -2.0], [-2.0, -2.0, -1.0], zeros, zeros, beta=0.5, loss_type="ipo")
    assert losses.tolist() == pytest.approx([1.0, 0.0, 4.0])
    losses.sum().backward()
    # d loss / d chosen = 2 * (h - 1): 2, 0, -4
    assert chosen.grad.tolist() == pytest.approx([2.0, 0.0, -4.0])


def test_hinge_by_hand_on_both_sides_of_the_margin():
    # beta = 0.1, margin 1 / beta = 10: h = 2 -> 1 - 0.2 = 0.8; h = -5 -> 1 + 0.5 = 1.5; h = 20 -> max(0, -1) = 0
    (losses, _, _), chosen, _ = dpo([2.0, -5.0, 20.0], [0.0] * 3, [0.0] * 3, [0.0] * 3, beta=0.1, loss_type="hinge")
    assert losses.tolist() == pytest.approx([0.8, 1.5, 0.0])
    losses.sum().backward()
    # slope -beta inside the margin, 0 beyond it
    assert chosen.grad.tolist() == pytest.approx([-0.1, -0.1, 0.0])


def test_every_registered_dpo_loss_type_is_tested():
    assert set(DPO_LOSS_TYPES) == {"sigmoid", "ipo", "hinge"}


# --- errors ---------------------------------------------------------------------------

ONE = torch.zeros(1)


def test_unknown_loss_type_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        dpo_loss(ONE, ONE, ONE, ONE, 0.1, loss_type="kto")
    assert all(name in str(err.value) for name in ("sigmoid", "ipo", "hinge", "'kto'"))


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_beta_must_be_positive(beta):
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(ONE, ONE, ONE, ONE, beta)


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_label_smoothing_is_for_sigmoid_only(loss_type):
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type=.sigmoid. only"):
        dpo_loss(ONE, ONE, ONE, ONE, 0.1, loss_type=loss_type, label_smoothing=0.1)


@pytest.mark.parametrize("label_smoothing", [-0.1, 0.5, 0.7])
def test_label_smoothing_range(label_smoothing):
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        dpo_loss(ONE, ONE, ONE, ONE, 0.1, label_smoothing=label_smoothing)
