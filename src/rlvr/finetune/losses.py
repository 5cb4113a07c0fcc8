"""Losses of supervised fine-tuning and direct preference optimisation, as pure functions.

SFT (and rejection-sampling fine-tuning, which is SFT on the verified completions):

    L = -sum_it m_it * logp_it / num_tokens

num_tokens counts the trained tokens of the whole accumulated batch, as transformers does with
`num_items_in_batch`, so the summed micro-batch losses equal the token mean of one big batch.

DPO-style losses, per pair of a chosen (preferred) and a rejected completion of one prompt, with
log-probabilities summed over each completion's tokens (`sequence_logps`):

    h = (logp_chosen - logp_rejected) - (ref_chosen - ref_rejected)

    sigmoid  -(1 - ls) * log sigma(beta * h) - ls * log sigma(-beta * h)
             (DPO, https://arxiv.org/abs/2305.18290; ls is cDPO's label smoothing,
             https://ericmitchell.ai/cdpo.pdf, the assumed probability that a label is flipped)
    ipo      (h - 1 / (2 * beta))**2                   (IPO, https://arxiv.org/abs/2310.12036)
    hinge    max(0, 1 - beta * h)                      (SLiC, https://arxiv.org/abs/2305.10425)

The implicit rewards reported beside the loss are beta * (logp - ref) for each completion.

Departures from the papers, all as in TRL (https://huggingface.co/docs/trl/dpo_trainer):
IPO's paper writes tau for beta and uses log-probs of whole sequences; TRL, and we, feed it
log-probs averaged over each completion's tokens (`sequence_logps(average=True)`), which keeps
the target margin 1 / (2 * beta) independent of length.  SLiC's calibration loss has no reference
model and a margin delta: here h includes the reference log-ratio and the margin is 1 / beta
(max(0, 1 - beta * h) = beta * max(0, 1 / beta - h)).

Masked tokens contribute exactly zero loss and zero gradient (they are selected out with
`where`, never multiplied, so a -inf log-prob at a padded position cannot leak a NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens: int, loss_type: str = "nll") -> torch.Tensor:
    """-sum_it m_it * w_it * logp_it / num_tokens over logprobs, mask: [B, T].

    w_it is 1 for loss_type="nll"; for "dft" (Dynamic Fine-Tuning, https://arxiv.org/abs/2508.05629,
    as TRL's SFTTrainer) it is the token's probability exp(logp_it), detached, so a token the model
    finds unlikely weighs less.  num_tokens is the number of trained tokens in the whole accumulated
    batch, so that the losses of its micro-batches add up to the batch's token mean.  num_tokens = 0
    (nothing to train on) gives a loss of 0.0 that is still connected to logprobs, so backward runs
    and yields zeros.
    """
    if loss_type not in SFT_LOSS_TYPES:
        raise ValueError(f"SFT loss_type must be one of {', '.join(SFT_LOSS_TYPES)}; got {loss_type!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0; got {num_tokens}")
    mask = mask.bool()
    if num_tokens == 0:  # an empty batch: every token is left out
        mask = torch.zeros_like(mask)
    per_token = SFT_LOSS_TYPES[loss_type](logprobs)
    return torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / max(num_tokens, 1)


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """[B]: sum_t m_it * logp_it per row, or with average=True that sum over the row's masked
    count (the length-normalised log-prob IPO uses).  A row with no masked tokens gives 0."""
    mask = mask.bool()
    total = torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum(-1)
    if not average:
        return total
    return total / mask.sum(-1).clamp(min=1)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
):
    """Per-pair losses and implicit rewards of P preference pairs; every input is [P].

    Returns (losses [P], chosen_rewards [P], rejected_rewards [P]) where the rewards are
    beta * (logp - ref) of the chosen and of the rejected completion, detached.  The caller
    reduces the losses (mean over pairs).  For loss_type="ipo" pass log-probs averaged over
    each completion's tokens (`sequence_logps(average=True)`), as TRL does; for sigmoid and
    hinge pass sums.  label_smoothing (cDPO) is in [0, 0.5) and belongs to sigmoid only.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"DPO loss_type must be one of {', '.join(DPO_LOSS_TYPES)}; got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (typically 0.1 to 0.5); got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) (the rate of flipped labels); got {label_smoothing}")
    if label_smoothing > 0 and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to loss_type='sigmoid' only; got loss_type={loss_type!r}")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    losses = DPO_LOSS_TYPES[loss_type](h, beta, label_smoothing)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def combined_dpo_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, beta: float,
                      loss_types: tuple[str, ...] = ("sigmoid",), loss_weights: tuple[float, ...] | None = None,
                      label_smoothing: float = 0.0):
    """TRL's list of DPO losses: sum_k w_k * mean_pairs(loss_k), each loss on the sequence log-probs it
    takes (ipo: averaged over the completion's tokens; the others: summed; `sequence_logps`).
    logprobs, ref_logprobs, mask: [2P, T] per-token log-probs of the policy and the reference, chosen
    at even rows and rejected at odd.  Returns (loss, chosen_rewards [P], rejected_rewards [P]), the
    rewards from the summed log-probs, as TRL logs them."""
    weights = loss_weights or (1.0,) * len(loss_types)
    if len(weights) != len(loss_types):
        raise ValueError(f"loss_weights needs one weight per loss type; got {len(weights)} for {list(loss_types)}")
    sequences = {average: (sequence_logps(logprobs, mask, average), sequence_logps(ref_logprobs, mask, average))
                 for average in {name in AVERAGED for name in loss_types} | {False}}
    total = logprobs.new_zeros(())
    for name, weight in zip(loss_types, weights):
        p, r = sequences[name in AVERAGED]
        losses, _, _ = dpo_loss(p[0::2], p[1::2], r[0::2], r[1::2], beta, name, label_smoothing)
        total = total + weight * losses.mean()
    sums, ref_sums = sequences[False]
    chosen_rewards = beta * (sums[0::2] - ref_sums[0::2]).detach()
    rejected_rewards = beta * (sums[1::2] - ref_sums[1::2]).detach()
    return total, chosen_rewards, rejected_rewards


# --- DPO variants: margin h (policy log-ratio minus reference log-ratio) -> loss per pair ------


def _sigmoid(h, beta: float, label_smoothing: float):
    # logsigmoid is exact where sigmoid would round to 0 or 1 (|beta * h| in the hundreds).
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def _ipo(h, beta: float, label_smoothing: float):
    return (h - 1 / (2 * beta)) ** 2


def _hinge(h, beta: float, label_smoothing: float):
    return torch.relu(1 - beta * h)


DPO_LOSS_TYPES = {"sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge}
AVERAGED = frozenset({"ipo"})  # the losses that take log-probs averaged over the completion's tokens
# TRL 1.16's DPO losses that rlvr does not have: refused by name when the settings are checked.
TRL_ONLY_DPO_LOSS_TYPES = ("exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero",
                           "apo_down", "discopop", "sft", "sigmoid_norm")


# --- SFT variants: per-token log-probs -> per-token loss ---------------------------------------

def _nll(logprobs):
    return -logprobs


def _dft(logprobs):
    return -logprobs * logprobs.detach().exp()


SFT_LOSS_TYPES = {"nll": _nll, "dft": _dft}
