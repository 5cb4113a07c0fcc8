"""One path from prompts to scored completions (rollout/path.py): `rlvr sample` and `rlvr eval` of a
run trained with tools call them as training did, evaluation takes a run's rollout_func, and the
sampling parameters of training, evaluation and sampling come from one place.

The tiny random model cannot spell a tool call, so where a call must happen a scripted sampler
stands in for its engine (the run's model is still loaded): its first turn calls the calculator on
the question asked, its next answers with what the calculator said, if it said anything."""

from __future__ import annotations

import json
import re

import pytest

from rlvr import cli
from rlvr.config import build_config
from rlvr.rewards import RewardSet
from rlvr.rollout import SamplingParams, sampling_params
from rlvr.types import Example, Rollout

CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*/=?.,:;_'\"(){}[]\\<>\n")


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory):
    """A run of one step of the tiny model trained with the calculator (config.yaml: tools: [calculator]);
    stop strings keep the random model's turns short."""
    from conftest import make_tiny_model, make_tokenizer

    from rlvr.run import train

    tok = make_tokenizer(CHARS)  # it can spell JSON
    model_dir = tmp_path_factory.mktemp("tiny-json")
    make_tiny_model(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    run = tmp_path_factory.mktemp("tools") / "run"
    train(build_config({
        "model": str(model_dir), "task_args": {"digits": 1, "num_train": 8, "num_test": 2}, "tools": ["calculator"],
        "max_turns": 2, "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 120,
        "stop_strings": list("aeiou "), "max_steps": 1, "save_steps": 100, "eval_on_start": False, "eval_on_end": False,
        "max_prompt_length": 120, "output_dir": str(run)}))  # the calculator's description: 700 tokens, context 256
    return run


class CallsTheCalculator:
    """Turn 1: a calculator call on the last "What is ...?" of the prompt; turn 2: the tool's
    answer, boxed (or "no result" when no tool answered)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos = tokenizer, [tokenizer.eos_token_id]

    def generate(self, prompt_ids, params, generator=None):
        out = []
        for ids in prompt_ids:
            prompt = self.tokenizer.decode(ids)
            if "<tool_call>" not in prompt.rpartition("What is")[2]:
                expression = re.findall(r"What is (.+?)\?", prompt)[-1]
                text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expression
            else:
                answered = re.search(r"tool\n(.+?)<\|im_end\|>", prompt.rpartition("</tool_call>")[2])
                text = f"\\boxed{{{answered.group(1)}}}" if answered else "no result"
            completion = self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.eos
            assert len(completion) <= params.max_tokens
            out.append([Rollout(list(ids), completion, [0.0] * len(completion), "stop", text) for _ in range(params.n)])
        return out


@pytest.fixture
def calculator_model(monkeypatch):
    import rlvr.rollout.engine

    monkeypatch.setattr(rlvr.rollout.engine, "make_sampler", lambda model, tokenizer, *a, **k: CallsTheCalculator(tokenizer))


@pytest.mark.trains
def test_sample_of_a_run_trained_with_tools_calls_them(tools_run, calculator_model, capsys):
    """Before the one path, `rlvr sample` sampled one turn without the run's tools: the completion
    was the call itself, never answered, and scored 0."""
    assert cli.main(["sample", f"model={tools_run}", "prompt=What is 6 * 7?", "n=2", "answer=42"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- completion") == 2
    assert out.count("[tool] 42") == 2  # the calculator ran, and its result is in the transcript
    assert out.count("[assistant] \\boxed{42}") == 2 and out.count("reward 1 ") == 2


@pytest.mark.trains
def test_eval_of_a_run_trained_with_tools_calls_them(tools_run, calculator_model, tmp_path):
    out = tmp_path / "eval.json"
    assert cli.main(["eval", f"model={tools_run}", f"eval_output={out}"]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["tools"] == ["calculator"] and result["n"] == 2
    assert result["accuracy"] == 1.0  # each answer is the calculator's
    for sample in result["samples"]:
        roles = [m["role"] for m in sample["turns"]]
        assert roles == ["assistant", "tool", "assistant"]
        assert sample["turns"][1]["content"] == sample["answer"] and sample["completion"] == f"\\boxed{{{sample['answer']}}}"


# --- evaluation takes the run's rollout_func --------------------------------------------------


def boxed_rollouts(prompts, trainer):
    """A rollout_func that answers every prompt with \\boxed{7}, whatever the sampler says."""
    tok = trainer.processing_class
    ids = tok(["q"] * len(prompts), add_special_tokens=False)["input_ids"]
    answer = tok("\\boxed{7}", add_special_tokens=False)["input_ids"]
    return {"prompt_ids": ids, "completion_ids": [answer] * len(prompts), "logprobs": [[0.0] * len(answer)] * len(prompts)}


class Says:
    def __init__(self, text):
        self.text = text

    def generate(self, prompt_ids, params, generator=None):
        return [[Rollout(list(ids), [5], [0.0], "stop", self.text) for _ in range(params.n)] for ids in prompt_ids]


def test_evaluation_samples_with_the_runs_rollout_func():
    """Before the one path, evaluation sampled around a run's rollout_func."""
    from conftest import make_tokenizer

    from rlvr.loop import evaluate_run as evaluate

    tok = make_tokenizer()
    examples = [Example("what is 3 + 4?", "7", {"answer": "7"})]
    plain = evaluate(Says("\\boxed{1}"), tok, examples, RewardSet(["accuracy"]), "accuracy", build_config({}))
    cfg = build_config({"rollout_func": "test_rollout_path:boxed_rollouts"})
    with_func = evaluate(Says("\\boxed{1}"), tok, examples, RewardSet(["accuracy"]), "accuracy", cfg)
    assert (plain.accuracy, with_func.accuracy) == (0.0, 1.0)
    assert with_func.samples[0]["completion"] == "\\boxed{7}"


# --- sampling parameters, built in one place ----------------------------------------------------


def test_evaluation_sampling_parameters():
    cfg = build_config({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.2,
                        "stop_strings": ["\n\n"], "max_completion_length": 64, "num_generations": 4})
    # greedy: no truncation, no repetition penalty; the stop strings and the length as in training
    assert sampling_params(cfg.rollout_settings, n=1, eval_temperature=0.0) == SamplingParams(
        n=1, max_tokens=64, temperature=0.0, stop_strings=("\n\n",))
    # sampled: training's truncation at eval_temperature, still no repetition penalty
    assert sampling_params(cfg.rollout_settings, n=8, eval_temperature=0.6) == SamplingParams(
        n=8, max_tokens=64, temperature=0.6, top_p=0.9, top_k=20, min_p=0.1, stop_strings=("\n\n",))
    # training, and `rlvr sample`'s n completions at the training settings
    training = SamplingParams(n=4, max_tokens=64, temperature=0.7, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.2,
                              stop_strings=("\n\n",))
    assert sampling_params(cfg.rollout_settings) == training
    assert sampling_params(cfg.rollout_settings, n=2) == SamplingParams(**{**training.__dict__, "n": 2})
