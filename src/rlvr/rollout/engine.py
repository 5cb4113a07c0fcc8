"""The in-process sampler: a Hugging Face causal LM decoding with a KV cache.

Each prompt is prefilled once; its cache is then repeated for the n completions
of its group.  Rows that finish (EOS or a stop string) are dropped from the
cache, so the remaining rows decode without carrying dead ones.  The model is
put in eval mode (dropout off) for the call and restored afterwards.

Caches kept between calls (rollout/turns.py): given a TurnCaches and a key per row, a row whose rollout
goes on in a later call leaves a copy of its cache there, and that call runs only the rollout's new
tokens on the copy (`_extend`) instead of prefilling its whole history again.  A multi-turn rollout's
row (rollout/multiturn.py) leaves it when it stops at the end of a turn; a partial rollout's (`resume`)
when the round's tokens run out.  Every sampler here does, the generic one where the model's cache is
plain full attention (not a sliding window: `keeps_turns`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlvr.llama import LlamaRunner, on_fast_path
from rlvr.rollout import RolloutError, SamplingParams, decoded_text, ends_with_stop, pad_token_id
from rlvr.rollout.graphs import StaticDecoder
from rlvr.rollout.sampling import GroupGenerators, sample_next, seen_tokens
from rlvr.rollout.turns import Held, TurnCaches
from rlvr.runtime import configure_allocator, decoding
from rlvr.types import Rollout


class HFSampler:
    seeds_per_group = True  # generate() also takes a GroupGenerators (rollout/sampling.py)
    reloads_in_flight = True  # newer weights may be loaded between two decode steps (see `live`)
    # async_mode=free: the producer's rollout.producer.WeightVersions.  Between two decode steps the
    # sampler asks it to load newer weights if some were published (an in-flight update: the cache of
    # the tokens so far stays, the next ones come from the new weights) and records the version of
    # each token (Rollout.versions).  None: the weights do not change during a call.
    live = None

    def __init__(self, model, tokenizer, eos_token_ids: list[int], max_batch_size: int = 64, bf16: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.pad_id = pad_token_id(tokenizer, eos_token_ids)
        self.max_batch_size = max_batch_size  # sequences decoded together
        self.bf16 = bf16
        # transformers 5 renamed the forward argument `past_key_values` to `cache`.
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        # Whether generate() takes `turns` (multi-turn rollouts' caches kept between turns): a plain cache of
        # full attention (DynamicLayer), whose rows can be cut out and put together again.
        self.keeps_turns = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)

    def generate(self, prompt_ids, params: SamplingParams, generator=None, turns: TurnCaches | None = None,
                 keys: list | None = None) -> list[list[Rollout]]:
        """Per prompt, params.n Rollouts.  `turns` and `keys` (multi-turn rollouts, rollout/turns.py): keys[i * n + j]
        names the rollout of prompt i's j-th completion.  With n == 1, a prompt whose rollout has a cache in
        `turns` (the prompt is its whole history) goes on from it; each row that stops (EOS or a stop
        string) leaves its cache there for its next turn."""
        if (turns is None) != (keys is None) or (keys is not None and len(keys) != len(prompt_ids) * params.n):
            raise ValueError("generate(turns=..., keys=...): give both, with one key per completion (prompts x n)")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("cannot sample from an empty prompt")
        context = getattr(self.model.config, "max_position_embeddings", None)
        longest = max((len(p) for p in prompt_ids), default=0)
        if context and longest >= context:  # as TRL, no prompt is cut unless max_prompt_length says so
            raise RolloutError(f"a prompt of {longest} tokens does not fit the model's context of {context} tokens "
                               f"(max_position_embeddings); set max_prompt_length (e.g. {context // 2}) to cut prompts from the left")
        per_chunk = max(1, self.max_batch_size // params.n)
        out = []
        for lo in range(0, len(prompt_ids), per_chunk):
            # GroupGenerators: one stream per prompt, so the chunk gets the streams of its prompts.
            chunk_generator = generator.slice(lo, lo + per_chunk) if isinstance(generator, GroupGenerators) else generator
            chunk_keys = None if keys is None else keys[lo * params.n : (lo + per_chunk) * params.n]
            out += self._generate_chunk(prompt_ids[lo : lo + per_chunk], params, chunk_generator, turns=turns, keys=chunk_keys)
        return out

    def resume(self, partials: list[Rollout], params: SamplingParams, generator=None, turns: TurnCaches | None = None,
               keys: list | None = None) -> list[Rollout]:
        """Decode on from partly sampled completions (partial rollouts, rollout/generation.py): each one's
        prompt and completion so far are prefilled, and it goes on as if it had never stopped (its stop
        strings, repetition penalty and max_tokens see the whole completion), for at most params.round_tokens
        more tokens.  Its tokens so far keep their log-probs and versions.  One completion per partial
        (params.n is not used); `generator`: a torch.Generator, or GroupGenerators with one stream per partial.
        `turns` and `keys` (caches kept between rounds): keys[i] names partials[i]'s completion; one whose
        cache `turns` holds runs only its last token sampled on it instead of the prefill, and each that the
        round cuts (finish_reason "partial") leaves its cache there for its next round."""
        if (turns is None) != (keys is None) or (keys is not None and len(keys) != len(partials)):
            raise ValueError("resume(turns=..., keys=...): give both, with one key per partial")
        params = dataclasses.replace(params, n=1)
        out = []
        for lo in range(0, len(partials), self.max_batch_size):
            chunk = partials[lo : lo + self.max_batch_size]
            chunk_generator = generator.slice(lo, lo + len(chunk)) if isinstance(generator, GroupGenerators) else generator
            chunk_keys = None if keys is None else keys[lo : lo + len(chunk)]
            # Rows in a row that hold the same ids (a new prompt's completions, started empty) are run once.
            unique, repeats = [], []
            for p in chunk:
                ids = p.prompt_ids + p.completion_ids
                if unique and ids == unique[-1]:
                    repeats[-1] += 1
                else:
                    unique.append(ids)
                    repeats.append(1)
            out += [group[0] for group in self._generate_chunk(unique, params, chunk_generator, chunk, repeats, turns, chunk_keys)]
        return out

    @torch.inference_mode()
    def _generate_chunk(self, prompts, params: SamplingParams, generator, carried=None, repeats=None, turns=None, keys=None):
        """carried: with resume, the partial Rollout of each row, its prompt and completion so far prefilled
        from prompts[i] for repeats[i] rows in a row; the rows come back one per group.  turns, keys: see
        generate (keys: one per row)."""
        model, n = self.model, params.n
        was_training = model.training
        model.eval()
        try:
            with self._autocast():
                rows = self._decode(prompts, params, generator, carried, repeats, turns, keys)
        finally:
            model.train(was_training)
        tokens, logps, finish, versions = rows
        unfinished = "partial" if params.round_tokens else "length"  # cut by the round's budget, or by max_tokens

        def rollout(prompt, r):
            return Rollout(list(prompt), tokens[r], logps[r], finish[r] or unfinished, decoded_text(tokens[r], params.stop_strings, self.eos, self.tokenizer),
                           versions=versions[r] if versions is not None else None)

        if carried:
            return [[rollout(c.prompt_ids, r)] for r, c in enumerate(carried)]
        return [[rollout(prompt, r) for r in range(i * n, (i + 1) * n)] for i, prompt in enumerate(prompts)]

    def _decode(self, prompts, params: SamplingParams, generator, carried=None, repeats=None, turns=None, keys=None):
        """The sampling loop; `_prefill` (or `_extend`), `_step`, `_drop` and `_held` are the model-specific parts.
        A row ends at EOS or a stop string ("stop"), at max_tokens ("length"), or unfinished (None) when the
        call's params.round_tokens run out first.  carried, repeats: see _generate_chunk (each row has its own
        random stream then; else the n rows of a prompt share its group's).  turns, keys: see generate and
        resume: a row leaves its cache in `turns` when it stops (a multi-turn rollout's turn, unless it is the
        last) or, with round_tokens, when the round ends before it does."""
        n = repeats if repeats is not None else params.n  # rows per prompt: one number, or one per prompt
        owner = [i for i, count in enumerate(_counts(n, len(prompts))) for _ in range(count)]  # each row's prompt
        total = len(owner)
        done = [len(c.completion_ids) for c in carried] if carried else [0] * total  # tokens each row has already
        steps = params.max_tokens - min(done)
        if params.round_tokens:
            steps = min(steps, params.round_tokens)
        logits, state = self._start(prompts, n, steps, turns, keys)
        decoding()  # fsdp on the CPU: the sampler's copy of the weights was built in mappings of its own, the rest in the heap
        stream = torch.arange(total) if repeats is not None else torch.arange(total) // params.n  # each row's random stream
        rows = torch.arange(total)  # which completion each live cache row belongs to
        tokens = [list(c.completion_ids) for c in carried] if carried else [[] for _ in range(total)]
        logps = [list(c.logprobs) for c in carried] if carried else [[] for _ in range(total)]
        finish: list[str | None] = [None] * total
        clock = self.live if self.reloads_in_flight else None  # the producer's weight versions, if any
        versions = None
        if clock is not None:
            versions = [list(c.versions or []) for c in carried] if carried else [[] for _ in range(total)]
        # The repetition penalty's memory: which tokens each live row's prompt and completion hold.
        seen = None
        if params.repetition_penalty != 1.0:
            seen = seen_tokens(prompts, logits.shape[-1], logits.device).repeat_interleave(_repeats(n, logits.device), dim=0)

        def leave(j: int, r: int) -> None:  # live row j (row r) leaves its cache: what it ran, less the token sampled last
            turns.put(keys[r], self._held(state, j, prompts[owner[r]] + tokens[r][done[r] : -1]))

        for step in range(steps):
            u = generator.rand(stream[rows].tolist()) if isinstance(generator, GroupGenerators) else None
            tok, lp = sample_next(logits, params.temperature, params.top_k, params.top_p, generator, u,
                                  params.min_p, params.repetition_penalty, seen)
            if seen is not None:
                seen[torch.arange(len(tok), device=seen.device), tok.to(seen.device)] = True
            stopped = self._record(rows.tolist(), tok.tolist(), lp.tolist(), (tokens, logps, finish, versions), params, clock)
            if turns is not None and not params.round_tokens and not turns.last_turn:  # a turn's end: its cache, before it is dropped
                for j, r in stopped:
                    leave(j, r)
            live = [j for j, r in enumerate(rows.tolist()) if finish[r] is None]
            if not live or step == steps - 1:
                break
            if len(live) < len(rows):
                keep = torch.tensor(live)
                state = self._drop(state, keep.to(logits.device))
                rows, tok = rows[keep], tok[keep.to(tok.device)]
                seen = None if seen is None else seen[keep.to(seen.device)]
            if clock is not None and clock.refresh():  # newer weights published: the next token is theirs
                state = self._reloaded(state)
            logits = self._step(tok, state)
        if turns is not None and params.round_tokens:  # partial rollouts: a row the round cut keeps its cache for the next
            for j, r in enumerate(rows.tolist()):
                if finish[r] is None:
                    leave(j, r)
        return tokens, logps, finish, versions

    def _record(self, rows: list[int], tok: list[int], lp: list[float], out, params: SamplingParams, clock) -> list[tuple[int, int]]:
        """Add each live row's sampled token (and its log-prob, and the version of the weights held) to the
        row's completion in `out` (tokens, logps, finish, versions) and set the finish reasons of rows that
        end here.  Returns (index among the live rows, row) of each row that stopped (EOS or a stop string)."""
        tokens, logps, finish, versions = out
        stopped = []
        for j, (r, t, l) in enumerate(zip(rows, tok, lp)):
            tokens[r].append(t)
            logps[r].append(l)
            if versions is not None:
                versions[r].append(clock.held)
            if t in self.eos or (params.stop_strings and ends_with_stop(tokens[r], params.stop_strings, self.tokenizer)):
                finish[r] = "stop"
                stopped.append((j, r))
            elif len(tokens[r]) >= params.max_tokens:
                finish[r] = "length"
        return stopped

    def _start(self, prompts, n, steps: int, turns: TurnCaches | None, keys):
        """The first logits and the decode state: the prompts prefilled, or where `turns` holds the cache of a
        rollout continued here, only the rest of its history run on it.  keys: one per row, a prompt's n rows
        in turn; rows that share a prompt (a multi-turn group's first turn, or a partial rollout's identical
        completions) go on from the first cache among theirs, and the others are let go."""
        kept = []
        if turns is not None:
            at = 0
            for prompt, count in zip(prompts, _counts(n, len(prompts))):
                taken = [turns.take(k, prompt) for k in keys[at : at + count]]
                kept.append(next((h for h in taken if h is not None), None))
                at += count
        if any(h is not None for h in kept):
            return self._extend(prompts, kept, n, steps)
        return self._prefill(prompts, n, steps)

    def _reloaded(self, state):
        """The decode state after the model's weights were loaded in place: here the model itself samples."""
        return state

    # --- the generic backend: any Hugging Face causal LM, through its own forward -------

    def _prefill(self, prompts, n: int, max_new: int):
        device = next(self.model.parameters()).device
        empty = torch.zeros((len(prompts), 0), dtype=torch.long, device=device)  # no columns before the prompts
        return self._repeated(*self._forward(prompts, DynamicCache(config=self.model.config), empty), n)

    def _extend(self, prompts, kept: list[Held | None], n, max_new: int):
        """`_prefill` where kept[i] (or None) holds the keys and values of prompts[i]'s first tokens: they go
        into a new cache, right-aligned, and only the rest of each prompt runs."""
        device = next(self.model.parameters()).device
        starts = [0 if h is None else len(h.ids) for h in kept]
        width, some = max(starts), next(h for h in kept if h is not None)
        past = (torch.arange(width, device=device)[None] >= width - torch.tensor(starts, device=device)[:, None]).long()
        data = []
        for layer, (k, v) in enumerate(zip(some.keys, some.values)):  # [kv_heads, tokens, head_dim] a row
            keys = k.new_zeros((len(prompts), k.shape[0], width, k.shape[-1]))
            values = v.new_zeros((len(prompts), v.shape[0], width, v.shape[-1]))
            for i, (s, h) in enumerate(zip(starts, kept)):
                if h is not None:
                    keys[i, :, width - s :], values[i, :, width - s :] = h.keys[layer], h.values[layer]
            data.append((keys, values))
        cache = DynamicCache(ddp_cache_data=data, config=self.model.config)
        return self._repeated(*self._forward([p[s:] for p, s in zip(prompts, starts)], cache, past), n)

    def _repeated(self, logits, state, n):
        """The logits and decode state of each prompt's row n times over (n: one number, or one per prompt),
        for its n completions."""
        counts = _counts(n, len(logits))
        if all(c == 1 for c in counts):
            return logits, state
        index = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts)).to(state["mask"].device)
        state["cache"].batch_select_indices(index)
        state["mask"], state["next"] = state["mask"][index], state["next"][index]
        return logits[index.to(logits.device)], state

    def _forward(self, prompts, cache, past):
        """Run `prompts` (left-padded: each ends at the last column) after the columns `cache` holds, whose
        attention mask is `past` [rows, columns] -> (logits of each row's next token, the decode state)."""
        device = past.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device=device)
            mask[i, width - len(p) :] = 1
        positions = past.sum(-1, keepdim=True) + (mask.cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([past, mask], dim=1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                         **{self.cache_arg: cache})
        return out.logits[:, -1].float(), {"cache": cache, "mask": mask, "next": positions[:, -1:] + 1}

    def _step(self, tok, state):
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones((len(tok), 1))], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=state["mask"], position_ids=state["next"], use_cache=True,
                         **{self.cache_arg: state["cache"]})
        state["next"] = state["next"] + 1
        return out.logits[:, -1].float()

    def _drop(self, state, keep):
        state["cache"].batch_select_indices(keep)
        state["mask"], state["next"] = state["mask"][keep], state["next"][keep]
        return state

    def _held(self, state, live: int, ids: list[int]) -> Held:
        """A copy of live row `live`'s cache, the tokens `ids` (its columns in use), a tensor per layer."""
        columns = state["mask"][live].bool()
        layers = state["cache"].layers
        return Held(ids, [layer.keys[live][:, columns] for layer in layers], [layer.values[live][:, columns] for layer in layers])

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)


class FastSampler(HFSampler):
    """The same sampler on rlvr's own Llama forward (llama.py): a preallocated KV cache,
    each prompt prefilled once for its group, finished rows dropped in batches."""

    def __init__(self, model, tokenizer, eos_token_ids: list[int], max_batch_size: int = 64, bf16: bool = False):
        super().__init__(model, tokenizer, eos_token_ids, max_batch_size, bf16)
        self.runner = LlamaRunner(model)

    def release(self) -> None:
        """Drop the sampling copy of the weights built from the model's (fused, in the sampling dtype):
        its parameters are about to be dropped too (fsdp.GatheredCopy), and the next call builds it again."""
        self.runner.release()

    def _prefill(self, prompts, n: int, max_new: int):
        return self.runner.prefill(prompts, n, max_new, self._dtype())

    def _extend(self, prompts, kept: list[Held | None], n, max_new: int):
        return self.runner.extend(prompts, [None if h is None else (h.keys, h.values) for h in kept], n, max_new, self._dtype())

    def _held(self, state, live: int, ids: list[int]) -> Held:
        return Held(ids, *state.held(live))

    def _dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else next(self.model.parameters()).dtype

    def _step(self, tok, state):
        return self.runner.decode(tok, state)

    def _reloaded(self, state):
        self.runner.reload(state)  # the fused sampling weights, built again from the new ones
        return state

    def _drop(self, state, keep):
        # Copying the cache costs about as much as a decode step; do it only when a quarter of the rows are done.
        if len(keep) <= 0.75 * state.rows:
            state.keep(keep)
        else:
            state.hold(keep)
        return state


class GraphSampler(FastSampler):
    """The fast sampler with llama.py's decode step given static shapes (rollout/graphs.py) and,
    on a CUDA GPU with `graphs`, replayed from CUDA graphs.  The graphs hold the weights' addresses,
    so newer weights are loaded between calls only, never during one."""

    reloads_in_flight = False

    def __init__(self, model, tokenizer, eos_token_ids: list[int], max_batch_size: int = 64, bf16: bool = False,
                 graphs: bool = True, block: int = 256):
        super().__init__(model, tokenizer, eos_token_ids, max_batch_size, bf16)
        self.graphs, self.block = graphs, block  # block: attention windows are multiples of it

    def _prefill(self, prompts, n: int, max_new: int):
        logits, state = super()._prefill(prompts, n, max_new)
        return logits, StaticDecoder(self.runner, state, graphs=self.graphs, block=self.block)

    def _extend(self, prompts, kept: list[Held | None], n, max_new: int):
        logits, state = super()._extend(prompts, kept, n, max_new)
        return logits, StaticDecoder(self.runner, state, graphs=self.graphs, block=self.block)

    def _held(self, decoder, live: int, ids: list[int]) -> Held:
        return super()._held(decoder.state, live, ids)

    def _step(self, tok, decoder):
        return decoder.step(tok)

    def _drop(self, decoder, keep):
        decoder.drop(keep)
        return decoder


def make_sampler(model, tokenizer, eos_token_ids: list[int], max_batch_size: int = 64, bf16: bool = False,
                 cuda_graphs: bool = True):
    """The fast sampler where the model's architecture allows, else the generic one, saying once why.
    On a CUDA GPU the fast sampler replays its decode step from CUDA graphs unless `cuda_graphs` is false."""
    configure_allocator()
    if not on_fast_path(model):
        cls = HFSampler
    elif cuda_graphs and next(model.parameters()).device.type == "cuda":
        cls = GraphSampler
    else:
        cls = FastSampler
    return cls(model, tokenizer, eos_token_ids, max_batch_size=max_batch_size, bf16=bf16)


def _repeats(n, device):
    """repeat_interleave's repeats: a number for every prompt, or one per prompt (a tensor on `device`)."""
    return n if isinstance(n, int) else torch.tensor(n, device=device)


def _counts(n, prompts: int) -> list[int]:
    """Rows per prompt, one each: n is one number for every prompt, or already one per prompt."""
    return [n] * prompts if isinstance(n, int) else list(n)
