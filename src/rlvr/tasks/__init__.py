"""Where examples come from: built-in generated tasks, or a `datasets` dataset.

A task bundles prompts, reference answers and its verifier (the reward that
decides correctness, used for held-out accuracy).  Add a task by giving it
`name`, `verifier`, `check_args(args)` and `splits(args, seed)` and listing it
in TASKS below.
"""

from __future__ import annotations

from rlvr.tasks.arithmetic import ArithmeticTask
from rlvr.tasks.humaneval import HumanEvalTask
from rlvr.types import Example


def load_splits(cfg) -> tuple[list[Example], list[Example]]:
    """(train, test) examples for the configured dataset or built-in task."""
    if cfg.dataset:
        from rlvr.tasks.dataset import load_splits as load_dataset_splits

        return load_dataset_splits(cfg)
    return TASKS[cfg.task].splits(cfg.task_args, cfg.seed)


def verifier_name(cfg) -> str:
    """The reward that decides "correct" for accuracy: the task's verifier, else `accuracy`."""
    return "accuracy" if cfg.dataset else TASKS[cfg.task].verifier


def reward_funcs(cfg) -> tuple[str, ...]:
    """The configured reward functions, or the task's verifier alone."""
    return tuple(cfg.reward_funcs) if cfg.reward_funcs else (verifier_name(cfg),)


def build_rewards(cfg, with_verifier: bool = False):
    """The RewardSet for training (with_verifier: plus the verifier at weight 0, for accuracy)."""
    from rlvr.rewards import RewardSet

    names = list(reward_funcs(cfg))
    weights = list(cfg.reward_weights) if cfg.reward_weights is not None else [1.0] * len(names)
    verifier = verifier_name(cfg)
    if with_verifier and verifier not in names:
        names.append(verifier)
        weights.append(0.0)
    task_args = {} if cfg.dataset else TASKS[cfg.task].reward_args(cfg.task_args)
    args = {name: {**task_args.get(name, {}), **cfg.reward_args.get(name, {})} for name in names}
    return RewardSet(names, weights, args, timeout=cfg.reward_timeout)


TASKS = {ArithmeticTask.name: ArithmeticTask, HumanEvalTask.name: HumanEvalTask}


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

    def take(self, k: int) -> list[Example]:
        out = []
        while len(out) < k:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

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
