"""Log-probabilities of completion tokens: every path the trainer (and SFT or DPO) computes them by.

`LogProbs` is the one entry point: per-token log-probs and entropies of a Batch's completion
tokens under a model, with logits divided by the sampling temperature as the sampler saw them,
by rlvr's own forward (llama.py, `batch_logprobs`) where the model supports it, else by the
model's own padded forward (`padded_logprobs`, `selective_logprobs`).

Through the output layer (`linear_logprobs`), for hidden states h [M, d], output weights
W [V, d] and chosen tokens y [M]:

    z = (h / temperature) W^T                          logits
    logp_j = z_j[y_j] - logsumexp(z_j)
    entropy_j = logsumexp(z_j) - sum_v softmax(z_j)_v z_j,v

The full [M, V] logits (V = 49,152 for SmolLM2: 200 kB per token in fp32) are
never held: the forward works `chunk` rows at a time in one reused buffer and
keeps only logp, the entropy and logsumexp; the backward recomputes each
chunk's logits and uses d logp / d z = onehot(y) - softmax(z), so the gradients
of h and W are accumulated chunk by chunk.  Every pass over a chunk is in
place: on CPU, allocating a fresh 100 MB tensor costs more than the arithmetic.
The entropy carries a gradient for the entropy bonus (entropy_coef): dH / dz = -p (log p + H),
added in the same chunked backward (the padded path computes it with autograd only when asked,
`entropy_grad`, since it holds the whole softmax there).  The token statistics that SFT and DPO log
as TRL does (`stats=True`) are metrics without gradient: whether the target is the most likely
token (mean_token_accuracy) and the mean of the position's logits over the vocabulary (DPO's
logits/chosen, logits/rejected).
"""

from __future__ import annotations

import contextlib

import torch

from rlvr.types import Batch

DEFAULT_CHUNK = 512


class LogProbs:
    """Per-token log-probs of completion tokens under a model, the same way everywhere.

    fast: rlvr's forward (llama.py; each group's prompt once, no padding) rather than the model's
    own; autocast: the dtype of the matmuls under autocast (torch.bfloat16 for bf16, torch.float16 for
    fp16; None: the weights' own); micro_batch_size: rows per forward in `no_grad`."""

    def __init__(self, fast: bool, temperature: float, autocast: torch.dtype | None = None, micro_batch_size: int = 8,
                 device="cpu"):
        self.fast, self.temperature, self.autocast_dtype = fast, temperature, autocast
        self.micro_batch_size, self.device = micro_batch_size, device
        self._runners: dict = {}

    def __call__(self, model, batch, stats: bool = False, entropy_grad: bool = False):
        """(logp [B, T], entropy [B, T]) of `batch`'s completion tokens under `model`, with gradients
        (the entropy's where entropy_grad; the fast path's always); with stats, also (top1 [B, T] bool,
        mean_logit [B, T]) (see the module docstring)."""
        if self.fast:
            with self.autocast(model):
                return batch_logprobs(self.runner(model), batch, self.temperature, self.autocast_dtype, stats=stats)
        return self.padded(model, batch, stats=stats, entropy_grad=entropy_grad)

    def runner(self, model):
        """`model`'s llama.LlamaRunner (fast only), made once per model."""
        if id(model) not in self._runners:
            from rlvr.llama import LlamaRunner

            self._runners[id(model)] = LlamaRunner(model)
        return self._runners[id(model)]

    def padded(self, model, batch, stats: bool = False, entropy_grad: bool = False):
        """The straightforward computation: the model's own forward over padded prompt + completion."""
        with self.autocast(model):
            return padded_logprobs(model, batch, self.temperature, stats=stats, entropy_grad=entropy_grad)

    def with_router_loss(self, model, batch, entropy_grad: bool = False):
        """(logp, entropy, aux) of a Mixture-of-Experts model: its own forward, which also returns
        the routers' load-balancing loss (`aux`, a scalar with gradient)."""
        with self.autocast(model):
            return padded_logprobs(model, batch, self.temperature, router_loss=True, entropy_grad=entropy_grad)

    def chunks(self, batch) -> int:
        """The forwards in_chunks runs for `batch`."""
        return -(-len(batch) // self.micro_batch_size)

    @torch.no_grad()
    def in_chunks(self, model, batch, at_least: int = 0) -> torch.Tensor:
        """Log-probs [B, T] on the CPU, micro_batch_size rows at a time (old and reference log-probs).
        at_least: run that many forwards, the ones past the batch on an empty row (a sharded model,
        whose every forward is a collective: each rank runs as many as the busiest)."""
        out = torch.zeros(batch.completion_ids.shape)
        size = self.micro_batch_size
        for lo in range(0, len(batch), size):
            sub = batch.select(slice(lo, lo + size)).to(self.device)
            logprobs, _ = self(model, sub)
            out[lo : lo + size, : logprobs.shape[1]] = logprobs.float().cpu()
        for _ in range(at_least - self.chunks(batch)):
            self(model, Batch.empty().to(self.device))
        return out

    def autocast(self, model):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=next(model.parameters()).device.type, dtype=self.autocast_dtype)


def padded_logprobs(model, batch, temperature: float, router_loss: bool = False, stats: bool = False,
                    entropy_grad: bool = False):
    """(logp, entropy) [B, T] by the model's own forward over left-padded prompt + right-padded completion;
    with router_loss, a Mixture-of-Experts model's load-balancing loss as a third value; with stats,
    (logp, entropy, top1, mean_logit)."""
    ids, mask, positions = padded_inputs(batch)
    width = batch.completion_ids.shape[1]
    extra = {"output_router_logits": True} if router_loss else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=width + 1, **extra)
    logits = out.logits[:, :-1] / temperature  # position t predicts token t + 1
    found = selective_logprobs(logits, batch.completion_ids, stats=stats, entropy_grad=entropy_grad)
    return (*found, out.aux_loss) if router_loss else found


def padded_inputs(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, position ids) [B, P + T] of left-padded prompts and right-padded
    completions, positions counting real tokens only."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1).long()
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def selective_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk: int = 8, stats: bool = False,
                       entropy_grad: bool = False):
    """log softmax(logits)[ids] and the entropy of each position, computed a few rows
    at a time so that the full [B, T, V] log-softmax is never held at once.

    logits [B, T, V], ids [B, T] -> (logprobs [B, T], entropy [B, T]); the entropy has a gradient
    only with entropy_grad (it then keeps each block's softmax for the backward).  With stats, also
    top1 [B, T] (the target is the most likely token) and mean_logit [B, T].
    """
    logps, ents, top1, means = [], [], [], []
    for lo in range(0, logits.shape[0], chunk):
        block = logits[lo : lo + chunk].float()
        lse = torch.logsumexp(block, dim=-1)
        chosen = block.gather(-1, ids[lo : lo + chunk, :, None]).squeeze(-1)
        logps.append(chosen - lse)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(block, dim=-1)
            ents.append(lse - (probs * block).sum(-1))
        with torch.no_grad():
            if stats:
                top1.append(chosen >= block.amax(-1))
                means.append(block.mean(-1))
    if stats:
        return torch.cat(logps), torch.cat(ents), torch.cat(top1), torch.cat(means)
    return torch.cat(logps), torch.cat(ents)


def batch_logprobs(runner, batch, temperature: float, dtype: torch.dtype | None = None, stats: bool = False):
    """Per-token log-probs and entropies [B, T] of a Batch's completion tokens (zero where masked)
    by rlvr's forward (a llama.LlamaRunner): each group's prompt run once, no padding, the output
    layer only where a token is predicted.  With stats, also top1 and mean_logit [B, T].

    A sharded model (fsdp) runs as its own call (runner.call), a collective: it runs also for a batch
    without a completion token (Batch.empty), on the first row's first token, whose result is masked out."""
    mask = batch.completion_mask
    lengths = mask.sum(1).tolist()
    rows = [i for i, n in enumerate(lengths) if n > 0]  # a fully masked row contributes nothing
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    entropy = torch.zeros_like(logp)
    if not rows and not runner.sharded:
        return (logp, entropy, torch.zeros_like(mask), torch.zeros_like(logp)) if stats else (logp, entropy)
    if not rows:  # every rank takes part in the sharded model's gathers and reductions
        rows, lengths = [0], [1, *lengths[1:]]
    prompts, completions, group = packed(batch, rows, lengths)
    targets = torch.tensor([t for c in completions for t in c], device=runner.inner.embed_tokens.weight.device)

    def forward():
        hidden = runner.completion_hidden(prompts, completions, group)
        return linear_logprobs(hidden, runner.model.lm_head.weight, targets, temperature, dtype, stats=stats)

    found = runner.call(forward)
    out = (logp.masked_scatter(mask, found[0]), entropy.masked_scatter(mask, found[1]))
    if not stats:
        return out
    top1, means = found[2].unbind(-1)
    return (*out, torch.zeros_like(mask).masked_scatter(mask, top1.bool()), torch.zeros_like(logp).masked_scatter(mask, means.float()))


def packed(batch, rows: list[int], lengths: list[int]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The fast path's inputs for `rows` of a Batch: each group's prompt once (without padding), each
    row's first lengths[row] completion tokens, and the prompt each completion continues."""
    gids = batch.group_ids[rows] if batch.group_ids is not None else torch.tensor(rows)
    unique, group = torch.unique(gids, return_inverse=True)
    first = [rows[(gids == g).nonzero()[0].item()] for g in unique.tolist()]
    prompts = [batch.prompt_ids[r][batch.prompt_mask[r]].tolist() for r in first]
    completions = [batch.completion_ids[r, : lengths[r]].tolist() for r in rows]
    return prompts, completions, group.tolist()


def packed_hidden(runner, batch) -> torch.Tensor:
    """[completion tokens, hidden]: the final hidden states that predict each completion token of
    `batch` (its completion_mask's, row after row) by rlvr's forward (a llama.LlamaRunner, not sharded)."""
    lengths = batch.completion_mask.sum(1).tolist()
    rows = [i for i, n in enumerate(lengths) if n > 0]
    if not rows:
        weight = runner.inner.embed_tokens.weight
        return weight.new_zeros((0, weight.shape[1]))
    return runner.completion_hidden(*packed(batch, rows, lengths))


def linear_logprobs(hidden, weight, targets, temperature: float = 1.0, dtype: torch.dtype | None = None, chunk: int = DEFAULT_CHUNK,
                    stats: bool = False):
    """(logp [M], entropy [M]) of `targets` under softmax(hidden @ weight.T / temperature); with stats,
    also [M, 2]: whether the target is the most likely token (1.0 or 0.0), and the mean logit.

    dtype: the precision of the matmuls (e.g. bfloat16); the softmax is fp32 or wider."""
    logp, entropy, found = _LinearLogprobs.apply(hidden, weight, targets, 1.0 / temperature, dtype or hidden.dtype, chunk, stats)
    return (logp, entropy, found) if stats else (logp, entropy)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, dtype, chunk, stats=False):
        acc = torch.promote_types(dtype, torch.float32)
        scaled = (hidden * inv_temp).to(dtype)
        w = weight.to(dtype)
        logp = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        found = torch.empty((hidden.shape[0] if stats else 0, 2), dtype=acc, device=hidden.device)
        logits = exps = None
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            logits = _logits(scaled[lo:hi], w, acc, logits)
            top = logits.amax(-1, keepdim=True)
            exps = torch.sub(logits, top, out=_buffer(exps, logits.shape, acc, logits.device)).exp_()
            total = exps.sum(-1)
            lse[lo:hi] = top.squeeze(-1) + total.log()
            chosen = logits.gather(-1, targets[lo:hi, None]).squeeze(-1)
            logp[lo:hi] = chosen - lse[lo:hi]
            if stats:  # before exps is overwritten; logits stay as they are
                found[lo:hi, 0] = (chosen >= top.squeeze(-1)).to(acc)
                found[lo:hi, 1] = logits.mean(-1)
            entropy[lo:hi] = lse[lo:hi] - exps.mul_(logits).sum(-1) / total
        ctx.save_for_backward(scaled, w, targets, lse, entropy)
        ctx.inv_temp, ctx.dtype, ctx.chunk, ctx.weight_dtype, ctx.hidden_dtype = inv_temp, dtype, chunk, weight.dtype, hidden.dtype
        ctx.mark_non_differentiable(found)
        ctx.set_materialize_grads(False)  # an output the loss does not use (the entropy, mostly) gets None
        return logp, entropy, found

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_found):
        scaled, w, targets, lse, entropy = ctx.saved_tensors
        acc = lse.dtype
        grad_hidden = torch.empty(scaled.shape, dtype=ctx.hidden_dtype, device=scaled.device) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(w.shape, dtype=acc, device=w.device) if ctx.needs_input_grad[1] else None
        logits = None
        for lo in range(0, scaled.shape[0], ctx.chunk):
            hi = min(lo + ctx.chunk, scaled.shape[0])
            logits = _logits(scaled[lo:hi], w, acc, logits)
            g = grad_logp[lo:hi].to(acc) if grad_logp is not None else torch.zeros(hi - lo, dtype=acc, device=lse.device)
            if grad_entropy is None:
                # d logp / d z = onehot(y) - softmax(z), scaled by the incoming gradient
                d = logits.sub_(lse[lo:hi, None]).exp_().mul_(-g[:, None])
            else:  # and d H / d z = -p (log p + H), scaled by the entropy's incoming gradient
                log_p = logits.sub_(lse[lo:hi, None])
                e = grad_entropy[lo:hi].to(acc)[:, None]
                d = log_p.exp() * (-g[:, None] - e * (log_p + entropy[lo:hi, None]))
            d.scatter_add_(-1, targets[lo:hi, None], g[:, None])
            d = d.to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = (d @ w).to(ctx.hidden_dtype) * ctx.inv_temp
            if grad_weight is not None:
                grad_weight += (d.t() @ scaled[lo:hi]).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


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
