"""What SFT and DPO train on, and how it becomes token batches.

A *demonstration* is a prompt with a completion to imitate; a *pair* is a prompt with a chosen
and a rejected completion.  They come from:

- a dataset (`dataset=`): for SFT a prompt column (prompt, question, problem) with a completion
  column (`completion_column`, default the first of completion, solution, answer: GSM8K's worked
  `answer`, MATH's `solution`), or a chat `messages` column whose last message is the
  assistant's; for DPO TRL's prompt / chosen / rejected columns (text, or message lists);
- a built-in task, whose worked solutions (`Task.solution`) are the demonstrations;
- the model itself (`self_samples`): G samples per prompt scored by the task's verifier, the
  correct ones kept (rejection-sampling fine-tuning) or paired with incorrect ones (on-policy DPO).

Prompts are rendered exactly as `rlvr train` and `rlvr eval` render them (chat template, system
prompt, text_prompts), so the model is trained in the format it is evaluated in; a completion
is its text followed by the end-of-turn token, so the model learns to stop.  A sequence longer
than max_length keeps its prompt (already cut from the left to max_prompt_length) and loses the
end of its completion.  With completion_only_loss=false the prompt's tokens are trained on too:
the sequence is then its first token as the "prompt" and everything after as the "completion".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlvr.chat import render_prompts, tokenize_prompts
from rlvr.tasks.dataset import ANSWER_COLUMNS, PROMPT_COLUMNS, DatasetError, pick_column
from rlvr.types import Batch, Example, Prompt, Rollout, completion_text

if TYPE_CHECKING:
    from rlvr.config import DataSettings, FinetuneSettings

COMPLETION_COLUMNS = ("completion", "solution", "answer")


@dataclass(frozen=True)
class Demonstration:
    prompt: Prompt
    completion: str


@dataclass(frozen=True)
class Pair:
    prompt: Prompt
    chosen: str
    rejected: str


Sequence = tuple[list[int], list[int]]  # (prompt ids, completion ids)


# --- from a dataset or a task ----------------------------------------------------------------

def load_data(data: DataSettings, finetune: FinetuneSettings, seed: int, objective: str,
              rows=None) -> tuple[list, list[Example], list[Example]]:
    """(train demonstrations or pairs, train examples, test examples).  The examples (prompt,
    answer, columns) are what the verifier and evaluation use; with self_samples, the train
    examples are the prompts sampled from and the first list is empty.  `rows`: the train rows
    given as objects (SFTTrainer / DPOTrainer), then the test examples are empty.  `objective`: the
    method (methods.py), which says whether its data are demonstrations or preference pairs.  `seed`
    (the run's) draws a task's problems and a held-out test split."""
    from rlvr.methods import get as get_method
    from rlvr.tasks import TASKS, load_splits

    pairs = get_method(objective).pairs

    if rows is None and not data.dataset:
        train, test = load_splits(data, seed)
        if finetune.self_samples:
            return [], train, test
        if pairs:
            raise DatasetError(f"rlvr dpo on the built-in task {data.task!r} builds its pairs from the model's own samples: "
                               "set self_samples=true, or dataset=<file with prompt, chosen, rejected columns>")
        task = TASKS[data.task]
        if not hasattr(task, "solution"):
            raise DatasetError(f"the built-in task {data.task!r} has no worked solutions to imitate: use self_samples=true "
                               "(rejection-sampling fine-tuning) or dataset=<file with prompt and completion columns>")
        return [Demonstration(ex.prompt, task.solution(ex)) for ex in train], train, test
    if rows is not None:
        train_rows, test_rows, where = list(rows), [], (lambda split, row, i: f"train_dataset row {i}")
    else:
        from rlvr.tasks.dataset import load_split_rows

        train_rows, test_rows, where = load_split_rows(data, seed)
    columns = list(train_rows.column_names) if hasattr(train_rows, "column_names") else \
        list(dict.fromkeys(k for row in train_rows[:100] for k in row))
    name = data.dataset or "train_dataset"
    if not train_rows:
        raise DatasetError(f"{name} has no train rows")
    read = _pair_reader(data, columns, name) if pairs and not finetune.self_samples else _demo_reader(data, finetune, columns, name)
    answer_col = pick_column(columns, data.answer_column, ANSWER_COLUMNS, "answer", name, required=False)
    train, train_examples, test_examples = [], [], []
    for split, split_rows, examples in (("train", train_rows, train_examples), ("test", test_rows, test_examples)):
        for i, row in enumerate(split_rows):
            item = read(row, lambda: where(split, row, i))
            if split == "train":
                train.append(item)
            answer = row.get(answer_col) if answer_col else None
            answer = None if answer is None else str(answer)
            examples.append(Example(item.prompt, answer, {**{k: v for k, v in row.items() if not k.startswith("__")},
                                                           "answer": answer}))
    return ([] if finetune.self_samples else train), train_examples, test_examples


def _demo_reader(data: DataSettings, finetune: FinetuneSettings, columns: list[str], name: str):
    if "messages" in columns and not any(c in columns for c in PROMPT_COLUMNS) and data.prompt_column is None:
        def read(row, where):
            messages = _column(row, "messages", where)
            if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)
                    and messages[-1].get("role") == "assistant" and len(messages) >= 2):
                raise DatasetError(f"{where()}: `messages` must be a list of chat messages ending with the assistant's")
            return Demonstration(_messages(messages[:-1], where), str(messages[-1].get("content") or ""))
        return read
    prompt_col = pick_column(columns, data.prompt_column, PROMPT_COLUMNS, "prompt", name)
    completion_col = None if finetune.self_samples else \
        pick_column(columns, finetune.completion_column, COMPLETION_COLUMNS, "completion", name)

    def read(row, where):
        prompt = _prompt(_column(row, prompt_col, where), where)
        if completion_col is None:
            return Demonstration(prompt, "")
        completion = _completion(_column(row, completion_col, where), where, completion_col)
        return Demonstration(prompt, completion)
    return read


def _pair_reader(data: DataSettings, columns: list[str], name: str):
    for col in ("chosen", "rejected"):
        if col not in columns:
            raise DatasetError(f"{name} has no {col!r} column (DPO needs prompt, chosen and rejected; columns: "
                               f"{', '.join(columns)}), or build the pairs from the model's own samples: self_samples=true")
    prompt_col = pick_column(columns, data.prompt_column, PROMPT_COLUMNS, "prompt", name, required=False)

    def read(row, where):
        chosen, rejected = _column(row, "chosen", where), _column(row, "rejected", where)
        if prompt_col is None:  # TRL's implicit prompt: two conversations that differ in their last message
            if not (isinstance(chosen, list) and isinstance(rejected, list) and chosen[:-1] == rejected[:-1] and chosen[:-1]):
                raise DatasetError(f"{where()}: without a prompt column, chosen and rejected must be conversations "
                                   "that share every message but the last")
            prompt = _messages(chosen[:-1], where)
        else:
            prompt = _prompt(_column(row, prompt_col, where), where)
        return Pair(prompt, _completion(chosen, where, "chosen"), _completion(rejected, where, "rejected"))
    return read


def _column(row: dict, column: str, where):
    """The row's value in `column`; a row without one (a column the first rows have) is an error naming it."""
    if row.get(column) is None:
        raise DatasetError(f"{where()}, column {column!r}: missing (every row needs one)")
    return row[column]


def _prompt(value, where) -> Prompt:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value:
        return _messages(value, where)
    raise DatasetError(f"{where()}: the prompt must be non-empty text or a list of chat messages, got {value!r:.80}")


def _messages(messages: list, where) -> list:
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DatasetError(f"{where()}: each chat message must be {{role: str, content: str}}, got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _completion(value, where, column: str) -> str:
    if isinstance(value, list):  # TRL's conversational form: [{"role": "assistant", "content": ...}]
        value = completion_text(value) if value and isinstance(value[-1], dict) else None
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where()}: column {column!r} must hold non-empty text (or an assistant message), got {value!r:.80}")
    return value


# --- tokens ---------------------------------------------------------------------------------

class Encoder:
    """Prompts and completions as token ids, the way rollouts and evaluation see them: prompts by
    the data settings, a prompt + completion cut to max_length tokens (None: not cut)."""

    def __init__(self, data: DataSettings, tokenizer, eos_id: int, max_length: int | None):
        self.data, self.tokenizer, self.eos_id, self.max_length = data, tokenizer, eos_id, max_length
        self.dropped = 0  # sequences with no room for a completion token under max_length

    def prompts(self, prompts: list[Prompt]) -> list[list[int]]:
        data = self.data
        texts = render_prompts(self.tokenizer, prompts, data.system_prompt, data.chat_template_kwargs, data.text_prompts == "raw")
        return tokenize_prompts(self.tokenizer, texts, data.max_prompt_length)

    def completion(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_id]

    def sequences(self, prompts: list[Prompt], completions: list[str], full_loss: bool = False) -> list[Sequence | None]:
        """One (prompt ids, completion ids) per prompt; None where max_length leaves no completion token.
        full_loss: the prompt's tokens are trained on too (completion_only_loss=false)."""
        out = []
        for p, text in zip(self.prompts(prompts), completions):
            c = self.completion(text)
            if self.max_length is not None:
                c = c[: self.max_length - len(p)]
            if not c:
                self.dropped += 1
                out.append(None)
                continue
            out.append(([p[0]], p[1:] + c) if full_loss else (p, c))
        return out


def to_batch(sequences: list[Sequence], pad_id: int, group_size: int | None = None) -> Batch:
    """An update Batch of these sequences (every completion token trained on); with group_size,
    rows i*g .. i*g+g-1 share their prompt (a DPO pair), which the fast path then runs once."""
    rollouts = [Rollout(p, c, [], "stop", "") for p, c in sequences]
    n = len(rollouts)
    return Batch.from_rollouts(rollouts, torch.zeros(n), torch.ones(n, dtype=torch.bool), pad_id, False, group_size)


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of `lengths` in bins whose totals stay within capacity
    (a longer item gets a bin of its own).  Sequences are never split, and the fast path keeps
    the sequences of a bin apart, so packing changes how many fit in a micro-batch, not the loss."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            best = min(fits, key=lambda b: room[b])
            bins[best].append(i)
            room[best] -= lengths[i]
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


# --- the model's own samples --------------------------------------------------------------

def keep_correct(prompts_and_groups, verifier_scores: list[list]) -> list[tuple[int, str]]:
    """Rejection sampling: (prompt index, completion) for each distinct completion the verifier
    scored 1 (exactly: a partial score is not correct).  `prompts_and_groups`: per prompt, its
    completions' texts; `verifier_scores`: per prompt, the verifier's score of each (None: unscorable)."""
    kept = []
    for i, (texts, scores) in enumerate(zip(prompts_and_groups, verifier_scores)):
        seen = set()
        for text, score in zip(texts, scores):
            if score == 1 and text not in seen:
                seen.add(text)
                kept.append((i, text))
    return kept


def make_pairs(prompts_and_groups, verifier_scores: list[list]) -> list[tuple[int, str, str]]:
    """On-policy preference pairs: per prompt, its distinct correct completions (score 1) each
    paired with a distinct incorrect one (score 0 or unscorable) in order, as many pairs as the
    smaller side has; a prompt whose samples are all correct or all wrong gives none."""
    pairs = []
    for i, (texts, scores) in enumerate(zip(prompts_and_groups, verifier_scores)):
        good = list(dict.fromkeys(t for t, s in zip(texts, scores) if s == 1))
        bad = list(dict.fromkeys(t for t, s in zip(texts, scores) if s != 1 and t not in good))
        pairs += [(i, g, b) for g, b in zip(good, bad)]
    return pairs
