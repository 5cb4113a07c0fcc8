r"""An LLM judge as a reward: a generative model asked a rubric about each completion.

    reward_funcs: [judge]
    reward_args: {judge: {base_url: "http://localhost:8000/v1"}}  # an OpenAI-compatible server: vllm serve, rlvr vllm-serve
    reward_args: {judge: {model: ./my-judge}}                      # or a local model (a path, a Hub id, default)

For tasks without an exact checker, or as a second opinion (reward_audit=judge).  Each completion is
put into the rubric, a text with the placeholders {prompt}, {completion} (required) and {answer}
(the reference); the default asks whether the completion's final answer is equivalent to the
reference.  The judge's reply is read strictly: its last non-empty line must be `VERDICT: yes`
(1.0), `VERDICT: no` (0.0) or `SCORE: <a number from 0 to 1>`; anything else is None and counted
(errors, and judge/unparsed), never a silent 0 or 1.

- endpoint (base_url): POST <base_url>/chat/completions, temperature 0, `max_concurrency` requests at
  once, each bounded by `timeout` seconds (past it: None, counted in timeouts); an HTTP error, a
  malformed reply or a refused connection is None, counted in errors.  `model` is the served model's
  name (default: the first the endpoint lists).  Before the run's model loads, the endpoint must answer.
- local model: loaded once per process on `device` (auto: the GPU this process trains on, else the
  CPU), greedy, `batch_size` rubrics at a time, in the trainer's process (a judge model of your
  policy's base: give its path).

Verdicts are cached per process by (judge, filled rubric), so a completion seen again (a prompt
sampled twice, an evaluation) is not asked again.  Each call logs judge/calls (requests or
generations made), judge/cached, judge/tokens (the endpoint's usage, or the local model's prompt and
reply tokens) and judge/seconds.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from rlvr.types import ScoreList, completion_text

RUBRIC = """You are grading an answer to a problem against the reference answer.

Problem:
{prompt}

Reference answer:
{answer}

Answer to grade:
{completion}

Is the final answer of the answer to grade equivalent to the reference answer? Judge only the final \
answer, not the working. Reply with exactly one line: VERDICT: yes, or VERDICT: no."""
PLACEHOLDERS = ("{prompt}", "{completion}", "{answer}")
VERDICT = re.compile(r"^\W*verdict\W*:\W*(yes|no)\W*$", re.IGNORECASE)
SCORE = re.compile(r"^\W*score\W*:\s*([0-9]*\.?[0-9]+)\W*$", re.IGNORECASE)
CACHE_SIZE = 100_000  # verdicts kept per process
_CACHE: dict = {}
_LOCAL: dict = {}  # (model, device) -> (model, tokenizer)
_SERVED: dict = {}  # base_url -> the first model the endpoint lists


def judge(completions, prompts=None, answer=None, *, base_url: str | None = None, model: str | None = None,
          rubric: str = RUBRIC, max_concurrency: int = 8, timeout: float = 30.0, max_tokens: int = 32,
          batch_size: int = 8, device: str = "auto", **kwargs):
    """1.0 / 0.0 (or the judge's score) per completion, None where the judge gave no verdict."""
    from rlvr.rewards.calls import Logged

    _check(rubric, max_concurrency, timeout, max_tokens, batch_size)
    if not completions:
        if base_url:  # called with nothing to grade: the launch check (rewards.check_reward_args)
            served_model(base_url, min(timeout, 10.0))
        return Logged(ScoreList())
    prompts = prompts if prompts is not None else [""] * len(completions)
    answers = answer if answer is not None else [""] * len(completions)
    texts = [fill(rubric, p, c, a) for p, c, a in zip(prompts, completions, answers)]
    who = ("endpoint", base_url, model) if base_url else ("local", model or "default", device)
    start, scores, counts = time.perf_counter(), ScoreList([None] * len(texts)), {"calls": 0, "cached": 0, "tokens": 0, "unparsed": 0}
    todo = {}
    for i, text in enumerate(texts):
        if (who, text) in _CACHE:
            scores[i] = _CACHE[(who, text)]
            counts["cached"] += 1
        else:
            todo.setdefault(text, []).append(i)
    asked = list(todo)
    if base_url:
        replies = _ask_endpoint(asked, base_url, model, max_concurrency, timeout, max_tokens)
    else:
        replies = _ask_local(asked, model or "default", device, max_tokens, batch_size)
    for text, (reply, tokens, failure) in zip(asked, replies):
        counts["calls"] += 1
        counts["tokens"] += tokens
        verdict = None if failure else parse_verdict(reply)
        if failure == "timeout":
            scores.timeouts += len(todo[text])
        elif failure or verdict is None:
            scores.errors += len(todo[text])
            counts["unparsed"] += failure is None
        if verdict is not None:
            if len(_CACHE) >= CACHE_SIZE:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[(who, text)] = verdict
        for i in todo[text]:
            scores[i] = verdict
    metrics = {f"judge/{k}": [float(v)] for k, v in counts.items()}
    metrics["judge/seconds"] = [time.perf_counter() - start]
    return Logged(scores, metrics=metrics)


def fill(rubric: str, prompt, completion, answer) -> str:
    """The rubric with its placeholders replaced (only those three: a rubric may hold other braces, LaTeX's)."""
    if isinstance(prompt, list):  # a conversation: its last user message
        prompt = next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")
    values = {"{prompt}": "" if prompt is None else str(prompt), "{completion}": completion_text(completion), "{answer}": "" if answer is None else str(answer)}
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: values[m.group(0)], rubric)


def parse_verdict(reply: str | None) -> float | None:
    """The verdict of the reply's last non-empty line: VERDICT: yes / no, or SCORE: x in [0, 1]; else None."""
    lines = [line for line in (reply or "").splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1].strip()
    if m := VERDICT.match(last):
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    if (m := SCORE.match(last)) and 0.0 <= float(m.group(1)) <= 1.0:
        return float(m.group(1))
    return None


def _check(rubric: str, max_concurrency: int, timeout: float, max_tokens: int, batch_size: int) -> None:
    if not isinstance(rubric, str) or "{completion}" not in rubric:
        raise ValueError("rubric must be text with the placeholder {completion} (and may use {prompt} and {answer}); "
                         f"got {str(rubric)[:80]!r}")
    for name, value in (("max_concurrency", max_concurrency), ("max_tokens", max_tokens), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds; got {timeout!r}")


# --- an OpenAI-compatible endpoint ----------------------------------------------------------


def served_model(base_url: str, timeout: float) -> str:
    """The first model `base_url`/models lists; a ValueError when the endpoint does not answer."""
    if base_url not in _SERVED:
        try:
            with urllib.request.urlopen(f"{base_url.rstrip('/')}/models", timeout=timeout) as response:
                _SERVED[base_url] = json.loads(response.read())["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"judge endpoint {base_url} does not answer GET /models within {timeout:g} s "
                             f"({e.__class__.__name__}: {e}); start the server, or check base_url") from None
    return _SERVED[base_url]


def _ask_endpoint(texts, base_url, model, max_concurrency, timeout, max_tokens) -> list[tuple]:
    """(reply, tokens, failure) per text: failure None, "timeout" or "error"."""
    if not texts:
        return []
    try:
        name = model or served_model(base_url, timeout)
    except ValueError:
        return [(None, 0, "error")] * len(texts)
    url = f"{base_url.rstrip('/')}/chat/completions"

    def ask(text: str) -> tuple:
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": text}], "temperature": 0,
                           "max_tokens": max_tokens}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                reply = json.loads(response.read())
            usage = reply.get("usage") or {}
            return str(reply["choices"][0]["message"]["content"]), int(usage.get("total_tokens") or 0), None
        except (socket.timeout, TimeoutError):
            return None, 0, "timeout"
        except urllib.error.URLError as e:
            return None, 0, "timeout" if isinstance(e.reason, (socket.timeout, TimeoutError)) else "error"
        except (OSError, ValueError, KeyError, IndexError, TypeError):  # a refused connection, malformed JSON, no choices
            return None, 0, "error"

    with ThreadPoolExecutor(min(max_concurrency, len(texts)), thread_name_prefix="rlvr-judge") as pool:
        return list(pool.map(ask, texts))


# --- a local model --------------------------------------------------------------------------


def _ask_local(texts, name: str, device: str, max_tokens: int, batch_size: int) -> list[tuple]:
    if not texts:
        return []
    import torch

    model, tokenizer = _local(name, device)
    out = []
    for start in range(0, len(texts), batch_size):
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 if getattr(tokenizer, "chat_template", None) else t for t in texts[start:start + batch_size]]
        batch = tokenizer(chats, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        batch = batch.to(next(model.parameters()).device)
        with torch.inference_mode():
            ids = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        replies = ids[:, batch["input_ids"].shape[1]:]
        for row, mask in zip(replies, batch["attention_mask"]):
            kept = row[row != tokenizer.pad_token_id]
            out.append((tokenizer.decode(kept, skip_special_tokens=True), int(mask.sum()) + len(kept), None))
    return out


def _local(name: str, device: str):
    """(model, tokenizer) of a local judge, loaded once per process and device."""
    from rlvr.models import load_model
    from rlvr.rewards.model import torch_device

    where = torch_device(device)
    if (name, where) not in _LOCAL:
        model, tokenizer, _ = load_model(name, device=where)  # a path, a Hub id or default (models.resolve_model_path)
        _LOCAL[(name, where)] = (model.eval(), tokenizer)
    return _LOCAL[(name, where)]
