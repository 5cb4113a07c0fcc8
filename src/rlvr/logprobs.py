"""Log-probabilities of chosen tokens through the output layer, a chunk of tokens at a time.

For hidden states h [M, d], output weights W [V, d] and chosen tokens y [M]:

    z = (h / temperature) W^T                          logits
    logp_j = z_j[y_j] - logsumexp(z_j)
    entropy_j = logsumexp(z_j) - sum_v softmax(z_j)_v z_j,v

The full [M, V] logits (V = 49,152 for SmolLM2: 200 kB per token in fp32) are
never held: the forward works `chunk` rows at a time in one reused buffer and
keeps only logp, the entropy and logsumexp; the backward recomputes each
chunk's logits and uses d logp / d z = onehot(y) - softmax(z), so the gradients
of h and W are accumulated chunk by chunk.  Every pass over a chunk is in
place: on CPU, allocating a fresh 100 MB tensor costs more than the arithmetic.
The entropy is a metric and carries no gradient.
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
        acc = torch.promote_types(dtype, torch.float32)
        scaled = (hidden * inv_temp).to(dtype)
        w = weight.to(dtype)
        logp = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        logits = exps = None
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            logits = _logits(scaled[lo:hi], w, acc, logits)
            top = logits.amax(-1, keepdim=True)
            exps = torch.sub(logits, top, out=_buffer(exps, logits.shape, acc, logits.device)).exp_()
            total = exps.sum(-1)
            lse[lo:hi] = top.squeeze(-1) + total.log()
            logp[lo:hi] = logits.gather(-1, targets[lo:hi, None]).squeeze(-1) - lse[lo:hi]
            entropy[lo:hi] = lse[lo:hi] - exps.mul_(logits).sum(-1) / total
        ctx.save_for_backward(scaled, w, targets, lse)
        ctx.inv_temp, ctx.dtype, ctx.chunk, ctx.weight_dtype, ctx.hidden_dtype = inv_temp, dtype, chunk, weight.dtype, hidden.dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        scaled, w, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        grad_hidden = torch.empty(scaled.shape, dtype=ctx.hidden_dtype, device=scaled.device) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(w.shape, dtype=acc, device=w.device) if ctx.needs_input_grad[1] else None
        logits = None
        for lo in range(0, scaled.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, scaled.shape[0])
            logits = _logits(scaled[lo:hi], w, acc, logits)
            g = grad_logp[lo:hi].to(acc)
            # d logp / d z = onehot(y) - softmax(z), scaled by the incoming gradient
            d = logits.sub_(lse[lo:hi, None]).exp_().mul_(-g[:, None])
            d.scatter_add_(-1, targets[lo:hi, None], g[:, None])
            d = d.to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = (d @ w).to(ctx.hidden_dtype) * ctx.inv_temp
            if grad_weight is not None:
                grad_weight += (d.t() @ scaled[lo:hi]).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _logits(h, w, acc, buffer):
    """Logits of the rows h in `acc` precision, written into `buffer` (reused across chunks)."""
    out = _buffer(buffer, (h.shape[0], w.shape[0]), acc, h.device)
    if w.dtype == acc:
        return torch.mm(h, w.t(), out=out)
    return out.copy_(h @ w.t())


def _buffer(buffer, shape, dtype, device):
    """`buffer` viewed as `shape` when it is large enough, else a new tensor."""
    n = shape[0] * shape[1]
    if buffer is None or buffer.dtype != dtype or buffer.numel() < n:
        return torch.empty(shape, dtype=dtype, device=device)
    return buffer.view(-1)[:n].view(shape)
