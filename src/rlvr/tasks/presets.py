r"""Presets for the math sets people train and evaluate on: GSM8K, MATH-500 and AIME.

A preset knows its dataset's columns, asks for the answer in ``\boxed{}`` and grades with the
fitting built-in reward.  It reads the dataset from the Hugging Face Hub by default, or the file
(or hub id) given as `dataset`, so ``rlvr eval task=math500 dataset=math500.jsonl`` works
without a network.  `prompt_column` / `answer_column` override the preset's columns, and a prompt
already written as chat messages is used as it is.

    task     default dataset (hub)                 columns                  grader
    gsm8k    openai/gsm8k (main): train, test      question, answer (#### N)  numeric_accuracy
    math500  HuggingFaceH4/MATH-500: test          problem, answer          accuracy (symbolic)
    aime     HuggingFaceH4/aime_2024: train        problem, answer (0-999)  numeric_accuracy

GSM8K splits as any dataset does (dataset_train_split / dataset_test_split; a file without a
test split gets 10% held out).  MATH-500 and AIME are evaluation sets: every row is a test
problem (the dataset's `dataset_test_split` where it has one, else its only split) and there is
no train split, so `rlvr train` refuses them and `rlvr eval` grades every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlvr.types import Example

if TYPE_CHECKING:
    from rlvr.config import DataSettings

_STEPS = "Solve the problem step by step, then write the final answer in \\boxed{{}}."
GSM8K_TEMPLATE = "{problem}\n\n" + _STEPS.replace("final answer", "final number")
MATH_TEMPLATE = "{problem}\n\n" + _STEPS
AIME_TEMPLATE = "{problem}\n\n" + _STEPS.replace("final answer", "final answer, an integer from 0 to 999,")


@dataclass(frozen=True)
class Preset:
    name: str
    verifier: str
    hub: str  # the dataset read when `dataset` is not set
    hub_config: str | None
    train_split: str | None  # in the hub dataset; None: an evaluation set, no train split
    test_split: str
    prompt_columns: tuple[str, ...]  # the first present is the prompt (prompt_column overrides)
    answer_columns: tuple[str, ...]
    template: str  # the prompt, with {problem}

    reads_dataset = True

    def check_args(self, args: dict) -> dict:
        if args:
            raise ValueError(f"task={self.name} takes no task_args (got {sorted(args)}); set its columns with "
                             "prompt_column / answer_column and its dataset with dataset=...")
        return {}

    def reward_args(self, args: dict) -> dict:
        return {}

    def load(self, data: DataSettings, seed: int) -> tuple[list[Example], list[Example]]:
        """(train, test) from `data.dataset` when set, else from the hub dataset; `seed` draws a
        held-out test split."""
        from rlvr.tasks.dataset import DatasetError, pick_column, split_rows

        given = data.dataset is not None
        name, config = (data.dataset, data.dataset_config) if given else (self.hub, self.hub_config)
        train_split, test_split = (data.dataset_train_split, data.dataset_test_split) if given else (self.train_split, self.test_split)
        try:
            if self.train_split is None:
                train, (test, where) = None, self._test_only(name, config, test_split)
            else:
                train, test, where = split_rows(name, config, train_split, test_split, seed)
        except DatasetError as e:
            if given or not str(e).startswith("could not load dataset"):
                raise
            raise DatasetError(f"task={self.name} reads {self.hub} from the Hugging Face Hub, which failed "
                               f"({str(e).partition(': ')[2]}); without a network, pass the dataset as a local file: "
                               f"task={self.name} dataset=<file.jsonl, .parquet or .csv>") from None
        columns = (test if train is None else train).column_names
        prompt_col = pick_column(columns, data.prompt_column, self.prompt_columns, "prompt", name)
        answer_col = pick_column(columns, data.answer_column, self.answer_columns, "answer", name)
        train = [] if train is None else self._examples(train, prompt_col, answer_col, "train", where)
        return train, self._examples(test, prompt_col, answer_col, "test", where)

    def _test_only(self, name: str, config: str | None, test_split: str):
        from rlvr.tasks.dataset import DatasetError, Where, load_rows

        dd, lines = load_rows(name, config, keep_row=lambda dd: True)
        if test_split in dd:
            return dd[test_split], Where(name, lines)
        if len(dd) == 1:
            return next(iter(dd.values())), Where(name, lines)
        raise DatasetError(f"{name} has no split {test_split!r} to evaluate on; splits: {', '.join(dd)}. "
                           "Set dataset_test_split=<one of them>")

    def _examples(self, rows, prompt_col: str, answer_col: str, split: str, where) -> list[Example]:
        from rlvr.tasks.dataset import examples_of

        out = []
        for ex in examples_of(rows, prompt_col, answer_col, split, where):
            prompt = self.template.format(problem=ex.prompt.strip()) if isinstance(ex.prompt, str) else ex.prompt
            out.append(Example(prompt=prompt, answer=ex.answer, columns=ex.columns))
        return out


GSM8K = Preset("gsm8k", "numeric_accuracy", "openai/gsm8k", "main", "train", "test",
               ("question", "problem", "prompt"), ("answer",), GSM8K_TEMPLATE)
MATH500 = Preset("math500", "accuracy", "HuggingFaceH4/MATH-500", None, None, "test",
                 ("problem", "question", "prompt"), ("answer", "solution"), MATH_TEMPLATE)
AIME = Preset("aime", "numeric_accuracy", "HuggingFaceH4/aime_2024", None, None, "train",
              ("problem", "Problem", "question", "prompt"), ("answer", "Answer"), AIME_TEMPLATE)
PRESETS = (GSM8K, MATH500, AIME)
