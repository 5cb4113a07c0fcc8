"""The clipped policy-gradient loss of GRPO and its variants, as pure functions.

Per completion token t of completion i (PPO, https://arxiv.org/abs/1707.06347):

    w_it  = exp(logp_it - old_logp_it)                     token-level ratio
            exp(mean_t(logp_it - old_logp_it))             sequence-level (GSPO, https://arxiv.org/abs/2507.18071)
    l_it  = -min(min(w_it, delta) * A_i, clip(w_it, 1 - eps, 1 + eps_high) * A_i) * e_it * v_it
          + beta * KL_it * c_it                            k1, k2 or k3 estimator (kl.py; default k3)

    KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1  (k3, http://joschu.net/blog/kl-approx.html)
    c_it  = w_it (with its gradient) when `bias_correction_kl`, else 1

The KL is estimated from tokens sampled by the old policy, not by the current one; weighting the
estimate by the ratio w corrects for that (TRL's `use_bias_correction_kl`, its default).  Even on
the first pass, where w = 1, the weight changes the gradient: d(KL * w) = dKL + KL * dlogp.

`eps_high` > `eps` is DAPO's clip-higher (https://arxiv.org/abs/2503.14476).  `delta` (off
when None) is INTELLECT-2's two-sided clipping (https://arxiv.org/abs/2505.07291): it caps the
unclipped ratio, which binds only where A < 0, so a token made far likelier than before cannot
push an unbounded loss.  e_it is 1 for the tokens trained on and 0 for the others: all of them,
or with `top_entropy_quantile` < 1 only those of highest entropy (`high_entropy_mask`).
v_it corrects for completions sampled by another engine (vLLM, rollout workers) whose
probabilities differ slightly from the trainer's (`sampler_importance_weights`; 1 otherwise).
Both multiply the policy term only, never the KL term.

Four loss types replace the clipped term (LOSS_TYPES pairs each type with its term and aggregation;
sg = no gradient through it; TRL 1.16's semantics and defaults):

    cispo  -sg(min(w, eps_high)) * A * logp          (MiniMax-M1) the weight clipped, never the gradient
    sapo   -(4 / tau) * sigmoid(tau * (w - 1)) * A   (SAPO) a soft gate; tau by the sign of A
    vespo  -sg(phi(W)) * A * logp                    (VESPO) phi(W) = exp(lambda + k log W - lambda W),
                                                     W the completion's whole ratio (summed log-ratios)
    luspo  the clipped term, each completion's tokens summed (LUSPO: GSPO scaled by length)

and `off_policy_mask` (DeepSeek-V3.2) leaves out completions with A < 0 whose mean KL from the
sampling policy exceeds a threshold.

The per-token losses are then aggregated over the masked tokens by `loss_type`:

    grpo, sapo      sum_i (sum_t l_it / |o_i|) / N          mean per completion, then over completions
    dapo, cispo,    sum_it l_it / (number of tokens)        every token weighs the same
      vespo
    dr_grpo         sum_it l_it / (N * max_completion_length)   (Dr. GRPO, https://arxiv.org/abs/2503.20783)
    bnpo            sum_it l_it / (tokens of this micro-batch)  normalised per micro-batch, then averaged
    luspo           sum_it l_it / N                         each completion's sum, averaged

N and the token count are totals over the whole accumulated batch (`LossNorm`),
so with gradient accumulation the summed micro-batch losses equal the loss of
one big batch for every type but bnpo.  bnpo, as in TRL, normalises each
micro-batch by its own tokens and so depends on how the batch is split.  Tokens
left out by the entropy mask still count in these denominators, as in TRL.

Masked tokens contribute exactly zero loss and zero gradient (they are selected
out with `where`, never multiplied, so an inf ratio at a padded position cannot
leak a NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlvr.kl import kl_estimate


@dataclass(frozen=True)
class LossNorm:
    """Totals over the whole accumulated batch that the aggregations divide by."""

    num_sequences: int
    num_tokens: float  # dapo: the tokens normalised over (with steps_per_generation, a share of the generation's)
    max_completion_length: int
    num_micro_batches: int = 1


IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_importance_weights(old_logprobs, sampler_logprobs, mask, mode: str = "sequence_mask",
                               clip_min: float | None = None, clip_max: float | None = 3.0) -> torch.Tensor:
    """Weights v correcting for completions sampled by another engine; no gradient.

        rho_it = exp(old_it - sampler_it)                  token_* modes: [B, T], 1 at masked positions
        rho_i  = exp(sum_t (old_it - sampler_it))          sequence_* modes: [B, 1], the whole completion's ratio
        *_truncate  v = clamp(rho, clip_min, clip_max)     (TIS, https://fengyao.notion.site/off-policy-rl)
        *_mask      v = rho where clip_min <= rho <= clip_max, else 0   (an unset bound is no bound)

    As TRL's `vllm_importance_sampling_mode` (https://huggingface.co/docs/trl/main/en/grpo_trainer): the
    sequence ratio sums the log-ratios (unlike GSPO's training ratio, which averages them), and a
    token whose sampler log-prob is NaN (not reported) has log-ratio 0.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"importance sampling mode must be one of {', '.join(IMPORTANCE_SAMPLING_MODES)}; got {mode!r}")
    level, _, kind = mode.partition("_")
    with torch.no_grad():
        mask = mask.bool()
        diff = torch.nan_to_num(old_logprobs.detach() - sampler_logprobs, nan=0.0)
        diff = torch.where(mask, diff, torch.zeros_like(diff))
        rho = torch.exp(diff.sum(-1, keepdim=True) if level == "sequence" else diff)
        if kind == "truncate":
            return rho.clamp(min=clip_min, max=clip_max)
        outside = torch.zeros_like(rho, dtype=torch.bool)
        if clip_min is not None:
            outside |= rho < clip_min
        if clip_max is not None:
            outside |= rho > clip_max
        return rho.masked_fill(outside, 0.0)


def entropy_threshold(entropies: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """tau = Q_(1 - rho)(H): the (1 - rho) quantile of the entropies given (a flat tensor), with
    linear interpolation between order statistics (torch.quantile's default, as TRL).

    "Beyond the 80/20 rule" (https://arxiv.org/abs/2506.01939) trains on the tokens with
    H >= tau only: rho = 0.2 keeps the top fifth; rho = 0 keeps the highest-entropy token(s)
    (tau = max); rho = 1 keeps every token (tau = min).  No entropies: tau = +inf, none kept.
    """
    values = entropies.detach().reshape(-1).float()
    if values.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(values, 1.0 - top_quantile)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold) -> torch.Tensor:
    """e_it = mask_it and H_it >= tau: the tokens of [B, T] trained on (`entropy_threshold`)."""
    return (entropy.detach() >= torch.as_tensor(threshold, device=entropy.device)) & mask.bool()


def importance_log_weights(logprobs, old_logprobs, mask, level: str = "token") -> torch.Tensor:
    """log w: [B, T] per token, or [B, 1] per sequence (mean log-ratio over the completion)."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        return log_ratio
    if level == "sequence":
        return (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    raise ValueError(f"importance_sampling_level must be token or sequence; got {level!r}")


@dataclass(frozen=True)
class LossKnobs:
    """The settings of the policy terms beyond the clip range (TRL's names and defaults): SAPO's gate
    temperatures and VESPO's Gamma weighting, each for positive and for negative advantages."""

    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclass(frozen=True)
class _Term:
    """What a policy term reads: the log-probs, the ratio w ([B, T] or [B, 1]), the advantages ([B, 1] or
    [B, T]), the mask, where a clip is counted, and the settings."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ratio: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    counted: torch.Tensor  # the tokens, or with sequence ratios the completions, a clip count covers
    sign: torch.Tensor  # the advantage a clip count reads: per token, or a completion's first token's (its return)
    epsilon: float
    eps_high: float
    delta: float | None
    knobs: LossKnobs
    importance_weights: torch.Tensor | None


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    norm: LossNorm,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    bias_correction_kl: bool = False,
    importance_weights: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    sequence_mask: torch.Tensor | None = None,
    knobs: LossKnobs = LossKnobs(),
):
    """Loss of one micro-batch and its metrics (sums, so micro-batches can be added up).

    logprobs, old_logprobs, ref_logprobs, mask: [B, T]; advantages: [B], or [B, T] (process rewards,
    one per token); importance_weights (`sampler_importance_weights`): [B, T] or [B, 1]; entropy_mask
    (`high_entropy_mask`): [B, T], False for the tokens whose policy term is left out (their KL term
    stays); sequence_mask (`off_policy_mask`): [B, 1], False for the completions whose policy term is
    left out.  bias_correction_kl: the KL term is weighted by the policy ratio (token or sequence
    level, as the policy term's).  Returns (loss, metrics) where metrics maps names to 0-dim tensors
    of *sums*: the clipped loss types' "clip_ratio/low", "clip_ratio/high", "clip_ratio/region" over
    masked tokens (over completions with sequence-level ratios, each clipped or not as a whole), and
    "clip_ratio/low_min" and "clip_ratio/high_max" (when a completion has a token), this micro-batch's
    extremes over completions of the share of clipped tokens, which TRL averages over the micro-batches
    of a step; cispo's "cispo_clip_ratio" (as the clip counts); vespo's "vespo/phi_seq" over completions;
    "kl" over masked tokens.  The caller divides each sum by its count.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    mask = mask.bool()
    eps_high = epsilon if epsilon_high is None else epsilon_high
    # Padded positions may hold anything; zero them before any exp so no inf * 0 reaches a gradient.
    logprobs, old_logprobs = _masked(logprobs, mask), _masked(old_logprobs, mask)
    ref_logprobs = None if ref_logprobs is None else _masked(ref_logprobs, mask)
    log_w = importance_log_weights(logprobs, old_logprobs, mask, importance_sampling_level)
    ratio = torch.exp(log_w)
    adv = (advantages if advantages.dim() == 2 else advantages[:, None]).to(logprobs.dtype)
    per_token_ratio = ratio.shape == mask.shape
    counted = mask if per_token_ratio else torch.ones_like(ratio, dtype=torch.bool)
    sign = (adv if per_token_ratio else adv[:, :1]).detach()
    term, aggregate = LOSS_TYPES[loss_type]
    weights = None if importance_weights is None else importance_weights.detach()
    per_token, metrics = term(_Term(logprobs, old_logprobs, ratio, adv, mask, counted, sign, epsilon, eps_high, delta, knobs,
                                    weights))
    if weights is not None and term is not _vespo:  # the sampler was not exactly this policy (vespo weighs it in phi)
        per_token = per_token * weights
    if per_token.shape != mask.shape:  # sequence-level weights broadcast over tokens
        per_token = per_token.expand_as(mask)
    if sequence_mask is not None:  # off-policy completions with a negative advantage are left out
        per_token = torch.where(sequence_mask.bool(), per_token, torch.zeros_like(per_token))
    if entropy_mask is not None:  # only the high-entropy tokens are trained on
        per_token = torch.where(entropy_mask.bool(), per_token, torch.zeros_like(per_token))
    if beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = torch.where(mask, kl, 0.0).sum().detach()
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    return aggregate(per_token, mask, norm), metrics


def off_policy_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (https://arxiv.org/abs/2512.02556, eq. 9; TRL's
    `off_policy_mask_threshold`): [B, 1] (or [B, T] with per-token advantages), False where a completion
    has a negative advantage and its mean per-token KL from the sampling policy to this one,
    mean_t (sampling_logp - logp), exceeds `threshold`.  No gradient; a log-prob the sampler did not
    report (NaN) gives no evidence (0)."""
    with torch.no_grad():
        mask = mask.bool()
        kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)
        mean = torch.where(mask, kl, 0.0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        adv = advantages if advantages.dim() == 2 else advantages[:, None]
        return (adv >= 0) | (mean <= threshold)


# --- the policy term of each loss type: per-token losses (before masking) and their metric sums ------


def _clipped(x: _Term):
    """PPO's clipped term (grpo, dapo, dr_grpo, bnpo, luspo): -min(min(w, delta) * A, clip(w, 1 - eps, 1 + eps_high) * A)."""
    unclipped = (x.ratio if x.delta is None else x.ratio.clamp(max=x.delta)) * x.adv
    clipped = torch.clamp(x.ratio, 1 - x.epsilon, 1 + x.eps_high) * x.adv
    metrics = {}
    with torch.no_grad():  # per token, or per completion with sequence-level ratios (as TRL counts them)
        low = (x.ratio < 1 - x.epsilon) & (x.sign < 0) & x.counted
        high = (x.ratio > 1 + x.eps_high) & (x.sign > 0) & x.counted
        metrics["clip_ratio/low"] = low.sum().float()
        metrics["clip_ratio/high"] = high.sum().float()
        metrics["clip_ratio/region"] = (low | high).sum().float()
        # TRL's extremes: the smallest share of low-clipped tokens in a completion, the largest high-clipped share
        rows = x.counted.sum(-1)
        seen = rows > 0
        if seen.any():
            metrics["clip_ratio/low_min"] = (low.sum(-1)[seen] / rows[seen]).min().float()
            metrics["clip_ratio/high_max"] = (high.sum(-1)[seen] / rows[seen]).max().float()
    return -torch.minimum(unclipped, clipped), metrics


def _cispo(x: _Term):
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): -sg(min(w, eps_high)) * A * logp.  The weight
    is clipped and detached, so every token keeps a gradient A * min(w, eps_high) * dlogp; eps_high is
    the paper's eps_max (TRL: epsilon_high; ScaleRL recommends 5)."""
    weight = x.ratio.clamp(max=x.eps_high).detach()
    with torch.no_grad():
        clipped = (x.ratio > x.eps_high) & (x.sign > 0) & x.counted
    return -weight * x.adv * x.logprobs, {"cispo_clip_ratio": clipped.sum().float()}


def _sapo(x: _Term):
    """SAPO (https://arxiv.org/abs/2511.20347): a soft gate in place of the clip, -(4 / tau) * sigmoid(tau * (w - 1)) * A,
    tau = sapo_temperature_pos where A > 0, else sapo_temperature_neg.  At w = 1 its gradient is A * dlogp,
    as the clipped term's; away from 1 it fades smoothly instead of stopping."""
    tau = torch.where(x.adv > 0, x.knobs.sapo_temperature_pos, x.knobs.sapo_temperature_neg).to(x.ratio.dtype)
    return -torch.sigmoid(tau * (x.ratio - 1)) * 4 / tau * x.adv, {}


def _vespo(x: _Term):
    """VESPO (https://arxiv.org/abs/2602.10693): -sg(phi(W)) * A * logp with phi(W) = exp(lambda + k log W - lambda W), a
    Gamma-shaped weight of the completion's whole ratio W = exp(sum_t (logp - old_logp)) (times the sampler
    weights, whose log-ratios join the sum), phi(1) = 1; (k, lambda) = (vespo_k_pos, vespo_lambda_pos) where
    A >= 0, else the _neg pair.  Each token's log-ratio and the sum are clamped to [log 1e-8, 20] as TRL
    does (each token's to [-20, 20] first)."""
    floor, k = math.log(1e-8), x.knobs
    with torch.no_grad():
        per_token = torch.where(x.mask, (x.logprobs - x.old_logprobs).clamp(-20.0, 20.0), 0.0)
        log_w = per_token.sum(-1, keepdim=True)
        if x.importance_weights is not None:
            log_w = log_w + torch.log(x.importance_weights).clamp(floor, 20.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        positive = x.adv >= 0
        k_ = torch.where(positive, k.vespo_k_pos, k.vespo_k_neg).to(log_w.dtype)
        lam = torch.where(positive, k.vespo_lambda_pos, k.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k_ * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * x.adv * x.logprobs, {"vespo/phi_seq": phi[:, :1].sum().float()}


def _masked(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, t, torch.zeros_like(t))


# --- aggregation: per-token losses (zero where masked) -> scalar -----------------------


def _grpo(per_token, mask, norm: LossNorm):
    per_seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(norm.num_sequences, 1)


def _dapo(per_token, mask, norm: LossNorm):
    return per_token.sum() / max(norm.num_tokens, 1)


def _dr_grpo(per_token, mask, norm: LossNorm):
    return per_token.sum() / (max(norm.num_sequences, 1) * norm.max_completion_length)


def _bnpo(per_token, mask, norm: LossNorm):
    return per_token.sum() / mask.sum().clamp(min=1) / norm.num_micro_batches


def _luspo(per_token, mask, norm: LossNorm):
    return per_token.sum() / max(norm.num_sequences, 1)


# loss_type -> (policy term, aggregation), TRL 1.16's eight
LOSS_TYPES = {
    "grpo": (_clipped, _grpo), "dapo": (_clipped, _dapo), "dr_grpo": (_clipped, _dr_grpo), "bnpo": (_clipped, _bnpo),
    "cispo": (_cispo, _dapo), "sapo": (_sapo, _grpo), "luspo": (_clipped, _luspo), "vespo": (_vespo, _dapo),
}
# the types normalised by the step's tokens (dapo's aggregation); TRL divides the others by its accumulation steps
TOKEN_NORMALISED = frozenset(name for name, (_, aggregate) in LOSS_TYPES.items() if aggregate is _dapo)
