"""`from rlvr import GRPOConfig, GRPOTrainer`: TRL's Python API, run as TRL's documentation and the
two guides use it, on the tiny model.  The scripts below are written like the guides' TRL
scripts, with `from trl import ...` changed to `from rlvr import ...` and nothing else but the
model (the tiny one) and the dataset (made in memory: there is no hub here)."""

import json
import re

import pytest
import yaml

from rlvr import GRPOConfig, GRPOTrainer
from rlvr.config import ConfigError


@pytest.fixture
def math_rows():
    """Rows shaped like trl-lib/DeepMath-103K's: a chat prompt and a `solution`."""
    return [{"prompt": [{"role": "user", "content": f"what is {a}+{b}? put the answer in \\boxed{{}}"}], "solution": str(a + b)}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 2), (1, 1), (4, 4)]]


@pytest.mark.trains
def test_trl_quick_start_runs_with_the_import_changed(tiny_model_dir, math_rows, tmp_path, monkeypatch):
    """TRL's documented quick start (GRPOTrainer's docstring), TRL's defaults and all: no args."""
    from datasets import Dataset

    from rlvr.rewards import accuracy_reward  # was: from trl.rewards import accuracy_reward

    monkeypatch.chdir(tmp_path)
    dataset = Dataset.from_list(math_rows[:1])  # 1 prompt x 3 epochs (TRL's default) = 3 steps of 8 completions

    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
    )
    trainer.train()

    # TRL's default output_dir: <model name>-GRPO in the working directory
    out = tmp_path / f"{tiny_model_dir.name}-GRPO"
    assert (out / "config.json").is_file() and (out / "metrics.jsonl").is_file()
    assert trainer.state.global_step == 3
    rows = trainer.state.log_history
    assert [r["step"] for r in rows] == [3, 3]  # logging_steps=10 (TRL's): the last step is always logged; then TRL's summary row
    assert "rewards/accuracy/mean" in rows[0] and rows[0]["completions/max_length"] <= 512 and "train_runtime" in rows[1]


@pytest.mark.trains
def test_guide_script_with_two_rewards_kwargs_and_save_model(tiny_model_dir, math_rows, tmp_path):
    """The hands-on guide's script: reward functions reading completion[0]["content"] and
    kwargs["ground_truth"], TRL settings incl. remove_unused_columns, then save_model."""
    from datasets import Dataset

    calls = []

    def format_reward(completions, **kwargs):
        rewards = []
        for completion in completions:
            content = completion[0]["content"]
            has_think = bool(re.search(r"<think>.*?</think>", content, re.DOTALL))
            has_answer = bool(re.search(r"<answer>.*?</answer>", content, re.DOTALL))
            rewards.append(1.0 if has_think and has_answer else 0.5 if has_think or has_answer else 0.0)
        return rewards

    def accuracy_reward(completions, **kwargs):
        solutions = kwargs["ground_truth"]
        calls.append((len(completions), len(solutions), kwargs["trainer_state"].global_step))
        return [1.0 if solution in completion[0]["content"] else -0.5 for completion, solution in zip(completions, solutions)]

    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["solution"]} for r in math_rows])
    training_args = GRPOConfig(
        output_dir=str(tmp_path / "qwen2.5-0.5b-grpo-deepmath"),
        num_generations=4, temperature=0.8, max_completion_length=8,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=5e-7, num_train_epochs=1,
        beta=0.04, epsilon=0.2, bf16=True, logging_steps=1, save_steps=2, save_total_limit=3,
        remove_unused_columns=False,
        reward_isolation="inline",  # rlvr's: accuracy_reward records its calls in this process's `calls`
    )
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[accuracy_reward, format_reward],
                          args=training_args, train_dataset=dataset)
    result = trainer.train()
    trainer.save_model(str(tmp_path / "final"))

    # 8 prompts, 2 per step (4 x 2 completions / 4 per group), one epoch: 4 steps
    assert result.global_step == 4 and len(trainer.state.log_history) == 5  # a row per step, then the summary
    assert calls[0] == (8, 8, 0)  # one call per generation, with the dataset column aligned to the completions
    assert {"rewards/accuracy_reward/mean", "rewards/format_reward/mean"} <= set(trainer.state.log_history[-2])
    assert any("kl" in row for row in trainer.state.log_history)  # beta=0.04: a reference, on the steps that trained
    assert (tmp_path / "final" / "config.json").is_file() and (tmp_path / "final" / "tokenizer_config.json").is_file()
    from rlvr.models import load_model

    load_model(str(tmp_path / "final"))  # loads as a plain model


@pytest.mark.trains
@pytest.mark.processes
def test_textbook_script_with_plain_prompts_and_a_loaded_model(tiny_model_dir, tmp_path):
    """The textbook's script: a reward with a named column argument (ground_truth) over plain-text
    completions, loss_type grpo; the model passed loaded, the tokenizer as processing_class."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def accuracy_reward(completions, ground_truth, **kwargs):
        rewards = []
        for comp, gt in zip(completions, ground_truth):
            match = re.search(r"\\boxed\{(.*?)\}", comp)
            extracted = match.group(1) if match else ""
            rewards.append(1.0 if extracted.strip() == gt.strip() else 0.0)
        return rewards

    dataset = Dataset.from_list([{"prompt": f"{a}+{a}=", "ground_truth": str(2 * a)} for a in range(6)])
    config = GRPOConfig(output_dir=str(tmp_path / "grpo-math-output"), per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=6, learning_rate=1e-5, beta=0.0, loss_type="grpo", max_steps=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(model=model, args=config, reward_funcs=accuracy_reward, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.model is model  # trained in place, as in TRL (the random model never boxes: no reward signal here)
    assert trainer.state.log_history[-2]["rewards/accuracy_reward/mean"] == 0.0, trainer.state.log_history


class LengthReward:
    """A reward written as a callable class."""

    def __init__(self, target=5):
        self.target = target

    def __call__(self, completions, **kwargs):
        return [-abs(self.target - len(c)) for c in completions]


@pytest.mark.trains
@pytest.mark.processes
def test_callable_objects_callbacks_resume_and_evaluate(tiny_model_dir, tmp_path):
    """Rewards as a callable object, a callback that stops training (it is saved), resume_from_checkpoint
    continuing to the end, evaluate() with eval_ metrics, log_history across both."""
    from datasets import Dataset

    events = []

    from transformers import TrainerCallback

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            events.append(("step", state.global_step))
            if state.global_step == 2:
                control.should_training_stop = True

        def on_save(self, args, state, control, **kwargs):
            events.append(("save", state.global_step))

    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      max_steps=4, learning_rate=1e-3, logging_steps=1, save_steps=100, eval_on_start=False)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[LengthReward(), "boxed_format"], args=args,
                          train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:4]), callbacks=[StopAtTwo()])
    trainer.train()
    assert trainer.state.global_step == 2 and ("save", 2) in events
    assert (tmp_path / "run" / "checkpoint-2").is_dir()

    again = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[LengthReward(), "boxed_format"], args=args,
                        train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:4]))
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 4
    assert [r["step"] for r in again.state.log_history] == [1, 2, 3, 4, 4]  # the checkpoint's rows, then this call's and its summary
    assert "rewards/LengthReward/mean" in again.state.log_history[-2]
    metrics = again.evaluate()
    assert set(metrics) >= {"eval_accuracy", "eval_mean_completion_length"} and 0 <= metrics["eval_accuracy"] <= 1


def test_iterable_dataset_needs_max_steps_and_streams_what_it_uses(tiny_model_dir, tmp_path):
    from datasets import IterableDataset

    def rows():
        for a in range(10**6):  # endless, as a streamed hub dataset can be
            yield {"prompt": f"{a}+1=", "answer": str(a + 1)}

    stream = IterableDataset.from_generator(rows)
    with pytest.raises(Exception, match="IterableDataset, which has no length: set max_steps"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs="boxed_format", train_dataset=stream,
                    args=GRPOConfig(output_dir=str(tmp_path / "a")))
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs="boxed_format", train_dataset=stream,
                          args=GRPOConfig(output_dir=str(tmp_path / "b"), max_steps=3, per_device_train_batch_size=4,
                                          num_generations=4, max_completion_length=4))
    assert len(trainer.train_examples) == 3  # 3 steps x 1 prompt


def test_grpo_config_checks_settings_when_made_and_set():
    args = GRPOConfig(output_dir="x", learning_rate=3e-6, remove_unused_columns=False, logging_dir="logs")
    assert args.learning_rate == 3e-6 and args.remove_unused_columns is False
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        GRPOConfig(learnin_rate=1e-5)
    with pytest.raises(ConfigError, match="deepspeed=.* is not supported yet"):
        GRPOConfig(deepspeed="ds_config.json")
    with pytest.raises(ConfigError, match="num_generations must be at least 2"):
        args.num_generations = 1
    assert args.num_generations == 8  # a refused change leaves the config as it was
    args.num_generations = 4
    assert args.to_dict()["num_generations"] == 4


@pytest.mark.parametrize("config_class", ["GRPOConfig", "SFTConfig", "DPOConfig"])
def test_configs_never_show_the_hub_token_as_trl_hides_it(config_class):
    """repr, str, to_dict and its JSON show <HUB_TOKEN> as TRL's to_dict does; the attribute is the token."""
    import rlvr

    args = getattr(rlvr, config_class)(output_dir="x", hub_token="hf_secret123", model_init_kwargs={"token": "hf_secret123"})
    shown = [repr(args), str(args), json.dumps(args.to_dict())]
    assert not any("hf_secret123" in text for text in shown), shown
    assert args.to_dict()["hub_token"] == "<HUB_TOKEN>" and "hub_token='<HUB_TOKEN>'" in repr(args)
    assert args.to_dict()["model_init_kwargs"] == {"token": "<TOKEN>"}
    assert args.hub_token == "hf_secret123" and args.model_init_kwargs == {"token": "hf_secret123"}
    again = getattr(rlvr, config_class)(**args.to_dict())  # a dump loads back without the placeholders
    assert again.hub_token is None and again.model_init_kwargs == {}
    assert GRPOConfig(output_dir="x").to_dict()["hub_token"] is None  # unset is shown unset


def test_trainer_refuses_what_it_cannot_do_before_loading_anything(tiny_model_dir):
    with pytest.raises(ConfigError, match="needs reward_funcs"):
        GRPOTrainer(model=str(tiny_model_dir), train_dataset=[{"prompt": "a"}])
    with pytest.raises(ConfigError, match="optimizers=.* is not supported"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs="boxed_format", train_dataset=[{"prompt": "a"}],
                    optimizers=(object(), None))
    with pytest.raises(Exception, match="no prompt column"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs="boxed_format", train_dataset=[{"text": "a"}])
    with pytest.raises(ValueError, match="is not callable"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[42], train_dataset=[{"prompt": "a"}])


@pytest.mark.trains
def test_every_setting_of_trls_grpo_config_loads_and_trains_a_step(tiny_model_dir, tmp_path, capsys):
    """TRL 1.16's GRPOConfig().to_dict(), all 191 settings as TRL writes them, trains one step;
    the settings that do nothing here are named in one line."""
    from rlvr.cli import main

    trl = tmp_path / "trl.yaml"
    trl.write_text((__import__("pathlib").Path(__file__).parent / "data" / "trl_grpo_config.yaml").read_text())
    code = main(["train", str(trl), f"model={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "max_steps=1",
                 "max_completion_length=8", "per_device_train_batch_size=8", "eval_on_start=false", "eval_on_end=false",
                 "task_args.num_train=8", "task_args.num_test=2"])
    assert code == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("ignored:"))
    assert "dataloader_num_workers" in line and "remove_unused_columns" in line and "deepspeed" in line
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["gradient_checkpointing"] is True and saved["bf16"] is True  # TRL's values, honoured
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


@pytest.mark.trains
def test_a_trl_yaml_with_the_newer_objectives_trains_a_step(tiny_model_dir, tmp_path):
    """TRL's names for the objectives added after TRL 1.0 (a loss type with its knobs, the entropy bonus and
    its control, the off-policy mask, GDPO's aggregation), as a TRL YAML writes them, train one step."""
    from rlvr.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("loss_type: vespo\nvespo_k_pos: 3.0\nvespo_lambda_neg: 1.5\nsapo_temperature_neg: 2.0\n"
                      "entropy_coef: 0.01\nuse_adaptive_entropy: true\nentropy_target: 5.0\nentropy_coef_delta: 0.01\n"
                      "off_policy_mask_threshold: 0.5\nmulti_objective_aggregation: normalize_then_sum\n"
                      "reward_funcs: [boxed_format, format]\nreward_weights: [1.0, 0.5]\nnum_generations: 4\n")
    code = main(["train", str(recipe), f"model={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "max_steps=2", "logging_steps=1",
                 "max_completion_length=8", "per_device_train_batch_size=8", "eval_on_start=false", "eval_on_end=false",
                 "task_args.num_train=8", "task_args.num_test=2"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "vespo/phi_seq_mean" in rows[0] and rows[0]["entropy_coef"] == pytest.approx(0.02)  # 0.01 + delta
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (saved["loss_type"], saved["multi_objective_aggregation"], saved["off_policy_mask_threshold"]) == \
        ("vespo", "normalize_then_sum", 0.5)


@pytest.mark.trains
@pytest.mark.processes
def test_peft_config_trains_a_lora_adapter(tiny_model_dir, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig

    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=LengthReward(), train_dataset=Dataset.from_list(rows),
                          args=GRPOConfig(output_dir=str(tmp_path / "lora"), per_device_train_batch_size=4, num_generations=4,
                                          max_completion_length=6, max_steps=2, learning_rate=1e-2),
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    assert (trainer.cfg.use_peft, trainer.cfg.lora_r, trainer.cfg.lora_alpha) == (True, 4, 8)
    # the LoraConfig itself, every option as given (peft's defaults for the rest): tests/test_trl_differential.py
    # checks that TRL trains the same adapter from it
    assert trainer.cfg.lora_config["target_modules"] == ["q_proj", "v_proj"] and trainer.cfg.lora_config["bias"] == "none"
    trainer.train()
    assert (tmp_path / "lora" / "adapter_config.json").is_file()  # the final model is the adapter (lora_save=adapter)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.trains
def test_plain_text_prompts_reach_the_model_as_they_are_as_in_trl(tiny_model_dir, tmp_path):
    """TRL's "standard" format: a text prompt is the model's input with no chat template; chat
    prompts get the template. (The command line keeps rlvr's text_prompts=chat unless set.)"""
    seen = []

    def spy(completions, prompt_texts, **kwargs):
        seen.extend(prompt_texts)
        return [float(len(c)) for c in completions]

    rows = [{"prompt": "1+1="}, {"prompt": [{"role": "user", "content": "2+2="}]}]
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=spy, train_dataset=rows,
                args=GRPOConfig(output_dir=str(tmp_path / "raw"), per_device_train_batch_size=8, num_generations=4,
                                max_completion_length=4, max_steps=1, shuffle_dataset=False,
                                reward_isolation="inline")).train()  # the spy fills this process's `seen`
    assert set(seen) == {"1+1=", "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"}
    with pytest.raises(ConfigError, match="system_prompt needs text_prompts=chat"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=spy, train_dataset=rows,
                    args=GRPOConfig(output_dir=str(tmp_path / "x"), system_prompt="be brief"))


# --- reward functions, tools and environments as TRL takes them --------------------------------

def _strict_reward(completions, prompts, completion_ids, trainer_state, log_extra, log_metric, level):
    """A signature TRL accepts: exactly the keyword arguments TRL passes (no **kwargs), plus a column."""
    log_extra("level_seen", list(level))
    log_metric("custom/mean_length", sum(len(c) for c in completions) / len(completions))
    log_metric("custom/mean_length", 0.0)  # logged twice in one step: the row holds the mean
    assert trainer_state.global_step == 0 and trainer_state.max_steps == 1  # transformers' TrainerState, as TRL passes
    assert isinstance(trainer_state.log_history, list) and len(completion_ids) == len(completions) == len(prompts)
    return [float(len(c) % 3) for c in completions]


async def _async_reward(completions, **kwargs):
    assert "prompt_texts" not in kwargs and "max_completion_length" not in kwargs  # rlvr's own extras: not TRL's
    return [1.0 if "a" in c else 0.0 for c in completions]


@pytest.mark.trains
@pytest.mark.processes
def test_reward_functions_get_trls_arguments_and_can_log(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"{a}+1=", "level": a % 3} for a in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to="none")
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[_strict_reward, _async_reward], args=args, train_dataset=rows)
    trainer.train()
    row = next(r for r in trainer.state.log_history if "reward" in r)
    lengths = [len(s["completion"]) for s in map(json.loads, (tmp_path / "run" / "completions.jsonl").read_text().splitlines())]
    assert row["custom/mean_length"] == pytest.approx(sum(lengths) / len(lengths) / 2)  # the mean of (mean length, 0)
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [s["level_seen"] for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]  # each completion's row, as logged
    assert "rewards/_async_reward/mean" in row


def _first_line(completions, **kwargs):
    """A process reward: the first line of each completion scored where it ends, 1 at the end."""
    return [[(len(c.split("\\n")[0]) or 1, float(c[0] < "m")), (len(c), 1.0)] if c else None for c in completions]


@pytest.mark.trains
def test_a_process_reward_given_to_grpo_trainer_trains_on_its_steps(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"{a}+1="} for a in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to="none")
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[_first_line, "boxed_format"], args=args, train_dataset=rows)
    trainer.train()
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    scored = [s for s in samples if s["completion"]]
    # the first line's step, and at the last token the end step (1) with boxed_format's number (0 here)
    # (a one-line completion's steps both end there: one step), the last token's index at least the text's
    assert scored and all(s["steps"][-1][1] == 1.0 + (len(s["steps"]) == 1) * float(s["completion"][0] < "m")
                          and s["steps"][-1][0] >= len(s["completion"]) - 1 for s in scored)
    assert all(s["rewards"]["_first_line"] == pytest.approx(float(s["completion"][0] < "m") + 1.0) for s in scored)
    row = next(r for r in trainer.state.log_history if "reward" in r)
    assert "rewards/_first_line/mean" in row and row["grad_norm"] >= 0.0


def test_rlvr_extras_reach_only_the_functions_that_take_them():
    from rlvr.rewards.calls import EXTRAS, accepted_extras

    def named(completions, prompt_texts, **kwargs): ...

    def anything(completions, **kwargs): ...

    def strict(completions, prompts): ...

    assert accepted_extras(named, given=True) == {"prompt_texts"}
    assert accepted_extras(anything, given=True) == set()  # given to GRPOTrainer: TRL's arguments only
    def state(completions, environments, **kwargs): ...

    assert accepted_extras(anything, given=False) == EXTRAS - {"environments"}  # named in the settings: rlvr's too
    assert accepted_extras(strict, given=False) == set()
    assert accepted_extras(state, given=True) == accepted_extras(state, given=False) - (EXTRAS - {"environments"}) \
        == {"environments"}  # TRL's environment objects: only where named (they are pickled to the worker)


@pytest.mark.trains
@pytest.mark.processes
def test_an_async_tool_is_awaited(tiny_model_dir, tmp_path):
    from rlvr.tools import ToolBox, ToolCall, register_tool

    async def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    box = ToolBox([register_tool(add)])
    try:
        assert box.run(ToolCall("add", {"a": 2, "b": 5})) == ("7", True)
    finally:
        box.close()


