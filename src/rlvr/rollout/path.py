"""The one path from prompts to scored completions, taken by training (rollout/stage.py), held-out
evaluation (evaluate.py) and `rlvr sample` alike:

1. render each prompt (the chat template, the system prompt, the template's variables; with tools,
   their descriptions);
2. sample params.n completions of each through the given sampler: in one turn, or turn by turn
   with the run's tools or environment answering between turns (rollout/multiturn.py), or by the
   run's rollout_func (rollout/custom.py);
3. score them with the reward functions (a RewardSet: the run's rewards, with the task's verifier
   for evaluation).

What differs between the three callers is only what they pass in: the sampler (training's engine
or vLLM, an in-process engine on a loaded model), the SamplingParams (rollout.sampling_params),
the prompts (evaluation's few-shot prompts) and the random streams.  Training's Ray rollout
workers (rollout/workers.py) each build this path from the run's settings and run it on the actor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlvr.chat import render_prompts, tokenize_prompts
from rlvr.rewards import RewardSet, Scores
from rlvr.rollout import SamplingParams
from rlvr.types import Example, Rollout, TrainerState


@dataclass
class Scored:
    """Per example, the rendered prompt (with tools, the first one), its params.n rollouts and their scores."""

    texts: list[str]
    groups: list[list[Rollout]]
    scores: Scores


class RolloutPath:
    """Prompts -> scored completions with one sampler and one set of reward functions.

    `settings`: the run's Config.  The path reads its rollout settings (max_completion_length, the
    multi-turn fields) and the data settings' prompt fields (system_prompt, text_prompts,
    chat_template_kwargs, max_prompt_length), both of which MultiTurn reads too; a rollout_func
    gets the whole Config as `trainer.args`, as TRL's gets GRPOConfig.  `multiturn` (a MultiTurn)
    and `rollout_func`: built by `of` from the settings."""

    def __init__(self, settings, tokenizer, sampler, rewards: RewardSet, multiturn=None, rollout_func=None):
        self.settings, self.tokenizer, self.sampler, self.rewards = settings, tokenizer, sampler, rewards
        self.multiturn, self.rollout_func = multiturn, rollout_func

    @classmethod
    def of(cls, settings, tokenizer, sampler, rewards: RewardSet) -> "RolloutPath":
        """The path of a run: with its tools or environment, or its rollout_func, where it has one."""
        from rlvr.rollout.custom import load_rollout_func
        from rlvr.rollout.multiturn import make_multiturn

        rollout_func = load_rollout_func(settings.rollout_func) if settings.rollout_func else None
        return cls(settings, tokenizer, sampler, rewards, make_multiturn(settings.rollout_settings, settings.data_settings, tokenizer), rollout_func)

    def render(self, prompts: list) -> list[str]:
        """The single-turn prompts' texts, as the sampler sees them."""
        s = self.settings
        return render_prompts(self.tokenizer, prompts, s.system_prompt, s.chat_template_kwargs, s.text_prompts == "raw")

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return tokenize_prompts(self.tokenizer, texts, self.settings.max_prompt_length)

    def generate(self, examples: list[Example], params: SamplingParams, generator,
                 prompts: list | None = None) -> tuple[list[str], list[list[Rollout]]]:
        """(the prompts' texts, per example params.n Rollouts).  `prompts`: what to ask in place of
        each example's own prompt (evaluation's few-shot prompts); `generator`: a torch.Generator,
        per-group streams (rollout/sampling.py) or None, as the sampler takes them."""
        asked = examples if prompts is None else [dataclasses.replace(ex, prompt=p) for ex, p in zip(examples, prompts)]
        prompts = [ex.prompt for ex in asked]
        if self.multiturn is not None:  # the turns, the environment's answers between them
            return self.multiturn.generate(self.sampler, examples, prompts, params, generator)
        texts = self.render(prompts)
        if self.rollout_func is not None:  # it is given the prompts asked, each params.n times
            from rlvr.rollout.custom import custom_rollouts

            return texts, custom_rollouts(self.rollout_func, self.settings, self.tokenizer, self.sampler, asked, params,
                                          generator)
        return texts, self.sampler.generate(self.tokenize(texts), params, generator)

    def score(self, examples: list[Example], groups: list[list[Rollout]], texts: list[str],
              state: TrainerState | None = None) -> Scores:
        """The reward functions' scores of every rollout (group i belongs to examples[i]).  Each rollout's
        environment (TRL's `environments`) is let go once scored: the rollouts travel on without it."""
        scores = self.rewards.score_groups(examples, groups, texts, state, self.settings.max_completion_length)
        for r in (r for group in groups for r in group if r.info):
            r.info.pop("environment", None)
        return scores

    def run(self, examples: list[Example], params: SamplingParams, generator, prompts: list | None = None,
            state: TrainerState | None = None) -> Scored:
        """generate, then score."""
        texts, groups = self.generate(examples, params, generator, prompts)
        return Scored(texts, groups, self.score(examples, groups, texts, state))


def in_process_sampler(model, tokenizer, bf16: bool, cuda_graphs: bool, max_batch_size: int | None = None):
    """The in-process engine on a loaded model: the sampler of `rlvr eval`, `rlvr sample` and
    GRPOTrainer.evaluate, which run outside a training run."""
    from rlvr.models import eos_token_ids
    from rlvr.rollout.engine import make_sampler

    batch = {} if max_batch_size is None else {"max_batch_size": max_batch_size}
    return make_sampler(model, tokenizer, eos_token_ids(model, tokenizer), bf16=bf16, cuda_graphs=cuda_graphs, **batch)
