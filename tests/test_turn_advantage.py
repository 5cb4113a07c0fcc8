"""turn_advantage=return: the rewards an environment or a tool gives per turn, each credited on its own
turn (rollout/steps.turn_steps, advantages.step_advantages); values worked out by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlvr.advantages import EPS, step_advantages
from rlvr.config import ConfigError, build_config
from rlvr.environments import MethodEnvironment, Step, ToolEnvironment
from rlvr.rollout import SamplingParams
from rlvr.rollout.multiturn import MultiTurn
from rlvr.rollout.steps import turn_steps
from rlvr.tools import ToolBox, ToolResult
from rlvr.types import Example, Rollout
from test_multiturn import CHARS, GuessEnv, ScriptedSampler


@pytest.fixture(scope="module")
def tok():
    from conftest import make_tokenizer

    return make_tokenizer(CHARS)  # test_multiturn's: it can spell JSON; ChatML without tool support


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    from conftest import save_tiny_model

    return save_tiny_model(tok, tmp_path_factory.mktemp("tiny-json"))


def _rollout(turns: list[tuple[int, int]], turn_rewards: list[tuple[int, float]]) -> Rollout:
    """A multi-turn rollout of (policy tokens, observation tokens after them) per turn."""
    mask = [m for policy, seen in turns for m in [True] * policy + [False] * seen]
    return Rollout([1], [7] * len(mask), [0.0] * len(mask), "stop", "", mask=mask, info={"turn_rewards": turn_rewards})


def test_each_turn_gets_the_normalised_rewards_from_its_turn_on_by_hand():
    # One group of 3 (token: P policy, o observation):
    #   A  PPoo PPo PP  turn rewards 0.5 (ends at token 1), -0.5 (token 5), none in turn 3; final reward 1.0 (token 8)
    #   B  PPPoo PP     turn reward 1.0 (token 2), none in turn 2; final 0.0 (token 6)
    #   C  PPo PP       no turn reward; final 0.4 (token 4)
    # Steps: A {1: 0.5, 5: -0.5, 8: 1.0}, B {2: 1.0, 6: 0.0}, C {4: 0.4}.  The pool [0.5, -0.5, 1.0, 1.0, 0.0, 0.4]
    # has mean 2.4 / 6 = 0.4; unscaled the steps are A +0.1, -0.9, +0.6; B +0.6, -0.4; C 0.0.  A token's advantage
    # sums the steps that end at or after it:
    #   A tokens 0-1: 0.1 - 0.9 + 0.6 = -0.2; tokens 2-5: -0.9 + 0.6 = -0.3; tokens 6-8: 0.6
    #   B tokens 0-2: 0.6 - 0.4 = 0.2; tokens 3-6: -0.4; padding 0
    #   C every token 0.0 (one step, equal to the mean: GRPO's advantage on every token)
    # The rollout rule (every turn reward summed into one number) gives A 1.0, B 1.0, C 0.4: A and B alike; by
    # turns A's first turn earned less than B's and its second lost, so A's early tokens get less.  Each step
    # subtracts the mean once, so A, rewarded in three steps, pays it three times (DeepSeekMath's rule).
    rollouts = [_rollout([(2, 2), (2, 1), (2, 0)], [(1, 0.5), (5, -0.5)]),
                _rollout([(3, 2), (2, 0)], [(2, 1.0)]),
                _rollout([(2, 1), (2, 0)], [])]
    finals = [1.0, 0.0, 0.4]
    steps = [turn_steps(r, {len(r.completion_ids) - 1: f}) for r, f in zip(rollouts, finals)]
    assert steps == [{1: 0.5, 5: -0.5, 8: 1.0}, {2: 1.0, 6: 0.0}, {4: 0.4}]
    adv, zero_std = step_advantages(steps, [9, 7, 5], 3, "none")
    expected = [[-0.2] * 2 + [-0.3] * 4 + [0.6] * 3,
                [0.2] * 3 + [-0.4] * 4 + [0.0] * 2,
                [0.0] * 5 + [0.0] * 4]
    assert adv.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    assert zero_std.tolist() == [False]
    # scale_rewards=group divides by the pool's sample std: squares .01 + .81 + .36 + .36 + .16 + 0 = 1.7, / 5 -> 0.34
    scaled, _ = step_advantages(steps, [9, 7, 5], 3, "group")
    assert torch.allclose(scaled, adv / (math.sqrt(0.34) + EPS), atol=1e-6)


def test_without_turn_rewards_it_is_the_rollout_rule_and_equal_steps_carry_no_signal():
    r = _rollout([(2, 1), (2, 0)], [])
    assert turn_steps(r, {4: 0.7}) == {4: 0.7}  # one step at the end: GRPO's advantage on every token
    same = [turn_steps(_rollout([(1, 1), (1, 0)], [(0, 1.0)]), {2: 1.0}) for _ in range(2)]
    adv, zero_std = step_advantages(same, [3, 3], 2, "group")
    assert zero_std.tolist() == [True] and adv.abs().sum() == 0  # left out of the batch, as any group without signal


# --- recorded where the turn's tokens end --------------------------------------------------


def _multi(tok, turn_advantage, env=GuessEnv):
    cfg = build_config({"environment": "test_multiturn:GuessEnv", "max_turns": 4, "turn_advantage": turn_advantage})
    return MultiTurn(cfg.rollout_settings, cfg.data_settings, tok, env)


@pytest.mark.parametrize("turn_advantage", ["rollout", "return"])
def test_a_steps_reward_is_recorded_at_the_last_token_of_its_turn(tok, turn_advantage):
    sampler = ScriptedSampler(tok, ["3", "9", "5"], eos_after={0, 1, 2})
    _, groups = _multi(tok, turn_advantage).generate(sampler, [Example("x", answer="5")], ["x"],
                                                     SamplingParams(n=1, max_tokens=50), None)
    r = groups[0][0]
    # each turn is a digit and the EOS token; the observations ("higher", "lower") sit between them
    ends = [i for i, m in enumerate(r.mask) if m and (i + 1 == len(r.mask) or not r.mask[i + 1])]
    assert len(ends) == 3 and [tok.decode(r.completion_ids[i - 1]) for i in ends] == ["3", "9", "5"]
    assert r.info["turn_rewards"] == [(ends[0], -0.1), (ends[1], -0.1), (ends[2], 1.0)]
    assert ends[2] == len(r.completion_ids) - 1
    # the rollout rule sums them into env_rewards; the return rule credits them on their turns, once, so
    # env_rewards (the `environment` reward) keeps what is left: 0 here, where every reward came with a turn
    assert r.info["env_reward"] == (pytest.approx(0.8) if turn_advantage == "rollout" else 0.0)


def scored_lookup(word: str):
    """Look a word up.

    Args:
        word: The word.
    """
    return ToolResult(word.upper(), reward=0.25 if word == "grpo" else -0.25)


def test_a_tool_may_return_a_reward_with_its_output(tok):
    box = ToolBox([scored_lookup])
    try:
        env = ToolEnvironment(box)
        two = '<tool_call>{"name": "scored_lookup", "arguments": {"word": "grpo"}}</tool_call>' \
              '<tool_call>{"name": "scored_lookup", "arguments": {"word": "ppo"}}</tool_call>'
        step = env.step(two)
        assert step == Step("GRPO\nPPO", reward=0.0, role="tool")  # a turn's calls: their rewards summed
        one = env.step('<tool_call>{"name": "scored_lookup", "arguments": {"word": "grpo"}}</tool_call>')
        assert one.reward == 0.25 and env.errors == 0
    finally:
        box.close()
    # a plain return value gives no reward, exactly as before
    calc = ToolEnvironment(ToolBox(["calculator"])).step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert calc == Step("42", reward=None, role="tool")
    with pytest.raises(ValueError, match="ToolResult's reward must be a finite number or None; got 'high'"):
        ToolResult("x", reward="high")


class Counter:
    """TRL's protocol: a method as a tool, with a reward per call; get_reward for the whole rollout."""

    def reset(self, **row):
        self.n = 0

    def increment(self, step: int):
        """Add to the counter.

        Args:
            step: How much.
        """
        self.n += step
        return ToolResult(self.n, reward=0.1 * step)

    def get_reward(self) -> float:
        return float(self.n == 3)


@pytest.mark.parametrize("turn_advantage, env_reward", [("rollout", 0.3 + 1.0), ("return", 1.0)])
def test_a_trl_environments_methods_give_turn_rewards_and_get_reward_the_rest(tok, turn_advantage, env_reward):
    call = '<tool_call>{"name": "increment", "arguments": {"step": %d}}</tool_call>'
    multi = _multi(tok, turn_advantage, lambda: MethodEnvironment(Counter(), ToolBox([])))
    sampler = ScriptedSampler(tok, [call % 1, call % 2, "done"], eos_after={2})
    _, groups = multi.generate(sampler, [Example("x")], ["x"], SamplingParams(n=1, max_tokens=80), None)
    r = groups[0][0]
    assert [m["content"] for m in r.messages if m["role"] == "tool"] == ["1", "3"]
    assert [reward for _, reward in r.info["turn_rewards"]] == pytest.approx([0.1, 0.2])
    # get_reward's value is the rest of the rollout's reward (its `Counter` reward, env_rewards): with the return
    # rule the turns' rewards are credited on their turns and left out of it
    assert r.info["env_reward"] == pytest.approx(env_reward)


# --- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, message", [
    ({"turn_advantage": "return"}, "turn_advantage=return credits the rewards tools or an environment give per turn: "
                                   "set tools or environment (GRPOTrainer: tools= or environment_factory=)"),
    ({"turn_advantage": "return", "rollout_func": "test_multiturn:my_rollouts"}, "turn_advantage=return credits"),
    ({"tools": ["calculator"], "turn_advantage": "turn"}, "turn_advantage must be one of rollout, return; got 'turn'"),
    ({"tools": ["calculator"], "turn_advantage": "return", "advantage_estimator": "rloo"},
     "turn_advantage=return normalises the turns' rewards by GRPO's rule only"),
    ({"tools": ["calculator"], "turn_advantage": "return", "multi_objective_aggregation": "normalize_then_sum"},
     "turn_advantage=return normalises the turns' rewards by GRPO's rule only"),
])
def test_turn_advantage_is_refused_where_it_cannot_apply(settings, message):
    from rlvr.settings import check_settings

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_settings(build_config(settings))  # value rules in build_config, the rest in the launch check


def test_grpo_config_takes_turn_advantage_before_its_trainer_gives_the_environment():
    from rlvr import GRPOConfig

    assert GRPOConfig(output_dir="unused", turn_advantage="return").turn_advantage == "return"


# --- on the tiny model ---------------------------------------------------------------------


@pytest.mark.trains
def test_training_credits_each_turn_its_own_reward(model_dir, tmp_path, monkeypatch):
    from test_multiturn import _run_config

    from rlvr.run import train
    from rlvr.trainer import Trainer

    env_file = tmp_path / "envs" / "parity_env.py"
    env_file.parent.mkdir()
    env_file.write_text(
        "from rlvr.environments import Step\n"
        "class ParityEnv:\n"
        "    def reset(self, example):\n        self.n = 0\n        return None\n"
        "    def step(self, text):\n        self.n += 1\n"
        "        return Step('again', done=self.n >= 2, reward=float(len(text) % 2))\n")
    monkeypatch.syspath_prepend(str(env_file.parent))
    batches, update = [], Trainer.update
    monkeypatch.setattr(Trainer, "update", lambda self, batch, *rest: batches.append(batch) or update(self, batch, *rest))
    out = tmp_path / "run"
    train(_run_config(model_dir, out, environment="parity_env:ParityEnv", reward_funcs=["environment"], turn_advantage="return",
                      max_completion_length=60, max_turns=2, eval_on_end=False, stop_strings=list("aeiou0123456789 ")))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.0 <= row["turns/reward_mean"] <= 1.0 for row in rows)
    assert all(row["rewards/environment/mean"] == 0.0 for row in rows)  # every reward came with a turn
    differ = 0
    for batch in batches:
        assert batch.advantages.shape == batch.completion_ids.shape  # an advantage per token
        for adv, mask in zip(batch.advantages, batch.loss_mask):
            starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
            per_turn = [adv[s].item() for s in starts]
            assert all(adv[s:e][mask[s:e]].unique().numel() == 1  # one value over a turn's policy tokens
                       for s, e in zip(starts, starts[1:] + [len(mask)]))
            differ += len(per_turn) == 2 and per_turn[0] != pytest.approx(per_turn[1])
    assert differ > 0, "some rollout's two turns got different advantages"
    sample = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert sample["steps"] and sample["turns"][0]["role"] == "assistant"
