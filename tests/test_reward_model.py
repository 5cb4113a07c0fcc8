"""Reward models as TRL's reward_funcs takes them: a sequence classifier (num_labels 1) given by
path, id or object scores prompt + completion, and each score equals a forward of that model on
that one text alone (so padding, batching and the chat template are right); what is wrong with
one is said before any model loads."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_classifier, make_tokenizer
from rlvr.config import ConfigError, build_config
from rlvr.rewards import RewardSet
from rlvr.settings import check_settings
from rlvr.types import Example, Rollout

COMPLETIONS = ["2", " the answer is 42.", "x" * 60]  # three lengths: padded rows in a batch of two, then one alone


def _direct(path, text: str) -> float:
    """The classifier's score of one text, unpadded: what TRL's reward is for that row."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        return model(**ids).logits[0, 0].item()


def _rollouts(texts):
    return [Rollout([1], [5], [-0.1], "stop", t) for t in texts]


def test_scores_equal_a_forward_of_the_classifier_on_prompt_and_completion(tiny_reward_model_dir):
    rewards = RewardSet([str(tiny_reward_model_dir), "boxed_format"], weights=[2.0, 1.0], model_batch_size=2)
    assert rewards.names == [tiny_reward_model_dir.name, "boxed_format"]  # TRL's name: the path's last part
    scores = rewards.score_groups([Example("what is 6*7? ", "42")], [_rollouts(COMPLETIONS)])
    expected = [_direct(tiny_reward_model_dir, "what is 6*7? " + c) for c in COMPLETIONS]
    got = scores.per_func[tiny_reward_model_dir.name]
    assert got == pytest.approx(expected, abs=1e-5) and len(set(got)) == 3
    assert scores.total == pytest.approx([2 * e for e in expected], abs=1e-5)  # weighted like any reward (boxed: 0)


def test_chat_prompts_are_scored_in_the_reward_models_template(tiny_reward_model_dir):
    prompt = [{"role": "user", "content": "what is 6*7?"}]
    example = Example(prompt, "42")
    scores = RewardSet([str(tiny_reward_model_dir)]).score_groups([example], [_rollouts(["42", "i think 41"])])
    tokenizer = make_tokenizer()
    texts = [tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": c}], tokenize=False)
             for c in ("42", "i think 41")]
    assert scores.per_func[tiny_reward_model_dir.name] == pytest.approx([_direct(tiny_reward_model_dir, t) for t in texts], abs=1e-5)


def test_a_model_that_is_not_a_reward_model_is_refused_before_anything_loads(tiny_model_dir, tmp_path, monkeypatch):
    def problems(name):
        with pytest.raises(ConfigError) as raised:
            check_settings(build_config({"model": str(tiny_model_dir), "reward_funcs": [name]}))
        return str(raised.value)

    assert "is a LlamaForCausalLM, not a sequence-classification model: its score head would be new random weights" \
        in problems(str(tiny_model_dir))
    two = tmp_path / "two-labels"
    make_tiny_classifier(len(make_tokenizer()), num_labels=2).save_pretrained(two)
    assert f"reward model {str(two)!r} has num_labels=2; a reward model gives one score" in problems(str(two))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "'nobody/no-such-reward-model'" in problems("nobody/no-such-reward-model") and "local cache" in problems(
        "nobody/no-such-reward-model")
    assert "did you mean 'accuracy'?" in problems("acuracy")  # a word is a misspelt function, not a model id
    assert "give your own as package.module:function or path/to/file.py:function" in problems("rewards/mine.py")


@pytest.mark.trains
def test_grpo_trainer_takes_reward_models_by_object_and_by_path(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rlvr import GRPOConfig, GRPOTrainer

    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir, num_labels=1)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to="none", logging_steps=1)
    rows = [{"prompt": "3+4=", "answer": "7"}]
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[classifier, str(tiny_reward_model_dir)], args=args,
                          train_dataset=rows, reward_processing_classes=[make_tokenizer(), None])
    trainer.train()
    row = next(r for r in trainer.state.log_history if "reward" in r)
    by_object, by_path = row[f"rewards/{tiny_reward_model_dir.name}/mean"], row[f"rewards/{tiny_reward_model_dir.name}_2/mean"]
    assert by_object == pytest.approx(by_path, abs=1e-5)  # the same weights, loaded twice
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    expected = [_direct(tiny_reward_model_dir, "3+4=" + s["completion"]) for s in samples]
    assert row["reward"] == pytest.approx(2 * sum(expected) / len(expected), abs=1e-4)
    with pytest.raises(ConfigError, match="reward_processing_classes has 1 entries but reward_funcs has 2"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[classifier, "accuracy"], args=args, train_dataset=rows,
                    reward_processing_classes=[make_tokenizer()])


def test_trls_reward_model_name_or_path_goes_first_among_reward_funcs(tiny_reward_model_dir):
    cfg = build_config({"reward_funcs": ["accuracy"], "reward_model_name_or_path": str(tiny_reward_model_dir)})
    assert cfg.reward_funcs == (str(tiny_reward_model_dir), "accuracy")  # as TRL's grpo.py builds its list
    assert build_config({"reward_model_name_or_path": None}).reward_funcs is None
