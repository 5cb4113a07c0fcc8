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

The per-token losses are then aggregated over the masked tokens by `loss_type`:

    grpo     sum_i (sum_t l_it / |o_i|) / N          mean per completion, then over completions
    dapo     sum_it l_it / (number of tokens)        every token weighs the same
    dr_grpo  sum_it l_it / (N * max_completion_length)   (Dr. GRPO, https://arxiv.org/abs/2503.20783)
    bnpo     sum_it l_it / (tokens of this micro-batch)  normalised per micro-batch, then averaged

N and the token count are totals over the whole accumulated batch (`LossNorm`),
so with gradient accumulation the summed micro-batch losses equal the loss of
one big batch for grpo, dapo and dr_grpo.  bnpo, as in TRL, normalises each
micro-batch by its own tokens and so depends on how the batch is split.  Tokens
left out by the entropy mask still count in these denominators, as in TRL.

Masked tokens contribute exactly zero loss and zero gradient (they are selected
out with `where`, never multiplied, so an inf ratio at a padded position cannot
leak a NaN).
"""

from __future__ import annotations

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
):
    """Loss of one micro-batch and its metrics (sums, so micro-batches can be added up).

    logprobs, old_logprobs, ref_logprobs, mask: [B, T]; advantages: [B], or [B, T] (process rewards,
    one per token); importance_weights
    (`sampler_importance_weights`): [B, T] or [B, 1]; entropy_mask (`high_entropy_mask`): [B, T],
    False for the tokens whose policy term is left out (their KL term stays).  bias_correction_kl:
    the KL term is weighted by the policy ratio (token or sequence level, as the policy term's).
    Returns (loss, metrics) where metrics maps names to 0-dim tensors of *sums over
    masked tokens* ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "kl")
    that the caller divides by the token count; with sequence-level ratios the clip counts
    are over completions (each clipped or not as a whole), divided by the completion count.
    "clip_ratio/low_min" and "clip_ratio/high_max" (when a completion has a token) are this
    micro-batch's extremes over completions of the share of clipped tokens, which TRL averages over
    the micro-batches of a step.
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
    unclipped = (ratio if delta is None else ratio.clamp(max=delta)) * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if importance_weights is not None:  # the sampler was not exactly this policy
        per_token = per_token * importance_weights.detach()
    if per_token.shape != mask.shape:  # sequence-level weights broadcast over tokens
        per_token = per_token.expand_as(mask)
    if entropy_mask is not None:  # only the high-entropy tokens are trained on
        per_token = torch.where(entropy_mask.bool(), per_token, torch.zeros_like(per_token))
    metrics = {}
    if beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = torch.where(mask, kl, 0.0).sum().detach()
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = LOSS_TYPES[loss_type](per_token, mask, norm)

    with torch.no_grad():  # per token, or per completion with sequence-level ratios (as TRL counts them)
        counted = mask if ratio.shape == mask.shape else torch.ones_like(ratio, dtype=torch.bool)
        sign = adv if ratio.shape == mask.shape else adv[:, :1]  # a completion's: its first token's (its return)
        low = (ratio < 1 - epsilon) & (sign < 0) & counted
        high = (ratio > 1 + eps_high) & (sign > 0) & counted
        metrics["clip_ratio/low"] = low.sum().float()
        metrics["clip_ratio/high"] = high.sum().float()
        metrics["clip_ratio/region"] = (low | high).sum().float()
        # TRL's extremes: the smallest share of low-clipped tokens in a completion, the largest high-clipped share
        rows = counted.sum(-1)
        seen = rows > 0
        if seen.any():
            metrics["clip_ratio/low_min"] = (low.sum(-1)[seen] / rows[seen]).min().float()
            metrics["clip_ratio/high_max"] = (high.sum(-1)[seen] / rows[seen]).max().float()
    return loss, metrics


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


LOSS_TYPES = {"grpo": _grpo, "dapo": _dapo, "dr_grpo": _dr_grpo, "bnpo": _bnpo}
