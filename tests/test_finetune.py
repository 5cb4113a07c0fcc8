"""rlvr sft / rft / dpo on the tiny model: the SFT loss is transformers' own causal-LM loss, each
trainer learns what it is given, rejection sampling keeps exactly the verifier-correct samples,
and a stopped run resumes exactly."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from rlvr.config import ConfigError, build_config
from rlvr.methods import method_settings
from rlvr.finetune.data import Demonstration, Encoder, keep_correct, make_pairs, pack, to_batch
from rlvr.run import train


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def sft_data(tmp_path):
    train_rows = [{"prompt": f"what is {i}?", "completion": "\\boxed{42}", "answer": "42"} for i in range(12)]
    d = tmp_path / "sft-data"
    d.mkdir()
    _write(d / "train.jsonl", train_rows)
    _write(d / "test.jsonl", [{"prompt": f"and {i}?", "completion": "\\boxed{42}", "answer": "42"} for i in range(4)])
    return str(d)


@pytest.fixture
def pair_data(tmp_path):
    rows = [{"prompt": f"what is {i}?", "chosen": "\\boxed{42}", "rejected": "\\boxed{17}", "answer": "42"} for i in range(8)]
    return _write(tmp_path / "pairs.jsonl", rows)


def _config(tiny_model_dir, out, method, **settings):
    base = {"model": str(tiny_model_dir), "max_completion_length": 8, "learning_rate": 1e-2, "max_steps": 4,
            "save_steps": 2, "logging_steps": 1, "eval_on_start": False, "eval_on_end": False, "output_dir": str(out),
            "per_device_train_batch_size": 4, "lr_scheduler_type": "constant"}
    return build_config(method_settings(method, {}), base, method_settings(method, settings))


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")} for r in rows]


# --- the loss against transformers' own ----------------------------------------------------

@pytest.mark.parametrize("completion_only", [True, False])
def test_sft_loss_is_transformers_causal_lm_loss(tiny, completion_only):
    """The trainer's token loss, on rlvr's fast path, equals model(input_ids, labels=...).loss
    with the prompt's labels at -100 (completion_only_loss) or none masked."""
    from rlvr.finetune.losses import sft_loss
    from rlvr.logprobs import LogProbs

    model, tokenizer = tiny
    cfg = build_config({"method": "sft", "text_prompts": "raw", "max_length": 64})
    enc = Encoder(cfg.data_settings, tokenizer, tokenizer.eos_token_id, cfg.max_length)
    prompts, completions = ["what is 2+3?", "say hi"], ["5", "hi there"]
    seqs = enc.sequences(prompts, completions, full_loss=not completion_only)
    batch = to_batch(seqs, tokenizer.pad_token_id)
    logp, _ = LogProbs(True, 1.0)(model, batch)
    ours = sft_loss(logp, batch.completion_mask, batch.num_tokens)
    ids, labels = [], []
    for p, c, _ in seqs:
        ids.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    label_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
    mask = (torch.arange(width)[None] < torch.tensor([len(x) for x in ids])[:, None]).long()
    theirs = model(input_ids=input_ids, attention_mask=mask, labels=label_t).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    # the prompt is trained on only without completion_only_loss: its tokens are then in the completion
    # "5" and "hi there" are 1 and 8 characters, plus the end-of-turn token; else all but the first token
    assert [len(c) for _, c, _ in seqs] == ([2, 9] if completion_only else [len(x) - 1 for x in ids])


def test_sequences_end_with_eos_and_are_cut_at_max_length(tiny):
    _, tokenizer = tiny
    cfg = build_config({"method": "sft", "text_prompts": "raw", "max_length": 8})
    enc = Encoder(cfg.data_settings, tokenizer, tokenizer.eos_token_id, cfg.max_length)
    (p, c, _), none = enc.sequences(["abc", "abcdefgh"], ["xyz", "x"])
    assert p == tokenizer("abc", add_special_tokens=False)["input_ids"]
    assert c == tokenizer("xyz", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # the model learns to stop
    assert none is None and enc.dropped == 1  # an 8-token prompt leaves no room under max_length=8


def test_pack_is_best_fit_decreasing():
    # sorted by length: 5 (i0), 4 (i1), 3 (i2), 3 (i3), 1 (i4); capacity 8
    # 5 -> bin A (room 3); 4 -> new bin B (room 4); 3 (i2) fits A (3) and B (4): best fit A (room 0);
    # 3 (i3) -> B (room 1); 1 (i4) -> B (room 0)
    assert pack([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert pack([9, 2], 8) == [[0], [1]]  # a longer one gets a bin of its own


def test_keep_correct_keeps_exactly_the_distinct_samples_scored_one():
    texts = [["a", "b", "a", "c"], ["d", "e"]]
    scores = [[1.0, 0.5, 1.0, 1], [None, 0.0]]
    assert keep_correct(texts, scores) == [(0, "a"), (0, "c")]  # 0.5 is not correct; "a" once
    assert make_pairs([["a", "b", "c", "a"], ["d", "e"]], [[1, 0, None, 1], [1, 1]]) == [(0, "a", "b")]


# --- learning --------------------------------------------------------------------------------

@pytest.mark.trains
def test_sft_teaches_the_demonstrated_answer(tiny_model_dir, tmp_path, sft_data):
    out = tmp_path / "sft"
    summary = train(_config(tiny_model_dir, out, "sft", dataset=sft_data, max_steps=30, eval_on_start=True, eval_on_end=True, max_completion_length=16,
                            save_strategy="no"))
    assert summary["eval_before"]["accuracy"] == 0.0
    assert summary["eval_after"]["accuracy"] == 1.0  # greedy "\boxed{42}" on prompts it never saw
    rows = _rows(out)
    assert rows[-1]["loss"] < 0.05 * rows[0]["loss"]
    # TRL's num_tokens: every token of the rows trained on so far, prompt included. The first step's 4 rows
    # are a 29-token chat prompt ("what is 3?", one digit) and "\boxed{42}" with the end of turn "<|im_end|>\n" (12)
    assert rows[0]["num_tokens"] == 4 * (29 + 12)
    assert all(b["num_tokens"] - a["num_tokens"] >= 4 * 41 for a, b in zip(rows, rows[1:]))  # adding up over the run
    assert 0 <= rows[0]["mean_token_accuracy"] < rows[-1]["mean_token_accuracy"] == 1.0  # it learned to predict every token


@pytest.mark.trains
def test_dpo_learns_to_prefer_the_chosen_completion(tiny_model_dir, tmp_path, pair_data):
    out = tmp_path / "dpo"
    train(_config(tiny_model_dir, out, "dpo", dataset=pair_data, max_steps=12, beta=0.5, save_strategy="no"))
    rows = _rows(out)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at the first step: h = 0
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert rows[-1]["rewards/accuracies"] == 1.0 and rows[-1]["rewards/margins"] > 1.0
    assert rows[-1]["loss"] < 0.3 and rows[-1]["logps/chosen"] > rows[-1]["logps/rejected"]


def _starts_with_digit(completions, **kwargs):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


@pytest.fixture
def digit_verifier(monkeypatch):
    """The task's verifier replaced by "the completion starts with a digit" (18% of the tiny model's samples)."""
    import rlvr.finetune.trainer as trainer
    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "starts_with_digit", _starts_with_digit)
    monkeypatch.setattr(trainer, "verifier_name", lambda cfg: "starts_with_digit")


def _rft_config(tiny_model_dir, out, **settings):
    return _config(tiny_model_dir, out, "sft", **{
        "self_samples": True, "reward_funcs": ["starts_with_digit"], "num_generations": 4, "self_round_prompts": 4,
        "self_round_steps": 2, "task_args": {"digits": 2, "num_train": 50, "num_test": 8}, "max_completion_length": 6, **settings})


def test_rft_keeps_exactly_the_verifier_correct_samples(tiny_model_dir, tmp_path, digit_verifier):
    from rlvr.finetune.data import load_data
    from rlvr.finetune.trainer import FinetuneTrainer
    from rlvr.models import load_model

    cfg = _rft_config(tiny_model_dir, tmp_path / "r", self_round_prompts=3, num_generations=5)
    model, tokenizer, _ = load_model(str(tiny_model_dir))
    data, examples, _ = load_data(cfg.data_settings, cfg.finetune_settings, cfg.seed, "sft")
    trainer = FinetuneTrainer(cfg, model, tokenizer, data, examples, tmp_path / "r")
    metrics = trainer._new_round()
    samples = trainer.last_samples  # all 15 of this round
    assert len(samples) == 15
    expected = {(s["prompt"], s["completion"]) for s in samples if s["reward"] == 1.0}  # distinct per prompt
    assert 0 < len(expected) < 15
    prompts = {p: trainer.encoder.prompts([p])[0] for p, _ in expected}
    got = sorted((tuple(p), tokenizer.decode(c[:-1])) for p, c, _ in trainer.sequences)
    assert got == sorted((tuple(prompts[p]), t) for p, t in expected)
    assert metrics["self/keep_rate"] == pytest.approx(len(expected) / 15)
    trainer.close()


@pytest.mark.trains
def test_rft_raises_the_verifier_correct_rate_round_after_round(tiny_model_dir, tmp_path, digit_verifier):
    out = tmp_path / "rft"
    train(_rft_config(tiny_model_dir, out, max_steps=32, self_round_prompts=8, self_round_steps=4, save_strategy="no"))
    rates = [r["self/correct_rate"] for r in _rows(out) if "self/correct_rate" in r]
    print(rates)
    assert len(rates) == 8  # one per round of 4 steps
    assert rates[0] < 0.3 and min(rates[-2:]) > 0.7


# --- exact resume ------------------------------------------------------------------------------

def _interrupt_at_step(monkeypatch, n):
    from rlvr.monitor import MetricsLog

    original, calls = MetricsLog.add, {"n": 0}

    def add(self, *args, **kwargs):  # Ctrl-C while step n is recorded: it completes, is saved, the run stops
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MetricsLog, "add", add)
    return original


@pytest.mark.trains
@pytest.mark.parametrize("kind", ["sft", "sft-packed", "dpo", "rft"])
def test_a_stopped_run_resumes_exactly(kind, tiny_model_dir, tmp_path, monkeypatch, sft_data, pair_data, digit_verifier):
    from rlvr.monitor import MetricsLog

    def cfg(out, **extra):
        if kind == "rft":  # stopped in the middle of its second round
            return _rft_config(tiny_model_dir, out, **extra)
        data = pair_data if kind == "dpo" else sft_data
        more = {"packing": True, "max_length": 40, "per_device_train_batch_size": 2} if kind == "sft-packed" else {}
        return _config(tiny_model_dir, out, "dpo" if kind == "dpo" else "sft", dataset=data, **more, **extra)

    straight = tmp_path / "straight"
    train(cfg(straight))
    out = tmp_path / "stopped"
    original = _interrupt_at_step(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(cfg(out))
    assert (out / "checkpoint-3").is_dir()
    monkeypatch.setattr(MetricsLog, "add", original)
    train(cfg(out, resume=True))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(out) == _rows(straight)


# --- settings and errors ---------------------------------------------------------------------

def test_dpo_names_are_trl_dpoconfig_names():
    from rlvr import DPOConfig, SFTConfig

    args = DPOConfig(output_dir="x", beta=0.3, loss_type="ipo", max_length=256)
    assert (args.beta, args.loss_type, args._config.dpo_beta, args._config.beta) == (0.3, ["ipo"], 0.3, 0.0)
    assert args.learning_rate == 1e-6 and SFTConfig(output_dir="x").learning_rate == 2e-5  # TRL's defaults
    with pytest.raises(ConfigError, match="loss_type 'ipo2' for rlvr dpo is unknown; rlvr has sigmoid, ipo, hinge"):
        DPOConfig(loss_type="ipo2")
    # a GRPO recipe's loss_type (the demo file has loss_type: grpo) stays GRPO's under rlvr dpo demo
    assert method_settings("dpo", {"loss_type": "grpo", "beta": 0.2}) == {"loss_type": "grpo", "dpo_beta": 0.2}


def test_dpo_on_the_builtin_task_without_pairs_says_what_to_do(tiny_model_dir, tmp_path):
    from rlvr.tasks.dataset import DatasetError

    with pytest.raises(DatasetError, match="self_samples=true"):
        train(_config(tiny_model_dir, tmp_path / "d", "dpo"))
    assert not (tmp_path / "d").exists()  # a run that failed before writing anything leaves no directory behind


def test_a_pair_file_without_rejected_names_the_column(tiny_model_dir, tmp_path):
    from rlvr.tasks.dataset import DatasetError

    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b"}] * 4)
    with pytest.raises(DatasetError, match="no 'rejected' column"):
        train(_config(tiny_model_dir, tmp_path / "d", "dpo", dataset=bad))


# --- TRL's documented quick starts, with the import changed ----------------------------------

@pytest.mark.trains
def test_trl_sft_quick_start_runs_on_chat_messages(tiny_model_dir, tmp_path, monkeypatch):
    """TRL's SFTTrainer quick start (trl-lib/Capybara: a `messages` column), on in-memory rows."""
    from rlvr import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer

    monkeypatch.chdir(tmp_path)
    dataset = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello there"}]}
               for i in range(8)]
    trainer = SFTTrainer(model=str(tiny_model_dir), train_dataset=dataset, args=SFTConfig(max_steps=3, learning_rate=1e-3))
    out = trainer.train()
    assert out.global_step == 3 and (tmp_path / "tiny-llama0-SFT" / "model.safetensors").is_file()
    assert trainer.state.log_history[-2]["num_tokens"] > 0 and "train_loss" in trainer.state.log_history[-1]
    with pytest.raises(ConfigError, match=r"SFTTrainer\(formatting_func=...\) is not supported"):
        SFTTrainer(model=str(tiny_model_dir), train_dataset=dataset, formatting_func=lambda row: row)


@pytest.mark.trains
def test_trl_dpo_quick_start_runs_on_implicit_prompt_pairs(tiny, tmp_path):
    """TRL's DPOTrainer quick start: a loaded model and tokenizer, DPOConfig(output_dir=...), and
    trl-lib/ultrafeedback_binarized's shape (chosen / rejected conversations, no prompt column)."""
    from rlvr import DPOConfig, DPOTrainer  # was: from trl import DPOConfig, DPOTrainer

    model, tokenizer = tiny
    convo = [{"role": "user", "content": "2+2?"}]
    train_dataset = [{"chosen": convo + [{"role": "assistant", "content": "4"}],
                      "rejected": convo + [{"role": "assistant", "content": "5"}]}] * 4
    training_args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_steps=2, logging_steps=1)
    trainer = DPOTrainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=train_dataset)
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and "rewards/margins" in first
    assert trainer.model is model  # trained in place, as in TRL


@pytest.mark.trains
def test_dpo_with_lora_uses_the_model_with_its_adapter_off_as_reference(tiny_model_dir, tmp_path, pair_data):
    out = tmp_path / "dpo-lora"
    train(_config(tiny_model_dir, out, "dpo", dataset=pair_data, max_steps=6, use_peft=True, lora_r=4, lora_alpha=8,
                  learning_rate=5e-2, beta=0.5, save_strategy="no"))
    rows = _rows(out)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # a fresh adapter (B = 0) is the reference itself
    assert rows[-1]["rewards/margins"] > 0.1 and (out / "adapter_model.safetensors").is_file()


def test_an_empty_demonstration_is_named_by_file_and_line(tiny_model_dir, tmp_path):
    from rlvr.tasks.dataset import DatasetError

    bad = _write(tmp_path / "demos.jsonl", [{"prompt": "a", "completion": "b"}] * 3 + [{"prompt": "c", "completion": " "}] * 2)
    with pytest.raises(DatasetError, match=r"demos.jsonl:[45]: column 'completion' must hold non-empty text"):
        train(_config(tiny_model_dir, tmp_path / "s", "sft", dataset=bad))


@pytest.mark.trains
def test_rows_that_max_length_leaves_without_a_trained_token_are_dropped_in_one_line(tiny_model_dir, tmp_path, capsys):
    """As TRL: a prompt that fills max_length (keep_start) leaves its completion cut away; the row is
    dropped and the run says how many, once.  Every row dropped: an error that says what to raise."""
    rows = [{"prompt": f"what is {i}?", "completion": "\\boxed{42}"} for i in range(8)]
    rows += [{"prompt": "tell me " * 200, "completion": "\\boxed{42}"} for _ in range(4)]
    data = tmp_path / "demos"
    data.mkdir()
    _write(data / "train.jsonl", rows)
    _write(data / "test.jsonl", rows[:2])  # so that all 12 train
    train(_config(tiny_model_dir, tmp_path / "s", "sft", dataset=str(data), max_length=200, max_steps=1, save_strategy="no"))
    out = capsys.readouterr().out
    assert out.count("dropped 4 of 12 rows: no trained token fits max_length=200 (truncation_mode=keep_start)") == 1
    long_only = _write(tmp_path / "long.jsonl", rows[8:])
    with pytest.raises(ValueError, match="no example fits max_length=200 with at least one trained token; raise max_length"):
        train(_config(tiny_model_dir, tmp_path / "t", "sft", dataset=long_only, max_length=200, max_steps=1, save_strategy="no"))


@pytest.mark.trains
def test_rlvr_train_refuses_to_continue_an_sft_run(tiny_model_dir, tmp_path, sft_data, capsys):
    from rlvr import cli

    out = tmp_path / "sft"
    train(_config(tiny_model_dir, out, "sft", dataset=sft_data, max_steps=1))
    assert cli.main(["train", f"output_dir={out}", "resume=true"]) == 2
    assert "use rlvr sft" in capsys.readouterr().err


@pytest.mark.trains
@pytest.mark.parametrize("command", ["sft", "dpo", "rft"])
def test_every_method_resumes_with_the_runs_own_settings(command, tiny_model_dir, tmp_path, sft_data, pair_data,
                                                          digit_verifier, capsys):
    """`rlvr sft|dpo|rft resume=true output_dir=<run>`: the run's config.yaml is the base, as for
    rlvr train; the method's default learning rate is not slipped in as if the user had given it
    (it was: the resume was refused, and with resume_override=true trained on at the default)."""
    from rlvr import cli

    out = tmp_path / command
    data = {"sft": [f"dataset={sft_data}"], "dpo": [f"dataset={pair_data}"],
            "rft": ["reward_funcs=[starts_with_digit]", "num_generations=4", "self_round_prompts=4", "self_round_steps=2",
                    "task_args.num_train=50", "task_args.num_test=8", "max_completion_length=6"]}[command]
    first = ["model=" + str(tiny_model_dir), *data, "learning_rate=3e-3", "lr_scheduler_type=constant", "max_steps=2",
             "save_steps=2", "logging_steps=1", "eval_on_start=false", "eval_on_end=false", "per_device_train_batch_size=4",
             f"output_dir={out}"]
    assert cli.main([command, *first]) == 0
    assert cli.main([command, "resume=true", f"output_dir={out}", "max_steps=4"]) == 0, capsys.readouterr().err
    assert "resume_override" not in capsys.readouterr().out
    assert [r["learning_rate"] for r in _rows(out)] == pytest.approx([3e-3] * 4)
