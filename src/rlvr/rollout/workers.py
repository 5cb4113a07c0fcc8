"""Rollout workers: Ray actors that sample and score groups, with the trainer on the driver.

`rollout_workers=N` starts N actors (`RolloutWorker`), on a local Ray cluster or the one at
`ray_address`.  Each runs the trainer's own path from prompts to scored completions
(rollout/path.py: RolloutPath.of, built from the run's settings as the trainer builds it) on a
sampler of its own: single turns, or turn by turn with the run's tools or environments, which it
makes and holds (the python tool runs in the sandbox of the actor's node), or the run's
rollout_func, whose `trainer.generate` samples with the actor's sampler.  The sampler is either
rlvr's in-process engine (rollout/engine.py) on a model built from the trainer's model config and
weights, or with use_vllm vLLM's colocated sampler (rollout/vllm.py) started from the model's
path.  An actor is sent the run's settings once, at its start (the path reads them, and a
rollout_func gets them as trainer.args), the tokenizer, vLLM's engine arguments and the latest
weights.  Tools, environments, rollout functions and reward functions are imported on the actor
from the names the settings hold, so objects given to GRPOTrainer are refused with rollout_workers
(api/trainers.py).  `RolloutWorkers`, on the driver, splits a round's groups across the actors,
gathers the rollouts (turns, masks, environment rewards, tool counters: Rollout.info) and scores in
order, and after each optimizer step puts the update in the object store once for every actor to
load (it is one of `Trainer.weight_subscribers`).

What is sent (rollout/weights.py): the whole policy under Hugging Face names; with LoRA only the
adapter and its LoraConfig.  An in-process worker with LoRA builds a peft model once from the
trainer's state at the start (base weights and adapter) and then loads only each new adapter;
a vLLM worker with LoRA applies the adapter per request (vLLM's enable_lora) over the base model
it started from.

Determinism: every group is sampled from its own random stream (GroupGenerators,
rollout/sampling.py; with vLLM, one request seed drawn from that stream; a later turn from a seed
mixed from its group's, rollout/multiturn.py), seeded by the trainer from its generator exactly as
the in-process path seeds it, so a group's completions do not depend on which actor ran it, what
else that actor ran, or whether workers are used at all.  (A rollout_func is called once per actor
with that actor's share of the prompts: its results match the in-process run's with one worker.)
Fault tolerance: an actor that dies (preemption, out of memory, a crash in a reward function)
is replaced by a new one holding the current weights, and exactly the groups it had are sent
again; results are kept by group index, so none is lost or counted twice.

Ray is imported only here, inside the functions that use it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from rlvr.config import Config
from rlvr.errors import RolloutError
from rlvr.rewards import Scores, merge_counters
from rlvr.rollout import SamplingParams
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.weights import weight_update, wire_dtype
from rlvr.types import Example, Rollout, TrainerState

RAY_INSTALL = "pip install 'rlvr[ray]'  (or: pip install 'ray>=2.9')"
MAX_REPLACEMENTS_PER_ROUND = 3  # per actor slot; then the round fails with the last error


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"rollout_workers > 0 needs Ray, which is not installed. Install it with: {RAY_INSTALL}") from None
    return ray


def concat_scores(parts: list[Scores]) -> Scores:
    """The Scores of consecutive slices of a round, joined in order (counters and logged values added up)."""
    total, per_func, extra, logged = [], {}, {}, {}
    for s in parts:
        total += s.total
        for joined, own in ((per_func, s.per_func), (extra, s.extra), (logged, s.logged)):
            for name, values in own.items():
                joined.setdefault(name, []).extend(values)
    steps = None if all(s.steps is None for s in parts) else \
        [x for s in parts for x in (s.steps or [[(None, t)] for t in s.total])]
    return Scores(total, per_func, merge_counters(s.counters for s in parts), extra, logged, steps=steps)


class LocalPolicy:
    """The in-process engine (`sampler`) on a Hugging Face model built in the actor.  `state`: with
    LoRA the trainer's peft state dict at the start (the frozen base weights with them), else None."""

    def __init__(self, model_config, tokenizer, eos_ids: list[int], bf16: bool, cuda_graphs: bool, state: dict | None,
                 update: tuple):
        from transformers import AutoModelForCausalLM

        from rlvr.rollout.engine import make_sampler

        meta, tensors = update
        weights = state if state is not None else tensors
        dtype = next(t.dtype for t in weights.values() if t.is_floating_point())
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        if state is not None:  # the same LoRA layers as the trainer's, then its weights
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig.from_peft_type(**meta["adapter"]))
            model.load_state_dict(state, strict=True)
        self.model = model.eval()
        self.load(meta, tensors)
        self.sampler = make_sampler(self.model, tokenizer, eos_ids, bf16=bf16, cuda_graphs=cuda_graphs)

    def load(self, meta: dict, tensors: dict) -> None:
        """In place: the sampler reads the model's parameters, so it sees the new values."""
        if meta["adapter"] is not None:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.model, tensors)
            if result.unexpected_keys:
                raise RuntimeError(f"the adapter sent does not fit the worker's LoRA layers: {result.unexpected_keys[:5]}")
            return
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        params = {name for name, _ in self.model.named_parameters()}
        if unexpected or params & set(missing):
            raise RuntimeError(f"the weights sent do not fit the worker's model: unexpected {unexpected[:5]}, "
                               f"missing {sorted(params & set(missing))[:5]}")

    def close(self) -> None:
        pass


class VLLMPolicy:
    """vLLM in the actor (no engine subprocess): the colocated sampler (`sampler`) started from
    `model_path` with `engine_args` (vllm.engine_args), then given every update."""

    def __init__(self, model_path: str, tokenizer, eos_ids: list[int], engine_args: dict, update: tuple):
        from rlvr.rollout.vllm import VLLMColocateSampler

        self.sampler = VLLMColocateSampler(model_path, tokenizer, eos_ids, **engine_args)
        self.load(*update)

    def load(self, meta: dict, tensors: dict) -> None:
        self.sampler.engine.load(meta, tensors.items())

    def close(self) -> None:
        self.sampler.close()


class RolloutWorker:
    """One actor: a sampler holding the current policy, on the trainer's path from prompts to scored
    completions.  (Wrapped by ray.remote in RolloutWorkers.)  With use_vllm the sampler is vLLM on
    `model_path` with `engine_args`, else the in-process engine on a model of `model_config`.
    `settings`: the run's Config, from which the path is built as the trainer builds it (the
    rendering, the tools or environments, the rollout_func, the reward functions); `update`:
    (meta, tensors) of the latest weight update."""

    def __init__(self, model_config, tokenizer, eos_ids: list[int], model_path: str | None, engine_args: dict | None,
                 settings: Config, threads: int, state: dict | None, update: tuple):
        from rlvr.rollout.path import RolloutPath
        from rlvr.tasks import build_rewards

        torch.set_num_threads(threads)
        if settings.use_vllm:
            self.policy = VLLMPolicy(model_path, tokenizer, eos_ids, engine_args, update)
        else:
            self.policy = LocalPolicy(model_config, tokenizer, eos_ids, settings.bf16, settings.cuda_graphs, state, update)
        rewards = build_rewards(settings.reward_settings, settings.data_settings)
        self.path = RolloutPath.of(settings, tokenizer, self.policy.sampler, rewards)

    def pid(self) -> int:
        return os.getpid()

    def load(self, update: tuple) -> None:
        self.policy.load(*update)

    def generate_and_score(self, examples: list[Example], params: SamplingParams, seeds: list[int],
                           trainer_state: TrainerState) -> tuple[list[list[Rollout]], Scores]:
        """The path's run on these groups, each from its own stream (seeds[i] for examples[i])."""
        scored = self.path.run(examples, params, GroupGenerators(seeds), state=trainer_state)
        return scored.groups, scored.scores

    def close(self) -> None:
        self.policy.close()


class RolloutWorkers:
    """N RolloutWorker actors seen as one sampler + reward set; a weight subscriber of the Trainer.

    `settings`: the run's Config, which the actors build their path from (RolloutWorker); read
    here: the rollout section (rollout_workers, ray_address, use_vllm, ...), the model's name, dtype
    and LoRA, and what vLLM's engine arguments take (vllm.engine_args).  With use_vllm each actor
    starts vLLM from rlvr.models.resolve_model_path(settings.model), resolved here on the driver: a
    hub id works on every node; a local path must exist on each node."""

    def __init__(self, model, tokenizer, eos_ids: list[int], settings: Config, *, threads: int | None = None):
        ray = import_ray()
        rollout = settings.rollout_settings
        self.ray, self.use_peft = ray, settings.use_peft
        self.size = rollout.rollout_workers
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.size)
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if rollout.ray_address:
                ray.init(address=rollout.ray_address, logging_level="WARNING")
            else:
                ray.init(num_cpus=max(os.cpu_count() or 1, self.size * self.threads), include_dashboard=False,
                         logging_level="WARNING")
        gpus = rollout.vllm_tensor_parallel_size if rollout.use_vllm and ray.cluster_resources().get("GPU", 0) else 0
        self.actor_class = ray.remote(num_cpus=self.threads, num_gpus=gpus, max_restarts=0)(RolloutWorker)
        model_path, self.engine_args = None, None  # vLLM's: where the actors start it, and how
        if rollout.use_vllm:
            from rlvr.models import resolve_model_path
            from rlvr.rollout.vllm import engine_args

            model_path = resolve_model_path(settings.model)
            self.engine_args = engine_args(rollout, settings.model_settings, max_prompt_length=settings.max_prompt_length,
                                           bf16=settings.bf16, seed=settings.seed)
        # The actor constructor's arguments; the state and the update as object-store references.
        self.spec = [ray.put(model.config), ray.put(tokenizer), list(eos_ids), model_path, self.engine_args,
                     ray.put(_with_absolute_reward_files(settings))]
        local_lora = settings.use_peft and not rollout.use_vllm and hasattr(model, "peft_config")
        self.state = ray.put({k: v.detach().cpu() for k, v in model.state_dict().items()}) if local_lora else None
        self.version = 0
        self.replacements = 0  # actors replaced since the start
        self.last_sync: tuple[int, float] = (0, 0.0)  # bytes and seconds of the last update put in the object store
        self.loading: list = []  # the actors' loads of the last update, checked before the next round
        self.update = self._put(model)
        self.actors = [self._start() for _ in range(self.size)]
        self._check_started()

    def _check_started(self) -> None:
        """Fail here, in one line, if an actor cannot start: a module the settings name that its node cannot
        import, no sandbox there for the python tool, a model that does not fit, ..."""
        from ray.exceptions import RayActorError

        try:
            self.ray.get([a.pid.remote() for a in self.actors])
        except RayActorError as e:
            self.close()
            why = (getattr(e, "error_msg", None) or str(e)).strip().splitlines()[-1]  # the error its constructor raised
            raise RolloutError(f"a rollout worker could not start: {why}") from e

    def _start(self):
        return self.actor_class.remote(*self.spec, self.threads, self.state, self.update)

    def _put(self, model):
        """The policy's update for version self.version, in the object store once for every actor."""
        t0 = time.perf_counter()
        update = weight_update(model, self.use_peft, self.version)
        dtype = None
        if self.engine_args is not None and update.adapter is None:  # vLLM holds the weights in its own dtype: send that
            dtype = wire_dtype(self.engine_args["dtype"])
        tensors = {name: t.to("cpu", dtype) if dtype is not None and t.is_floating_point() else t.cpu()
                   for name, t in update.pairs()}
        ref = self.ray.put(({**update.meta, "version": update.version, "adapter": update.adapter}, tensors))
        self.last_sync = (sum(t.numel() * t.element_size() for t in tensors.values()), time.perf_counter() - t0)
        return ref

    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def update_weights(self, model) -> None:
        """Put the new weights (with LoRA: the adapter) in the object store once; every actor loads
        them before its next round.  (Ray runs an actor's calls in the order they were sent, so
        nothing waits here; a load that failed is raised before the next round.)"""
        self.version += 1
        self.update = self._put(model)
        self.loading = [actor.load.remote(self.update) for actor in self.actors]

    def metrics(self) -> dict:
        """For the step's row: actors replaced so far, and the last update's bytes and the seconds
        the trainer spent gathering it and putting it in the object store."""
        return {"workers/replacements": self.replacements, "workers/weight_sync_bytes": self.last_sync[0],
                "workers/weight_sync_seconds": self.last_sync[1]}

    def generate_and_score(self, examples: list[Example], params: SamplingParams, seeds: list[int],
                           trainer_state: TrainerState) -> tuple[list[list[Rollout]], Scores]:
        """(groups of rollouts, Scores) for every prompt, in order, as RolloutPath.run gives them in
        the trainer's process; seeds[i]: the seed of examples[i]'s stream."""
        from ray.exceptions import RayActorError, RayTaskError

        self._check_loads()
        slices = [range(len(examples))[k :: self.size] for k in range(self.size)]
        slices = [s for s in slices if len(s)]

        def submit(slot: int):
            idx = slices[slot]
            return self.actors[slot].generate_and_score.remote([examples[i] for i in idx], params,
                                                              [seeds[i] for i in idx], trainer_state)

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
            except RayTaskError as e:  # the run's own error on the actor (an environment, a reward): as in-process
                raise e.cause from e
        groups: list = [None] * len(examples)
        parts: list = [None] * len(examples)
        size = params.n
        for slot, (slot_groups, scores) in results.items():
            for j, i in enumerate(slices[slot]):
                groups[i] = slot_groups[j]
                parts[i] = _slice_scores(scores, j * size, (j + 1) * size, first=j == 0)
        return groups, concat_scores(parts)

    def _check_loads(self) -> None:
        """A load that raised (weights that do not fit, vLLM failing) stops the run instead of
        leaving an actor on the old weights; an actor that died is replaced by the round."""
        from ray.exceptions import RayActorError

        loading, self.loading = self.loading, []
        for ref in loading:
            try:
                self.ray.get(ref)
            except RayActorError:
                pass

    def _replace(self, slot: int) -> None:
        self.ray.kill(self.actors[slot], no_restart=True)
        self.actors[slot] = self._start()  # built with the latest update
        self.replacements += 1

    def close(self) -> None:
        """Let the engines clean up (vLLM's adapter files), then stop the actors."""
        if self.actors:
            self.ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=30)
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self.owns_ray:
            self.ray.shutdown()


def _slice_scores(scores: Scores, lo: int, hi: int, first: bool) -> Scores:
    """Rows lo:hi of a Scores; the counters and logged values go with the first slice only, so they are counted once."""
    return Scores(scores.total[lo:hi], {n: v[lo:hi] for n, v in scores.per_func.items()},
                  scores.counters if first else {n: {} for n in scores.counters},
                  {n: v[lo:hi] for n, v in scores.extra.items()}, scores.logged if first else {},
                  steps=None if scores.steps is None else scores.steps[lo:hi])


def _with_absolute_reward_files(settings: Config) -> Config:
    """reward_funcs given as path/to/file.py:function (and their reward_args keys) made absolute,
    as the actors may run in another directory."""
    renamed = {}
    for name in settings.reward_funcs or ():
        target, sep, attr = name.rpartition(":")
        if sep and target.endswith(".py"):
            renamed[name] = f"{Path(target).expanduser().resolve()}:{attr}"
    if not renamed:
        return settings
    return dataclasses.replace(settings, reward_funcs=tuple(renamed.get(n, n) for n in settings.reward_funcs),
                               reward_args={renamed.get(k, k): v for k, v in settings.reward_args.items()})
