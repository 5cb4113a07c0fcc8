"""Environments and rollout functions that misbehave (rollout/multiturn.py, rollout/custom.py): each one
that hangs is given up at env_timeout, each fault of one rollout ends that rollout and is counted, and
each broken contract ends the run with one line naming the class or function and what it returned,
never a traceback from deep inside rlvr or a run that waits for ever."""

from __future__ import annotations

import threading
import time

import pytest

from rlvr.config import ConfigError, build_config
from rlvr.environments import Step
from rlvr.rollout import RolloutError, SamplingParams
from rlvr.rollout.custom import custom_rollouts
from rlvr.rollout.multiturn import MultiTurn
from rlvr.types import Example, Rollout

pytestmark = pytest.mark.unit
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 ")


@pytest.fixture(scope="module")
def tok():
    from conftest import make_tokenizer

    return make_tokenizer(CHARS)


class Writes:
    """A sampler that writes `text` and ends each turn with EOS; `pause`: seconds each call sleeps first."""

    def __init__(self, tokenizer, text="guess 3", pause=0.0):
        self.tokenizer, self.text, self.pause = tokenizer, text, pause
        self.eos = [tokenizer.eos_token_id]

    def generate(self, prompt_ids, params, generator=None):
        time.sleep(self.pause)
        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"] + self.eos
        return [[Rollout(list(p), list(ids), [-0.5] * len(ids), "stop", self.text) for _ in range(params.n)] for p in prompt_ids]


def finishes(fn, *args, within=60.0):
    """fn(*args) run in a thread: its result, its error, or a failure if it has not ended after `within`
    seconds (a bound on a hang, which the code under test must prevent; never on how fast it is)."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"still running after {within} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box["value"]


# --- environments -------------------------------------------------------------------------------


class Fine:
    def reset(self, example):
        return None

    def step(self, text):
        return Step(observation="go on")


class HangsInStep(Fine):
    def step(self, text):
        time.sleep(3600)


class HangsInReset(Fine):
    def reset(self, example):
        time.sleep(3600)


class HangsInInit(Fine):
    def __init__(self):
        time.sleep(3600)


class RaisesInInit(Fine):
    def __init__(self):
        raise ConnectionError("no game server at localhost:9999")


def multi(tok, env, **settings):
    cfg = build_config({"environment": "test_hostile_rollouts:Fine", "max_completion_length": 60, "env_timeout": 2,
                        **settings})
    return MultiTurn(cfg.rollout_settings, cfg.data_settings, tok, env, name=env.__name__)


def sample(m, tok, n=2):
    return m.generate(Writes(tok), [Example("x", answer="3")], ["x"], SamplingParams(n=n, max_tokens=20), None)


def test_a_step_that_never_returns_ends_its_rollout_at_env_timeout_and_is_counted(tok):
    _, groups = finishes(sample, multi(tok, HangsInStep), tok)
    assert all(r.info["env_error"] and r.info["turns"] == 1 for r in groups[0])


class HangsEveryOther(Fine):
    """The second environment made, and every second one after it, hangs in step; the others answer."""

    made = 0

    def __init__(self):
        HangsEveryOther.made += 1
        self.hangs = HangsEveryOther.made % 2 == 0

    def step(self, text):
        if self.hangs:
            time.sleep(3600)
        return Step(observation="go on") if text else Step(done=True)


def test_the_steps_of_a_turn_run_together_so_one_that_hangs_does_not_stall_the_others(tok):
    """Four rollouts over two turns: the two whose environment hangs end at the first turn (counted), the
    two others go on to max_turns, their answers not held up by the hung ones."""
    HangsEveryOther.made = 0
    m = multi(tok, HangsEveryOther, max_turns=2)
    HangsEveryOther.made = 0  # the one made to read stop_strings aside
    _, groups = finishes(sample, m, tok, 4)
    assert [r.info["env_error"] for r in groups[0]] == [False, True, False, True]
    assert [r.info["turns"] for r in groups[0]] == [2, 1, 2, 1]


@pytest.mark.parametrize("env, message", [
    (HangsInInit, "HangsInInit() did not return within env_timeout=2 s"),
    (RaisesInInit, "RaisesInInit() raised ConnectionError: no game server at localhost:9999"),
])
def test_a_constructor_that_hangs_or_raises_is_one_line_naming_it(tok, env, message):
    with pytest.raises(RolloutError) as e:
        finishes(multi, tok, env)
    assert str(e.value) == message


def test_a_reset_that_hangs_is_one_line_naming_it(tok):
    with pytest.raises(RolloutError, match=r"^HangsInReset.reset did not return within env_timeout=2 s$"):
        finishes(sample, multi(tok, HangsInReset), tok)


def _returning(method: str, value):
    def fn(self, *args):
        return value

    return type(f"Returns{type(value).__name__.title()}", (Fine,), {method: fn})


@pytest.mark.parametrize("method, value, said", [
    ("reset", 5, "reset returned 5 (int): return None (the row's own prompt), text, or a non-empty list of"),
    ("reset", [], "reset returned [] (list): return None"),
    ("reset", [{"text": "hi"}], "reset returned [{'text': 'hi'}] (list)"),
    ("step", None, "step returned None (NoneType), not a Step(observation, done, reward)"),
    ("step", ("go on", False, 1.0), "step returned ('go on', False, 1.0) (tuple), not a Step"),
    ("step", Step("x", done=True, reward="high"), "step returned a Step whose reward is 'high' (str): a number, or None"),
    ("step", Step("x", done=True, reward=float("nan")), "step returned a Step whose reward is nan (float)"),
    ("step", Step("x", done="yes"), "step returned a Step whose done is 'yes' (str): True or False"),
    ("step", Step("x", role=None), "step returned a Step whose role is None"),
])
def test_a_reset_or_step_that_returns_what_no_rollout_can_use_is_one_line_naming_it(tok, method, value, said):
    env = _returning(method, value)
    with pytest.raises(RolloutError) as e:
        finishes(sample, multi(tok, env), tok)
    assert str(e.value).startswith(f"{env.__name__}.{said}") and "\n" not in str(e.value)


def test_a_step_that_returns_numpy_values_is_fine(tok):
    import numpy as np

    env = _returning("step", Step("go on", done=np.bool_(True), reward=np.float32(0.5)))
    _, groups = finishes(sample, multi(tok, env), tok)
    assert [r.info["env_reward"] for r in groups[0]] == [0.5, 0.5]


@pytest.mark.parametrize("stops", [5, "</call>", ["</call>", 3], [""]])
def test_bad_stop_strings_are_one_line_naming_them(tok, stops):
    env = type("BadStops", (Fine,), {"stop_strings": stops})
    with pytest.raises(RolloutError, match=r"^BadStops.stop_strings is .*: a list of non-empty strings"):
        multi(tok, env)


def test_an_environment_that_cannot_be_made_is_refused_before_the_model_loads():
    from rlvr.settings import check_settings

    for name, message in (("RaisesInInit", "environment RaisesInInit() raised ConnectionError: no game server"),
                          ("HangsInInit", "environment HangsInInit() did not return within env_timeout=2 s")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            finishes(check_settings, build_config({"environment": f"test_hostile_rollouts:{name}", "env_timeout": 2}))
    with pytest.raises(ConfigError, match="env_timeout must be >= 0"):
        build_config({"env_timeout": -1})


# --- rollout functions ----------------------------------------------------------------------------


class Args:
    env_timeout = 2


def run_func(tok, fn, sampler=None, n=2):
    return custom_rollouts(fn, Args(), tok, sampler or Writes(tok), [Example("x")], SamplingParams(n=n, max_tokens=8), None)


def raises(prompts, trainer):
    raise RuntimeError("sampler gone")


def strings(prompts, trainer):
    return {"prompt_ids": [[1]] * len(prompts), "completion_ids": ["abc"] * len(prompts), "logprobs": [[0.0] * 3] * len(prompts)}


def negative(prompts, trainer):
    return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[5, -2]] * len(prompts), "logprobs": [[0.0] * 2] * len(prompts)}


def beyond(prompts, trainer):
    return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[10**6]] * len(prompts), "logprobs": [[0.0]] * len(prompts)}


def text_logprobs(prompts, trainer):
    return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[5]] * len(prompts), "logprobs": [["low"]] * len(prompts)}


def hangs(prompts, trainer):
    time.sleep(3600)


@pytest.mark.parametrize("fn, message", [
    (raises, "rollout_func raises raised RuntimeError: sampler gone"),
    (strings, "rollout_func strings: completion_ids 0 is 'abc' (str), not a list of token ids"),
    (negative, "rollout_func negative: completion_ids 0 holds the token id -2, outside the vocabulary"),
    (beyond, "rollout_func beyond: completion_ids 0 holds the token id 1000000, outside the vocabulary"),
    (text_logprobs, "rollout_func text_logprobs: logprobs 0 is ['low'], not a list of numbers"),
    (hangs, "rollout_func hangs ran 2 s without returning, not counting its sampling (env_timeout): it was given up"),
])
def test_a_rollout_func_that_raises_returns_garbage_or_hangs_is_one_line_naming_it(tok, fn, message):
    with pytest.raises(RolloutError) as e:
        finishes(run_func, tok, fn)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_rollout_funcs_sampling_does_not_count_against_env_timeout_and_one_given_up_may_not_sample(tok):
    def samples_slowly(prompts, trainer):
        rollouts = [g[0] for g in trainer.generate([[1, 2]] * len(prompts))]  # 3 s of sampling, beyond 2 s
        return {"prompt_ids": [r.prompt_ids for r in rollouts], "completion_ids": [r.completion_ids for r in rollouts],
                "logprobs": [r.logprobs for r in rollouts]}

    groups = finishes(run_func, tok, samples_slowly, Writes(tok, pause=3.0))
    assert len(groups) == 1 and len(groups[0]) == 2
    contexts = []

    def stalls_then_samples(prompts, trainer):
        contexts.append(trainer)
        time.sleep(4.0)
        return trainer.generate([[1]])

    with pytest.raises(RolloutError, match="given up"):
        finishes(run_func, tok, stalls_then_samples)
    with pytest.raises(RolloutError, match="may not sample any more"):
        contexts[0].generate([[1]])
