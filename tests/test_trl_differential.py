"""rlvr against TRL itself: the same GRPO step, nothing different.

TRL 1.16's GRPOTrainer and rlvr's GRPOTrainer train from the same tiny model, the same prompts and
the **same completions** (both take a `rollout_func`; this one returns fixed completions), each
with TRL's defaults.  For every setting below, the per-token log-probs of the completions, the
logged loss and metrics both have, and every parameter's gradient at every optimizer step (after
clipping, where transformers' `on_pre_optimizer_step` sees it) agree to fp32 tolerance.

The differences rlvr keeps by design are named in docs/trl.md; none of them shows in these runs.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.trains

PROMPTS = ["2+3=", "7-1=", "4*2=", "9-5="]
LETTERS = "abcdefghij0123456789+-*= "
MAX_COMPLETION = 7


def fixed_rollouts(prompts, trainer):
    """The same completions for TRL and rlvr: each prompt's k-th occurrence in a call always gets the
    same 2 to MAX_COMPLETION tokens, drawn from a seed of (prompt, k); every other one ends with the
    end-of-sequence token, the rest were cut off (mask_truncated_completions tells them apart)."""
    tokenizer = trainer.processing_class
    seen: Counter = Counter()
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for prompt in prompts:
        k = seen[prompt]
        seen[prompt] += 1
        rng = random.Random(f"{prompt}|{k}")
        text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, MAX_COMPLETION)))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if k % 2:
            ids = ids[: MAX_COMPLETION - 1] + [tokenizer.eos_token_id]
        out["prompt_ids"].append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        out["completion_ids"].append(ids)
        out["logprobs"].append([0.0] * len(ids))
    return out


def digits_reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def length_reward(completions, **kwargs):
    return [len(c) / 4 for c in completions]


def _rows():
    return [{"prompt": p} for p in PROMPTS]


def _common(out, settings: dict) -> dict:
    # TRL's defaults, except what a CPU needs (use_cpu, fp32: TRL's bf16 default assumes a GPU) and what
    # keeps the two runs' data order the same (no shuffling); no checkpoints, no loggers.
    return {"output_dir": str(out), "use_cpu": True, "bf16": False, "report_to": "none", "save_strategy": "no",
            "logging_steps": 1, "shuffle_dataset": False, "num_generations": 4, "per_device_train_batch_size": 8,
            "max_completion_length": MAX_COMPLETION, "max_steps": 1, "learning_rate": 1e-2, **settings}


def _grab(model, grads: list) -> None:
    grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None})


def _keyed(logps: dict, prompt_ids, prompt_mask, completion_ids, completion_mask, values) -> None:
    """Per-token log-probs by (prompt tokens, completion tokens), so the rows' order does not matter."""
    for row in range(len(completion_ids)):
        p = tuple(prompt_ids[row][prompt_mask[row].bool()].tolist())
        c = tuple(completion_ids[row][completion_mask[row].bool()].tolist())
        logps.setdefault((p, c), []).append(values[row][completion_mask[row].bool()].detach().clone())


def _final(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class Grab:
    """A transformers TrainerCallback (duck-typed) that keeps every gradient where the optimizer is about to use it."""

    def __init__(self, grads: list):
        self.grads = grads

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        _grab(model, self.grads)


def run_trl(model_dir, out, settings: dict, reward_funcs=(digits_reward,), peft_config=None, callbacks=(), weights=False):
    from datasets import Dataset
    from transformers import TrainerCallback

    grads, logps = [], {}
    grab = type("TRLGrab", (Grab, TrainerCallback), {})(grads)
    args = trl.GRPOConfig(**_common(out, settings))
    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=list(reward_funcs), args=args,
                              train_dataset=Dataset.from_list(_rows()), rollout_func=fixed_rollouts,
                              peft_config=peft_config, callbacks=[grab, *callbacks])
    forward = trainer._get_per_token_logps_and_entropies

    def spy(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        result = forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if torch.is_grad_enabled():  # the loss's forward, not the old or reference log-probs
            width = input_ids.shape[1] - logits_to_keep
            _keyed(logps, input_ids[:, :width], attention_mask[:, :width], input_ids[:, width:],
                   attention_mask[:, width:], result[0])
        return result

    trainer._get_per_token_logps_and_entropies = spy
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row and "train_loss" not in row]
    return (grads, logps, rows, _final(trainer.model)) if weights else (grads, logps, rows)


def run_rlvr(model_dir, out, settings: dict, monkeypatch, reward_funcs=(digits_reward,), peft_config=None, callbacks=(),
             weights=False):
    import rlvr
    from rlvr import logprobs as logprobs_module

    grads, logps = [], {}
    call = logprobs_module.LogProbs.__call__
    with_router_loss = logprobs_module.LogProbs.with_router_loss

    def spying(forward):
        def spy(self, model, batch, **kwargs):
            result = forward(self, model, batch, **kwargs)
            if torch.is_grad_enabled():
                _keyed(logps, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, result[0])
            return result

        return spy

    monkeypatch.setattr(logprobs_module.LogProbs, "__call__", spying(call))
    monkeypatch.setattr(logprobs_module.LogProbs, "with_router_loss", spying(with_router_loss))
    args = rlvr.GRPOConfig(**_common(out, settings))
    trainer = rlvr.GRPOTrainer(model=str(model_dir), reward_funcs=list(reward_funcs), args=args, train_dataset=_rows(),
                               rollout_func=fixed_rollouts, peft_config=peft_config, callbacks=[Grab(grads), *callbacks])
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row and "train_loss" not in row]
    return (grads, logps, rows, _final(trainer.model)) if weights else (grads, logps, rows)


TIMED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}  # the machine's speed


def compare(theirs, ours, atol=1e-5, rtol=1e-4, left_out=()):
    """`left_out`: prompts whose completions rlvr does not run through the update (a group without
    signal: advantage 0, and no KL term to pull on them)."""
    trl_grads, trl_logps, trl_rows = theirs
    our_grads, our_logps, our_rows = ours
    prompt_ids = {p for p, _ in trl_logps}
    skipped = {key for key in trl_logps if any(key[0] == p for p in left_out)}
    assert set(our_logps) == set(trl_logps) - skipped, (len(our_logps), len(trl_logps), len(skipped), len(prompt_ids))
    for key, values in our_logps.items():
        values = trl_logps[key]
        mine = our_logps[key]
        assert len(mine) == len(values)
        for a, b in zip(sorted(mine, key=lambda t: t.sum().item()), sorted(values, key=lambda t: t.sum().item())):
            torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)
    assert len(our_grads) == len(trl_grads) >= 1
    for step, (mine, theirs_) in enumerate(zip(our_grads, trl_grads)):
        assert set(mine) == set(theirs_), f"step {step + 1}: trained parameters differ"
        for name in theirs_:
            torch.testing.assert_close(mine[name], theirs_[name], atol=atol, rtol=rtol, msg=lambda m: f"step {step + 1} {name}: {m}")
    assert len(our_rows) == len(trl_rows)
    for mine, theirs_ in zip(our_rows, trl_rows):  # every metric TRL logs, rlvr logs with the same value
        missing = sorted(set(theirs_) - set(mine) - TIMED)
        assert not missing, f"rlvr does not log {missing}"
        for key in sorted(set(theirs_) - TIMED):
            assert mine[key] == pytest.approx(theirs_[key], abs=atol * 10, rel=rtol * 10, nan_ok=True), key

CASES = {
    "defaults": {},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "beta-no-bias-correction": {"beta": 0.04, "use_bias_correction_kl": False},
    "scale-batch": {"scale_rewards": "batch"},
    "scale-none-mask-truncated": {"scale_rewards": "none", "mask_truncated_completions": True},
    "iterations": {"num_iterations": 2, "max_steps": 2, "beta": 0.04},
    "sequence-iterations": {"num_iterations": 2, "max_steps": 2, "importance_sampling_level": "sequence",
                            "loss_type": "grpo"},
    "accumulation-grpo": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "loss_type": "grpo",
                          "beta": 0.04},
    "clip-higher-delta": {"epsilon_high": 0.28, "delta": 1.5, "num_iterations": 2, "max_steps": 2},
    "temperature-beta": {"temperature": 0.7, "beta": 0.04},  # beta with TRL's default use_bias_correction_kl
    "steps-per-generation": {"steps_per_generation": 2, "per_device_train_batch_size": 4, "max_steps": 2,
                             "loss_type": "grpo"},
    # the other four of TRL's loss types on a second iteration, where the ratios are not 1, with the off-policy
    # mask and the entropy bonus: static (a token-normalised type, gradient accumulation) and adaptive (a target
    # above the tiny model's entropy: the coefficient climbs and applies from the second step on)
    "cispo-entropy-bonus": {"loss_type": "cispo", "epsilon_high": 1.02, "num_iterations": 2, "max_steps": 2,
                            "entropy_coef": 0.05},  # one micro-batch: TRL averages a step's micro-batches' ratios (docs/trl.md)
    # dapo with gradient accumulation, and the bonus (sequence ratios: sequence-iterations and luspo's case)
    "entropy-bonus-accumulation": {"entropy_coef": 0.05, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    "sapo": {"loss_type": "sapo", "num_iterations": 2, "max_steps": 2, "sapo_temperature_neg": 2.0},
    "luspo-adaptive-entropy": {"loss_type": "luspo", "importance_sampling_level": "sequence", "num_iterations": 2,
                               "max_steps": 3, "use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 10.0,
                               "top_entropy_quantile": 0.5},
    "vespo-off-policy-mask": {"loss_type": "vespo", "num_iterations": 2, "max_steps": 2, "vespo_k_pos": 3.0,
                              "off_policy_mask_threshold": 0.002},
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_agrees_with_trl(case, tiny_model_dir, tmp_path, monkeypatch):
    settings = CASES[case]
    if settings.get("steps_per_generation", 1) > 1:
        # TRL shuffles a generation's completions before cutting it into steps, rlvr cuts it in order
        # (docs/trl.md: groups stay together); with TRL's shuffle left out the steps are the same.
        import trl.trainer.grpo_trainer as trl_grpo

        monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    theirs = run_trl(tiny_model_dir, tmp_path / "trl", settings)
    ours = run_rlvr(tiny_model_dir, tmp_path / "rlvr", settings, monkeypatch)
    compare(theirs, ours)


def digits_or_none(completions, **kwargs):
    """None (not applicable) for a completion without a digit: with no other function, an unscorable one."""
    return [float(sum(ch.isdigit() for ch in c)) if any(ch.isdigit() for ch in c) else None for c in completions]


@pytest.mark.parametrize("case", ["unscorable", "normalize-then-sum"])
def test_unscorable_completions_and_normalize_then_sum_agree_with_trl(case, tiny_model_dir, tmp_path, monkeypatch):
    """A completion no function scores is out of its group's baseline with advantage 0 (TRL 1.16's NaN
    handling); GDPO's normalize_then_sum normalises each function in its group, then the batch."""
    if case == "unscorable":
        funcs, settings = (digits_or_none,), {}
    else:
        funcs, settings = (digits_or_none, length_reward), {"multi_objective_aggregation": "normalize_then_sum",
                                                            "reward_weights": [1.0, 0.5]}
    theirs = run_trl(tiny_model_dir, tmp_path / "trl", settings, reward_funcs=funcs)
    ours = run_rlvr(tiny_model_dir, tmp_path / "rlvr", settings, monkeypatch, reward_funcs=funcs)
    compare(theirs, ours)


def test_weighted_reward_functions_and_a_reward_model_agree_with_trl(tiny_model_dir, tiny_reward_model_dir, tmp_path,
                                                                     monkeypatch):
    """TRL's only way to weight functions given to the trainer: GRPOConfig(reward_weights=[...]); one of
    them here is a reward model by path (a sequence classifier, TRL's reward_funcs=[<path>]): the same
    scores, under TRL's name for it, so the same advantages and gradients."""
    settings = {"reward_weights": [1.0, -0.5], "beta": 0.04}
    funcs = (digits_reward, str(tiny_reward_model_dir))
    theirs = run_trl(tiny_model_dir, tmp_path / "trl", settings, reward_funcs=funcs)
    ours = run_rlvr(tiny_model_dir, tmp_path / "rlvr", settings, monkeypatch, reward_funcs=funcs)
    compare(theirs, ours)
    for name in ("digits_reward", tiny_reward_model_dir.name):
        assert ours[2][0][f"rewards/{name}/mean"] == pytest.approx(theirs[2][0][f"rewards/{name}/mean"], abs=1e-6)
    assert theirs[2][0][f"rewards/{tiny_reward_model_dir.name}/mean"] != 0


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """A tiny Mixture-of-Experts model (Qwen3-MoE: 4 experts, 2 per token) with its own router loss weight."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from conftest import make_tokenizer

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2, router_aux_loss_coef=0.05, max_position_embeddings=256,
                            tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("coef", [None, 0.3, 0.0])
def test_router_load_balancing_loss_agrees_with_trl(coef, tiny_moe_dir, tmp_path, monkeypatch):
    # None: the model's own weight (0.05 here), as TRL reads it from the config; 0.0: off.
    settings = {"router_aux_loss_coef": coef}
    theirs = run_trl(tiny_moe_dir, tmp_path / "trl", settings)
    ours = run_rlvr(tiny_moe_dir, tmp_path / "rlvr", settings, monkeypatch)
    compare(theirs, ours)
    assert ("aux_loss" in ours[2][0]) == (coef != 0.0)
    if coef != 0.0:
        assert ours[2][0]["aux_loss"] == pytest.approx(theirs[2][0]["aux_loss"], rel=1e-4)


def test_router_loss_weight_on_a_model_without_routers_is_refused(tiny_model_dir, tmp_path):
    import rlvr
    from rlvr.config import ConfigError

    args = rlvr.GRPOConfig(**_common(tmp_path / "rlvr", {"router_aux_loss_coef": 0.1}))
    trainer = rlvr.GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digits_reward], args=args, train_dataset=_rows(),
                               rollout_func=fixed_rollouts)
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.1 .* LlamaConfig has no routers"):
        trainer.train()


LORA_CASES = {
    "task-type-only": {},  # peft's own defaults: r=8, alpha=8, q_proj and v_proj for Llama
    "rank-targets-dropout": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "o_proj", "down_proj"], "lora_dropout": 0.1},
    "rslora": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": "all-linear"},
    "dora": {"r": 4, "use_dora": True},
    "modules-to-save": {"r": 4, "modules_to_save": ["lm_head"]},
    "bias": {"r": 4, "bias": "lora_only"},
}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_from_a_peft_config_agrees_with_trl(case, tiny_model_dir, tmp_path, monkeypatch):
    # peft initialises A at random: both trainers wrap the model with the adapter seeded alike (rlvr
    # seeds it with the run's seed; TRL with whatever the global stream holds, so here the same seed).
    from peft import LoraConfig

    import trl.trainer.grpo_trainer as trl_grpo

    wrap = trl_grpo.get_peft_model

    def seeded_wrap(model, config, **kwargs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(42)
            return wrap(model, config, **kwargs)

    monkeypatch.setattr(trl_grpo, "get_peft_model", seeded_wrap)
    settings = {"beta": 0.04, "num_iterations": 2, "max_steps": 2}
    if LORA_CASES[case].get("lora_dropout"):  # dropout draws differ: both switch it off (rlvr's default, TRL's option)
        settings["disable_dropout"] = True
    config = LoraConfig(task_type="CAUSAL_LM", **LORA_CASES[case])
    theirs = run_trl(tiny_model_dir, tmp_path / "trl", settings, peft_config=config)
    ours = run_rlvr(tiny_model_dir, tmp_path / "rlvr", settings, monkeypatch, peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA_CASES[case]))
    compare(theirs, ours)
    assert all("lora_" in name or "modules_to_save" in name for name in theirs[0][0]), "only the adapter trains"


def flat_first_prompt_reward(completions, prompts, **kwargs):
    """Every completion of the first prompt scores the same: that group carries no signal."""
    return [1.0 if p == PROMPTS[0] else float(sum(ch.isdigit() for ch in c)) for c, p in zip(completions, prompts)]


def flat_reward(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.mark.parametrize("case", [
    {},
    {"loss_type": "grpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "bnpo", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    {"beta": 0.04},
    {"steps_per_generation": 2, "per_device_train_batch_size": 4, "max_steps": 2},
], ids=["dapo", "grpo", "dr_grpo", "bnpo-accumulation", "beta", "steps-per-generation"])
def test_a_group_without_signal_trains_as_in_trl(case, tiny_model_dir, tmp_path, monkeypatch):
    # rlvr leaves such a group out of the update (no forward, no backward); the step must be TRL's all the same.
    if case.get("steps_per_generation") or case.get("loss_type") == "bnpo":  # micro-batches cut as rlvr cuts them
        import trl.trainer.grpo_trainer as trl_grpo

        monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    funcs = (flat_first_prompt_reward,)
    theirs = run_trl(tiny_model_dir, tmp_path / "trl", case, reward_funcs=funcs)
    ours = run_rlvr(tiny_model_dir, tmp_path / "rlvr", case, monkeypatch, reward_funcs=funcs)
    skips = not case.get("beta") and case.get("loss_type") != "bnpo" and not case.get("steps_per_generation")
    first = tuple(__import__("conftest").make_tokenizer()(PROMPTS[0], add_special_tokens=False)["input_ids"])
    compare(theirs, ours, left_out=[first] if skips else ())


def test_steps_without_any_signal_move_the_weights_as_in_trl(tiny_model_dir, tmp_path, monkeypatch):
    # Step 1 learns; steps 2 and 3 have no signal at all: TRL's AdamW still steps (its momentum and weight decay).
    settings = {"max_steps": 3, "per_device_train_batch_size": 8, "weight_decay": 0.1}
    calls = {"n": 0}

    def first_step_only(completions, **kwargs):
        calls["n"] += 1
        return digits_reward(completions) if calls["n"] == 1 else flat_reward(completions)

    theirs = run_trl(tiny_model_dir, tmp_path / "trl", settings, reward_funcs=(first_step_only,), weights=True)
    calls["n"] = 0
    ours = run_rlvr(tiny_model_dir, tmp_path / "rlvr", settings, monkeypatch, reward_funcs=(first_step_only,), weights=True)
    # Steps 2 and 3: TRL's loss forward runs on zero advantages, rlvr's does not run; the gradients are all 0.
    assert len(ours[0]) == len(theirs[0]) == 3
    for mine, trls in zip(ours[0], theirs[0]):
        for name in trls:
            torch.testing.assert_close(mine[name], trls[name], atol=1e-5, rtol=1e-4)
    assert [r["loss"] for r in ours[2]] == pytest.approx([r["loss"] for r in theirs[2]], abs=1e-6)
    assert [r["grad_norm"] for r in ours[2]] == pytest.approx([r["grad_norm"] for r in theirs[2]], rel=1e-4, abs=1e-6)
    # AdamW with lr 1e-2 moves each weight by about 1e-2 per step even on zero gradients (its momentum and weight
    # decay), so a run that skipped steps 2 and 3 would miss by ~1e-2.  Where step 1's gradient is near Adam's
    # eps (1e-8) the step lr * g / (|g| + eps) magnifies float noise: measured, a gradient of -7.396e-9 here and
    # -7.450e-9 in TRL (summed in another order) ends 2.8e-5 apart after three steps.  Hence atol 1e-4: 100x
    # below the miss it must catch.
    for name, value in theirs[3].items():
        torch.testing.assert_close(ours[3][name], value, atol=1e-4, rtol=1e-4)
