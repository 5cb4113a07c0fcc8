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
is its text followed by the end-of-turn token, so the model learns to stop.

Tokens are made as TRL's SFTTrainer and DPOTrainer make them: a chat prompt is rendered with the
generation prompt, the whole conversation (prompt and completion messages) without, and the
completion is where the two part; a text prompt and its completion (with the end-of-sequence
token) are tokenised together and parted the same way.  SFT's other formats are TRL's too: a
`text` column (`dataset_text_field`) or a `messages` conversation is trained on as a whole, every
token after the first, or with assistant_only_loss only the assistant's tokens of every turn.  A
sequence longer than max_length loses its end (truncation_mode=keep_start) or its start
(keep_end); one with no trained token left is dropped, and the run says so in one line.  With
completion_only_loss=false the prompt's tokens are trained on too: the sequence is then its first
token as the "prompt" and everything after as the "completion".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlvr.chat import render_prompt, render_prompts, to_messages, tokenize_prompts
from rlvr.tasks.dataset import ANSWER_COLUMNS, PROMPT_COLUMNS, DatasetError, pick_column
from rlvr.types import Batch, Example, Prompt, Rollout, completion_text

if TYPE_CHECKING:
    from rlvr.config import DataSettings, FinetuneSettings

COMPLETION_COLUMNS = ("completion", "solution", "answer")


@dataclass(frozen=True)
class Demonstration:
    prompt: Prompt  # what evaluation and self_samples sample from
    completion: str | list  # text, or TRL's conversational completion (assistant messages)
    whole: str | list | None = None  # TRL's language-modelling formats: a text or a conversation, trained on as a whole


@dataclass(frozen=True)
class Pair:
    prompt: Prompt
    chosen: str | list
    rejected: str | list


# (prompt ids, completion ids, mask): mask[t] says whether completion token t is trained on (None: all are)
Sequence = tuple[list[int], list[int], "list[bool] | None"]


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
    no_prompt = not any(c in columns for c in PROMPT_COLUMNS) and data.prompt_column is None
    if "messages" in columns and no_prompt:  # TRL's conversational language modelling: every turn
        def read(row, where):
            messages = _column(row, "messages", where)
            if not (isinstance(messages, list) and messages and any(isinstance(m, dict) and m.get("role") == "assistant"
                                                                    for m in messages)):
                raise DatasetError(f"{where()}: `messages` must be a list of chat messages with at least one of the assistant's")
            messages = _messages(messages, where)
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            return Demonstration(messages[:last] or messages[:1], messages[last]["content"], whole=messages)
        return read
    if finetune.dataset_text_field in columns and no_prompt:  # TRL's language modelling: the text as a whole
        def read(row, where):
            text = _column(row, finetune.dataset_text_field, where)
            if not isinstance(text, str) or not text.strip():
                raise DatasetError(f"{where()}: column {finetune.dataset_text_field!r} must hold non-empty text, got {text!r:.80}")
            return Demonstration(text, "", whole=text)
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
        if prompt_col is None:  # TRL's implicit prompt: the start chosen and rejected share
            prompt, chosen, rejected = implicit_prompt(chosen, rejected)
            if not prompt:
                raise DatasetError(f"{where()}: without a prompt column, chosen and rejected must share a beginning "
                                   "(the prompt): the same first messages, or the same first characters")
            prompt = _messages(prompt, where) if isinstance(prompt, list) else prompt
        else:
            prompt = _prompt(_column(row, prompt_col, where), where)
        return Pair(prompt, _completion(chosen, where, "chosen"), _completion(rejected, where, "rejected"))
    return read


def implicit_prompt(chosen, rejected) -> tuple:
    """(prompt, chosen, rejected): the longest start the two share (messages of a conversation, or
    characters of a text, less a space it ends with), as TRL's extract_prompt."""
    n = _common_prefix(chosen, rejected)
    if n and isinstance(chosen, str) and chosen[n - 1] == " ":  # the space goes with the completion
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


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


def _completion(value, where, column: str) -> str | list:
    """Text, or TRL's conversational form ([{"role": "assistant", "content": ...}, ...]) kept as messages."""
    if isinstance(value, list) and value and isinstance(value[-1], dict) and completion_text(value).strip():
        return _messages(value, where)
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where()}: column {column!r} must hold non-empty text (or an assistant message), got {value!r:.80}")
    return value


# --- tokens ---------------------------------------------------------------------------------

class Encoder:
    """Demonstrations and pairs as token ids, made as TRL's SFTTrainer and DPOTrainer make them (the
    module's docstring), each cut to max_length tokens by truncation_mode (max_length None: never)."""

    def __init__(self, data: DataSettings, tokenizer, eos_id: int, max_length: int | None,
                 truncation_mode: str = "keep_start", assistant_only_loss: bool = False, as_sampled: bool = False):
        """as_sampled: the completions are the model's own samples (self_samples), tokenised as the
        rollout stage had them: the prompt as sampled from, then the completion's text and eos_id."""
        self.data, self.tokenizer, self.eos_id, self.max_length = data, tokenizer, eos_id, max_length
        self.truncation_mode, self.assistant_only_loss, self.as_sampled = truncation_mode, assistant_only_loss, as_sampled
        self.dropped = 0  # rows (demonstrations or pairs) left without a trained token by max_length

    @classmethod
    def of(cls, data: DataSettings, finetune: FinetuneSettings, model, tokenizer, as_sampled: bool = False) -> Encoder:
        """The run's encoder: its max_length, truncation_mode and assistant_only_loss, completions ended
        by the tokenizer's EOS where it is one the model stops at (else the model's first)."""
        from rlvr.models import eos_token_ids

        ends = eos_token_ids(model, tokenizer)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in ends else ends[0]
        return cls(data, tokenizer, eos, finetune.max_length, finetune.truncation_mode, finetune.assistant_only_loss,
                   as_sampled=as_sampled)

    def prompts(self, prompts: list[Prompt]) -> list[list[int]]:
        """The prompts' ids as the rollout stage samples from them (chat template, system prompt, max_prompt_length)."""
        data = self.data
        texts = render_prompts(self.tokenizer, prompts, data.system_prompt, data.chat_template_kwargs, data.text_prompts == "raw")
        return tokenize_prompts(self.tokenizer, texts, data.max_prompt_length)

    def sequences(self, prompts: list[Prompt], completions: list, full_loss: bool = False,
                  wholes: list | None = None) -> list[Sequence | None]:
        """One (prompt ids, completion ids, mask) per prompt; None where max_length leaves no trained token.
        full_loss: the prompt's tokens are trained on too (completion_only_loss=false); wholes: per
        row, a text or conversation trained on as a whole (TRL's language modelling), or None."""
        out = []
        for prompt, completion, whole in zip(prompts, completions, wholes or [None] * len(prompts)):
            if whole is not None:
                ids, trained = self._whole(whole)
                start = 1
            else:
                p, ids, assistant = self._prompt_and_full(prompt, completion, self.assistant_only_loss)
                start = 1 if full_loss else len(p)
                trained = [i >= start and a for i, a in enumerate(assistant)]
            out.append(self._cut(ids, trained, start))
        self.dropped += out.count(None)
        return out

    def pairs(self, prompts: list[Prompt], chosen: list, rejected: list) -> list[tuple[Sequence, Sequence] | None]:
        """(chosen, rejected) sequences per pair, their prompt where both part from it (TRL's DPO);
        None where max_length leaves either without a completion token."""
        out = []
        for prompt, c, r in zip(prompts, chosen, rejected):
            p_c, c_ids, _ = self._prompt_and_full(prompt, c)
            p_r, r_ids, _ = self._prompt_and_full(prompt, r)
            start = min(len(p_c), len(p_r))
            seqs = [self._cut(ids, [i >= start for i in range(len(ids))], start) for ids in (c_ids, r_ids)]
            out.append(None if None in seqs else (seqs[0], seqs[1]))
        self.dropped += out.count(None)  # a pair is one row, however many of its sides are left empty
        return out

    # --- TRL's tokenisation ---------------------------------------------------------------------

    def _chat(self, messages: list, **kwargs) -> dict:
        return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  **(self.data.chat_template_kwargs or {}), **kwargs)

    def _conversational(self, prompt) -> bool:
        raw = isinstance(prompt, str) and self.data.text_prompts == "raw"
        return not raw and bool(getattr(self.tokenizer, "chat_template", None))

    def _eos(self, text: str) -> str:
        eos = self.tokenizer.decode([self.eos_id])
        return text if text.endswith(eos) else text + eos

    def _whole(self, whole) -> tuple[list[int], list[bool]]:
        """A text (with the end-of-sequence token) or a conversation; every token trained on, or with
        assistant_only_loss the assistant's."""
        if isinstance(whole, str):
            ids = list(self.tokenizer(self._eos(whole))["input_ids"])
            return ids, [True] * len(ids)
        out = self._chat(to_messages(whole, self.data.system_prompt), return_assistant_tokens_mask=self.assistant_only_loss)
        ids = list(out["input_ids"])
        return ids, self._assistant(out, len(ids))

    def _assistant(self, out: dict, n: int) -> list[bool]:
        if not self.assistant_only_loss:
            return [True] * n
        mask = [bool(m) for m in out.get("assistant_masks") or []]
        if not any(mask):
            raise DatasetError("assistant_only_loss=true, but the chat template marks no assistant token: it needs "
                               "{% generation %} ... {% endgeneration %} around the assistant's messages")
        return mask

    def _prompt_and_full(self, prompt, completion, assistant_only: bool = False) -> tuple[list[int], list[int], list[bool]]:
        """(prompt ids, prompt + completion ids, assistant mask over the latter); the completion starts
        where the two part (TRL's common_prefix_length)."""
        if self.as_sampled:
            p = self.prompts([prompt])[0]
            ids = p + self.tokenizer(completion_text(completion), add_special_tokens=False)["input_ids"] + [self.eos_id]
            return p, ids, [True] * len(ids)
        if self._conversational(prompt):
            messages = to_messages(prompt, self.data.system_prompt)
            tail = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            p = list(self._chat(messages, add_generation_prompt=True)["input_ids"])
            out = self._chat(messages + tail, return_assistant_tokens_mask=assistant_only)
            ids = list(out["input_ids"])
            assistant = self._assistant(out, len(ids)) if assistant_only else [True] * len(ids)
        else:
            text = prompt if isinstance(prompt, str) else render_prompt(self.tokenizer, prompt, self.data.system_prompt)
            completion = completion if isinstance(completion, str) else completion_text(completion)
            p = list(self.tokenizer(text)["input_ids"])
            ids = list(self.tokenizer(text + self._eos(completion))["input_ids"])
            assistant = [True] * len(ids)
        n = _common_prefix(p, ids)
        if self.data.max_prompt_length is not None and n > self.data.max_prompt_length:  # rlvr's: cut from the left
            cut = n - self.data.max_prompt_length
            p, ids, assistant, n = p[cut:n], ids[cut:], assistant[cut:], n - cut
        return p[:n], ids, assistant

    def _cut(self, ids: list[int], trained: list[bool], start: int) -> Sequence | None:
        """ids cut to max_length by truncation_mode, as (ids before start, the rest, mask of the rest);
        None when no trained token is left (the first token is never one: nothing predicts it)."""
        if self.max_length is not None and len(ids) > self.max_length:
            if self.truncation_mode == "keep_end":
                cut = len(ids) - self.max_length
                ids, trained, start = ids[cut:], trained[cut:], max(start - cut, 1)
            else:
                ids, trained = ids[: self.max_length], trained[: self.max_length]
        start = max(1, min(start, len(ids)))
        mask = trained[start:]
        if not any(mask):
            return None
        return ids[:start], ids[start:], None if all(mask) else mask


def _common_prefix(a, b) -> int:
    """How many items (token ids, messages, characters) a and b share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def to_batch(sequences: list[Sequence], pad_id: int, group_size: int | None = None) -> Batch:
    """An update Batch of these sequences (every completion token trained on); with group_size,
    rows i*g .. i*g+g-1 share their prompt (a DPO pair), which the fast path then runs once."""
    rollouts = [Rollout(p, c, [], "stop", "", mask=m) for p, c, m in sequences]
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
