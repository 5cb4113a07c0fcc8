"""Log-probabilities of chosen tokens through the output layer, a chunk of tokens at a time.

For hidden states h [M, d], output weights W [V, d] and chosen tokens y [M]:

    logits = (h W^T) / temperature
    logp_j = logits_j[y_j] - logsumexp(logits_j)
    entropy_j = logsumexp(logits_j) - sum_v softmax(logits_j)_v logits_j,v

The full [M, V] logits tensor (V = 49,152 for SmolLM2: 200 kB per token in
fp32) is never held: the forward computes `chunk` rows at a time and keeps
only logp and entropy, and the backward recomputes each chunk's logits and
uses d logp / d logits = (onehot(y) - softmax) / temperature, so gradients
for h and W are accumulated chunk by chunk.  The entropy is a metric and
carries no gradient.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 512


def linear_logprobs(hidden, weight, targets, temperature: float = 1.0, dtype: torch.dtype | None = None, chunk: int = DEFAULT_CHUNK):
    """(logp [M], entropy [M]) of `targets` under softmax(hidden @ weight.T / temperature).

    dtype: the precision of the matmuls (e.g. bfloat16); the softmax is fp32 or wider."""
    return _LinearLogprobs.apply(hidden, weight, targets, 1.0 / temperature, dtype or hidden.dtype, chunk)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, dtype, chunk):
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.promote_types(dtype, torch.float32))
        entropy = torch.empty_like(logp)
        w = weight.to(dtype)
        for lo in range(0, hidden.shape[0], chunk):
            logits = _logits(hidden[lo : lo + chunk], w, inv_temp)
            lse = torch.logsumexp(logits, dim=-1)
            logp[lo : lo + chunk] = logits.gather(-1, targets[lo : lo + chunk, None]).squeeze(-1) - lse
            probs = torch.exp(logits - lse[:, None])
            entropy[lo : lo + chunk] = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.inv_temp, ctx.dtype, ctx.chunk = inv_temp, dtype, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(ctx.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for lo in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[lo : lo + ctx.chunk]
            logits = _logits(h, w, ctx.inv_temp)
            g = grad_logp[lo : lo + ctx.chunk].to(acc)
            d_logits = -torch.softmax(logits, dim=-1) * g[:, None]
            d_logits.scatter_add_(-1, targets[lo : lo + ctx.chunk, None], g[:, None])
            d_logits = (d_logits * ctx.inv_temp).to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[lo : lo + ctx.chunk] = (d_logits @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (d_logits.t() @ h.to(ctx.dtype)).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _logits(h, w, inv_temp):
    """fp32 logits (fp64 for fp64 inputs) of the rows h."""
    return (h.to(w.dtype) @ w.t()).to(torch.promote_types(w.dtype, torch.float32)) * inv_temp
