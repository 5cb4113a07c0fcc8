"""KL to the reference model: the three per-token estimators and the adaptive coefficient.

With r = ref_logp - logp for a token sampled from the policy
(http://joschu.net/blog/kl-approx.html), estimators of KL(pi || pi_ref):

    k1 = -r                    unbiased, high variance, can be negative
    k2 = r^2 / 2               biased, low variance, >= 0
    k3 = exp(r) - r - 1        unbiased, low variance, >= 0 (TRL's and GRPO's choice)

`kl_penalty=loss` adds beta * k per token to the loss (GRPO); `kl_penalty=reward`
subtracts beta * sum_t k from each completion's reward before the advantages are
computed (as in RLHF with PPO), so the penalty is a constant w.r.t. the update.

Adaptive KL (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593), one update per step:

    e     = clip(KL / kl_target - 1, -1, 1)
    beta <- beta * exp(e / kl_horizon)

so beta rises while the measured KL is above the target and falls while it is
below, by at most a factor e over kl_horizon steps.  The paper uses a linear
step beta * (1 + K e) with e clipped to +-0.2; the exponential form keeps beta
positive for any horizon.
"""

from __future__ import annotations

import math

import torch


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of sampled tokens."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")
    return KL_ESTIMATORS[estimator](ref_logprobs - logprobs)


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Sum over each completion's tokens of the per-token estimate: [B, T] -> [B]."""
    per_token = kl_estimate(logprobs, ref_logprobs, estimator)
    return torch.where(mask.bool(), per_token, torch.zeros_like(per_token)).sum(-1)


class AdaptiveKL:
    """beta, moved toward the value that keeps the measured KL at `target`."""

    def __init__(self, beta: float, target: float, horizon: int):
        if beta <= 0 or target <= 0 or horizon < 1:
            raise ValueError("adaptive KL needs beta > 0, target > 0 and horizon >= 1")
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl: float) -> float:
        """Observe one step's mean per-token KL; return the beta for the next step."""
        if kl is None or not math.isfinite(kl):
            return self.beta
        error = min(max(kl / self.target - 1.0, -1.0), 1.0)
        self.beta *= math.exp(error / self.horizon)
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state["beta"]


KL_ESTIMATORS = {
    "k1": lambda r: -r,
    "k2": lambda r: 0.5 * r * r,
    "k3": lambda r: torch.exp(r) - r - 1,
}
