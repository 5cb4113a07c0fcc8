"""reasoning-gym's procedural tasks (https://github.com/open-thought/reasoning-gym): over a hundred
generators (basic_arithmetic, leg_counting, spell_backward, sudoku, ...) with their own verifiers.

Needs the package: pip install 'rlvr[reasoning-gym]'.  Examples come from
`reasoning_gym.create_dataset(name, size=num_test + num_train, seed=seed, **config)`: the first
num_test entries are the test split, the rest the train split, less any entry whose question is
also a test question.  The prompt is the entry's question and an instruction to answer inside
<answer> </answer>; the entry's question, answer and metadata reach the `reasoning_gym` reward as
columns, which scores with the dataset's own `score_answer`.  task_args:

    name       the dataset, e.g. basic_arithmetic (required)
    num_train  train problems                                default 1000
    num_test   test problems                                 default 100
    seed       the dataset's seed (default: the run's seed)
    any other key is the dataset's own setting, e.g. {name: basic_arithmetic, min_terms: 2, max_terms: 3}
"""

from __future__ import annotations

import dataclasses
import difflib

from rlvr.types import Example

DEFAULTS = {"name": None, "num_train": 1000, "num_test": 100, "seed": None}
INSTRUCTION = "Give only your final answer inside <answer> </answer>."
INSTALL = "pip install 'rlvr[reasoning-gym]'"


def registry() -> dict:
    """reasoning-gym's datasets by name: (dataset class, config class); a ValueError naming the
    extra to install when the package is missing."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(f"task=reasoning_gym needs the reasoning-gym package: {INSTALL}") from None
    return DATASETS


class ReasoningGymTask:
    name = "reasoning_gym"
    verifier = "reasoning_gym"

    @staticmethod
    def check_available() -> None:
        registry()

    @staticmethod
    def check_args(args: dict) -> dict:
        a = {**DEFAULTS, **args}
        datasets = registry()
        name = a["name"]
        if name is None:
            raise ValueError(f"name is required: one of reasoning-gym's {len(datasets)} datasets, e.g. {_examples(datasets)}")
        if not isinstance(name, str) or name not in datasets:
            close = difflib.get_close_matches(str(name), list(datasets), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ValueError(f"unknown reasoning-gym dataset {name!r}; {hint}valid names include {_examples(datasets)} "
                             f"({len(datasets)} in all: python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
        for key in ("num_train", "num_test"):
            if not isinstance(a[key], int) or isinstance(a[key], bool) or a[key] < 1:
                raise ValueError(f"{key} must be a positive integer, got {a[key]!r}")
        if a["seed"] is not None and (not isinstance(a["seed"], int) or isinstance(a["seed"], bool)):
            raise ValueError(f"seed must be an integer or null, got {a['seed']!r}")
        if "size" in a:
            raise ValueError("set num_train and num_test, not size (the dataset is made with size = num_test + num_train)")
        fields = [f.name for f in dataclasses.fields(datasets[name][1]) if f.name not in ("size", "seed")]
        config = dataset_config(a)
        unknown = sorted(set(config) - set(fields))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} for reasoning-gym's {name}; its settings: {', '.join(fields) or 'none'} "
                             f"(and {', '.join(DEFAULTS)})")
        try:
            make_dataset(name, config, size=1, seed=0)  # the dataset's own checks of its settings
        except Exception as e:
            raise ValueError(f"reasoning-gym's {name} refuses {config}: {e.__class__.__name__}: {e}") from None
        return a

    @classmethod
    def reward_args(cls, args: dict) -> dict:
        return {}

    @classmethod
    def splits(cls, args: dict, seed: int) -> tuple[list[Example], list[Example]]:
        a = cls.check_args(args)
        name, config = a["name"], dataset_config(a)
        dataset = make_dataset(name, config, size=a["num_test"] + a["num_train"], seed=seed if a["seed"] is None else a["seed"])
        entries = [dataset[i] for i in range(len(dataset))]
        test = entries[: a["num_test"]]
        asked = {e["question"] for e in test}
        train = [e for e in entries[a["num_test"]:] if e["question"] not in asked]
        return [_example(e, name, config) for e in train], [_example(e, name, config) for e in test]


def dataset_config(args: dict) -> dict:
    """The dataset's own settings: the task_args other than rlvr's."""
    return {k: v for k, v in args.items() if k not in DEFAULTS}


def make_dataset(name: str, config: dict, size: int, seed: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)


def _examples(datasets: dict) -> str:
    simple = [n for n in ("basic_arithmetic", "leg_counting", "chain_sum", "spell_backward", "countdown") if n in datasets]
    return ", ".join(simple or sorted(datasets)[:5])


def _example(entry: dict, name: str, config: dict) -> Example:
    answer = entry.get("answer")
    columns = {"question": entry["question"], "answer": answer, "metadata": entry.get("metadata", {}),
               "rg_dataset": name, "rg_config": dict(config)}
    return Example(prompt=f"{entry['question'].rstrip()}\n\n{INSTRUCTION}", answer=answer, columns=columns)
