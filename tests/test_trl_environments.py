"""TRL's environment protocol (GRPOTrainer's environment_factory) run unchanged: the environment
classes here are written as TRL's GRPO guide writes them (docs/source/grpo_trainer.md, "Environments"):
reset(**kwargs) returning None or text, public methods the model calls as tools, get_reward()."""

from __future__ import annotations

import json
import random
import sys
import threading

import pytest

from rlvr.config import ConfigError, build_config
from rlvr.environments import EnvironmentReward, MethodEnvironment, appended, tool_methods
from rlvr.rollout import RolloutError, SamplingParams
from rlvr.rollout.multiturn import make_multiturn
from rlvr.types import Example, Rollout

CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*/=?.,:;_'\"(){}[]\\<>\n")


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# --- environments as TRL's guide writes them ---------------------------------------------------

class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class TargetEnv(IncrementEnv):
    """The guide's dataset version: the row's `target` column arrives as a keyword argument."""

    seen: list = []

    def reset(self, target, **kwargs) -> None:
        TargetEnv.seen.append({"target": target, **kwargs})
        self.counter = 0
        self.target = target


class CodingEnv:
    def reset(self, **kwargs) -> str:
        return "Compute 2 + 2 with code."

    def run_code(self, code: str) -> str:
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        return "4"


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        if action not in ("up", "down", "left", "right"):
            raise ValueError(f"no such action: {action}")
        return f"moved {action}"


def counter_reward(completions, environments, **kwargs) -> list[float]:
    """A reward function reading each completion's environment, as TRL passes them."""
    return [float(env.counter) for env in environments]


# --- a scripted sampler and the pieces a run gives MultiTurn -----------------------------------

@pytest.fixture(scope="module")
def tok():
    from conftest import make_tokenizer

    return make_tokenizer(CHARS)  # ChatML, without tool support: the tools are described in a system message


class Scripted:
    """Each call writes the next turn for every prompt it is given; records the prompts' texts."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.seen = tokenizer, turns, []
        self.eos = [tokenizer.eos_token_id]

    def generate(self, prompt_ids, params, generator=None):
        text = self.turns[len(self.seen)]
        self.seen.append([self.tokenizer.decode(p) for p in prompt_ids])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.eos
        return [[Rollout(list(p), ids, [-0.5] * len(ids), "stop", text) for _ in range(params.n)] for p in prompt_ids]


def multiturn(tok, environment, **settings):
    cfg = build_config({"environment": environment, "max_completion_length": 1000, "max_prompt_length": 4000, **settings})
    return make_multiturn(cfg.rollout_settings, cfg.data_settings, tok)


# --- the protocol ------------------------------------------------------------------------------

def test_public_methods_are_the_tools_and_reset_and_get_reward_are_not():
    env = IncrementEnv()
    assert list(tool_methods(env)) == ["increment"]
    assert list(tool_methods(GameEnv())) == ["move"]


def test_resets_text_is_added_to_the_last_user_message_as_trl_does():
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Go. "}, {"role": "assistant", "content": "A"}]
    assert appended(prompt, "Target 3.") == [{"role": "system", "content": "S"}, {"role": "user", "content": "Go. Target 3."},
                                             {"role": "assistant", "content": "A"}]
    assert prompt[1]["content"] == "Go. "  # the row is left as it was
    assert appended([{"role": "user", "content": ""}], "Task.") == [{"role": "user", "content": "Task."}]  # a row without a prompt
    assert appended("Plain prompt. ", "Task.") == "Plain prompt. Task."


def test_a_self_sampling_environment_runs_its_methods_and_scores_itself(tok):
    """The guide's IncrementEnv, no dataset: each rollout's reset samples its own target (so a group's completions
    start apart, each from its own prompt); the model's calls run the method on that rollout's instance."""
    random.seed(3)
    multi = multiturn(tok, "test_trl_environments:IncrementEnv")
    sampler = Scripted(tok, [call("increment", step=2), call("increment", step=1), "done"])
    example = Example([{"role": "user", "content": ""}])
    texts, groups = multi.generate(sampler, [example], [example.prompt], SamplingParams(n=3, max_tokens=200), None)
    rollouts = groups[0]
    envs = [r.info["environment"] for r in rollouts]
    assert all(isinstance(e, IncrementEnv) for e in envs) and len({id(e) for e in envs}) == 3  # one instance each
    assert [e.counter for e in envs] == [3, 3, 3]  # 2, then 1, on each rollout's own counter
    targets = [e.target for e in envs]
    assert len(set(targets)) > 1  # seed 3 draws different tasks: the prompts differ within the group
    first_prompts = sampler.seen[0]
    assert len(first_prompts) == 3  # one completion of each rollout's own prompt, not 3 of one
    for text, target, r in zip(first_prompts, targets, rollouts):
        assert f"Increment the counter by {target}." in text and '"name": "increment"' in text  # the tool's schema, shown
        assert r.info["prompt"] == [{"role": "user", "content": f"Increment the counter by {target}."}]
        assert tok.decode(r.prompt_ids) == text
    assert texts[0] == first_prompts[0]
    tool_turns = [m for m in rollouts[0].messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_turns] == ["2", "3"]  # what increment returned, read back
    assert [r.info["env_reward"] for r in rollouts] == [float(t == 3) for t in targets]  # get_reward, once at the end
    assert [r.info["turns"] for r in rollouts] == [3, 3, 3] and [r.info["tool_calls"] for r in rollouts] == [2, 2, 2]


def test_get_reward_is_a_reward_source_under_the_class_name_and_environments_reach_reward_functions(tok):
    from rlvr.rewards import RewardSet, register_reward

    random.seed(0)
    multi = multiturn(tok, "test_trl_environments:IncrementEnv")
    sampler = Scripted(tok, [call("increment", step=3), "done"])
    example = Example([{"role": "user", "content": ""}])
    _, groups = multi.generate(sampler, [example], [example.prompt], SamplingParams(n=4, max_tokens=200), None)
    owned = register_reward(EnvironmentReward(IncrementEnv))
    assert owned == "IncrementEnv"
    # counter_reward runs in the reward functions' worker process: the environments are sent there
    rewards = RewardSet([owned, "test_trl_environments:counter_reward"], [1.0, 0.5])
    try:
        scores = rewards.score_groups([example], groups)
    finally:
        rewards.close()
    wins = [float(r.info["environment"].target == 3) for r in groups[0]]
    assert scores.per_func["IncrementEnv"] == wins
    assert scores.per_func["counter_reward"] == [3.0] * 4
    assert scores.total == [w + 1.5 for w in wins]


def test_a_dataset_row_reaches_reset_as_keyword_arguments(tok):
    TargetEnv.seen.clear()
    multi = multiturn(tok, "test_trl_environments:TargetEnv")
    prompt = [{"role": "user", "content": "Increment the counter to 4."}]
    example = Example(prompt, columns={"target": 4, "level": "easy"})
    sampler = Scripted(tok, [call("increment", step=4), "done"])
    _, groups = multi.generate(sampler, [example], [prompt], SamplingParams(n=2, max_tokens=200), None)
    assert TargetEnv.seen == [{"target": 4, "level": "easy", "prompt": prompt}] * 2
    assert len(sampler.seen[0]) == 1  # reset returned None: the row's prompt, one prefill for the group
    assert all(r.info["env_reward"] == 1.0 and "prompt" not in r.info for r in groups[0])


def test_a_dict_of_environments_routes_each_row_and_shows_only_its_tools(tok):
    multi = multiturn(tok, {"coding": "test_trl_environments:CodingEnv", "game": "test_trl_environments:GameEnv"})
    rows = [Example([{"role": "user", "content": ""}], columns={"environment": name}) for name in ("game", "coding")]
    sampler = Scripted(tok, [call("move", action="up"), "done"])
    _, groups = multi.generate(sampler, rows, [r.prompt for r in rows], SamplingParams(n=2, max_tokens=200), None)
    game, coding = sampler.seen[0]
    assert "Reach the goal tile." in game and '"move"' in game and '"run_code"' not in game
    assert "Compute 2 + 2" in coding and '"run_code"' in coding and '"move"' not in coding
    assert [m["content"] for m in groups[0][0].messages if m["role"] == "tool"] == ["moved up"]
    unknown = [m["content"] for m in groups[1][0].messages if m["role"] == "tool"][0]
    assert unknown == "Error: unknown tool 'move'; the tools are run_code"  # the coding rollout has no move
    assert groups[1][0].info["tool_errors"] == 1
    stray = Example([{"role": "user", "content": ""}], columns={"environment": "chess"})
    with pytest.raises(RolloutError, match="a row's environment column is 'chess', which is not among the environments given "
                                           r"\(coding, game\)"):
        multi.generate(Scripted(tok, ["x"]), [stray], [stray.prompt], SamplingParams(n=1, max_tokens=20), None)


def test_a_method_that_raises_or_is_called_wrongly_is_read_back_as_an_error(tok):
    multi = multiturn(tok, "test_trl_environments:GameEnv")
    sampler = Scripted(tok, [call("move", action="jump") + call("move", direction="up") + call("move", action="left"), "done"])
    example = Example([{"role": "user", "content": ""}])
    _, groups = multi.generate(sampler, [example], [example.prompt], SamplingParams(n=1, max_tokens=300), None)
    answer = [m["content"] for m in groups[0][0].messages if m["role"] == "tool"][0].split("\n")
    assert answer[0] == "Error: ValueError: no such action: jump"
    assert answer[1] == "Error: move: missing a required argument: 'action'"
    assert answer[2] == "moved left"
    assert groups[0][0].info["tool_calls"] == 3 and groups[0][0].info["tool_errors"] == 2


class Scorer(IncrementEnv):
    mode = "raise"
    release = threading.Event()  # what a hanging get_reward waits for: set only once the test is over

    def get_reward(self) -> float:
        if Scorer.mode == "raise":
            raise ConnectionError("judge unreachable")
        if Scorer.mode == "hang":
            Scorer.release.wait()
        return "yes"


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_get_reward_that_raises_or_hangs_scores_none_and_is_counted(tok, mode):
    from test_hostile_rollouts import finishes

    Scorer.mode = mode
    Scorer.release.clear()
    multi = multiturn(tok, "test_trl_environments:Scorer", env_timeout=2)
    example = Example([{"role": "user", "content": ""}])
    try:  # a get_reward that never returns is given up at env_timeout: generate returns (`finishes`: not a hang)
        _, groups = finishes(multi.generate, Scripted(tok, ["done"]), [example], [example.prompt],
                             SamplingParams(n=3, max_tokens=20), None)
    finally:
        Scorer.release.set()
    assert all(r.info["env_reward"] is None and r.info["env_error"] for r in groups[0])


def test_a_get_reward_that_returns_text_ends_the_run_with_one_line(tok):
    Scorer.mode = "text"
    multi = multiturn(tok, "test_trl_environments:Scorer")
    example = Example([{"role": "user", "content": ""}])
    with pytest.raises(RolloutError, match=r"^Scorer.get_reward returned 'yes' \(str\): a number, or None$"):
        multi.generate(Scripted(tok, ["done"]), [example], [example.prompt], SamplingParams(n=1, max_tokens=20), None)


class Undocumented:
    def reset(self, **kwargs):
        return "go"

    def move(self, where):
        return where


def test_a_method_without_a_docstring_is_refused_before_the_model_loads():
    from rlvr.settings import check_settings

    with pytest.raises(ConfigError, match=r"environment Undocumented: its method move\(\) is offered to the model as a tool"):
        check_settings(build_config({"environment": "test_trl_environments:Undocumented"}))


def test_tools_go_beside_a_trl_environment(tok):
    multi = multiturn(tok, "test_trl_environments:GameEnv", tools=["calculator"])
    sampler = Scripted(tok, [call("calculator", expression="6*7") + call("move", action="down"), "done"])
    example = Example([{"role": "user", "content": ""}])
    _, groups = multi.generate(sampler, [example], [example.prompt], SamplingParams(n=1, max_tokens=300), None)
    assert '"calculator"' in sampler.seen[0][0] and '"move"' in sampler.seen[0][0]
    assert [m["content"] for m in groups[0][0].messages if m["role"] == "tool"] == ["42\nmoved down"]
    assert isinstance(MethodEnvironment(GameEnv(), multi.kinds[None].factory().toolbox), MethodEnvironment)


# --- GRPOTrainer(environment_factory=...) with the import changed --------------------------------

@pytest.mark.trains
def test_the_guides_environment_trains_without_a_dataset(tiny_model_dir, tmp_path):
    """TRL's first environment example: no train_dataset, max_steps sets the length, the environment owns the reward."""
    from rlvr import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=24, max_prompt_length=200, report_to="none")
    trainer = GRPOTrainer(model=str(tiny_model_dir), args=args, environment_factory=IncrementEnv)
    assert trainer.cfg.reward_funcs == ("IncrementEnv",) and trainer.cfg.environment == "<IncrementEnv>"
    trainer.train()
    row = trainer.state.log_history[-2]
    assert trainer.state.global_step == 2 and "rewards/IncrementEnv/mean" in row and "turns/mean" in row


@pytest.mark.trains
def test_reward_funcs_and_get_reward_are_summed_with_weights_on_reward_funcs_only(tiny_model_dir, tmp_path):
    from rlvr import GRPOConfig, GRPOTrainer

    def format_reward(completions, **kwargs):
        return [1.0 for _ in completions]

    rows = [{"prompt": [{"role": "user", "content": "Increment the counter."}], "environment": name}
            for name in ("inc", "game")] * 2
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=16, max_prompt_length=200, report_to="none", reward_weights=[0.5])
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=format_reward, args=args, train_dataset=rows,
                          environment_factory={"inc": IncrementEnv, "game": GameEnv})
    assert trainer.cfg.reward_funcs == ("format_reward", "IncrementEnv") and trainer.cfg.reward_weights == (0.5, 1.0)
    assert trainer.cfg.environment == {"inc": "<IncrementEnv>", "game": "<GameEnv>"}
    trainer.train()
    assert trainer.state.global_step == 1


def test_what_grpo_trainer_refuses_with_environments(tiny_model_dir, tmp_path):
    from rlvr import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, report_to="none")
    with pytest.raises(ConfigError, match="set max_steps to a positive number of steps"):
        GRPOTrainer(model=str(tiny_model_dir), args=args, environment_factory=IncrementEnv)
    with pytest.raises(ConfigError, match="needs a train_dataset with an `environment` column"):
        GRPOTrainer(model=str(tiny_model_dir), args=args, environment_factory={"a": IncrementEnv})
    with pytest.raises(ConfigError, match="needs reward_funcs"):
        GRPOTrainer(model=str(tiny_model_dir), args=args, train_dataset=[{"prompt": "go"}] * 4, environment_factory=GameEnv)
    from rlvr.tasks.dataset import DatasetError

    with pytest.raises(DatasetError, match=r"train_dataset row 1: its environment column is 'chess'"):
        GRPOTrainer(model=str(tiny_model_dir), args=args, reward_funcs=counter_reward,
                    train_dataset=[{"environment": "game"}, {"environment": "chess"}], environment_factory={"game": GameEnv})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
