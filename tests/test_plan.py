"""`rlvr plan`: the memory formulas of plan.py, checked by hand on the tiny model's sizes."""

from rlvr.config import build_config
from rlvr.plan import ModelSize, estimate

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 55, "tie_word_embeddings": True}


def _cfg(**kw):
    return build_config({"num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                         "max_prompt_length": 10, "max_completion_length": 6, "beta": 0.1, **kw})


def test_parameter_counts_match_the_model():
    from conftest import make_tiny_model

    size = ModelSize.from_config(TINY)
    # per layer: q 32x32 + k 32x16 + v 32x16 + o 32x32 + 3 x 32x64 + 2 norms x 32 = 9280;
    # 2 layers + embeddings 55 x 32 + final norm 32 (output layer tied) = 20352
    assert size.params == 20352
    assert size.params == sum(p.numel() for p in make_tiny_model(55).parameters())
    # LoRA r=4: 4 x ((32+32) + (32+16) x 2 + (32+32) + (32+64) x 3) = 2048 per layer
    assert size.lora_params(4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) == 4096


def test_full_fine_tuning_by_hand():
    est = estimate(ModelSize.from_config(TINY), _cfg())
    assert est["policy"] == 20352 * 4 == est["reference"] == est["gradients"]
    assert est["optimizer"] == 2 * 20352 * 4
    assert est["rollout weights"] == (20352 - 5 * 32) * 4  # every linear and the (tied) output layer, no norms
    # 2 prompts per step x G=4 = 8 rows; 2 (k, v) x 2 layers x 8 rows x 2 kv heads x 8 dims x 16 positions x 4 bytes
    assert est["KV cache"] == 32768
    assert est["rollout logits"] == 2 * 8 * 55 * 4
    # N = 4 x 6 + 1 prompt x 10 = 34 tokens; e = 4x32 + 3x32 + 3x16 + 4x64 = 528 elements
    # attention: 2 layers x 4 heads x (4 x 6 x 16 + 10 x 10) x 4 bytes = 15488
    assert est["activations"] == 2 * 34 * 528 * 4 + 15488 == 159104
    assert est["logits chunk"] == 2 * 24 * 55 * 4
    # resident 81408 x 3 + 162816 + 80768, plus the larger phase: update 159104 + 10560
    assert est["total"] == 81408 * 3 + 162816 + 80768 + 159104 + 10560 == 657472


def test_sampling_ahead_adds_a_weight_copy_and_overlaps_the_phases():
    est = estimate(ModelSize.from_config(TINY), _cfg(max_staleness=1))
    assert est["sampler copy"] == 20352 * 4
    # resident as above plus the copy, then rollout (KV 32768 + logits 3520) and update (159104 + 10560) at once
    assert est["total"] == 81408 * 4 + 162816 + 80768 + 32768 + 3520 + 159104 + 10560
    with_vllm = estimate(ModelSize.from_config(TINY), _cfg(max_staleness=1, use_vllm=True))
    assert with_vllm["sampler copy"] == 0 and with_vllm["total"] == 657472  # vLLM samples elsewhere


def test_lora_has_no_reference_and_a_small_optimizer():
    est = estimate(ModelSize.from_config(TINY), _cfg(use_peft=True, lora_r=4, bf16=True))
    assert est["reference"] == 0  # the adapter disabled is the reference
    assert est["policy"] == 20352 * 4 + 4096 * 4
    assert est["gradients"] == 4096 * 4 and est["optimizer"] == 2 * 4096 * 4
    assert est["rollout weights"] == (20352 - 5 * 32) * 2  # sampled in bf16
    assert est["bf16 casts"] == 20352 * 2
    assert est["activations"] == 2 * 34 * 528 * 2 + 15488  # bf16 activations, fp32 attention probabilities


def test_cli_prints_the_table(capsys):
    from rlvr.cli import main

    args = [f"{k}={str(v).lower()}" for k, v in TINY.items()]
    assert main(["plan", *args, "num_generations=4", "per_device_train_batch_size=4", "use_peft=true"]) == 0
    out = capsys.readouterr().out
    for row in ("policy", "reference", "gradients", "optimizer", "KV cache", "activations", "logits chunk", "total"):
        assert row in out
