"""Multi-turn rollouts: the loss mask of a hand-built trajectory, tools that misbehave, malformed
calls, environments, rollout_func, and runs on the tiny model."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

import pytest
import torch

from rlvr.config import ConfigError, build_config
from rlvr.environments import Step, ToolEnvironment
from rlvr.losses import LossNorm, policy_loss
from rlvr.rollout import RolloutError, SamplingParams
from rlvr.rollout.multiturn import MultiTurn
from rlvr.tools import ToolBox, calculator, parse_tool_calls
from rlvr.types import Batch, Example, Rollout

CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*/=?.,:;_'\"(){}[]\\<>\n")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from conftest import make_tokenizer

    return make_tokenizer(CHARS)  # it can spell JSON; ChatML without tool support


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    from conftest import save_tiny_model

    return save_tiny_model(tok, tmp_path_factory.mktemp("tiny-json"))


class ScriptedSampler:
    """Writes the given turns in order, whatever the prompt (each call: the next turn for every
    prompt); records the prompts it was given."""

    def __init__(self, tokenizer, turns: list[str], eos_after: set[int] = frozenset()):
        self.tokenizer, self.turns, self.eos_after, self.calls = tokenizer, turns, eos_after, []
        self.eos = [tokenizer.eos_token_id]

    def generate(self, prompt_ids, params, generator=None):
        k = len(self.calls)
        self.calls.append(prompt_ids)
        ids = self.tokenizer(self.turns[k], add_special_tokens=False)["input_ids"]
        if k in self.eos_after:
            ids = ids + self.eos
        ids = ids[: params.max_tokens]
        finish = "length" if len(ids) == params.max_tokens and k not in self.eos_after else "stop"
        text = self.turns[k]
        return [[Rollout(list(p), list(ids), [-0.5] * len(ids), finish, text) for _ in range(params.n)] for p in prompt_ids]


def _cfg(**settings):
    return build_config({"tools": ["calculator"], "max_completion_length": 200, **settings})


def _sections(cfg):
    """What MultiTurn is given: the rollout and data sections of the run's settings."""
    return cfg.rollout_settings, cfg.data_settings


def test_a_two_turn_trajectory_masks_the_tool_output_out_of_the_loss(tok):
    cfg = _cfg()
    multi = MultiTurn(*_sections(cfg), tok, lambda: ToolEnvironment(ToolBox(["calculator"])), ToolBox(["calculator"]).schemas)
    sampler = ScriptedSampler(tok, [CALL, "so \\boxed{42}"], eos_after={1})
    texts, groups = multi.generate(sampler, [Example("What is 6*7?")], ["What is 6*7?"], SamplingParams(n=2, max_tokens=200), None)
    r = groups[0][0]
    first = tok(CALL, add_special_tokens=False)["input_ids"]
    second = tok("so \\boxed{42}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    between = tok("<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert r.completion_ids == first + between + second  # the template's own markers around the tool's answer
    assert r.mask == [True] * len(first) + [False] * len(between) + [True] * len(second)
    assert r.text == "so \\boxed{42}" and r.info["turns"] == 2 and r.info["tool_calls"] == 1 and r.info["tool_errors"] == 0
    assert [m["role"] for m in r.messages] == ["assistant", "tool", "assistant"] and r.messages[1]["content"] == "42"
    # the second turn was sampled from the whole history: prompt, call, tool message, assistant header
    assert sampler.calls[1][0] == r.prompt_ids + first + between
    assert "calculator" in texts[0] and "<tool_call>" in texts[0]  # the template ignores tools: a system message shows them

    batch = Batch.from_rollouts(groups[0], torch.tensor([1.0, -0.5]), torch.ones(2, dtype=torch.bool), tok.pad_token_id, False, 2)
    assert batch.num_tokens == 2 * (len(first) + len(second))
    assert batch.completion_mask.all()  # the model still reads the tool's tokens
    # Only the policy's tokens count: the tool's tokens get old log-probs 3 nats away (a ratio far outside
    # the clip range), which would move the loss if they were counted; they change neither loss nor gradient.
    n = len(first) + len(between) + len(second)
    hole = slice(len(first), len(first) + len(between))
    logp = torch.full((2, n), -0.7, requires_grad=True)
    old = torch.full((2, n), -0.7)
    old[0] += 0.1  # row 0: ratio exp(-0.1) = 0.905, inside [0.8, 1.2]
    old[1] -= 0.2  # row 1: ratio exp(0.2) = 1.221, above 1.2
    old[:, hole] += 3.0
    norm = LossNorm(2, batch.num_tokens, 200, 1)
    loss, _ = policy_loss(logp, old, batch.advantages, batch.loss_mask, norm, loss_type="grpo")
    loss.backward()
    assert torch.all(logp.grad[:, hole] == 0) and torch.all(logp.grad[:, : len(first)] != 0)
    # GRPO by hand, each row the mean of its policy tokens' -min(A r, A clip(r)), then the mean of the rows:
    # row 0 (A = 1, r = 0.904837) gives -0.904837; row 1 (A = -0.5) keeps the unclipped, larger
    # 0.5 x 1.221403 = 0.610701 (the clip is pessimistic); (-0.904837 + 0.610701) / 2 = -0.147068.
    assert loss.item() == pytest.approx(-0.147068, abs=1e-5)
    # the gradient at a row-0 policy token: d(-A r)/d logp / tokens = -0.904837 / (len(first) + len(second)) / 2 rows
    assert logp.grad[0, 0].item() == pytest.approx(-0.904837 / (len(first) + len(second)) / 2, rel=1e-4)


def test_a_turn_that_ends_at_eos_gets_no_second_end_marker(tok):
    multi = MultiTurn(*_sections(_cfg()), tok, lambda: ToolEnvironment(ToolBox(["calculator"])), None)
    sampler = ScriptedSampler(tok, [CALL, "done"], eos_after={0, 1})
    _, groups = multi.generate(sampler, [Example("q")], ["q"], SamplingParams(n=1, max_tokens=200), None)
    r = groups[0][0]
    text = tok.decode(r.completion_ids)
    assert "</tool_call><|im_end|>\n<|im_start|>tool\n42<|im_end|>" in text and "<|im_end|><|im_end|>" not in text


def test_the_budget_covers_turns_and_observations_together(tok):
    multi = MultiTurn(*_sections(_cfg(max_completion_length=len(CALL) + 10)), tok, lambda: ToolEnvironment(ToolBox(["calculator"])), None)
    sampler = ScriptedSampler(tok, [CALL, "never sampled"])
    _, groups = multi.generate(sampler, [Example("q")], ["q"], SamplingParams(n=1, max_tokens=len(CALL) + 10), None)
    r = groups[0][0]
    assert r.finish_reason == "length" and len(sampler.calls) == 1  # no room for the tool's answer and a reply
    assert len(r.completion_ids) <= len(CALL) + 10


def test_max_turns_ends_a_rollout_that_keeps_calling(tok):
    multi = MultiTurn(*_sections(_cfg(max_turns=3, max_completion_length=1000)), tok, lambda: ToolEnvironment(ToolBox(["calculator"])), None)
    sampler = ScriptedSampler(tok, [CALL] * 5)
    _, groups = multi.generate(sampler, [Example("q")], ["q"], SamplingParams(n=1, max_tokens=1000), None)
    assert groups[0][0].info["turns"] == 3 and len(sampler.calls) == 3 and groups[0][0].info["tool_calls"] == 3


def test_a_template_with_tool_support_shows_the_tools_and_one_without_a_tool_role_gets_a_user_message(tok):
    """Qwen-like: the template renders `tools` itself and refuses a role it does not know; the tool's
    answer then comes back as a user message in <tool_response> tags."""
    from transformers import PreTrainedTokenizerFast

    qwenish = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, pad_token="<pad>", eos_token="<|im_end|>",
                                      bos_token="<|im_start|>", unk_token="<unk>")
    qwenish.chat_template = (
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    box = ToolBox(["calculator"])
    multi = MultiTurn(*_sections(_cfg()), qwenish, lambda: ToolEnvironment(box), box.schemas)
    texts, groups = multi.generate(ScriptedSampler(qwenish, [CALL, "42"], eos_after={1}), [Example("q")], ["q"],
                                   SamplingParams(n=1, max_tokens=200), None)
    assert texts[0].startswith("<|im_start|>system\nTools: [{") and "To call one, write" not in texts[0]
    text = qwenish.decode(groups[0][0].completion_ids)
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n42" in text


def test_raw_prompts_get_the_tool_answer_in_tags(tok):
    box = ToolBox(["calculator"])
    multi = MultiTurn(*_sections(_cfg(text_prompts="raw")), tok, lambda: ToolEnvironment(box), box.schemas)
    texts, groups = multi.generate(ScriptedSampler(tok, [CALL, "42"]), [Example("Q: 6*7?")], ["Q: 6*7?"],
                                   SamplingParams(n=1, max_tokens=200), None)
    assert texts[0].endswith("Q: 6*7?") and "calculator" in texts[0]
    assert tok.decode(groups[0][0].completion_ids) == CALL + "\n<tool_response>\n42\n</tool_response>\n42"


# --- tools that misbehave, calls that are malformed ------------------------------------------

def hangs(seconds: int) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def crashes(x: int) -> str:
    """Fail.

    Args:
        x: Anything.
    """
    raise ValueError(f"bad x {x}")


def floods(n: int) -> str:
    """Return a lot.

    Args:
        n: Characters.
    """
    return "y" * n


@pytest.mark.processes
def test_a_tool_that_hangs_crashes_or_floods_returns_a_message_and_the_run_goes_on():
    box = ToolBox([hangs, crashes, floods], timeout=0.5, max_output_chars=100)
    t0 = time.perf_counter()
    out, ok = box.run(parse_tool_calls('<tool_call>{"name": "hangs", "arguments": {"seconds": 30}}</tool_call>')[0])
    assert not ok and "ran past 0.5 s" in out and time.perf_counter() - t0 < 20  # not the 30 s
    out, ok = box.run(parse_tool_calls('<tool_call>{"name": "crashes", "arguments": {"x": 3}}</tool_call>')[0])
    assert (out, ok) == ("Error: ValueError: bad x 3", False)
    out, ok = box.run(parse_tool_calls('<tool_call>{"name": "floods", "arguments": {"n": 10000000}}</tool_call>')[0])
    assert ok and out == "y" * 75 + "\n[output cut: 9999900 characters]\n" + "y" * 25


def backtracks(text: str) -> str:
    """Match a pattern that backtracks for hours inside re's C code, holding the GIL.

    Args:
        text: Anything.
    """
    return str(re.match(r"(a+)+$", "a" * 40 + "b"))


def spins(n: int) -> str:
    """Loop forever in Python.

    Args:
        n: Anything.
    """
    while True:
        n += 1


def _call(name: str, **arguments):
    return parse_tool_calls("<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>")[0]


@pytest.mark.processes
def test_a_tool_that_holds_the_gil_is_stopped_at_tool_timeout_and_leaks_nothing():
    box = ToolBox([backtracks, spins], timeout=0.5)
    assert box.run(_call("backtracks", text="a")) == ("Error: backtracks ran past 0.5 s and was stopped waiting for", False)
    box.timeout = 0.1
    threads = threading.active_count(), len(os.listdir("/proc/self/task"))
    for _ in range(20):
        assert box.run(_call("spins", n=1)) == ("Error: spins ran past 0.1 s and was stopped waiting for", False)
    assert (threading.active_count(), len(os.listdir("/proc/self/task"))) == threads
    assert box.worker.pid is None  # the last one was killed with its call, not left spinning


def test_a_deeply_nested_tool_call_is_a_malformed_call():
    deep = "[" * 100_000 + "]" * 100_000
    for text in ('<tool_call>{"name": "calculator", "arguments": ' + deep + "}</tool_call>",
                 '<tool_call>{"name": "calculator", "arguments": ' + json.dumps(deep) + "}</tool_call>"):
        (call,) = parse_tool_calls(text)
        out, ok = ToolBox(["calculator"]).run(call)
        assert not ok and out.startswith("Error: ") and "\n" not in out


def test_the_python_tool_is_refused_before_the_model_loads_where_no_sandbox_works(monkeypatch):
    import rlvr.sandbox
    from rlvr.distributed import World
    from rlvr.settings import check_runnable
    from rlvr.tools import ToolError

    monkeypatch.setattr(rlvr.sandbox, "isolation_method", lambda: None)
    with pytest.raises(ToolError, match="the python tool runs the model's code in a sandbox, and none works") as refused:
        ToolBox(["python", "calculator"])
    assert "apt-get install bubblewrap" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="install bubblewrap"):
        check_runnable(build_config({"tools": ["python"]}), World())
    assert ToolBox(["calculator"]).run(_call("calculator", expression="6*7")) == ("42", True)
    ToolBox(["python"], allow_unisolated=True)  # the caller's own risk, as run_python's


@pytest.mark.processes
def test_the_python_tool_runs_in_the_sandbox_with_limits():
    box = ToolBox(["python"], timeout=2, max_output_chars=400)
    run = lambda code: box.run(parse_tool_calls("<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}})  # noqa: E731
                                                + "</tool_call>")[0])
    assert run("print(6 * 7)") == ("42", True)
    out, ok = run("print('z' * 10_000_000)")  # 10 MB: stopped at the sandbox's output cap, cut for the model
    assert out.startswith("z" * 300) and "[output cut:" in out and len(out) < 500
    t0 = time.perf_counter()
    out, ok = run("while True: pass")
    assert not ok and "ran past 2 s" in out and time.perf_counter() - t0 < 15
    readme = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "README.md")
    out, ok = run(f"print(open({readme!r}).read()[:20])")  # the sandbox holds no project files
    assert not ok and "No such file or directory" in out, out
    out, ok = run("raise SystemExit(3)")
    assert (out, ok) == ("Error: the program was stopped (exit status 3)", False)


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": "[1]"}</tool_call>', "must be a JSON object"),
])
def test_a_malformed_call_is_an_error_message(text, error):
    (call,) = parse_tool_calls(text)
    out, ok = ToolBox(["calculator"]).run(call)
    assert not ok and out.startswith("Error:") and error in out


def test_unknown_tools_and_wrong_arguments_are_error_messages():
    box = ToolBox(["calculator"])
    out, ok = box.run(parse_tool_calls('<tool_call>{"name": "search", "arguments": {}}</tool_call>')[0])
    assert not ok and "unknown tool 'search'; the tools are calculator" in out
    out, ok = box.run(parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')[0])
    assert not ok and "calculator" in out and "expr" in out
    # OpenAI's shape (arguments as a JSON string) and an unclosed call at the end both read
    (call,) = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2**10\\"}"}')
    assert box.run(call) == ("1024", True)


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("(12 + 3) * 4") == "60" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os').system('id')", "9 ** 9 ** 9", "10 ** 1000", "x + 1", "1" * 300):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)
    out, ok = ToolBox(["calculator"]).run(parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}')[0])
    assert not ok and "ZeroDivisionError" in out


# --- environments ----------------------------------------------------------------------------

class GuessEnv:
    """Guess the row's number: each turn the model writes a number and hears higher or lower."""

    def reset(self, example):
        self.target = int(example.answer)
        return [{"role": "user", "content": "guess a number"}]

    def step(self, text):
        guess = int(text.strip()) if text.strip().isdigit() else -1
        if guess == self.target:
            return Step(done=True, reward=1.0)
        return Step("higher" if guess < self.target else "lower", reward=-0.1)


class BrokenEnv(GuessEnv):
    def step(self, text):
        raise KeyError("board")


def test_an_environment_talks_back_and_its_rewards_reach_the_reward_functions(tok):
    from rlvr.rewards import RewardSet

    multi = MultiTurn(*_sections(build_config({"environment": "test_multiturn:GuessEnv", "max_turns": 4})), tok, GuessEnv)
    sampler = ScriptedSampler(tok, ["3", "9", "5"], eos_after={0, 1, 2})
    texts, groups = multi.generate(sampler, [Example("ignored", answer="5")], ["ignored"], SamplingParams(n=1, max_tokens=50), None)
    r = groups[0][0]
    assert "guess a number" in texts[0] and "ignored" not in texts[0]  # reset's messages replace the prompt
    assert [m["content"] for m in r.messages] == ["3", "higher", "9", "lower", "5"]
    assert r.info["env_reward"] == pytest.approx(0.8) and r.info["turns"] == 3
    scores = RewardSet(["environment"], [1.0], {}).score_groups([Example("x", answer="5")], groups)
    assert scores.total == [pytest.approx(0.8)]


def test_an_environment_that_raises_ends_its_rollout_and_is_counted(tok):
    multi = MultiTurn(*_sections(build_config({"environment": "test_multiturn:BrokenEnv"})), tok, BrokenEnv)
    _, groups = multi.generate(ScriptedSampler(tok, ["3"]), [Example("x", answer="5")], ["x"], SamplingParams(n=2, max_tokens=9), None)
    assert all(r.info["env_error"] and r.info["env_reward"] is None for r in groups[0])


def test_an_environment_must_start_a_group_from_one_place(tok):
    class Random(GuessEnv):
        count = 0

        def reset(self, example):
            Random.count += 1
            return f"start {Random.count}"

    multi = MultiTurn(*_sections(build_config({"environment": "test_multiturn:GuessEnv"})), tok, Random)
    with pytest.raises(RolloutError, match="different first messages"):
        multi.generate(ScriptedSampler(tok, ["1"]), [Example("x", answer="5")], ["x"], SamplingParams(n=2, max_tokens=9), None)


# --- configuration ---------------------------------------------------------------------------

def no_docstring(x: int) -> int:
    return x


@pytest.mark.parametrize("settings, message", [
    ({"tools": ["nosuch"]}, "expected a built-in tool (python, calculator) or package.module:function"),
    ({"tools": ["test_multiturn:no_docstring"]}, "needs type hints and a docstring"),
    ({"tools": ["calculator"], "environment": "test_multiturn:GuessEnv"}, "environment GuessEnv has step(text) (rlvr's protocol), which runs what the model writes itself"),
    ({"environment": "nosuch.module:Env"}, "No module named 'nosuch'"),
    ({"tools": ["calculator"], "max_turns": 0}, "max_turns must be at least 1"),
    ({"rollout_func": "test_multiturn:nothing_here"}, "has no attribute 'nothing_here'"),
])
def test_bad_multiturn_settings_are_refused_before_the_model_loads(settings, message):
    from rlvr.settings import check_settings

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_settings(build_config(settings))  # value rules in build_config, user code in the launch check


def test_trls_max_tool_calling_iterations_counts_tool_rounds():
    from rlvr.settings import resolve_config

    cfg = resolve_config(["tools=[calculator]", "max_tool_calling_iterations=2"])
    assert cfg.max_turns == 3


# --- on the tiny model -----------------------------------------------------------------------

def _run_config(model_dir, out, **settings):
    return build_config({
        "model": str(model_dir), "task_args": {"digits": 1, "num_train": 40, "num_test": 4},
        "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 40, "learning_rate": 1e-3,
        "max_steps": 2, "logging_steps": 1, "eval_on_start": False, "eval_on_end": True, "output_dir": str(out),
        # the tools' descriptions alone are 700 tokens, past the tiny model's context of 256
        "log_completions": True, "max_prompt_length": 200, **settings})


@pytest.mark.trains
def test_training_with_tools_runs_and_logs_turns(model_dir, tmp_path):
    from rlvr.run import train

    train(_run_config(model_dir, tmp_path / "run", tools=["calculator"], max_turns=2, stop_strings=["}"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"turns/mean", "tools/calls_per_completion", "tools/error_rate", "env/errors"} <= set(rows[0])
    evaluated = json.loads((tmp_path / "run" / "eval_after.json").read_text())
    assert evaluated["n"] == 4


@pytest.mark.trains
@pytest.mark.parametrize("mode", ["on-policy", "free"])
def test_training_with_an_environment_on_several_turns(model_dir, tmp_path, monkeypatch, mode):
    """Also with async_mode=free: a producer thread runs the environments, weights may change between and
    within turns, and each sampled token keeps its version (observations, masked out, are not counted)."""
    from rlvr.run import train

    env_file = tmp_path / "envs" / "count_env.py"
    env_file.parent.mkdir()
    env_file.write_text(
        "from rlvr.environments import Step\n"
        "class CountEnv:\n"
        "    def reset(self, example):\n        self.n = 0\n        return None\n"
        "    def step(self, text):\n        self.n += 1\n"
        "        return Step('again', done=self.n >= 3, reward=float(len(text) % 2))\n")
    monkeypatch.syspath_prepend(str(env_file.parent))
    train(_run_config(model_dir, tmp_path / "run", environment="count_env:CountEnv", reward_funcs=["environment"],
                      max_completion_length=120, max_turns=3, eval_on_end=False,
                      stop_strings=list("aeiou0123456789 "),  # short turns from a random model
                      **({"max_staleness": 2, "async_mode": "free", "max_steps": 4} if mode == "free" else {})))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["turns/max"] <= 3 and rows[0]["turns/mean"] > 1
    if mode == "free":
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(0 <= r["sampling/staleness_mean"] <= r["sampling/staleness_max"] <= 2 for r in rows)
    sample = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert "turns" in sample and sample["turns"][0]["role"] == "assistant"


def my_rollouts(prompts, trainer):
    """Samples one turn with rlvr's sampler, appends a fixed observation the policy did not write."""
    tok = trainer.processing_class
    ids = tok(["q: " + (p if isinstance(p, str) else p[-1]["content"]) for p in prompts], add_special_tokens=False)["input_ids"]
    out = trainer.generate(ids, n=1, max_tokens=5)
    tail = tok("ok", add_special_tokens=False)["input_ids"]
    completions = [g[0].completion_ids + tail for g in out]
    return {"prompt_ids": ids, "completion_ids": completions,
            "logprobs": [g[0].logprobs + [0.0] * len(tail) for g in out],
            "env_mask": [[1] * len(g[0].completion_ids) + [0] * len(tail) for g in out],
            "source": ["mine"] * len(prompts)}


def saw_source(completions, source=None, **kwargs):
    return [1.0 if s == "mine" else 0.0 for s in source]


@pytest.mark.trains
@pytest.mark.processes
def test_rollout_func_samples_and_its_fields_reach_the_rewards(model_dir, tmp_path):
    from rlvr.run import train

    summary = train(_run_config(model_dir, tmp_path / "run", rollout_func="test_multiturn:my_rollouts",
                                reward_funcs=["test_multiturn:saw_source", "numeric_accuracy"], eval_on_end=False))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rewards/saw_source/mean"] == 1.0 and summary["steps"] == 2


def bad_rollouts(prompts, trainer):
    return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[2]] * len(prompts)}


@pytest.mark.trains
def test_a_rollout_func_without_logprobs_is_a_clear_error(model_dir, tmp_path):
    from rlvr.run import train

    with pytest.raises(RolloutError, match="returned no logprobs"):
        train(_run_config(model_dir, tmp_path / "run", rollout_func="test_multiturn:bad_rollouts"))


@pytest.mark.trains
@pytest.mark.processes
def shout(word: str) -> str:
    """Shout a word.

    Args:
        word: The word.
    """
    return word.upper()


def test_a_tool_of_yours_keeps_its_worker_process_from_turn_to_turn(tok):
    """Each turn's steps run in threads of their own that end with the step; the tools' worker process,
    which the kernel kills when the thread that forked it ends, is forked by one lasting thread, so the
    second turn's call reaches the same live worker (it once died with the first step's thread)."""
    call = '<tool_call>\n{"name": "shout", "arguments": {"word": "hi"}}\n</tool_call>'
    box = ToolBox(["test_multiturn:shout"])
    multi = MultiTurn(*_sections(_cfg(max_turns=3, tools=["test_multiturn:shout"])), tok, lambda: ToolEnvironment(box), box.schemas)
    pids = []

    class Watching(ScriptedSampler):
        def generate(self, prompt_ids, params, generator=None):
            if self.calls:
                time.sleep(0.3)  # time for the kernel to end a worker whose forking thread has ended
                pids.append(box.worker.pid)
            return super().generate(prompt_ids, params, generator)

    try:
        _, groups = multi.generate(Watching(tok, [call, call, "done"], eos_after={0, 1, 2}), [Example("x")], ["x"],
                                   SamplingParams(n=2, max_tokens=150), None)
        assert [m["content"] for m in groups[0][0].messages if m["role"] == "tool"] == ["HI", "HI"]
        assert all(r.info["tool_errors"] == 0 for r in groups[0])
        assert pids[0] == pids[1] == box.worker.pid and os.path.exists(f"/proc/{pids[0]}")  # one worker, still running
    finally:
        box.close()


def test_grpo_trainer_takes_tools_as_functions_as_trl_does(model_dir, tmp_path):
    """TRL's GRPOTrainer(tools=[fn]) with the import changed; the trainer samples one step ahead
    (max_staleness=1), so the tools run in the sampling thread."""
    from rlvr import GRPOConfig, GRPOTrainer

    called = []

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        called.append((a, b))
        return a + b

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    rows = [{"prompt": f"{a} + 1 =", "answer": str(a + 1)} for a in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=40, max_steps=2, max_tool_calling_iterations=1, max_staleness=1,
                      stop_strings=list("aeiou "), report_to="none", max_prompt_length=200)  # the tiny model's context: 256
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=length, args=args, train_dataset=rows, tools=[add])
    assert trainer.cfg.tools == ("<add>",) and trainer.cfg.max_turns == 2
    trainer.train()
    assert trainer.state.global_step == 2 and "turns/mean" in trainer.state.log_history[-2]  # [-1]: the summary row


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
