"""Stages 1 and 2 of a step: G completions for each prompt, scored, along the path that
evaluation and `rlvr sample` take too (rollout/path.py).

Who samples (the in-process engine on the trained model, vLLM in this process or a server that is
sent the weights after every update, or Ray rollout workers that also score) is picked from the
settings where a run is assembled (trainer.rollout_stage); the stage is given the path and the
engines to keep up to date.  Under torchrun each process samples and scores its own share of the groups, and
every process gets all of them back (distributed.py), so what follows is the same as with one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch

from rlvr import distributed
from rlvr.rewards import RewardSet, Scores
from rlvr.rollout import SamplingParams
from rlvr.rollout.home import HomeThread
from rlvr.rollout.path import RolloutPath
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.turns import TurnCaches
from rlvr.types import Example, PartialGroup, Rollout, TrainerState


@dataclass
class Sampled:
    """One round's own share of the prompts, their completions and scores, and how long each took."""

    examples: list[Example]
    groups: list[list[Rollout]]
    scores: Scores
    rollout_seconds: float
    reward_seconds: float


class RolloutStage:
    def __init__(self, path: RolloutPath, params: SamplingParams, world: distributed.World = distributed.SINGLE,
                 home: HomeThread | None = None, *, source=None, subscribers=(), workers=None, off_policy: bool = False,
                 window=None, turn_cache: bool = True):
        """`path`: prompts -> scored completions with the run's sampler (trainer.rollout_stage picks it
        from the settings); `params`: the training rollouts' SamplingParams.  `source`: the model whose
        whole weights `subscribers` (the engines outside the trained model: vLLM, a sampling copy, the
        Ray workers) are sent after each update (with fsdp the sharded model, gathered a tensor at a time).
        `workers`: Ray actors that sample and score (rollout/workers.py), when rollout_workers > 0.
        `off_policy`: the completions come from another engine or from the weights before the last
        update, and get the importance correction (losses.py).  `home`: where reward functions run
        when a batch is sampled from another thread (rollout/home.py); without it, in the sampling thread.
        `window`: with fsdp and the in-process engine, a context in which the sampler's model holds
        the whole weights (fsdp.GatheredCopy.gathered, a collective): sampling happens inside it.
        `turn_cache`: with partial rollouts, keep each carried completion's cache from one round to the
        next (rollout/turns.py), where the sampler can."""
        self.path, self.params, self.world, self.home = path, params, world, home
        self.sampler, self.tokenizer = path.sampler, path.tokenizer
        self.source, self.subscribers, self.workers, self.off_policy = source, list(subscribers), workers, off_policy
        self._stream = None  # see side_stream
        self.window = window or contextlib.nullcontext
        self.kept = TurnCaches() if turn_cache and getattr(self.sampler, "keeps_turns", False) else None

    @property
    def pad_id(self) -> int:
        return self.sampler.pad_id

    @property
    def rewards(self) -> RewardSet:
        """The reward functions the rollouts are scored with (rlvr rft sets the verifier alone)."""
        return self.path.rewards

    @rewards.setter
    def rewards(self, rewards: RewardSet) -> None:
        self.path.rewards = rewards

    def sample(self, examples: list[Example], generator: torch.Generator, state: TrainerState) -> Sampled:
        """Sample and score this process's share of `examples` (all of them with one process)."""
        t0 = time.perf_counter()
        streams = self._streams(len(examples), generator)
        mine = distributed.shard(len(examples), self.world)
        examples = examples[mine.start : mine.stop]
        if self.workers is not None:  # along the same path on the Ray actors, sampled and scored there, timed together
            groups, scores = self.workers.generate_and_score(examples, self.params, streams.seeds, state)
            return Sampled(examples, groups, scores, time.perf_counter() - t0, 0.0)
        with self.window():  # the weights are gathered for sampling only, not for scoring
            texts, groups = self.path.generate(examples, self.params, streams)
        rollout_seconds = time.perf_counter() - t0
        score = (examples, groups, texts, state)
        scores, reward_seconds = self.home.call(self._score, *score) if self.home else self._score(*score)
        return Sampled(examples, groups, scores, rollout_seconds, reward_seconds)

    def sample_partial(self, examples: list[Example], carried: list[PartialGroup], generator: torch.Generator,
                       state: TrainerState, round_tokens: int, version: int) -> tuple[Sampled, list[PartialGroup]]:
        """Partial rollouts (one turn; the producer's, on rank 0 with several processes): G completions for each of the new
        `examples` and the unfinished completions of the `carried` groups go on for at most round_tokens
        tokens each (the sampler's resume: HFSampler's, or vLLM's, rollout/vllm_partial.py), with the in-process
        engine each carried one from the cache it kept in the round before, where it did (`kept`).  Returns (the
        groups now done, scored: carried ones first; the groups still unfinished).  Tokens the engine did not
        record a version for were sampled by `version`, the weights the samplers held when the round began
        (they change only between generations then)."""
        t0 = time.perf_counter()
        params = dataclasses.replace(self.params, round_tokens=round_tokens)
        size = params.n
        texts = self.path.render([ex.prompt for ex in examples]) if examples else []
        starts = [Rollout(ids, [], [], "partial", "", versions=[]) for ids in self.path.tokenize(texts) for _ in range(size)]
        partial = [r for group in carried for r in group.rollouts if r.finish_reason == "partial"]
        new = [PartialGroup(ex, text, ()) for ex, text in zip(examples, texts)]  # their keys, before they are sampled
        keys = [(g.key, j) for g in carried for j, r in enumerate(g.rollouts) if r.finish_reason == "partial"]
        keys += [(g.key, j) for g in new for j in range(size)]
        # One decode loop for the round: the carried completions go on beside the new prompts' (each new
        # completion starts as an empty partial; the G of a prompt draw from its group's stream in turn).
        streams = self._streams(len(partial), generator), self._streams(len(examples), generator)
        if isinstance(streams[0], GroupGenerators):
            streams = GroupGenerators.per_row([(streams[0], 1), (streams[1], size)])
        else:
            streams = generator
        if self.kept is not None:
            self.kept.keep(keys)  # the caches of groups no longer carried (dropped as too old) go
        kept = {} if self.kept is None else {"turns": self.kept, "keys": keys}
        out = iter(self.sampler.resume(partial + starts, params, streams, **kept) if partial or starts else [])
        every = [dataclasses.replace(g, rollouts=tuple(_stamped(next(out), r, version) if r.finish_reason == "partial" else r
                                                       for r in g.rollouts)) for g in carried]
        every += [dataclasses.replace(g, rollouts=tuple(_stamped(next(out), None, version) for _ in range(size))) for g in new]
        done = [g for g in every if g.done]
        rollout_seconds = time.perf_counter() - t0
        score = ([g.example for g in done], [list(g.rollouts) for g in done], [g.text for g in done], state)
        if not done:  # every completion goes on in the next round
            scores, reward_seconds = Scores([], {}), 0.0
        else:
            scores, reward_seconds = self.home.call(self._score, *score) if self.home else self._score(*score)
        return Sampled(score[0], score[1], scores, rollout_seconds, reward_seconds), [g for g in every if not g.done]

    def forget_kept(self) -> None:
        """Let go of the caches kept for carried completions: the groups carried now were put back (a
        rewind, a checkpoint) and may be others, or earlier in their completions, than those caches."""
        if self.kept is not None:
            self.kept.clear()

    def _score(self, *args) -> tuple[Scores, float]:
        """(scores, seconds spent scoring): timed where it runs, not counting a wait for the home thread."""
        t0 = time.perf_counter()
        return self.path.score(*args), time.perf_counter() - t0

    def _streams(self, num_groups: int, generator: torch.Generator):
        """With the in-process engine or the workers, one stream per group seeded from the trainer's
        generator (the same on every rank), so that the completions do not depend on how the groups
        are split among processes or workers; vLLM takes the generator itself."""
        if not getattr(self.sampler, "seeds_per_group", False):
            return generator
        base = int(torch.randint(0, 2**62, (1,), generator=generator))
        mine = distributed.shard(num_groups, self.world)
        return GroupGenerators([base + i for i in mine])

    def update_weights(self, model) -> None:
        """After an optimizer step: every engine outside this model gets the new weights, from the
        whole model (`model` itself is sharded under fsdp)."""
        for subscriber in self.subscribers:
            subscriber.update_weights(self.source)

    def rest(self) -> None:
        """A generation is sampled and the update comes: a sampler that frees its memory meanwhile
        (vLLM colocated, with vllm_enable_sleep_mode) does; it wakes by itself when used again."""
        if hasattr(self.sampler, "rest"):
            self.sampler.rest()

    def metrics(self) -> dict:
        """The samplers' own counters (vLLM servers left and dropped, weight sync), for the step's row."""
        out = {}
        for part in (self.sampler, self.workers):
            if hasattr(part, "metrics"):
                out.update(part.metrics())
        return out

    def _cuda_device(self):
        """The in-process sampler's CUDA device, or None (the CPU, or a sampler elsewhere)."""
        device = next(self.sampler.model.parameters()).device if hasattr(self.sampler, "model") else None
        return device if device is not None and device.type == "cuda" else None

    def side_stream(self):
        """Where sampling ahead runs on a GPU: a CUDA stream of its own, so its kernels can overlap
        the update's; a no-op context on the CPU."""
        device = self._cuda_device()
        if device is None:
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the weights copied in by the last update
        return torch.cuda.stream(self._stream)

    @contextlib.contextmanager
    def after_training(self):
        """A weight load on the sampling thread's stream (a GPU; nothing on the CPU): after the training
        stream's work queued so far (the optimizer step that made these weights), and before anything it
        queues next (a step that will change them)."""
        device = self._cuda_device()
        if device is None:
            yield
            return
        training, mine = torch.cuda.default_stream(device), torch.cuda.current_stream(device)
        mine.wait_stream(training)
        yield
        training.wait_stream(mine)

    def close(self) -> None:
        """Stop the rollout workers, if any, and what the sampler holds outside Python's reach."""
        if hasattr(self.sampler, "close"):
            self.sampler.close()
        if self.workers is not None:
            self.workers.close()
            self.subscribers.remove(self.workers)
            self.workers = None


def _stamped(rollout: Rollout, before: Rollout | None, version: int) -> Rollout:
    """The rollout with a version for each token: its own where the engine recorded them, else those
    `before` (the partial it continues) had and `version` for the tokens sampled since."""
    if rollout.versions is not None:
        return rollout
    had = list(before.versions or []) if before is not None else []
    return dataclasses.replace(rollout, versions=had + [version] * (len(rollout.completion_ids) - len(had)))
