"""Choosing the next token from logits: repetition penalty, temperature, top-k, top-p, min-p, greedy.

The order is transformers' (generate with do_sample): the repetition penalty on
the raw logits, then temperature, then top-k, top-p and min-p.  (vLLM applies
min-p before top-k / top-p; the two differ only when min_p and top_p are both set.)

`filter_logits` states the truncation rule plainly (sort everything); `sample_next`
draws from exactly that distribution without sorting the vocabulary: the nucleus
is found among the few hundred most likely tokens (`torch.topk`), widening only
for a row whose nucleus reaches past them, and the token is drawn by inverse
CDF instead of torch.multinomial, which is slow over 50k tokens on CPU.
"""

from __future__ import annotations

import math

import torch

PREFILTER = 256  # candidates examined first for top-p / min-p; widened when a row's kept set is larger


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seen: torch.Tensor | None = None,
):
    """logits [B, V] -> (tokens [B], logprobs [B]).

    With repetition_penalty != 1 the logits of the tokens in `seen` [B, V] (bool: already in
    the row's prompt or completion) are first penalised (`penalize_repetition`).  The token is
    then drawn from softmax(logits / temperature) restricted to the top_k most likely tokens,
    then to the smallest set whose probability (within the top-k set) reaches top_p, then to
    the tokens at least min_p times as likely as the most likely one, which is always kept.
    temperature 0 picks the argmax (of the penalised logits).  The returned log-prob is that
    of the token under the model's untruncated, unpenalised softmax(logits / temperature)
    (softmax(logits) when greedy): the same quantity the update recomputes.  `u` [B, 1],
    uniform in [0, 1), replaces the draw from `generator` (see GroupGenerators).
    """
    logits = raw = logits.float()
    if repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty needs `seen`, the tokens each row already holds")
        logits = penalize_repetition(logits, seen, repetition_penalty)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(raw, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logprobs_all = torch.log_softmax(logits / temperature, dim=-1)
    vocab = logits.shape[-1]
    k = min(top_k, vocab) if top_k else vocab
    if u is None:  # drawn on the CPU, as the generators are: the same stream whatever the device
        u = torch.rand(logits.shape[0], 1, generator=generator)
    u = u.to(logits.device)
    if k == vocab and top_p >= 1.0 and min_p <= 0.0:
        tokens = _inverse_cdf(logprobs_all.exp(), u)
    else:
        tokens = _sample_truncated(logprobs_all, k, top_p, min_p, u)
    # The model's own log-probs; a whole log_softmax, as torch's logsumexp is slower on CPU (measured 2.4 vs 6.8 ms).
    reported = logprobs_all if logits is raw else torch.log_softmax(raw / temperature, dim=-1)
    return tokens, reported.gather(-1, tokens[:, None]).squeeze(-1)


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, https://arxiv.org/abs/1909.05858) as
    transformers' RepetitionPenaltyLogitsProcessor and vLLM apply it: the logit of each token in
    `seen` [B, V] is divided by `penalty` where positive and multiplied by it where negative (the
    paper divides either way, which would make a negative logit more likely), so penalty > 1 makes
    every token already present less likely and penalty < 1 more likely."""
    where = seen.nonzero(as_tuple=True)  # a few hundred tokens of a row, against a vocabulary of 50k+
    values = logits[where]
    out = logits.clone()
    out[where] = torch.where(values > 0, values / penalty, values * penalty)
    return out


def seen_tokens(rows: list[list[int]], vocab: int, device=None) -> torch.Tensor:
    """[len(rows), vocab] bool: which token ids each row of ids holds."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for i, ids in enumerate(rows):
        seen[i, torch.tensor(ids, dtype=torch.long, device=device)] = True
    return seen


class GroupGenerators:
    """One seeded stream of uniforms per prompt, so that a group's completions depend only on
    its prompt, its seed and the model: not on which other prompts are decoded beside it.
    Several processes that each sample a share of the groups then draw exactly what one
    process sampling all of them draws (distributed.py)."""

    def __init__(self, seeds: list[int]):
        self.seeds = [int(s) for s in seeds]  # what a remote sampler needs to rebuild the streams (rollout/workers.py)
        self.generators = [torch.Generator().manual_seed(s) for s in self.seeds]

    def __len__(self) -> int:
        return len(self.generators)

    def slice(self, lo: int, hi: int) -> "GroupGenerators":
        return self.pick(range(len(self.seeds))[lo:hi])

    def pick(self, groups) -> "GroupGenerators":
        """The streams of `groups` (indices), in that order: the same streams, not copies."""
        part = GroupGenerators([])
        part.seeds, part.generators = [self.seeds[g] for g in groups], [self.generators[g] for g in groups]
        return part

    @classmethod
    def per_row(cls, parts: list[tuple["GroupGenerators", int]]) -> "GroupGenerators":
        """One entry per row: each part's streams, each repeated for its rows (the repeats are the same
        stream, so the rows of a group draw from it in turn, as the n completions of a prompt do)."""
        out = cls([])
        for streams, rows in parts:
            out.seeds += [s for s in streams.seeds for _ in range(rows)]
            out.generators += [g for g in streams.generators for _ in range(rows)]
        return out

    def rand(self, groups: list[int]) -> torch.Tensor:
        """[len(groups), 1]: the next uniform of each listed group's stream, in order."""
        return torch.stack([torch.rand(1, generator=self.generators[g]) for g in groups])


def _sample_truncated(logprobs: torch.Tensor, k: int, top_p: float, min_p: float, u: torch.Tensor) -> torch.Tensor:
    # Renormalise over the top-k set (a no-op when k is the whole vocabulary).
    norm = torch.logsumexp(torch.topk(logprobs, k, dim=-1).values, dim=-1, keepdim=True) if k < logprobs.shape[-1] else 0.0
    tokens = torch.empty(logprobs.shape[0], dtype=torch.long, device=logprobs.device)
    rows = torch.arange(logprobs.shape[0], device=logprobs.device)
    # top-p and min-p each keep a prefix of the sorted tokens: look at the first few hundred first.
    width = k if top_p >= 1.0 and min_p <= 0.0 else min(k, PREFILTER)
    while len(rows):
        lp = logprobs[rows]
        values, index = torch.topk(lp, width, dim=-1)  # sorted, most likely first
        q = torch.exp(values - (norm[rows] if torch.is_tensor(norm) else norm))
        keep = torch.ones_like(q, dtype=torch.bool)
        if top_p < 1.0:
            keep = (q.cumsum(-1) - q) < top_p  # drop a token once the tokens before it reach top_p
            keep[:, 0] = True
        if min_p > 0.0:  # p >= min_p * p_max, in logs; the most likely token always passes
            keep &= values >= values[:, :1] + math.log(min_p)
        # A row whose nucleus may continue past the candidates looked at is redone wider.
        spill = keep[:, -1] if width < k else torch.zeros_like(keep[:, -1])
        done = ~spill
        tokens[rows[done]] = index[done].gather(-1, _inverse_cdf(torch.where(keep, q, 0.0)[done], u[rows[done]])[:, None]).squeeze(-1)
        rows = rows[spill]
        width = min(k, width * 8)
    return tokens


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn in proportion to non-negative `weights` [B, n], given u ~ U(0, 1) [B, 1]."""
    cdf = weights.cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=weights.shape[-1] - 1).squeeze(-1)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Logits with everything outside top-k, the top-p nucleus and the min-p set to -inf (the reference rule)."""
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
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits
