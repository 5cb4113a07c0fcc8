"""Examples from a `datasets` dataset: a hub id or a local JSONL / JSON / Parquet / CSV file.

The prompt column holds plain text or a list of chat messages ({role, content}),
as in trl-lib/DeepMath-103K.  The reference answer is copied into the column
`answer` (which the built-in rewards read); every column except the prompt
reaches the reward functions as a keyword argument, as in TRL.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlvr.types import Example
from rlvr.errors import DatasetError  # noqa: F401 - raised here, defined in the leaf errors.py

if TYPE_CHECKING:
    from rlvr.config import DataSettings

PROMPT_COLUMNS = ("prompt", "question", "problem")
ANSWER_COLUMNS = ("answer", "solution", "ground_truth")
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HOLDOUT_FRACTION = 0.1
HOLDOUT_MAX = 1000


def load_splits(data: DataSettings, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, test) examples; the test split is held out of train (drawn with `seed`) when the dataset has none."""
    train, test, where = load_split_rows(data, seed)
    prompt_col = pick_column(train.column_names, data.prompt_column, PROMPT_COLUMNS, "prompt", data.dataset)
    answer_col = pick_column(train.column_names, data.answer_column, ANSWER_COLUMNS, "answer", data.dataset, required=False)
    return examples_of(train, prompt_col, answer_col, "train", where), examples_of(test, prompt_col, answer_col, "test", where)


def load_split_rows(data: DataSettings, seed: int):
    """(train, test, where): the two splits as `datasets` datasets, the test split held out of
    train (drawn with `seed`) when the dataset has none; `where(split, row, i)` names a row for an error message."""
    return split_rows(data.dataset, data.dataset_config, data.dataset_train_split, data.dataset_test_split, seed)


def split_rows(dataset: str, config: str | None, train_split: str, test_split: str, seed: int):
    """load_split_rows for a dataset named by its arguments (a task's own hub dataset)."""
    dd, lines = load_rows(dataset, config, keep_row=lambda dd: test_split not in dd)
    if train_split not in dd:
        raise DatasetError(f"{dataset} has no split {train_split!r}; splits: {', '.join(dd)}")
    train = dd[train_split]
    if test_split in dd:
        test = dd[test_split]
    else:
        n_test = max(1, min(HOLDOUT_MAX, int(len(train) * HOLDOUT_FRACTION)))
        if len(train) < 2:
            raise DatasetError(f"{dataset} has {len(train)} rows; need at least 2 to hold out a test split")
        parts = train.train_test_split(test_size=n_test, seed=seed, shuffle=True)
        train, test = parts["train"], parts["test"]
    return train, test, Where(dataset, lines)


def load_rows(dataset: str, config: str | None, keep_row=lambda dd: False):
    """(splits, lines): every split of the dataset, each row's index in its split kept in the column
    ROW for a local JSONL file or where keep_row(splits) says so; lines: a JSONL file's line numbers."""
    import datasets

    datasets.disable_progress_bars()
    lines = check_jsonl(Path(dataset).expanduser()) if Path(dataset).suffix == ".jsonl" else None
    dd = _load(dataset, config)
    if lines is not None or keep_row(dd):  # remember where each row came from
        dd = {name: split.add_column(ROW, list(range(len(split)))) for name, split in dd.items()}
    return dd, lines


ROW = "__rlvr_row__"  # a row's index in its split as loaded, before any held-out split is drawn


class Where:
    """Names a row for an error: the file and line of a local JSONL file, else the split and row."""

    def __init__(self, dataset: str, lines: list[int] | None):
        self.dataset, self.lines = dataset, lines

    def __call__(self, split: str, row: dict, index: int) -> str:
        original = row.get(ROW, index)
        if self.lines is not None:
            return f"{self.dataset}:{self.lines[original]}"
        return f"{self.dataset}, {split} row {original}"


def check_jsonl(path: Path) -> list[int]:
    """The line number of each row of a JSONL file, after checking every line: UTF-8, a JSON
    object, and at least one row.  The first problem is an error naming the file and line."""
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    import json

    lines = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                   "save the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except ValueError as e:
                raise DatasetError(f"{path}:{number}: not valid JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{number}: each line must be a JSON object {{...}}, got {type(row).__name__}")
            lines.append(number)
    if not lines:
        raise DatasetError(f"{path} holds no rows (an empty file, or only blank lines)")
    return lines


def _load(name: str, config: str | None):
    import datasets

    path = Path(name).expanduser()
    try:
        if path.suffix in _LOCAL_FORMATS:
            if not path.is_file():
                raise DatasetError(f"dataset file not found: {path}")
            return datasets.load_dataset(_LOCAL_FORMATS[path.suffix], data_files={"train": str(path)})
        if path.is_dir():
            return datasets.load_dataset(str(path), config)
        return datasets.load_dataset(name, config)
    except DatasetError:
        raise
    except Exception as e:  # datasets raises many types; the user needs the file and the reason
        raise DatasetError(f"could not load dataset {name!r}: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def pick_column(columns, configured, candidates, what, name, required=True):
    columns = [c for c in columns if c != ROW]
    if configured is not None:
        if configured not in columns:
            raise DatasetError(f"{what}_column={configured!r} is not a column of {name}; columns: {', '.join(columns)}")
        return configured
    for c in candidates:
        if c in columns:
            return c
    if required:
        raise DatasetError(
            f"{name} has no {what} column (looked for {', '.join(candidates)}); columns: {', '.join(columns)}. "
            f"Set {what}_column=<name>"
        )
    return None


def examples_of(ds, prompt_col: str, answer_col: str | None, split: str, where) -> list[Example]:
    """Examples of the rows: the prompt column checked, the answer as a string; the other columns as they are."""
    out = []
    for i, row in enumerate(ds):
        prompt = row.get(prompt_col)
        _check_prompt(prompt, f"{where(split, row, i)}, column {prompt_col!r}")
        answer = row.get(answer_col) if answer_col else None
        answer = None if answer is None else str(answer)
        columns = {k: v for k, v in row.items() if k not in (prompt_col, ROW)}
        out.append(Example(prompt=prompt, answer=answer, columns=columns))
    return out


def examples_from_rows(rows: list, prompt_column: str | None, answer_column: str | None, name: str) -> list[Example]:
    """Examples from rows given in memory (GRPOTrainer's train_dataset / eval_dataset), with the
    same column rules and checks as a dataset loaded by name."""
    if not all(isinstance(row, dict) for row in rows):
        raise DatasetError(f"{name}: each row must be a mapping of columns, got {type(next(r for r in rows if not isinstance(r, dict))).__name__}")
    columns = list(dict.fromkeys(k for row in rows[:100] for k in row))
    prompt_col = pick_column(columns, prompt_column, PROMPT_COLUMNS, "prompt", name)
    answer_col = pick_column(columns, answer_column, ANSWER_COLUMNS, "answer", name, required=False)
    return examples_of(rows, prompt_col, answer_col, name, lambda split, row, i: f"{name} row {i}")


def _check_prompt(prompt, where: str) -> None:
    if prompt is None:
        raise DatasetError(f"{where}: missing (every row needs a prompt)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: the prompt is empty")
        return
    if isinstance(prompt, list) and prompt:
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: each chat message must be {{role: str, content: str}}, got {m!r}")
        return
    raise DatasetError(f"{where}: the prompt must be text or a list of chat messages, got {type(prompt).__name__}: {prompt!r:.80}")
