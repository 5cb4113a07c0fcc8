"""Stages 1 and 2 of a step: G completions for each prompt, scored, along the path that
evaluation and `rlvr sample` take too (rollout/path.py).

The configuration picks who samples: the in-process engine on the trained model, vLLM (in this
process or a server) that is sent the weights after every update, or Ray rollout workers that
also score.  Under torchrun each process samples and scores its own share of the groups, and
every process gets all of them back (distributed.py), so what follows is the same as with one.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch

from rlvr import distributed
from rlvr.models import WeightCopy, eos_token_ids
from rlvr.rewards import RewardSet, Scores
from rlvr.rollout import sampling_params
from rlvr.rollout.engine import make_sampler
from rlvr.rollout.home import HomeThread
from rlvr.rollout.path import RolloutPath
from rlvr.rollout.sampling import GroupGenerators
from rlvr.tasks import build_rewards
from rlvr.types import Example, Rollout, TrainerState


@dataclass
class Sampled:
    """One round's own share of the prompts, their completions and scores, and how long each took."""

    examples: list[Example]
    groups: list[list[Rollout]]
    scores: Scores
    rollout_seconds: float
    reward_seconds: float


class RolloutStage:
    def __init__(self, cfg, model, sampler_model, tokenizer, world: distributed.World = distributed.SINGLE,
                 home: HomeThread | None = None):
        """`model` is the policy as trained; `sampler_model` the copy the in-process engine samples
        from (the same model, except with fsdp).  `home`: where reward functions run when a batch
        is sampled from another thread (rollout/home.py); without it, in the sampling thread."""
        self.cfg, self.tokenizer, self.world, self.home = cfg, tokenizer, world, home
        rewards = build_rewards(cfg.reward_settings, cfg.data_settings)
        eos = eos_token_ids(model, tokenizer)
        self.subscribers: list = []  # the engines outside this model, sent the weights after each update
        self.source = sampler_model  # whole weights to send them (with fsdp the unsharded copy, refreshed first)
        if cfg.use_vllm and cfg.rollout_workers == 0:  # with rollout workers, vLLM runs in each of them
            from rlvr.models import resolve_model_path
            from rlvr.rollout.vllm import make_vllm_sampler

            self.sampler = make_vllm_sampler(cfg.rollout_settings, cfg.model_settings, resolve_model_path(cfg.model), tokenizer,
                                             eos, world, max_prompt_length=cfg.max_prompt_length, bf16=cfg.bf16, seed=cfg.seed)
            self.sampler.update_weights(self.source)
            self.subscribers.append(self.sampler)
        else:
            if cfg.max_staleness:  # it samples while the policy trains: from a copy, refreshed after each update
                sampler_model = copy.deepcopy(sampler_model).eval()
                self.subscribers.append(WeightCopy(sampler_model))
            self.sampler = make_sampler(sampler_model, tokenizer, eos, bf16=cfg.bf16, cuda_graphs=cfg.cuda_graphs)
        self.workers = None  # Ray actors that sample and score (rollout/workers.py), when rollout_workers > 0
        if cfg.rollout_workers > 0:
            from rlvr.rollout.workers import RolloutWorkers

            self.workers = RolloutWorkers(model, tokenizer, eos, cfg.rollout_settings, cfg.model_settings, cfg.data_settings,
                                          cfg.reward_settings, bf16=cfg.bf16, seed=cfg.seed)
            self.subscribers.append(self.workers)
        # Completions from another engine, or from the weights before the last update, get the
        # importance correction (losses.py).
        self.off_policy = cfg.use_vllm or cfg.rollout_workers > 0 or cfg.max_staleness > 0
        self._stream = None  # see side_stream
        self.params = sampling_params(cfg.rollout_settings)
        # prompts -> scored completions: with tools or an environment, rollouts of several turns
        self.path = RolloutPath.of(cfg, tokenizer, self.sampler, rewards)

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
        if self.workers is not None and self.path.single_turn:  # sampled and scored on the Ray actors, timed together
            texts = self.path.render([ex.prompt for ex in examples])
            groups, scores = self.workers.generate_and_score(examples, texts, self.path.tokenize(texts), self.params,
                                                             streams.seeds, state)
            return Sampled(examples, groups, scores, time.perf_counter() - t0, 0.0)
        texts, groups = self.path.generate(examples, self.params, streams)
        rollout_seconds = time.perf_counter() - t0
        score = (examples, groups, texts, state)
        scores, reward_seconds = self.home.call(self._score, *score) if self.home else self._score(*score)
        return Sampled(examples, groups, scores, rollout_seconds, reward_seconds)

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

    def metrics(self) -> dict:
        """The samplers' own counters (vLLM servers left and dropped, weight sync), for the step's row."""
        out = {}
        for part in (self.sampler, self.workers):
            if hasattr(part, "metrics"):
                out.update(part.metrics())
        return out

    def side_stream(self):
        """Where sampling ahead runs on a GPU: a CUDA stream of its own, so its kernels can overlap
        the update's; a no-op context on the CPU."""
        device = next(self.sampler.model.parameters()).device if hasattr(self.sampler, "model") else None
        if device is None or device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the weights copied in by the last update
        return torch.cuda.stream(self._stream)

    def close(self) -> None:
        """Stop the rollout workers, if any, and what the sampler holds outside Python's reach."""
        if hasattr(self.sampler, "close"):
            self.sampler.close()
        if self.workers is not None:
            self.workers.close()
            self.subscribers.remove(self.workers)
            self.workers = None
