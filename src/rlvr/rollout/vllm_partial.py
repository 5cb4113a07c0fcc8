"""Partial rollouts with vLLM (partial_rollout_tokens): a partly sampled completion goes on as a new
request whose prompt is its prompt and its completion so far.  The colocated engine (rollout/vllm.py)
and the servers (rollout/vllm_client.py: rlvr's own and vLLM's own) have the in-process engine's
`resume` (HFSampler.resume) through `resume` here, each given its own way to send requests.

What vLLM is asked.  One request per completion (n=1): as prompt, the token ids of the prompt and of the
completion so far (prefix caching, on in every engine rlvr starts, finds the tokens already read in its
cache); as max_tokens, the round's tokens or what max_completion_length leaves, whichever is fewer, each
request its own.  Rows in a row with the same seed (a new prompt's G completions, which draw from their
group's stream: GroupGenerators.per_row) are given seed, seed + 1, ..., as vLLM numbers the n completions
of one request, so a new group's first round samples what generate() samples for it.

What comes back is put together as the in-process engine would: the tokens and sampler log-probs so far,
then the new ones; "stop" at EOS or a stop string, "length" at max_completion_length (or where vLLM's
context is full: fewer tokens than asked and "length"), else "partial".  vLLM looks for stop strings in
the text of the request's own output only, so one that began in the tokens so far and ends in this
round's tokens is looked for here, as HFSampler looks for one: in the decoded last few tokens after each
token (each token is at least one character, so such a stop string ends within the round's first
len(stop string) tokens); the completion ends after the token that completes it.  A continued
completion's text is its tokens decoded (without the EOS token) and cut before its first stop string,
as the in-process engine writes it; the text of one sampled in one request is vLLM's.

Penalties.  vLLM's repetition penalty counts the tokens of the prompt and of the output, so a continued
completion, whose tokens so far are now in its prompt, is penalised exactly as an uninterrupted one.
vLLM's presence and frequency penalties and min_tokens count the output only, so they would start again
at each round; rlvr sets none of them (generation_kwargs refuses them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rlvr.rollout import SamplingParams, decoded_text, ends_with_stop
from rlvr.rollout.vllm_request import check_prompts, params_dict, request_seeds
from rlvr.types import Rollout

# send(prompt_ids, params, seeds): per prompt, its completions as dicts of Rollout's fields; params as
# vllm_request.params_dict writes them, max_tokens one per prompt
Send = Callable[[list, dict, list], list]


def resume(send: Send, partials: list[Rollout], params: SamplingParams, generator, eos_token_ids: list[int],
           tokenizer) -> list[Rollout]:
    """Each of `partials` continued for at most params.round_tokens more tokens (all it has left when 0),
    one completion each; `generator`: a torch.Generator, or GroupGenerators with one stream per partial.
    The tokens so far keep their log-probs; versions are left to the caller (RolloutStage stamps them)."""
    budgets = [min(params.round_tokens or params.max_tokens, params.max_tokens - len(p.completion_ids)) for p in partials]
    asked = [i for i, b in enumerate(budgets) if b > 0]
    seeds = numbered(request_seeds(len(partials), generator))
    prompts = [partials[i].prompt_ids + partials[i].completion_ids for i in asked]
    check_prompts(prompts)
    request = {**params_dict(dataclasses.replace(params, n=1), list(eos_token_ids)), "max_tokens": [budgets[i] for i in asked]}
    replies = send(prompts, request, [seeds[i] for i in asked]) if asked else []
    out = [dataclasses.replace(p, finish_reason="length") for p in partials]  # none left to ask for: at max_tokens
    for i, group in zip(asked, replies):
        out[i] = joined(partials[i], group[0], budgets[i], params, set(eos_token_ids), tokenizer)
    return out


def joined(before: Rollout, new: dict, budget: int, params: SamplingParams, eos: set[int], tokenizer) -> Rollout:
    """`before` followed by `new` (a reply to a request for at most `budget` tokens): see the module's docstring."""
    ids, logprobs, finish = list(new["completion_ids"]), list(new["logprobs"]), new["finish_reason"]
    cut = straddling_stop(before.completion_ids, ids, params.stop_strings, tokenizer)
    if cut is not None:
        ids, logprobs, finish = ids[:cut], logprobs[:cut], "stop"
    tokens = before.completion_ids + ids
    if finish != "stop":
        ran_out = len(tokens) >= params.max_tokens or len(ids) < budget  # max_completion_length, or vLLM's context
        finish = "length" if ran_out or not params.round_tokens else "partial"
    text = decoded_text(tokens, params.stop_strings, eos, tokenizer) if before.completion_ids else new["text"]
    return Rollout(list(before.prompt_ids), tokens, before.logprobs + logprobs, finish, text)


def straddling_stop(before: list[int], new: list[int], stops, tokenizer) -> int | None:
    """How many of `new` tokens a completion keeps when a stop string that begins in the tokens `before`
    ends among them (the number up to the token that completes it), else None: the in-process engine's
    check (ends_with_stop) after each of the first tokens that could complete one."""
    if not before or not stops:
        return None
    window = max(len(s) for s in stops) + 2
    return next((k for k in range(1, min(len(new), window) + 1) if ends_with_stop(before + new[:k], stops, tokenizer)), None)


def numbered(seeds: list[int]) -> list[int]:
    """Rows in a row with the same seed (one group's stream repeated for its rows) get seed, seed + 1, ...,
    as vLLM seeds the n completions of one request."""
    out: list[int] = []
    for i, seed in enumerate(seeds):
        out.append(out[-1] + 1 if i and seeds[i - 1] == seed else seed)
    return out
