"""Where examples come from: built-in generated tasks, presets that read a dataset, or a plain dataset.

A task bundles prompts, reference answers and its verifier (the reward that
decides correctness, used for held-out accuracy).  Add a task by giving it
`name`, `verifier`, `check_args(args)`, `reward_args(args)` and either `splits(args, seed)`
(it makes its own problems) or `reads_dataset = True` and `load(data, seed)` (a preset: it reads
`dataset`, or its own default from the hub), and listing it in TASKS below.  The functions here
read the data settings (config.DataSettings), and the reward settings where they build rewards.

`dataset=...` with the default task (arithmetic) is a plain dataset: its columns, prompts and the
`accuracy` verifier as docs/data-and-tasks.md says.  With a preset (gsm8k, math500,
aime) the preset's columns, prompt and grader apply to it; a task that makes its own problems
(countdown, reasoning_gym, humaneval) refuses a dataset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlvr.tasks.arithmetic import ArithmeticTask
from rlvr.tasks.countdown import CountdownTask
from rlvr.tasks.humaneval import HumanEvalTask
from rlvr.tasks.presets import PRESETS
from rlvr.tasks.reasoning_gym import ReasoningGymTask
from rlvr.types import Example

if TYPE_CHECKING:
    from rlvr.config import DataSettings, RewardSettings


def task_of(data: DataSettings):
    """The task that makes the examples and grades them; None for a plain dataset."""
    task = TASKS[data.task]
    if data.dataset and not getattr(task, "reads_dataset", False):
        return None
    return task


def check_task(data: DataSettings) -> list[str]:
    """Problems with `task`, `task_args` and their fit with `dataset`; loads no data."""
    if data.task not in TASKS:
        return [f"unknown task {data.task!r}; built-in tasks: {', '.join(TASKS)} (or set dataset=...)"]
    task = TASKS[data.task]
    if data.dataset and not getattr(task, "reads_dataset", False):
        if data.task == ArithmeticTask.name:  # the default: a plain dataset, the task unused
            return []
        readers = ", ".join(name for name, t in TASKS.items() if getattr(t, "reads_dataset", False))
        return [f"task={data.task} makes its own problems and reads no dataset: drop dataset={data.dataset}, or use a task "
                f"that reads one ({readers}), or leave task unset for a plain dataset"]
    try:
        if hasattr(task, "check_available"):
            task.check_available()
    except ValueError as e:
        return [str(e)]
    try:
        task.check_args(data.task_args)
    except (TypeError, ValueError) as e:
        return [f"task_args for {data.task!r}: {e}"]
    return []


def load_splits(data: DataSettings, seed: int, evaluation: bool = False) -> tuple[list[Example], list[Example]]:
    """(train, test) examples for the configured dataset or built-in task; `seed` (the run's) draws a
    generated task's problems and a held-out test split.  An evaluation set (task=math500, aime)
    has no train split: an error unless `evaluation` (rlvr eval)."""
    task = task_of(data)
    if task is None:
        from rlvr.tasks.dataset import load_splits as load_dataset_splits

        return load_dataset_splits(data, seed)
    if not getattr(task, "reads_dataset", False):
        return task.splits(data.task_args, seed)
    train, test = task.load(data, seed)
    if not train and not evaluation:
        from rlvr.tasks.dataset import DatasetError

        raise DatasetError(f"task={data.task} is an evaluation set with no train split: train on another task or dataset "
                           f"(e.g. task=gsm8k), and measure with rlvr eval task={data.task}")
    return train, test


def verifier_name(data: DataSettings) -> str:
    """The reward that decides "correct" for accuracy: the task's verifier, else `accuracy`."""
    task = task_of(data)
    return "accuracy" if task is None else task.verifier


def reward_funcs(rewards: RewardSettings, data: DataSettings) -> tuple[str, ...]:
    """The configured reward functions, or the task's verifier alone."""
    return tuple(rewards.reward_funcs) if rewards.reward_funcs else (verifier_name(data),)


def build_rewards(rewards: RewardSettings, data: DataSettings, with_verifier: bool = False):
    """The RewardSet for training (with_verifier: plus the verifier at weight 0, for accuracy)."""
    from rlvr.rewards import RewardSet

    names = list(reward_funcs(rewards, data))
    weights = list(rewards.reward_weights) if rewards.reward_weights is not None else [1.0] * len(names)
    verifier = verifier_name(data)
    if with_verifier and verifier not in names:
        names.append(verifier)
        weights.append(0.0)
    task = task_of(data)
    task_args = {} if task is None else task.reward_args(data.task_args)
    args = {name: {**task_args.get(name, {}), **rewards.reward_args.get(name, {})} for name in names}
    return RewardSet.of(rewards, names, weights, args)


TASKS = {task.name: task for task in (ArithmeticTask, HumanEvalTask, CountdownTask, ReasoningGymTask, *PRESETS)}


class PromptStream:
    """Train examples epoch after epoch, each epoch in a new seeded random order (or, with
    shuffle=False, in dataset order: TRL's shuffle_dataset=false); its position is resumable."""

    def __init__(self, examples: list[Example], seed: int, shuffle: bool = True):
        if not examples:
            raise ValueError("the train split is empty")
        self.examples, self.seed, self.shuffle = examples, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        import random

        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, k: int, within_epoch: bool = False) -> list[Example]:
        """The next k examples; within_epoch: no further than the epoch's end (fewer at its last batch,
        as transformers' dataloader gives SFT and DPO a short last batch)."""
        out = []
        if within_epoch and self.index == len(self._order):
            self._next_epoch()
        while len(out) < k and not (within_epoch and out and self.index == len(self._order)):
            if self.index == len(self._order):
                self._next_epoch()
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

    def _next_epoch(self) -> None:
        self.epoch, self.index = self.epoch + 1, 0
        self._order = self._shuffle(self.epoch)

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.index / len(self.examples)

    @property
    def epochs_completed(self) -> int:
        """Whole passes over the examples taken so far (exact, where epochs_done is a float)."""
        return self.epoch + (self.index == len(self.examples))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)
