"""LoRA (use_peft=true) on the tiny model: the fast path against peft's own forward, gradients
only into the adapter, the reference as the adapter disabled, learning, exact resume, saves."""

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from rlvr import lora  # noqa: E402
from rlvr.config import build_config  # noqa: E402
from rlvr.llama import LlamaRunner, supports
from rlvr.logprobs import batch_logprobs  # noqa: E402
from rlvr.models import load_model, make_reference  # noqa: E402
from rlvr.rollout import SamplingParams  # noqa: E402
from rlvr.rollout.engine import FastSampler, HFSampler  # noqa: E402
from rlvr.run import train  # noqa: E402
from rlvr.trainer import Trainer  # noqa: E402
from rlvr.types import Batch, Example, Rollout  # noqa: E402

PROMPTS = [[1, 24, 22, 8, 33, 41, 35], [1, 24, 9], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
GROUP = [0, 0, 1, 1, 1, 2]  # completion i continues PROMPTS[GROUP[i]]
COMPLETIONS = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15], [16, 17], [18, 19, 20], [21, 22, 23, 24, 25, 26, 27]]


def _cfg(tiny_model_dir, out=None, **kw):
    return build_config({
        "model": str(tiny_model_dir),
        "use_peft": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_modules": ["all-linear"],  # every linear layer (unset: peft's q_proj and v_proj)
        "task_args": {"digits": 2, "num_train": 50, "num_test": 8},
        "reward_funcs": ["boxed_format", "accuracy"],
        "num_generations": 4,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_completion_length": 6,
        "learning_rate": 1e-2,
        "beta": 0.1,
        "max_steps": 2,
        "save_steps": 100,
        "logging_steps": 1,
        "eval_on_start": False,
        "eval_on_end": False,
        "output_dir": str(out) if out else None,
        **kw,
    })


def _adapted(tiny_model_dir, cfg):
    """The tiny model with a LoRA adapter whose B is random (peft starts it at zero: no change)."""
    model, tokenizer, path = load_model(str(tiny_model_dir))
    model = lora.wrap(model, cfg.model_settings, path, cfg.seed)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, tokenizer


def _batch(advantages=None):
    rollouts = [Rollout(PROMPTS[g], c, [0.0] * len(c), "stop", "") for g, c in zip(GROUP, COMPLETIONS)]
    adv = advantages if advantages is not None else torch.linspace(-1, 1, len(rollouts))
    batch = Batch.from_rollouts(rollouts, adv, torch.ones(len(rollouts), dtype=torch.bool), 0, False)
    batch.group_ids = torch.tensor(GROUP)
    return batch


def _trainer(model, tokenizer, cfg, tmp_path, ref=None):
    examples = [Example(prompt="1+1", answer="2")]
    return Trainer(cfg, model, tokenizer, examples, tmp_path, 10, ref)


def test_fast_path_includes_the_adapter(tiny_model_dir, tmp_path):
    """Update log-probs through the adapter, and sampling from the merged W + scale * B A,
    equal peft's own forward on the generic transformers path."""
    cfg = _cfg(tiny_model_dir)
    model, tokenizer = _adapted(tiny_model_dir, cfg)
    assert supports(model)
    trainer = _trainer(model, tokenizer, cfg, tmp_path)
    batch = _batch()
    with torch.no_grad():
        fast, _ = trainer.logprobs(model, batch)
        generic, _ = trainer.logprobs.padded(model, batch)
        plain, _ = trainer.logprobs.padded(lora.unwrap(model).__class__.from_pretrained(tiny_model_dir), batch)
    mask = batch.completion_mask
    assert (fast - generic)[mask].abs().max() < 1e-4
    assert (fast - plain)[mask].abs().max() > 1e-2  # the adapter really changes the model

    # Sampling: the fast sampler's per-token log-probs are those of the adapted model.
    params = SamplingParams(n=4, max_tokens=8, temperature=cfg.temperature)  # as the trainer divides
    fast_groups = FastSampler(model, tokenizer, [2]).generate(PROMPTS, params, torch.Generator().manual_seed(3))
    slow_groups = HFSampler(model, tokenizer, [2]).generate(PROMPTS, params, torch.Generator().manual_seed(3))
    for fg, sg in zip(fast_groups, slow_groups):
        for f, s in zip(fg, sg):
            assert f.completion_ids == s.completion_ids
            assert max(abs(a - b) for a, b in zip(f.logprobs, s.logprobs)) < 1e-4
    rollouts = [r for g in fast_groups for r in g]
    sampled = Batch.from_rollouts(rollouts, torch.zeros(len(rollouts)), torch.ones(len(rollouts), dtype=torch.bool), 0, False, 4)
    with torch.no_grad():
        recomputed, _ = trainer.logprobs.padded(model, sampled)
    assert (recomputed - sampled.sampler_logprobs)[sampled.completion_mask].abs().max() < 1e-4


def test_the_weights_sent_to_an_engine_without_adapters_are_the_merged_model_made_one_at_a_time(tiny_model_dir):
    """vLLM without LoRA gets the policy with its adapter merged in (rollout/weights.py): peft's own
    merge_and_unload's weights under Hugging Face names, each made as it is sent, the model never
    merged in place (a forward may run on another thread) and the same while the adapter is disabled
    (the reference's pass)."""
    import copy

    from rlvr.rollout.weights import weight_update

    model, _ = _adapted(tiny_model_dir, _cfg(tiny_model_dir))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update = weight_update(model, adapter_only=False, version=1)
    assert update.adapter is None and len(update.merged) == 2 * 7  # every adapted linear of the 2 layers
    params = {p.data_ptr() for p in model.parameters()}
    assert all(t.data_ptr() in params for t in update.tensors.values())  # nothing copied up front: the model's own
    sent = dict(update.pairs())
    assert sent.keys() == {k for k in expected if k != "lm_head.weight"}  # the tied head travels as an alias
    assert max((sent[k] - expected[k]).abs().max().item() for k in sent) < 1e-6
    assert any((sent[k] - before["base_model.model." + k.replace(".weight", ".base_layer.weight")]).abs().max() > 1e-3
               for k in update.merged)  # the adapter moved them
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the model was not merged
    with lora.reference_off(model):
        assert all(torch.equal(v, sent[k]) for k, v in update.pairs())


def test_gradients_flow_only_into_the_adapter(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir)
    model, tokenizer = _adapted(tiny_model_dir, cfg)
    trainer = _trainer(model, tokenizer, cfg, tmp_path)
    assert trainer.logprobs.fast
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = _batch()
    trainer.updater.prepare(batch)  # beta > 0: KL to the adapter-disabled model
    trainer.updater.accumulate_gradients(batch)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert all(g.abs().sum() > 0 for g in grads.values())  # every adapter matrix gets a gradient
    # The optimizer holds only the adapter (2 matrices x 7 modules x 2 layers).
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == 28
    trainer.optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n in before if "lora_" in n}

    # The fast update's gradients equal those of peft's own forward.
    def grads_of(fn):
        model.zero_grad()
        batch = _batch()
        logp, _ = fn(model, batch)
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp) * batch.completion_mask  # real tokens only
        (logp * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fast, generic = grads_of(trainer.logprobs), grads_of(trainer.logprobs.padded)
    assert fast.keys() == generic.keys()
    for name in fast:
        scale = generic[name].abs().max().clamp(min=1e-8)
        assert (fast[name] - generic[name]).abs().max() / scale < 1e-4, name


def test_reference_is_the_base_model_without_a_copy(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir)
    model, tokenizer = _adapted(tiny_model_dir, cfg)
    assert make_reference(model, beta=0.1) is None  # no second copy of the model
    base, _, _ = load_model(str(tiny_model_dir))
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in base.parameters()) + adapter
    trainer = _trainer(model, tokenizer, cfg, tmp_path)
    batch = _batch()
    with torch.no_grad():
        ref = trainer.kl.ref_logprobs(batch)  # fast path, adapter disabled
        expected, _ = batch_logprobs(LlamaRunner(base), batch, cfg.temperature)
        policy, _ = trainer.logprobs(model, batch)
    mask = batch.completion_mask
    assert (ref - expected)[mask].abs().max() < 1e-5
    assert (policy - expected)[mask].abs().max() > 1e-2  # adapter on again afterwards
    # Sampling weights are rebuilt when the adapter is switched off and on.
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0)
    sampler = FastSampler(model, tokenizer, [2])
    with lora.reference_off(model):
        off = sampler.generate(PROMPTS, params, torch.Generator().manual_seed(0))
    plain = FastSampler(base, tokenizer, [2]).generate(PROMPTS, params, torch.Generator().manual_seed(0))
    assert [x for g in off for r in g for x in r.logprobs] == pytest.approx([x for g in plain for r in g for x in r.logprobs], abs=1e-5)


REWARD = """
def starts_with_seven(completions, **kwargs):
    return [1.0 if c.startswith("7") else 0.0 for c in completions]
"""


@pytest.mark.trains
@pytest.mark.processes
def test_lora_run_learns_a_verifiable_reward(tmp_path):
    # The tiny model's embeddings (tied to the output layer) are scaled up x10: at their random
    # init (std 0.02) and after the final RMSNorm, no change of the layers an adapter sits on can
    # move the logits by more than about 0.6, so the first token could never become likely.
    from conftest import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    plugin = tmp_path / "seven.py"
    plugin.write_text(REWARD)
    cfg = _cfg(tmp_path / "model", tmp_path / "run", reward_funcs=[f"{plugin}:starts_with_seven"], lora_r=8, lora_alpha=16,
               task_args={"digits": 2, "num_train": 200, "num_test": 10}, num_generations=8,
               per_device_train_batch_size=64, gradient_accumulation_steps=1, max_completion_length=2,
               learning_rate=5e-2, lr_scheduler_type="constant", loss_type="grpo", beta=0.0, max_steps=12)
    train(cfg)
    rewards = [json.loads(l)["reward"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(rewards[:3]) / 3 < 0.2, rewards[:3]
    assert sum(rewards[-3:]) / 3 > 0.8, rewards[-3:]


@pytest.fixture
def informative_rewards(monkeypatch):
    """Random rewards, so every group carries signal and every step really updates."""
    import rlvr.rewards as rewards

    gen = torch.Generator().manual_seed(0)
    monkeypatch.setitem(rewards.REWARDS, "boxed_format", lambda completions, **kw: torch.rand(len(completions), generator=gen).tolist())
    return gen


def _metrics(path):
    rows = [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")} for r in rows]


@pytest.mark.trains
def test_interrupted_lora_run_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch, informative_rewards):
    kw = {"num_iterations": 2, "max_steps": 4, "save_steps": 2}
    straight = tmp_path / "straight"
    train(_cfg(tiny_model_dir, straight, **kw))

    informative_rewards.manual_seed(0)
    resumed = tmp_path / "resumed"
    original_step = Trainer.train_step

    def stop_before_step_4(self, **kwargs):
        if self.step == 3:
            raise KeyboardInterrupt
        return original_step(self, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", stop_before_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_model_dir, resumed, **kw))
    ckpt = resumed / "checkpoint-3"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    assert all("lora_" in k for k in load_file(str(ckpt / "adapter_model.safetensors")))
    monkeypatch.setattr(Trainer, "train_step", original_step)
    train(_cfg(tiny_model_dir, resumed, resume=True, **kw))

    a = load_file(str(straight / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 28
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _metrics(straight) == _metrics(resumed)


@pytest.mark.trains
def test_final_adapter_and_merged_saves_give_the_same_model(tiny_model_dir, tmp_path, informative_rewards):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_run, merged_run = tmp_path / "adapter", tmp_path / "merged"
    train(_cfg(tiny_model_dir, adapter_run, bf16=True))
    informative_rewards.manual_seed(0)
    train(_cfg(tiny_model_dir, merged_run, bf16=True, lora_save="merged"))
    assert (adapter_run / "adapter_config.json").is_file() and not (adapter_run / "model.safetensors").exists()
    assert (merged_run / "model.safetensors").is_file() and not (merged_run / "adapter_config.json").exists()

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with_adapter = PeftModel.from_pretrained(base, adapter_run)
    merged = AutoModelForCausalLM.from_pretrained(merged_run)
    via_rlvr, _, _ = load_model(str(adapter_run))  # what `rlvr eval model=<run dir>` loads
    ids = torch.tensor([PROMPTS[0] + COMPLETIONS[0]])
    with torch.no_grad():
        a = torch.log_softmax(with_adapter(input_ids=ids).logits, -1)
        b = torch.log_softmax(merged(input_ids=ids).logits, -1)
        c = torch.log_softmax(via_rlvr(input_ids=ids).logits, -1)
    assert (a - b).abs().max() < 1e-4 and (a - c).abs().max() < 1e-4
    fresh = torch.log_softmax(AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits, -1)
    assert (a - fresh).abs().max() > 1e-3  # two bf16 steps at lr 1e-2 did move the model


def test_missing_peft_is_a_clear_error(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import sys

    from rlvr.cli import main

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    out = tmp_path / "run"
    assert main(["train", f"model={tiny_model_dir}", "use_peft=true", f"output_dir={out}"]) == 2
    assert 'pip install "peft>=0.13"' in capsys.readouterr().err
    assert not out.exists()  # nothing made, nothing loaded
