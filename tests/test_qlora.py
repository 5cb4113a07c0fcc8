"""QLoRA (load_in_4bit with use_peft) on the tiny model, on the CPU: the settings and their refusals,
TRL's names for them, the fast path's refusal, gradients equal to LoRA over the dequantized weights
after sampling, and a run that trains the adapter and resumes exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlvr import lora, qlora
from rlvr.config import ConfigError, build_config
from rlvr.models import load_model

LINE = ("load_in_4bit=true (QLoRA) trains a LoRA adapter over the frozen 4-bit weights, which cannot be trained "
        "themselves: set use_peft=true")


def _problems(settings: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build_config(settings)
    return str(caught.value).split("\n  - ")[1:]


def test_qlora_needs_lora_and_refuses_what_would_copy_or_shard_its_weights():
    assert _problems({"load_in_4bit": True}) == [LINE]
    qlora_on = {"load_in_4bit": True, "use_peft": True}
    assert _problems({**qlora_on, "lora_save": "merged"}) == [
        "lora_save=merged with load_in_4bit would merge the adapter into rounded 4-bit weights: keep lora_save=adapter "
        "(rlvr eval puts it on the full-precision base model)"]
    assert _problems({**qlora_on, "fsdp": True}) == [
        "load_in_4bit (QLoRA) with fsdp is not supported: FSDP2 would shard bitsandbytes' packed 4-bit weights; train "
        "without fsdp (each process holds the whole 4-bit model, the adapter's gradients are summed)"]
    assert _problems({**qlora_on, "rollout_workers": 2}) == [
        "load_in_4bit (QLoRA) with rollout_workers is not supported: the Ray workers rebuild the model from the trainer's "
        "weights, which are packed 4-bit ones; sample in the training process"]
    assert _problems({**qlora_on, "max_staleness": 1}) == [
        "load_in_4bit (QLoRA) with max_staleness >= 1 and the in-process sampler is not supported: sampling ahead copies the "
        "policy's weights, which are packed 4-bit ones; use max_staleness=0, or use_vllm=true"]
    assert _problems({**qlora_on, "bnb_4bit_quant_type": "int4", "bnb_4bit_quant_storage": "int8"}) == [
        "bnb_4bit_quant_type must be one of nf4, fp4; got 'int4'",
        "bnb_4bit_quant_storage must be uint8, float16, bfloat16 or float32 (or null: uint8); got 'int8'"]
    build_config({**qlora_on, "max_staleness": 1, "use_vllm": True})  # vLLM samples: nothing copies the 4-bit model
    with pytest.raises(ConfigError, match=r"^load_in_8bit=True is not supported yet: 8-bit loading \(LLM.int8\) is not "
                                          r"supported; QLoRA is load_in_4bit=true with use_peft=true$"):
        build_config({"load_in_8bit": True, "use_peft": True})


def test_trls_names_make_the_bitsandbytes_config_trl_makes():
    """A TRL recipe's ModelConfig keys are rlvr's settings; the config is what TRL's get_quantization_config
    builds from them (the compute dtype is the weights' dtype)."""
    pytest.importorskip("bitsandbytes")
    import rlvr

    cfg = build_config({"load_in_4bit": True, "use_peft": True, "bnb_4bit_quant_type": "fp4", "use_bnb_nested_quant": True,
                        "bnb_4bit_quant_storage": "bfloat16", "dtype": "bfloat16"})
    ours = qlora.quantization_config(cfg.model_settings)
    trls = rlvr.get_quantization_config(rlvr.ModelConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", use_bnb_nested_quant=True,
                                                         bnb_4bit_quant_storage="bfloat16", dtype="bfloat16"))
    assert ours.to_dict() == trls.to_dict()
    assert (ours.load_in_4bit, ours.bnb_4bit_compute_dtype, ours.bnb_4bit_quant_type, ours.bnb_4bit_use_double_quant,
            ours.bnb_4bit_quant_storage) == (True, torch.bfloat16, "fp4", True, torch.bfloat16)
    assert qlora.quantization_config(build_config({}).model_settings) is None
    assert rlvr.get_quantization_config(rlvr.ModelConfig()) is None


def test_trainers_take_trls_quantization_config(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    import rlvr

    rows = [{"prompt": "1+1?", "answer": "2"}] * 8
    lora_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    trainer = rlvr.GRPOTrainer(str(tiny_model_dir), reward_funcs="accuracy", train_dataset=rows, peft_config=lora_config,
                               quantization_config=rlvr.get_quantization_config(rlvr.ModelConfig(load_in_4bit=True)),
                               args=rlvr.GRPOConfig(output_dir="unused", use_cpu=True))
    assert (trainer.cfg.load_in_4bit, trainer.cfg.bnb_4bit_quant_type, trainer.cfg.bnb_4bit_quant_storage) == (True, "nf4", None)
    with pytest.raises(ConfigError, match=r"^quantization_config computes in bfloat16 but dtype=float32: rlvr computes the 4-bit "
                                          r"layers in the weights' dtype"):
        rlvr.GRPOTrainer(str(tiny_model_dir), reward_funcs="accuracy", train_dataset=rows, peft_config=lora_config,
                         quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match=r"^quantization_config with load_in_8bit: 8-bit loading \(LLM.int8\) is not supported"):
        rlvr.GRPOTrainer(str(tiny_model_dir), reward_funcs="accuracy", train_dataset=rows, peft_config=lora_config,
                         quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(ConfigError, match=LINE.replace("(", r"\(").replace(")", r"\)")):  # no peft_config
        rlvr.GRPOTrainer(str(tiny_model_dir), reward_funcs="accuracy", train_dataset=rows,
                         quantization_config=rlvr.get_quantization_config(rlvr.ModelConfig(load_in_4bit=True)))


def test_missing_bitsandbytes_is_said_before_the_model_loads(tiny_model_dir, monkeypatch):
    import importlib.util

    from rlvr import distributed
    from rlvr.settings import check_runnable

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    cfg = build_config({"model": str(tiny_model_dir), "load_in_4bit": True, "use_peft": True})
    with pytest.raises(ConfigError) as caught:
        check_runnable(cfg, distributed.SINGLE)
    assert str(caught.value) == ("load_in_4bit=true needs bitsandbytes, which is not installed. Install it with: "
                                 "pip install 'rlvr[qlora]'  (or: pip install 'bitsandbytes>=0.50')")


def _qlora_model(tiny_model_dir, settings):
    """The tiny model in 4 bits, readied and adapted as a run does it, its adapter's B random (peft starts it at 0)."""
    model, tokenizer, path = load_model(str(tiny_model_dir), quantization_config=qlora.quantization_config(settings))
    model = lora.wrap(qlora.prepare(model, use_peft=True), settings, path, seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, tokenizer


def test_quantized_weights_keep_off_the_fast_path_with_the_reason(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    from rlvr.llama import LlamaRunner, fast_path_reason

    settings = build_config({"load_in_4bit": True, "use_peft": True, "lora_target_modules": ["all-linear"]}).model_settings
    model, _ = _qlora_model(tiny_model_dir, settings)
    reason = ("llama: its weights are quantized (bitsandbytes), unpacked only inside the quantized layers' own forward; "
              "rlvr's fast path reads plain weights")
    assert fast_path_reason(model) == reason
    with pytest.raises(ValueError, match="cannot run on rlvr's fast path: llama: its weights are quantized"):
        LlamaRunner(model)
    # a 4-bit model given as an object (GRPOTrainer(model=...)) trains through an adapter only
    bare, _, _ = load_model(str(tiny_model_dir), quantization_config=qlora.quantization_config(settings))
    with pytest.raises(ConfigError) as caught:
        qlora.prepare(bare, use_peft=False)
    assert str(caught.value) == ("the model is loaded in 4 bits, whose packed weights cannot be trained: train a LoRA adapter "
                                 "over it (use_peft=true, or GRPOTrainer(peft_config=LoraConfig(...)))")


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory):
    """The tiny model 64 wide (head_dim 16): the smallest whose layers bitsandbytes can repack for CPU
    inference (its packing needs inputs of at least one 64-weight block and outputs in multiples of 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import make_tokenizer

    path = tmp_path_factory.mktemp("wider-llama")
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_gradients_after_sampling_are_loras_over_the_dequantized_weights(wider_model_dir):
    """What QLoRA claims: the adapter's gradients are LoRA's over the 4-bit weights (dequantized), also after the
    sampler ran the model in eval mode without gradients.  There bitsandbytes 0.50 repacks the weights for
    inference on an AVX512-BF16 CPU (this project's), in place, into a layout whose kernel has no backward
    unless rlvr turns that off: measured without it, the first layer's adapter gradients were wrong."""
    bitsandbytes = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnb_functional
    from transformers import AutoModelForCausalLM

    from rlvr.models import eos_token_ids
    from rlvr.rollout import SamplingParams
    from rlvr.rollout.engine import make_sampler

    settings = build_config({"load_in_4bit": True, "use_peft": True, "lora_target_modules": ["all-linear"],
                             "lora_dropout": 0.0}).model_settings
    tiny_model_dir = wider_model_dir
    quantized, tokenizer = _qlora_model(tiny_model_dir, settings)
    sampler = make_sampler(quantized, tokenizer, eos_token_ids(quantized, tokenizer))
    sampler.generate([[1, 24, 22, 8]], SamplingParams(n=2, max_tokens=4), torch.Generator().manual_seed(0))

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # the same weights, dequantized from the 4-bit ones
    layers = {name.replace(".base_layer", ""): m for name, m in lora.unwrap(quantized).named_modules()
              if isinstance(m, bitsandbytes.nn.Linear4bit)}
    assert len(layers) == 14  # 7 linear layers a decoder layer, 2 layers
    with torch.no_grad():
        for name, module in layers.items():
            assert not getattr(module.weight.quant_state, "packing_format_for_cpu", False), name  # still the trainable layout
            plain.get_submodule(name).weight.copy_(bnb_functional.dequantize_4bit(module.weight.data, module.weight.quant_state))
    plain = lora.wrap(plain, settings, str(tiny_model_dir), seed=0)
    plain.load_state_dict({k: v for k, v in quantized.state_dict().items() if "lora_" in k}, strict=False)

    ids = torch.tensor([[1, 24, 22, 8, 33, 41, 35, 7, 9]])
    for model in (quantized, plain):
        model.train()
        torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
    ours = {n: p.grad for n, p in quantized.named_parameters() if p.requires_grad}
    theirs = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) == 28
    for name in ours:
        assert ours[name] is not None, name
        assert torch.allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-6), name


@pytest.fixture
def informative_rewards(monkeypatch):
    """Random rewards, so every group carries signal and every step updates the adapter."""
    import rlvr.rewards as rewards

    gen = torch.Generator().manual_seed(0)
    monkeypatch.setitem(rewards.REWARDS, "boxed_format", lambda completions, **kw: torch.rand(len(completions), generator=gen).tolist())
    return gen


@pytest.mark.trains
def test_a_qlora_run_trains_the_adapter_and_resumes_exactly(tiny_run_config, tiny_model_dir, tmp_path, monkeypatch,
                                                              informative_rewards):
    pytest.importorskip("bitsandbytes")
    from rlvr.run import train
    from rlvr.trainer import Trainer

    settings = {"load_in_4bit": True, "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["all-linear"],
                "beta": 0.04, "max_steps": 3, "save_steps": 2}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_run_config(straight, **settings))
    adapter = load_file(str(straight / "adapter_model.safetensors"))
    assert len(adapter) == 28 and all("lora_" in k for k in adapter) and not (straight / "model.safetensors").exists()
    assert all(adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)  # peft starts B at 0: the steps moved it
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[-1]["kl"] > 0  # the reference (the adapter off) is the 4-bit base model

    informative_rewards.manual_seed(0)
    original = Trainer.train_step

    def stop_before_step_3(self, **kwargs):
        if self.step == 2:
            raise KeyboardInterrupt
        return original(self, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", stop_before_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run_config(resumed, **settings))
    monkeypatch.setattr(Trainer, "train_step", original)
    train(tiny_run_config(resumed, **settings, resume=True))
    again = load_file(str(resumed / "adapter_model.safetensors"))
    assert all(torch.equal(adapter[k], again[k]) for k in adapter)

    model, _, _ = load_model(str(straight))  # what `rlvr eval` loads: the adapter merged onto the full-precision base
    assert qlora.bits(model) is None and all(p.is_floating_point() for p in model.parameters())
