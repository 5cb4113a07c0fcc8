"""Stages 1-3 of a step: one generation, a scored batch with its advantages.

A round samples G completions for each of `prompts_per_step` prompts and scores them
(rollout/stage.py); with dynamic sampling (DAPO) further rounds run until `prompts_per_step`
groups carry signal or `max_sampling_rounds` extra rounds have run.  Rewards are normalised
within each group (advantages.py); groups whose rewards are all equal carry no signal and are
left out of the batch, and counted.  With partial rollouts (the free-running producer's) a round gives
each completion a token budget, and groups not done are carried to the next round instead of holding
the generation (`carry_partials`).  Where a reward function scores steps (process rewards), or with
turn_advantage=return the turns of a multi-turn rollout have rewards of their own, the step scores are
placed on their tokens (rollout/steps.py) and the advantages are per token.

With `max_staleness` >= 1 the next generation is sampled in a thread while the current step trains
(from the sampler's weights before its update); a step that fails or is interrupted before its optimizer
step drops it and rewinds the prompt stream and the sampler's generator, so a checkpoint saved
then resumes exactly.  With
several processes the groups are gathered in the sampling process group (distributed.py), so the
thread's gathers never pair up with the update's collectives.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from rlvr import distributed
from rlvr.advantages import ESTIMATORS, normalize_then_sum, step_advantages
from rlvr.config import RolloutSettings, UpdateSettings
from rlvr.monitor import generation_metrics
from rlvr.rewards import RewardError, merge_counters
from rlvr.rollout.steps import token_steps, turn_steps
from rlvr.types import Batch, Generation, PartialGroup, Round, SampledGroup, TrainerState, oldest_token_version


@dataclass(frozen=True)
class GenerationSettings:
    """What a generation reads, every value set where it is built (`of`): no defaults of its own."""

    num_generations: int
    prompts_per_step: int
    scale_rewards: str
    advantage_estimator: str  # grpo | rloo | reinforce_pp (advantages.py)
    normalize_then_sum: bool  # multi_objective_aggregation=normalize_then_sum
    mask_truncated_completions: bool
    dynamic_sampling: bool
    max_sampling_rounds: int
    num_completions_to_print: int | None  # None: all
    sample_ahead: bool  # max_staleness >= 1
    skip_without_signal: bool  # leave groups without signal out of the batch (see `of`)
    turn_advantage: str  # rollout | return: each turn's reward a step at its turn's end (rollout/steps.py turn_steps)

    @classmethod
    def of(cls, rollout: RolloutSettings, update: UpdateSettings, prompts_per_step: int,
           num_completions_to_print: int | None, steps_per_optimizer_step: int = 1,
           every_completion: bool = False) -> "GenerationSettings":
        """From the rollout settings (num_generations, max_staleness), the update settings' advantage
        and loss parts, and the numbers of the whole run: prompts_per_step (Config.prompts_per_step),
        num_completions_to_print (the run's output settings) and steps_per_optimizer_step (optimizer
        steps one generation feeds).

        A group without signal has advantage 0 and adds nothing to the policy term, so it is left out
        of the update (counted where the loss normalises) where that leaves the step exactly TRL's:
        not when a KL term in the loss still pulls on its completions (beta > 0), not with bnpo or
        steps_per_generation (whose micro-batches or steps TRL cuts from every completion), not with
        vespo (whose logged mean weight, vespo/phi_seq_mean, TRL takes over every completion), not with
        reinforce_pp or normalize_then_sum (whose batch-wide normalisation moves such a group's advantage
        off 0), not with an entropy bonus (which pulls on every completion), not when the update's loss
        trains on every completion whatever its advantage (`every_completion`: rlvr distill)."""
        whole_batch = update.advantage_estimator == "reinforce_pp" or update.multi_objective_aggregation == "normalize_then_sum" \
            or update.entropy_bonus
        skip = not (update.beta > 0 and update.kl_penalty == "loss") and update.loss_type not in ("bnpo", "vespo") \
            and steps_per_optimizer_step == 1 and not whole_batch and not every_completion
        return cls(num_generations=rollout.num_generations, prompts_per_step=prompts_per_step,
                   scale_rewards=update.scale_rewards, advantage_estimator=update.advantage_estimator,
                   normalize_then_sum=update.multi_objective_aggregation == "normalize_then_sum",
                   mask_truncated_completions=update.mask_truncated_completions,
                   dynamic_sampling=update.dynamic_sampling, max_sampling_rounds=update.max_sampling_rounds,
                   num_completions_to_print=num_completions_to_print, sample_ahead=bool(rollout.max_staleness),
                   skip_without_signal=skip or update.dynamic_sampling, turn_advantage=rollout.turn_advantage)


class Generations:
    def __init__(self, settings: GenerationSettings, rollout, prompts, generator: torch.Generator, kl,
                 world: distributed.World = distributed.SINGLE, home=None, audit=None):
        """rollout: a RolloutStage (stages 1 and 2); prompts: a tasks.PromptStream; generator: the
        sampler's random state; kl: a reference.KLReference (a KL charged to the reward is charged
        here); home: the rollout.home.HomeThread where a batch sampled ahead is scored; audit: the
        audit.RewardAudit that re-grades a sample of each generation while it trains, or None."""
        self.settings, self.rollout, self.prompts, self.generator = settings, rollout, prompts, generator
        self.kl, self.world, self.home, self.audit = kl, world, home, audit
        self.ahead: Future | None = None  # the next generation, sampled while a step trains
        self._before_ahead: tuple | None = None
        self.ahead_seconds = 0.0  # wall seconds the last generation sampled ahead took
        self.partial: _Partial | None = None  # partial rollouts (carry_partials)
        # Generation.parts kept (reassemble): partial rollouts, and generations shared from rank 0 (several processes)
        self.keep_parts = False
        # partial rollouts: (groups not done yet, groups done and not yet trained), replaced, never changed in place
        self.carry: tuple = ((), ())

    def generate(self, state: TrainerState) -> Generation:
        """Sample and score G completions per prompt (1, 2), then compute advantages (3)."""
        s = self.settings
        position = self.prompts.state_dict()  # the audit's sample is drawn from it
        if self.partial is not None:
            return self._generate_partial(state, position)
        rounds = [self.sample_round(state)]
        while s.dynamic_sampling and len(rounds) <= s.max_sampling_rounds and _informative(rounds) < s.prompts_per_step:
            rounds.append(self.sample_round(state))
        self.rollout.rest()  # the update comes next (vllm_enable_sleep_mode)
        groups = [g for r in rounds for g in r.groups]
        chosen = [g for g in groups if g.has_signal][: s.prompts_per_step] if s.dynamic_sampling else groups
        gen = self.assemble(chosen, groups, rounds, len(rounds) * s.prompts_per_step, position)
        if s.dynamic_sampling:
            gen.metrics["sampling/rounds"] = len(rounds) - 1
            gen.metrics["sampling/dropped_groups"] = sum(not g.has_signal for g in groups)
        return gen

    def assemble(self, chosen: list[SampledGroup], groups: list[SampledGroup], rounds: list[Round], drawn: int,
                 position: dict | None, owned: list[bool] | None = None) -> Generation:
        """The generation of the `chosen` groups (the batch, with their advantages), its metrics over every
        group sampled (`groups`, in `rounds`); `drawn`: prompts taken from the stream for it; `position`:
        the prompt stream's state before them, from which the reward audit draws its sample (None: no audit).
        The batch holds this rank's groups: those it sampled, or those `owned` says (one flag per group)."""
        s, size = self.settings, self.settings.num_generations
        rollouts = [r for g in chosen for r in g.rollouts]
        advantages, zero_std = self.advantages(chosen, rollouts)
        owned = [g.rank == self.world.rank for g in chosen] if owned is None else owned
        mine = torch.tensor(owned, dtype=torch.bool).repeat_interleave(size)
        without = zero_std.repeat_interleave(size) if s.skip_without_signal else torch.zeros_like(mine)
        # dynamic sampling keeps the informative groups only (DAPO); otherwise those left out still count
        skipped = None if s.dynamic_sampling else without & mine
        batch = Batch.from_rollouts(rollouts, advantages, ~without & mine, self.rollout.pad_id, s.mask_truncated_completions,
                                    size, skipped)
        metrics = generation_metrics(groups, rounds, size)
        samples = [
            {"prompt": g.example.prompt, "answer": g.example.answer, "completion": r.text, "reward": reward,
             "rewards": {n: v[j] for n, v in g.per_func.items()},  # each function's score, as TRL's completions table
             "advantage": _first(advantages[i * size + j]), "finish_reason": r.finish_reason,
             **({"steps": sorted(g.steps[j].items())} if g.steps is not None else {}),
             **({"turns": r.messages} if r.messages else {}), **{k: v[j] for k, v in g.extra.items()}}
            for i, g in enumerate(chosen) for j, (r, reward) in enumerate(zip(g.rollouts, g.rewards))
        ][: s.num_completions_to_print]
        audit = self.audit.submit(chosen, position) if self.audit is not None and position is not None else None
        return Generation(batch, metrics, samples, epochs_after=self.prompts.epochs_done,
                          epochs_drawn=drawn / len(self.prompts.examples), audit=audit,
                          groups=len(chosen), token_versions=_token_versions(rollouts),
                          parts=(chosen, groups, rounds, drawn) if self.keep_parts else None)

    # --- partial rollouts (partial_rollout_tokens) ---------------------------------------------

    def carry_partials(self, round_tokens: int, versions, max_staleness: int) -> None:
        """Sample with partial rollouts (the free-running producer's, rollout/producer.py): a round gives
        each completion at most round_tokens tokens, and one not done by then is carried to the next
        round, of this generation or the next, instead of holding the step.  `versions`: the producer's
        WeightVersions (which version the samplers hold, which the policy is at)."""
        self.partial = _Partial(round_tokens, versions, max_staleness)
        self.keep_parts = True

    def _generate_partial(self, state: TrainerState, position: dict) -> Generation:
        """Rounds until prompts_per_step groups are done: each round keeps prompts_per_step groups in flight,
        the unfinished ones carried from before and new prompts; the groups done beyond prompts_per_step
        wait for the next generation.  A carried group with a token more than max_staleness versions behind
        the policy can never be trained: it is dropped (counted in Generation.stale_groups)."""
        s, p = self.settings, self.partial
        pending, done = self.carry
        rounds, drawn, stale = [], 0, 0
        while len(done) < s.prompts_per_step:
            floor = p.versions.current - p.max_staleness  # a token older than this can never enter a loss
            fresh = [g for g in pending if _oldest(g.rollouts) >= floor]
            ready = [g for g in done if _oldest(g.rollouts) >= floor]
            stale += len(pending) - len(fresh) + len(done) - len(ready)
            examples = self.prompts.take(max(0, s.prompts_per_step - len(fresh)))
            drawn += len(examples)
            out, pending = self.rollout.sample_partial(examples, fresh, self.generator, state, p.round_tokens,
                                                       p.versions.held)
            rounds.append(self._round(out))
            done = ready + rounds[-1].groups
        self.carry = (tuple(pending), tuple(done[s.prompts_per_step:]))
        chosen = done[: s.prompts_per_step]
        gen = self.assemble(chosen, chosen, rounds, drawn, position)
        gen.stale_groups = stale
        gen.metrics["sampling/rounds"] = len(rounds) - 1
        gen.metrics["sampling/carried_groups"] = len(self.carry[0]) + len(self.carry[1])
        return gen

    def reassemble(self, gen: Generation, keep: list[bool] | None = None, world: distributed.World | None = None) -> Generation:
        """`gen` made again from its parts (Generation.parts): with only the groups `keep` says (partial
        rollouts: the rest too old to train when it was taken, rollout/producer.py), or with the batch of
        `world`'s rank's share of its groups (several processes: a generation rank 0 sampled whole, each rank
        given the groups distributed.owners says).  Advantages, batch and metrics are made again."""
        chosen, groups, rounds, drawn = gen.parts
        if keep is not None:
            chosen = groups = [g for g, k in zip(chosen, keep) if k]
        owned = None if world is None else [owner == world.rank for owner in distributed.owners(len(chosen), world)]
        out = self.assemble(chosen, groups, rounds, drawn, None, owned)
        out.epochs_after, out.audit, out.weight_version, out.stale_groups = gen.epochs_after, gen.audit, gen.weight_version, gen.stale_groups
        out.metrics.update({k: v for k, v in gen.metrics.items() if k.startswith("sampling/")})
        if keep is None:  # the same tokens: their versions as the producer counted them
            out.token_versions = gen.token_versions
        return out

    def advantages(self, groups: list[SampledGroup], rollouts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: (advantages [N] or, with process rewards, [N, T]; zero_std per group), by the settings'
        estimator and aggregation (advantages.py); a completion no reward function scored gets 0."""
        s, size = self.settings, self.settings.num_generations
        if size == 1:  # groups of one (rlvr distill): nothing to compare, every advantage 0
            return torch.zeros(len(rollouts)), torch.ones(len(groups), dtype=torch.bool)
        if any(g.steps is not None for g in groups):  # process rewards: an advantage per token
            if s.advantage_estimator != "grpo" or s.normalize_then_sum:
                raise RewardError("a reward function returned step scores, which are normalised by GRPO's rule only: "
                                  "set advantage_estimator=grpo and multi_objective_aggregation=sum_then_normalize")
            return step_advantages([x for g in groups for x in g.token_steps()], [len(r.completion_ids) for r in rollouts],
                                   size, s.scale_rewards)
        if s.normalize_then_sum:
            rewards = self.rollout.path.rewards
            per_func = torch.tensor([[math.nan if g.per_func[n][j] is None else g.per_func[n][j] for n in rewards.names]
                                     for g in groups for j in range(size)], dtype=torch.float).reshape(-1, len(rewards.names))
            return normalize_then_sum(per_func, rewards.weights, size)
        rewards = torch.tensor([x for g in groups for x in g.scored_rewards], dtype=torch.float)
        lengths = [0 if s.mask_truncated_completions and r.truncated else sum(r.mask) if r.mask is not None
                   else len(r.completion_ids) for r in rollouts]  # the tokens the loss covers (reinforce_pp whitens over them)
        return ESTIMATORS[s.advantage_estimator](rewards, size, s.scale_rewards, lengths)

    def sample_round(self, state: TrainerState) -> Round:
        """One round: prompts_per_step prompts (the same on every rank), G completions each, scored."""
        examples = self.prompts.take(self.settings.prompts_per_step)
        return self._round(self.rollout.sample(examples, self.generator, state))

    def _round(self, out) -> Round:
        """A round's groups from what the stage sampled and scored (its share, with several processes); with
        the KL charged to the reward, each reward lowered by beta x the completion's KL."""
        size = self.settings.num_generations
        if not out.groups:  # partial rollouts: nothing was done this round
            return Round([], out.scores.counters, out.rollout_seconds, out.reward_seconds, out.scores.logged)
        rollouts = [r for group in out.groups for r in group]
        totals, kls = self.kl.penalize(list(out.scores.total), rollouts, self.rollout.pad_id, size)
        steps = None if out.scores.steps is None else [  # process rewards: each step on the token it ends at
            token_steps(mine, r, self.rollout.tokenizer, totals[j] - out.scores.total[j])
            for j, (mine, r) in enumerate(zip(out.scores.steps, rollouts))]
        if self.settings.turn_advantage == "return":  # each turn's reward a step too, on its turn's last token
            steps = [turn_steps(r, steps[j] if steps else {max(len(r.completion_ids) - 1, 0): totals[j]})
                     for j, r in enumerate(rollouts)]
            totals = [sum(s.values()) for s in steps]  # a rollout's reward: its return, the turns' rewards included
        groups = []
        for i, (ex, group) in enumerate(zip(out.examples, out.groups)):
            idx = range(i * size, (i + 1) * size)
            extra = {k: v[i * size:(i + 1) * size] for k, v in out.scores.extra.items() if len(v) == len(rollouts)}
            groups.append(SampledGroup(ex, group, [totals[j] for j in idx], {n: [v[j] for j in idx] for n, v in out.scores.per_func.items()},
                                       None if kls is None else [kls[j] for j in idx], self.world.rank, extra,
                                       None if steps is None else [steps[j] for j in idx],
                                       [any(v[j] is not None for v in out.scores.per_func.values()) for j in idx]
                                       if out.scores.per_func else None))
        if not self.world.enabled:
            return Round(groups, out.scores.counters, out.rollout_seconds, out.reward_seconds, out.scores.logged)
        # every rank gets every group
        parts = distributed.gather((groups, out.scores.counters, out.rollout_seconds, out.reward_seconds, out.scores.logged),
                                   self.world, self.world.sampling_group)
        logged: dict = {}
        for part in parts:
            for key, values in part[4].items():
                logged.setdefault(key, []).extend(values)
        return Round([g for p in parts for g in p[0]], merge_counters(p[1] for p in parts),
                     max(p[2] for p in parts), max(p[3] for p in parts), logged)

    # --- where sampling is, and going back there --------------------------------------------

    def position(self) -> tuple:
        """Where the prompt stream and the sampler's generator are, and with partial rollouts the groups
        carried: what a generation moves on."""
        return self.prompts.state_dict(), self.generator.get_state(), self.carry

    def rewind(self, position: tuple) -> None:
        self.prompts.load_state_dict(position[0])
        self.generator.set_state(position[1])
        self.restore_carry(position[2])

    def restore_carry(self, carry: tuple) -> None:
        """Put back the groups carried on (a rewind's, a checkpoint's).  The caches the stage kept for the
        groups carried until now go: they may be of completions further on than these (re-prefilled instead).
        A group from a checkpoint written before groups had keys (PartialGroup.key) is given one."""
        self.carry = tuple(tuple(g if hasattr(g, "key") else PartialGroup(g.example, g.text, g.rollouts) for g in part)
                           for part in carry)
        self.rollout.forget_kept()

    def generate_or_rewind(self, state: TrainerState) -> Generation:
        """generate(), or on any error (Ctrl-C included) leave data and sampler where they were."""
        before = self.position()
        try:
            return self.generate(state)
        except BaseException:
            self.rewind(before)
            raise

    # --- sampling ahead (max_staleness >= 1) ---------------------------------------------------

    def start_ahead(self, state: TrainerState) -> None:
        """Start sampling the next generation in a thread, from the sampler's current weights."""
        self._before_ahead = self.position()
        self.ahead = Future()
        # A daemon thread: one that cancel_ahead leaves behind does not hold up the process's exit.
        threading.Thread(target=self._generate_ahead, args=(state, self.ahead), name="rlvr-ahead", daemon=True).start()

    def _generate_ahead(self, state: TrainerState, future: Future) -> None:
        try:
            t0 = time.perf_counter()
            with self.rollout.side_stream():
                gen = self.generate_or_rewind(state)
            self.ahead_seconds = time.perf_counter() - t0  # the sampler's busy time (its rewards included)
            future.set_result(gen)
        except BaseException as e:  # raised by finish_ahead
            future.set_exception(e)

    def cancel_ahead(self) -> None:
        """Drop the generation being sampled ahead and rewind to before it.

        With several processes a thread still sampling is left to end by itself (a daemon, it does
        not keep the process alive): when the update failed on this process only, the thread may
        wait in a gather for another process's thread, whose reward calls wait for a training loop
        that waits for this process in the update.  Its reward calls are refused from now on, so a
        round it goes on to sample fails and rewinds to the same place."""
        self.home.refuse()  # its reward calls fail, so it ends
        if not self.world.enabled:
            wait([self.ahead])
        if self.ahead.done():
            self.home.accept()
        self.ahead = None
        self.rewind(self._before_ahead)

    def drop_ahead(self) -> None:
        """After a step that failed: drop the generation it sampled ahead, running or finished,
        and rewind to before it."""
        if self.ahead is not None:
            self.cancel_ahead()
        else:
            self.rewind(self._before_ahead)

    def finish_ahead(self) -> Generation:
        """The generation sampled ahead, its reward calls served on this thread until it is done."""
        self.home.serve_until(self.ahead)
        future, self.ahead = self.ahead, None
        return future.result()  # an error in it is raised here

    def close(self) -> None:
        if self.ahead is not None:  # stopped while a generation was sampled ahead
            self.cancel_ahead()


def _token_versions(rollouts: list) -> dict | None:
    """{weight version: tokens} over the tokens the loss covers (an observation between turns is not
    one), None where no engine recorded versions (every run but a free-running producer's in-flight loads);
    a rollout without them counts under None."""
    if all(r.versions is None for r in rollouts):
        return None
    versions = Counter()
    for r in rollouts:
        mask = r.mask if r.mask is not None else [True] * len(r.completion_ids)
        versions.update([v for v, m in zip(r.versions, mask) if m] if r.versions is not None else {None: sum(mask)})
    return dict(versions)


@dataclass(frozen=True)
class _Partial:
    round_tokens: int
    versions: object  # rollout.producer.WeightVersions
    max_staleness: int


def _oldest(rollouts) -> float:
    oldest = oldest_token_version(rollouts)
    return math.inf if oldest is None else oldest


def _informative(rounds: list[Round]) -> int:
    return sum(g.has_signal for r in rounds for g in r.groups)


def _first(advantage: torch.Tensor) -> float:
    """A completion's advantage as completions.jsonl shows it: with process rewards, its first token's."""
    return (advantage.reshape(-1)[0] if advantage.numel() else advantage.new_zeros(())).item()
