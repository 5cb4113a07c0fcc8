"""rlvr's own Llama forward (llama.py, logprobs.py) against the Hugging Face model it runs, for
each family it covers (Llama, Mistral, Qwen2, Qwen3): same log-probs, same gradients, same greedy
tokens; and the one line a model it does not cover prints."""

import logging

import pytest
import torch

from rlvr.llama import LlamaRunner, fast_path_reason, supports
from rlvr.logprobs import batch_logprobs
from rlvr.logprobs import linear_logprobs, selective_logprobs
from rlvr.rollout import SamplingParams
from rlvr.rollout.engine import FastSampler, HFSampler, make_sampler
from rlvr.types import Batch, Rollout

PROMPTS = [[1, 24, 22, 8, 33, 41, 35], [1, 24, 9], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
GROUP = [0, 0, 1, 1, 1, 2]  # completion i continues PROMPTS[GROUP[i]]
COMPLETIONS = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15], [16, 17], [18, 19, 20], [21, 22, 23, 24, 25, 26, 27]]


def reference_logprobs(model, temperature=1.0):
    """Each prompt + completion through the Hugging Face forward, one sequence at a time."""
    out = []
    for g, comp in zip(GROUP, COMPLETIONS):
        ids = torch.tensor([PROMPTS[g] + comp])
        logits = model(input_ids=ids).logits[0, len(PROMPTS[g]) - 1 : -1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(comp)[:, None]).squeeze(-1))
    return torch.cat(out)


def fast_logprobs(model, temperature=1.0):
    runner = LlamaRunner(model)
    hidden = runner.completion_hidden(PROMPTS, COMPLETIONS, GROUP)
    targets = torch.tensor([t for c in COMPLETIONS for t in c])
    return linear_logprobs(hidden, model.lm_head.weight, targets, temperature, chunk=5)[0]


FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def make_family_model(kind: str, vocab_size: int, seed: int = 0):
    """A tiny random model of one family, with what sets it apart switched on: Qwen2's q/k/v biases,
    Qwen3's q/k norms with head_dim (16) apart from hidden / heads (8), untied output layers for
    Llama and Mistral.  Norm weights and biases are drawn at random (transformers starts them at
    1 and 0), so that a norm or a bias applied in the wrong place shows."""
    import transformers

    sizes = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    config = {
        "llama": lambda: transformers.LlamaConfig(**sizes, tie_word_embeddings=False),
        "mistral": lambda: transformers.MistralConfig(**sizes, sliding_window=None, tie_word_embeddings=False),
        "qwen2": lambda: transformers.Qwen2Config(**sizes, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**sizes, head_dim=16, tie_word_embeddings=True),
    }[kind]()
    torch.manual_seed(seed + FAMILIES.index(kind))  # Llama and Mistral have the same block: not the same weights
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.3)
    return model


@pytest.fixture(params=FAMILIES)
def family(request, tiny):
    """(model, tokenizer): a tiny random model of each family the fast path covers, with the tiny tokenizer."""
    _, tokenizer = tiny
    return make_family_model(request.param, len(tokenizer)), tokenizer


def test_the_tiny_llama_is_supported(tiny):
    model, _ = tiny
    assert supports(model)
    assert not supports(torch.nn.Linear(2, 2))


def test_each_family_is_on_the_fast_path(family):
    model, tokenizer = family
    assert fast_path_reason(model) is None and supports(model)
    assert type(make_sampler(model, tokenizer, [2])) is FastSampler


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_hugging_face_forward(family, temperature):
    model, _ = family
    with torch.no_grad():
        assert (fast_logprobs(model, temperature) - reference_logprobs(model, temperature)).abs().max() < 1e-5


def test_gradients_equal_the_hugging_face_forward(family):
    model, _ = family
    weights = torch.linspace(-1, 1, sum(len(c) for c in COMPLETIONS))

    def grads(fn):
        model.zero_grad()
        (fn(model) * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, fast = grads(reference_logprobs), grads(fast_logprobs)
    for name in ref:
        scale = ref[name].abs().max().clamp(min=1e-8)
        assert (fast[name] - ref[name]).abs().max() / scale < 1e-5, name


def test_batch_logprobs_scatter_into_the_padded_layout(tiny):
    model, tokenizer = tiny
    rollouts = [Rollout(PROMPTS[g], c, [0.0] * len(c), "stop", "") for g, c in zip(GROUP, COMPLETIONS)]
    keep = torch.tensor([True, True, True, True, False, True])  # one completion left out
    batch = Batch.from_rollouts(rollouts, torch.zeros(6), keep, 0, False)
    batch.group_ids = torch.tensor(GROUP)[keep]
    batch.completion_mask[1] = False  # a fully masked row (mask_truncated_completions)
    with torch.no_grad():
        logp, entropy = batch_logprobs(LlamaRunner(model), batch, 1.0)
        expected = reference_logprobs(model)
    offsets = [0]
    for c in COMPLETIONS:
        offsets.append(offsets[-1] + len(c))
    for row, i in enumerate([0, 1, 2, 3, 5]):
        n = len(COMPLETIONS[i]) if row != 1 else 0
        assert torch.allclose(logp[row, :n], expected[offsets[i] : offsets[i] + n], atol=1e-5)
        assert (logp[row, n:] == 0).all() and (entropy[row, n:] == 0).all()
    assert (entropy[batch.completion_mask] > 0).all()


def _random_head():
    """(hidden [7, 5], output weights [11, 5], targets [7]) in float64, the same each call."""
    torch.manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    return hidden, weight, torch.randint(0, 11, (7,))


def test_linear_logprobs_gradcheck_and_chunking():
    hidden, weight, targets = _random_head()
    torch.autograd.gradcheck(lambda h, w: linear_logprobs(h, w, targets, 0.8, chunk=3)[0], (hidden, weight))
    logp, ent = linear_logprobs(hidden, weight, targets, 0.8, chunk=3)
    logits = hidden @ weight.T / 0.8
    assert torch.allclose(logp.double(), torch.log_softmax(logits, -1)[torch.arange(7), targets], atol=1e-6)
    p = torch.softmax(logits, -1)
    assert torch.allclose(ent.double(), -(p * torch.log(p)).sum(-1), atol=1e-5)


def test_the_entropy_carries_its_gradient_for_the_entropy_bonus():
    # dH/dz = -p (log p + H) in the chunked backward (gradcheck, with and without a log-prob gradient),
    # and the padded path's autograd entropy when asked for it
    hidden, weight, targets = _random_head()
    torch.autograd.gradcheck(lambda h, w: linear_logprobs(h, w, targets, 0.8, chunk=3)[1], (hidden, weight))
    torch.autograd.gradcheck(lambda h, w: sum(linear_logprobs(h, w, targets, 0.8, chunk=3)[:2]), (hidden, weight))
    logits = (hidden @ weight.T / 0.8)[None]
    _, ent = selective_logprobs(logits, targets[None], entropy_grad=True)
    ent.sum().backward()
    padded = hidden.grad.clone()
    hidden.grad = None
    linear_logprobs(hidden, weight, targets, 0.8, chunk=3)[1].sum().backward()
    assert torch.allclose(hidden.grad, padded)
    assert not selective_logprobs(logits.detach().requires_grad_(), targets[None])[1].requires_grad  # only when asked


def test_token_stats_are_the_argmax_hit_and_the_mean_logit_on_both_paths(tiny):
    """SFT's mean_token_accuracy and DPO's logits/* (TRL's): whether each target is the most likely
    token and the mean of its position's logits, by the chunked pass (chunks of 3 over 7 rows) and by
    the padded one, against the full logits; targets are made the argmax on some rows, so that both
    answers occur."""
    from rlvr.logprobs import selective_logprobs

    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 5, dtype=torch.float64), torch.randn(11, 5, dtype=torch.float64)
    logits = hidden @ weight.T
    targets = torch.randint(0, 11, (7,))
    targets[::2] = logits.argmax(-1)[::2]
    hit = targets == logits.argmax(-1)
    assert hit.any() and not hit.all()
    logp, ent, found = linear_logprobs(hidden, weight, targets, 1.0, chunk=3, stats=True)
    assert torch.equal(found[:, 0].bool(), hit) and torch.allclose(found[:, 1], logits.mean(-1))
    assert torch.equal(logp, linear_logprobs(hidden, weight, targets, 1.0, chunk=3)[0])  # the same log-probs either way
    _, _, top1, means = selective_logprobs(logits[None], targets[None], stats=True)
    assert torch.equal(top1[0], hit) and torch.allclose(means[0].double(), logits.mean(-1), atol=1e-6)  # in fp32
    model, _ = tiny  # the fast path scatters them into the padded layout as it does log-probs
    rollouts = [Rollout(PROMPTS[g], c, [0.0] * len(c), "stop", "") for g, c in zip(GROUP, COMPLETIONS)]
    batch = Batch.from_rollouts(rollouts, torch.zeros(6), torch.ones(6, dtype=torch.bool), 0, False)
    from rlvr.logprobs import padded_logprobs

    with torch.no_grad():
        fast = batch_logprobs(LlamaRunner(model), batch, 1.0, stats=True)
        slow = padded_logprobs(model, batch, 1.0, stats=True)
    mask = batch.completion_mask
    assert torch.equal(fast[2], slow[2] & mask) and torch.allclose(fast[3], torch.where(mask, slow[3], 0.0), atol=1e-5)


def test_a_group_whose_completions_start_from_different_prompts_is_not_packed_as_one(tiny):
    """TRL's environments may give each completion of a group its own task (its reset samples one): the fast
    path then prefills each prompt once for the rows that share it, not the group's first for all."""
    model, _ = tiny
    rollouts = [Rollout(PROMPTS[g], c, [0.0] * len(c), "stop", "") for g, c in zip(GROUP, COMPLETIONS)]
    batch = Batch.from_rollouts(rollouts, torch.zeros(6), torch.ones(6, dtype=torch.bool), 0, False, group_size=len(rollouts))
    assert batch.group_ids.tolist() == GROUP  # one id per distinct prompt of the group
    from rlvr.logprobs import padded_logprobs

    with torch.no_grad():
        fast, _ = batch_logprobs(LlamaRunner(model), batch, 1.0)
        slow, _ = padded_logprobs(model, batch, 1.0)
    mask = batch.completion_mask
    assert torch.allclose(fast, torch.where(mask, slow, 0.0), atol=1e-5)
    assert torch.allclose(fast[mask], reference_logprobs(model), atol=1e-5)


def test_bf16_logprobs_stay_close(tiny):
    model, _ = tiny
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        runner = LlamaRunner(model)
        hidden = runner.completion_hidden(PROMPTS, COMPLETIONS, GROUP)
        targets = torch.tensor([t for c in COMPLETIONS for t in c])
        bf16 = linear_logprobs(hidden, model.lm_head.weight, targets, 1.0, torch.bfloat16)[0]
    with torch.no_grad():
        assert torch.allclose(bf16, reference_logprobs(model), atol=0.05)


def test_the_update_gives_the_same_loss_and_gradients_on_both_paths(family, tmp_path):
    from rlvr.config import build_config
    from rlvr.trainer import Trainer
    from rlvr.types import Example

    model, tokenizer = family
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "num_generations": 3,
                        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "loss_type": "grpo", "beta": 0.05})
    trainer = Trainer(cfg, model, tokenizer, [Example("q", "1")], tmp_path, 5)
    rollouts = [Rollout(PROMPTS[g], c, [0.0] * len(c), "stop", "") for g, c in zip(GROUP, COMPLETIONS)]
    # positive advantages, so the loss is a sum of same-signed terms and a relative tolerance means something
    batch = Batch.from_rollouts(rollouts, torch.linspace(0.5, 1.5, 6), torch.ones(6, dtype=torch.bool), 0, False)
    batch.group_ids = torch.tensor(GROUP)
    with torch.no_grad():
        batch.ref_logprobs = trainer.logprobs.padded(model, batch)[0] - 0.1  # a reference that differs
        batch.old_logprobs = trainer.logprobs.padded(model, batch)[0] + 0.05  # ratios away from 1

    def run(fast):
        trainer.logprobs.fast = fast
        sums = trainer.updater.accumulate_gradients(batch)
        return sums, {n: p.grad.clone() for n, p in model.named_parameters()}

    fast_sums, fast_grads = run(True)
    ref_sums, ref_grads = run(False)
    assert fast_sums["loss"] == pytest.approx(ref_sums["loss"], rel=1e-5)
    assert fast_sums["kl"] == pytest.approx(ref_sums["kl"], rel=1e-5)
    for name in ref_grads:
        scale = ref_grads[name].abs().max().clamp(min=1e-8)
        assert (fast_grads[name] - ref_grads[name]).abs().max() / scale < 1e-5, name


def test_no_full_logits_tensor_is_ever_made(tiny):
    """No tensor of logits over all completion tokens is ever created, forward or backward:
    with 4-row chunks, every new [rows, vocab] tensor has at most 4 rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, _ = tiny
    vocab = model.config.vocab_size
    weight_storage = model.lm_head.weight.untyped_storage().data_ptr()
    rows_seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == vocab:
                    if t.untyped_storage().data_ptr() != weight_storage:  # not a view of the weights
                        rows_seen.append(t.shape[0])
            return out

    runner = LlamaRunner(model)
    with Watch():
        hidden = runner.completion_hidden(PROMPTS, COMPLETIONS, GROUP)
        targets = torch.tensor([t for c in COMPLETIONS for t in c])
        logp, _ = linear_logprobs(hidden, model.lm_head.weight, targets, 1.0, chunk=4)
        logp.sum().backward()
    assert rows_seen and max(rows_seen) == 4  # 23 completion tokens, never more than a chunk at once


def _checkpointing_on(model) -> None:
    """As run.py turns it on for gradient_checkpointing=true: on every decoder layer, non-reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})


def _loss_and_grads(model):
    weights = torch.linspace(-1, 1, sum(len(c) for c in COMPLETIONS))
    model.zero_grad()
    logp = fast_logprobs(model)
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_recomputes_each_layer_to_the_same_gradients(tiny):
    """With the model's gradient checkpointing on, the fast path runs each decoder layer again in the
    backward pass (twice in all, once without gradients) and gives the same log-probs and gradients."""
    model, _ = tiny
    calls = []
    for layer in model.model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda *args: calls.append(1))
    plain_logp, plain_grads = _loss_and_grads(model)
    assert len(calls) == 2
    _checkpointing_on(model)
    calls.clear()
    logp, grads = _loss_and_grads(model)
    assert len(calls) == 4  # forward, and again in the backward pass
    assert torch.equal(logp, plain_logp)
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        assert (g - plain_grads[name]).abs().max() <= 1e-6 * plain_grads[name].abs().max().clamp(min=1e-8), name
    calls.clear()
    with torch.no_grad():
        fast_logprobs(model)
    assert len(calls) == 2  # nothing is kept for a backward pass that will not come: no recomputation


def test_gradient_checkpointing_keeps_a_small_fraction_of_the_activations():
    """What the backward pass keeps (every tensor autograd saves that is not a weight), over 8
    completions of 60 tokens on 2 prompts of 40, 4 layers of width 64: with checkpointing only
    each layer's input and the output layer's inputs (measured: 6% of the 17.8 MB kept without)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (40,), generator=g).tolist() for _ in range(2)]
    completions = [torch.randint(3, 64, (60,), generator=g).tolist() for _ in range(8)]
    group = [0] * 4 + [1] * 4
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def kept_bytes() -> int:
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = LlamaRunner(model).completion_hidden(prompts, completions, group)
            linear_logprobs(hidden, model.lm_head.weight, torch.tensor([t for c in completions for t in c]))
        return sum(kept.values())

    plain = kept_bytes()
    _checkpointing_on(model)
    checkpointed = kept_bytes()
    assert plain > 10_000_000
    assert checkpointed < 0.1 * plain, (checkpointed, plain)


def test_gradient_checkpointing_with_lora_gives_the_adapter_its_gradients(tiny):
    """LoRA freezes the embeddings, so no checkpointed layer's input needs a gradient: non-reentrant
    checkpointing still gives the adapter weights inside the layers their gradients, unchanged."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    model, _ = tiny
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    _, plain = _loss_and_grads(model)
    _checkpointing_on(model)
    model.disable_input_require_grads()  # transformers 5 adds a hook that makes the embeddings' output need one
    _, checkpointed = _loss_and_grads(model)
    assert len(plain) == 12 and plain.keys() == checkpointed.keys()  # A and B of 3 modules x 2 layers
    for name, g in plain.items():
        assert g.abs().max() > 0 and torch.allclose(checkpointed[name], g, rtol=1e-5, atol=1e-8), name


@pytest.mark.trains
def test_a_run_with_gradient_checkpointing_trains_to_the_same_weights(tiny_run_config, tmp_path, monkeypatch):
    """gradient_checkpointing=true through train() (run.py turns it on, the fast path honours it):
    the recomputed layers give bit-identical log-probs, so the same run to the same weights."""
    import json
    import zlib

    from safetensors.torch import load_file

    import rlvr.llama as llama
    import rlvr.rewards as rewards
    from rlvr.run import train

    # rewards that differ within a group, so that every step updates
    monkeypatch.setitem(rewards.REWARDS, "boxed_format", lambda completions, **kw: [zlib.crc32(c.encode()) % 7 for c in completions])
    layers_checkpointed = []
    monkeypatch.setattr(llama, "checkpoint", lambda *a, real=llama.checkpoint, **kw: layers_checkpointed.append(1) or real(*a, **kw))
    train(tiny_run_config(tmp_path / "plain", max_steps=2))
    assert not layers_checkpointed
    train(tiny_run_config(tmp_path / "checkpointed", gradient_checkpointing=True, max_steps=2))
    assert len(layers_checkpointed) == 2 * 2  # 2 layers x 2 updates of one micro-batch
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("plain", "checkpointed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["grad_norm"] > 0 for r in rows)


# --- sampling: the fast sampler decodes what the model's own forward decodes ----------------


def test_greedy_outputs_are_identical_on_both_samplers_and_generate(family):
    """Prompts of different lengths (left-padded together on the generic path), two completions
    each: FastSampler, HFSampler and transformers' generate give the same greedy tokens, and the
    two samplers the same per-token log-probs."""
    model, tokenizer = family
    prompts = [p[:9] for p in PROMPTS]
    params = SamplingParams(n=2, max_tokens=12, temperature=0)
    fast = FastSampler(model, tokenizer, [10_000]).generate(prompts, params)  # an id never produced: run to length
    generic = HFSampler(model, tokenizer, [10_000]).generate(prompts, params)
    for prompt, fast_group, generic_group in zip(prompts, fast, generic):
        x = torch.tensor([prompt])
        ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        for f, g in zip(fast_group, generic_group):
            assert f.completion_ids == g.completion_ids == ref[0, x.shape[1]:].tolist()
            assert max(abs(a - b) for a, b in zip(f.logprobs, g.logprobs)) < 1e-4


def test_lora_on_qwen3_equals_peft_forward():
    """LoRA adapters on every linear layer of a Qwen3 model (k_proj feeds its k_norm): the fast
    path's log-probs and the adapters' gradients equal peft's own forward."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(make_family_model("qwen3", 64), LoraConfig(r=4, lora_alpha=8, target_modules=modules))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    assert supports(model)
    weights = torch.linspace(-1, 1, sum(len(c) for c in COMPLETIONS))

    def grads(fn):
        model.zero_grad()
        logp = fn(model)
        (logp * weights).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (fast, fast_grads), (ref, ref_grads) = grads(fast_logprobs), grads(reference_logprobs)
    assert (fast - ref).abs().max() < 1e-5
    assert len(ref_grads) == 2 * 7 * 2 and fast_grads.keys() == ref_grads.keys()  # A and B, 7 modules, 2 layers
    for name, g in ref_grads.items():
        assert (fast_grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-8) < 1e-5, name


# --- a model the fast path does not cover ---------------------------------------------------


def _tiny_gemma3(vocab_size):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=256)
    return Gemma3ForCausalLM(config)


def test_a_model_off_the_fast_path_says_once_which_path_and_why(tiny, caplog, monkeypatch):
    """Gemma 3 (and Mistral with its sliding window) sample on the generic path, and the first
    sampler made for each says so in one line naming the model type and the reason."""
    import rlvr.llama as llama

    _, tokenizer = tiny
    monkeypatch.setattr(llama, "_REPORTED", set())
    gemma = _tiny_gemma3(len(tokenizer))
    assert fast_path_reason(gemma).startswith("gemma3_text: sliding-window attention")
    with caplog.at_level(logging.WARNING, logger="rlvr.llama"):
        samplers = [make_sampler(gemma, tokenizer, [2]) for _ in range(3)]
    assert all(type(s) is HFSampler for s in samplers)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlvr.llama"]
    assert lines == ["gemma3_text: sliding-window attention and Gemma's decoder block are not implemented on rlvr's fast path; "
                     "rollout and update use the model's own forward (slower)"]
    out = samplers[0].generate([PROMPTS[1]], SamplingParams(n=2, max_tokens=3, temperature=0))
    assert [len(r.completion_ids) for r in out[0]] == [3, 3]

    caplog.clear()
    from transformers import MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, sliding_window=16))
    with caplog.at_level(logging.WARNING, logger="rlvr.llama"):
        assert type(make_sampler(windowed, tokenizer, [2])) is HFSampler
        make_sampler(windowed, tokenizer, [2])
    assert [r.getMessage() for r in caplog.records] == [
        "mistral: sliding-window attention is not implemented on rlvr's fast path; rollout and update use the model's own forward (slower)"]
    with pytest.raises(ValueError, match="mistral: sliding-window"):
        LlamaRunner(windowed)


def test_in_chunks_runs_at_least_the_forwards_asked_for_with_the_same_log_probs(tiny):
    """A sharded reference's forwards are collectives: a rank with fewer rows runs empty ones (at_least)."""
    from rlvr.logprobs import LogProbs

    model, _ = tiny
    rollouts = [Rollout(PROMPTS[g], c, [0.0] * len(c), "stop", "") for g, c in zip(GROUP, COMPLETIONS)]
    batch = Batch.from_rollouts(rollouts, torch.zeros(6), torch.ones(6, dtype=torch.bool), 0, False)
    logprobs, calls = LogProbs(fast=False, temperature=1.0, micro_batch_size=4), []
    hook = model.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        plain = logprobs.in_chunks(model, batch)
        assert (logprobs.chunks(batch), len(calls)) == (2, 2)  # 6 rows, 4 at a time
        more = logprobs.in_chunks(model, batch, at_least=5)
    finally:
        hook.remove()
    assert len(calls) == 2 + 5 and torch.equal(plain, more)

