"""Choosing the next token from logits: temperature, top-k, top-p, greedy."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
):
    """logits [B, V] -> (tokens [B], logprobs [B]).

    The token is drawn from softmax(logits / temperature) restricted to the top_k
    most likely tokens and then to the smallest set whose probability reaches
    top_p (the most likely token is always kept).  temperature 0 picks the
    argmax.  The returned log-prob is that of the token under the untruncated
    softmax(logits / temperature) (softmax(logits) when greedy): the same
    quantity the update recomputes, so sampler and trainer can be compared.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    scaled = logits / temperature
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    filtered = filter_logits(scaled, top_k, top_p)
    probs = torch.softmax(filtered, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits with everything outside top-k and the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
