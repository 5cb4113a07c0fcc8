"""Rollout workers: Ray actors that sample and score groups, with the trainer on the driver.

`rollout_workers=N` starts N actors (`RolloutWorker`), on a local Ray cluster or the
one at `ray_address`.  Each holds a copy of the policy (built from the trainer's
config and weights, sent through the Ray object store), a sampler from
rollout/engine.py and the reward functions.  `RolloutWorkers`, on the driver,
splits a round's groups across the actors, gathers the rollouts and scores in
order, and after each optimizer step puts the new weights in the object store
once for every actor to load (it is one of `Trainer.weight_subscribers`).

Determinism: every group is sampled from its own random stream (GroupGenerators,
rollout/sampling.py), seeded by the trainer from its generator exactly as the
in-process path seeds it, so a group's completions do not depend on which actor ran
it, what else that actor ran, or whether workers are used at all.  Fault tolerance: an actor that dies (preemption,
out of memory, a crash in a reward function) is replaced by a new one holding the
current weights, and exactly the groups it had are sent again; results are kept
by group index, so none is lost or counted twice.

Ray is imported only here, inside the functions that use it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from rlvr.rewards import Scores, merge_counters
from rlvr.rollout import SamplingParams
from rlvr.rollout.sampling import GroupGenerators
from rlvr.types import Example, Rollout, TrainerState

RAY_INSTALL = "pip install 'rlvr[ray]'  (or: pip install 'ray>=2.9')"
MAX_REPLACEMENTS_PER_ROUND = 3  # per actor slot; then the round fails with the last error


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"rollout_workers > 0 needs Ray, which is not installed. Install it with: {RAY_INSTALL}") from None
    return ray


def model_weights(model) -> dict[str, torch.Tensor]:
    """The model's weights as plain CPU tensors, ready to ship."""
    return {name: t.detach().cpu() for name, t in model.state_dict().items()}


def concat_scores(parts: list[Scores]) -> Scores:
    """The Scores of consecutive slices of a round, joined in order (counters added up)."""
    total, per_func = [], {}
    for s in parts:
        total += s.total
        for name, values in s.per_func.items():
            per_func.setdefault(name, []).extend(values)
    return Scores(total, per_func, merge_counters(s.counters for s in parts))


class RolloutWorker:
    """One actor: a policy copy, its sampler and the reward functions.  (Wrapped by ray.remote in RolloutWorkers.)"""

    def __init__(self, model_config, tokenizer, eos_ids: list[int], cfg, weights: dict, threads: int):
        from transformers import AutoModelForCausalLM

        from rlvr.rollout.engine import make_sampler
        from rlvr.tasks import build_rewards

        torch.set_num_threads(threads)
        dtype = next(iter(weights.values())).dtype
        self.model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        self.model.load_state_dict(weights, strict=True)
        self.model.eval()
        self.cfg = cfg
        self.sampler = make_sampler(self.model, tokenizer, eos_ids, bf16=cfg.bf16)
        self.rewards = build_rewards(cfg)

    def pid(self) -> int:
        return os.getpid()

    def update_weights(self, weights: dict) -> None:
        self.model.load_state_dict(weights, strict=True)  # in place: the sampler sees the new values

    def generate_and_score(self, examples: list[Example], texts: list[str], prompt_ids: list[list[int]],
                           params: SamplingParams, seeds: list[int], trainer_state: TrainerState):
        groups = self.sampler.generate(prompt_ids, params, GroupGenerators(seeds))
        scores = self.rewards.score_groups(examples, groups, texts, trainer_state, self.cfg.max_completion_length)
        return groups, scores


class RolloutWorkers:
    """N RolloutWorker actors seen as one sampler + reward set; a weight subscriber of the Trainer."""

    def __init__(self, model, tokenizer, eos_ids: list[int], cfg, threads: int | None = None):
        ray = import_ray()
        self.ray, self.cfg = ray, _with_absolute_reward_files(cfg)
        self.size = cfg.rollout_workers
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.size)
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if cfg.ray_address:
                ray.init(address=cfg.ray_address, logging_level="WARNING")
            else:
                ray.init(num_cpus=max(os.cpu_count() or 1, self.size * self.threads), include_dashboard=False,
                         logging_level="WARNING")
        self.actor_class = ray.remote(num_cpus=self.threads, max_restarts=0)(RolloutWorker)
        # The actor constructor's arguments, the weights as an object-store reference (updated by update_weights).
        self.spec = [ray.put(model.config), ray.put(tokenizer), eos_ids]
        self.weights = ray.put(model_weights(model))
        self.actors = [self._start() for _ in range(self.size)]
        self.replacements = 0  # actors replaced since the start
        ray.get([a.pid.remote() for a in self.actors])  # fail here, clearly, if an actor cannot start

    def _start(self):
        return self.actor_class.remote(*self.spec, self.cfg, self.weights, self.threads)

    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def update_weights(self, model) -> None:
        """Put the new weights in the object store once; every actor loads them before its next round.
        (Ray runs an actor's calls in the order they were sent, so nothing waits here.)"""
        self.weights = self.ray.put(model_weights(model))
        for actor in self.actors:
            actor.update_weights.remote(self.weights)

    def generate_and_score(self, examples: list[Example], texts: list[str], prompt_ids: list[list[int]],
                           params: SamplingParams, seeds: list[int], trainer_state: TrainerState):
        """(groups of rollouts, Scores) for every prompt, in order, as RewardSet.score_groups returns them."""
        from ray.exceptions import RayActorError

        slices = [range(len(examples))[k :: self.size] for k in range(self.size)]
        slices = [s for s in slices if len(s)]

        def submit(slot: int):
            idx = slices[slot]
            return self.actors[slot].generate_and_score.remote(
                [examples[i] for i in idx], [texts[i] for i in idx], [prompt_ids[i] for i in idx],
                params, [seeds[i] for i in idx], trainer_state)

        pending = {submit(slot): slot for slot in range(len(slices))}
        results, deaths = {}, [0] * len(slices)
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1)
            slot = pending.pop(ready[0])
            try:
                results[slot] = self.ray.get(ready[0])
            except RayActorError as e:  # the actor is gone: replace it, and send its groups again
                deaths[slot] += 1
                if deaths[slot] > MAX_REPLACEMENTS_PER_ROUND:
                    raise RuntimeError(f"rollout worker {slot} died {deaths[slot]} times in one round; last error: {e}") from e
                self._replace(slot)
                pending[submit(slot)] = slot
        groups: list = [None] * len(examples)
        parts: list = [None] * len(examples)
        size = params.n
        for slot, (slot_groups, scores) in results.items():
            for j, i in enumerate(slices[slot]):
                groups[i] = slot_groups[j]
                parts[i] = _slice_scores(scores, j * size, (j + 1) * size, first=j == 0)
        return groups, concat_scores(parts)

    def _replace(self, slot: int) -> None:
        self.ray.kill(self.actors[slot], no_restart=True)
        self.actors[slot] = self._start()
        self.replacements += 1

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self.owns_ray:
            self.ray.shutdown()


def _slice_scores(scores: Scores, lo: int, hi: int, first: bool) -> Scores:
    """Rows lo:hi of a Scores; the counters go with the first slice only, so they are counted once."""
    return Scores(scores.total[lo:hi], {n: v[lo:hi] for n, v in scores.per_func.items()},
                  scores.counters if first else {n: {} for n in scores.counters})


def _with_absolute_reward_files(cfg):
    """reward_funcs given as path/to/file.py:function (and their reward_args keys) made absolute,
    as the actors may run in another directory."""
    renamed = {}
    for name in cfg.reward_funcs or ():
        target, sep, attr = name.rpartition(":")
        if sep and target.endswith(".py"):
            renamed[name] = f"{Path(target).expanduser().resolve()}:{attr}"
    if not renamed:
        return cfg
    return dataclasses.replace(cfg, reward_funcs=tuple(renamed.get(n, n) for n in cfg.reward_funcs),
                               reward_args={renamed.get(k, k): v for k, v in cfg.reward_args.items()})
