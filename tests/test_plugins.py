"""Objects given to GRPOTrainer are known by TRL's names (a reward by its __name__), and one process
may hold several trainers (a notebook's second experiment) given different objects of one name:
each trains with the ones it was given, logged and saved under that one name."""

import pytest
import yaml

from rlvr import GRPOConfig, GRPOTrainer

pytestmark = [pytest.mark.trains, pytest.mark.processes]


def _reward(value: float):
    def reward(completions, **kwargs):
        return [value] * len(completions)
    return reward


def _lookup(answer: str):
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: The key to look up.
        """
        return answer
    return lookup


def test_two_trainers_given_a_reward_and_a_tool_of_one_name_each_use_their_own(tiny_model_dir, tmp_path, monkeypatch):
    from rlvr.tools import ToolBox

    looked_up = []  # what the tool `lookup` of each toolbox a run builds answers
    build = ToolBox.__init__

    def spy(self, *args, **kwargs):
        build(self, *args, **kwargs)
        looked_up.append(self.tools["lookup"].function("key"))

    monkeypatch.setattr(ToolBox, "__init__", spy)
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)]

    def trainer(name: str, value: float) -> GRPOTrainer:
        args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=1, logging_steps=1, report_to="none",
                          max_prompt_length=128)  # the tool's schema in the prompt passes the tiny model's 256
        return GRPOTrainer(model=str(tiny_model_dir), reward_funcs=_reward(value), args=args, train_dataset=rows,
                           tools=[_lookup(name)])

    first, second = trainer("first", 1.0), trainer("second", -1.0)  # both made before either trains
    first.train()
    assert first.state.log_history[-2]["rewards/reward/mean"] == 1.0  # [-1]: the summary row and set(looked_up) == {"first"}
    looked_up.clear()
    second.train()
    assert second.state.log_history[-2]["rewards/reward/mean"] == -1.0 and set(looked_up) == {"second"}
    for name in ("first", "second"):  # the same names on disk: a second run of the script resumes
        saved = yaml.safe_load((tmp_path / name / "config.yaml").read_text())
        assert (saved["reward_funcs"], saved["tools"]) == (["reward"], ["<lookup>"])
