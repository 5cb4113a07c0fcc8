"""rlvr against TRL itself: the same SFT step and the same DPO step.

TRL 1.16's SFTTrainer / DPOTrainer and rlvr's train the same tiny model (conftest.py's) on the same
rows for one optimizer step, each with TRL's defaults except what a CPU needs (use_cpu, fp32) and
what keeps the runs comparable (no checkpoints, no loggers).  The logged loss and every parameter's
gradient where the optimizer is about to use it (transformers' on_pre_optimizer_step) agree to fp32
tolerance.  The differences kept by design are in docs/finetune.md ("Differences from TRL").
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.trains

# The tiny tokenizer has one token per character (conftest.CHARS): the rows stay within it.
SFT_ROWS = {
    "text": [{"text": "the sky is blue."}, {"text": "2+3=5, so 5."}, {"text": "abc def"}],
    "prompt-completion": [{"prompt": "2+3=", "completion": "5"}, {"prompt": "say hi.", "completion": "hi there"},
                          {"prompt": "7-1=", "completion": "6, done"}],
    "messages": [
        {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"},
                      {"role": "user", "content": "and 5+1?"}, {"role": "assistant", "content": "6."}]},
        {"messages": [{"role": "system", "content": "be short."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
    ],
    "prompt-completion-conversational": [
        {"prompt": [{"role": "user", "content": "2+3?"}], "completion": [{"role": "assistant", "content": "5"}]},
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello there"}]},
    ],
}

DPO_ROWS = {
    "explicit": [{"prompt": "2+3=", "chosen": "5", "rejected": "six"},
                 {"prompt": "say hi.", "chosen": "hi there", "rejected": "no"}],
    "implicit-text": [{"chosen": "2+3= 5", "rejected": "2+3= six"}, {"chosen": "abc yes", "rejected": "abc no way"}],
    "implicit-messages": [
        {"chosen": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
         "rejected": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "six"}]},
        {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
         "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}]},
    ],
}


def _common(out, rows: list, settings: dict) -> dict:
    return {"output_dir": str(out), "use_cpu": True, "bf16": False, "report_to": "none", "save_strategy": "no",
            "logging_steps": 1, "max_steps": 1, "per_device_train_batch_size": len(rows), "learning_rate": 1e-2,
            **settings}


class Grab:
    """Every gradient where the optimizer is about to use it (a duck-typed TrainerCallback)."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def _trl(kind: str, model_dir, out, rows: list, settings: dict):
    from datasets import Dataset
    from transformers import TrainerCallback

    grab = type("TRLGrab", (Grab, TrainerCallback), {})()
    config, trainer_class = (trl.SFTConfig, trl.SFTTrainer) if kind == "sft" else (trl.DPOConfig, trl.DPOTrainer)
    trainer = trainer_class(model=str(model_dir), args=config(**_common(out, rows, settings)),
                            train_dataset=Dataset.from_list(rows), callbacks=[grab])
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    return grab.grads, logged


def _rlvr(kind: str, model_dir, out, rows: list, settings: dict):
    import rlvr

    grab = Grab()
    config, trainer_class = (rlvr.SFTConfig, rlvr.SFTTrainer) if kind == "sft" else (rlvr.DPOConfig, rlvr.DPOTrainer)
    trainer = trainer_class(model=str(model_dir), args=config(**_common(out, rows, {"shuffle_dataset": False, **settings})),
                            train_dataset=rows, callbacks=[grab])
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    return grab.grads, logged


SFT_METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")  # every metric TRL's SFT step logs
DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
               "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
               "num_tokens")


def _compare(theirs, ours, metrics=("loss", "grad_norm")):
    (trl_grads, trl_rows), (our_grads, our_rows) = theirs, ours
    assert len(our_grads) == len(trl_grads) == 1
    assert set(our_grads[0]) == set(trl_grads[0]), "the trained parameters differ"
    for name, grad in trl_grads[0].items():
        torch.testing.assert_close(our_grads[0][name], grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert set(metrics) <= set(trl_rows[0]), "TRL does not log one of these"
    for key in metrics:
        assert our_rows[0][key] == pytest.approx(trl_rows[0][key], rel=1e-4, abs=1e-6), key


SFT_CASES = {
    "text": ("text", {}),
    "text-field": ("text", {"dataset_text_field": "body"}),
    "prompt-completion": ("prompt-completion", {}),
    "prompt-completion-full-loss": ("prompt-completion", {"completion_only_loss": False}),
    "messages-multi-turn": ("messages", {}),
    "prompt-completion-conversational": ("prompt-completion-conversational", {}),
    "dft": ("prompt-completion", {"loss_type": "dft"}),
    "truncated-keep-start": ("text", {"max_length": 8}),
    "truncated-keep-end": ("text", {"max_length": 8, "truncation_mode": "keep_end"}),
}


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_one_sft_step_agrees_with_trl(case, tiny_model_dir, tmp_path):
    data, settings = SFT_CASES[case]
    rows = SFT_ROWS[data]
    if "dataset_text_field" in settings:
        rows = [{settings["dataset_text_field"]: r["text"]} for r in rows]
    theirs = _trl("sft", tiny_model_dir, tmp_path / "trl", rows, settings)
    ours = _rlvr("sft", tiny_model_dir, tmp_path / "rlvr", rows, settings)
    _compare(theirs, ours, SFT_METRICS)


def test_an_epochs_last_sft_step_is_short_as_in_trl(tiny_model_dir, tmp_path):
    """3 rows in batches of 2 for one epoch: two steps, the second of one row, in both (TRL's dataloader
    keeps its short last batch); every row's tokens counted once (num_tokens).  TRL draws the rows in a
    random order, so the steps' gradients are not compared here."""
    rows, settings = SFT_ROWS["text"], {"per_device_train_batch_size": 2, "max_steps": -1, "num_train_epochs": 1}
    (_, trl_rows), (_, our_rows) = (run("sft", tiny_model_dir, tmp_path / name, rows, settings)
                                    for run, name in ((_trl, "trl"), (_rlvr, "rlvr")))
    assert len(our_rows) == len(trl_rows) == 2
    assert our_rows[-1]["num_tokens"] == trl_rows[-1]["num_tokens"]


GENERATION_TEMPLATE = (  # conftest's ChatML with the assistant's tokens marked, as assistant_only_loss needs
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_assistant_only_loss_trains_every_assistant_turn_as_trl(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = GENERATION_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    settings = {"assistant_only_loss": True}
    theirs = _trl("sft", model_dir, tmp_path / "trl", SFT_ROWS["messages"], settings)
    ours = _rlvr("sft", model_dir, tmp_path / "rlvr", SFT_ROWS["messages"], settings)
    _compare(theirs, ours, SFT_METRICS)


DPO_CASES = {
    "sigmoid": ("explicit", {}),
    "ipo": ("explicit", {"loss_type": ["ipo"]}),
    "hinge": ("explicit", {"loss_type": "hinge", "beta": 0.5}),
    "weighted-sum": ("explicit", {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.5]}),
    "implicit-text": ("implicit-text", {}),
    "implicit-messages": ("implicit-messages", {}),
    "truncated": ("explicit", {"max_length": 6}),
}


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_one_dpo_step_agrees_with_trl(case, tiny_model_dir, tmp_path):
    data, settings = DPO_CASES[case]
    rows = DPO_ROWS[data]
    theirs = _trl("dpo", tiny_model_dir, tmp_path / "trl", rows, settings)
    ours = _rlvr("dpo", tiny_model_dir, tmp_path / "rlvr", rows, settings)
    _compare(theirs, ours, DPO_METRICS)
