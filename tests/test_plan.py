"""`rlvr plan`: the memory formulas of plan.py, checked by hand on the tiny model's sizes."""

from rlvr.config import build_config
from rlvr.plan import ModelSize, estimate, on_trainer

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


def test_one_process_sampling_elsewhere_holds_no_sampler():
    """With vLLM (or rollout workers) the trainer process holds no rollout weights, KV cache or logits
    (with LoRA not even a merged copy: rollout/weights.py merges each weight as it is sent)."""
    size = ModelSize.from_config(TINY)
    for settings in ({"use_vllm": True, "vllm_mode": "server"}, {"use_vllm": True}, {"rollout_workers": 2}):
        est = on_trainer(size, _cfg(**settings))
        assert est["rollout weights"] == est["KV cache"] == est["rollout logits"] == 0
        # policy, reference, gradients 81408 each, optimizer 162816, then the update 159104 + 10560
        assert est["total"] == 81408 * 3 + 162816 + 159104 + 10560 == 576704
    assert on_trainer(size, _cfg())["total"] == estimate(size, _cfg())["total"] == 657472  # sampling here: as before
    lora = on_trainer(size, _cfg(use_vllm=True, vllm_mode="server", use_peft=True, lora_r=4, lora_target_modules=["all-linear"]))
    # the policy with its adapter 81408 + 16384, gradients 16384, optimizer 32768, then the update
    assert lora["total"] == 81408 + 16384 + 16384 + 32768 + 159104 + 10560


def test_lora_has_no_reference_and_a_small_optimizer():
    est = estimate(ModelSize.from_config(TINY), _cfg(use_peft=True, lora_r=4, lora_target_modules=["all-linear"], bf16=True))
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


# Layouts (gpus=N, gpu_memory_gb=M): per GPU of each node.  MIB: gpu_memory_gb for a 1 MiB "GPU", whose
# byte counts stay whole numbers.
MIB = 1 / 1024


def test_fsdp_over_four_gpus_shards_what_trains_and_gathers_the_whole_weights_only_to_sample():
    from rlvr.plan import Layout, trainer_gpu

    size = ModelSize.from_config(TINY)
    cfg = _cfg(fsdp=True, gradient_accumulation_steps=1)  # 4 completions a process: 16 over 4, 4 prompts, one per process
    one, four = estimate(size, cfg), trainer_gpu(size, cfg, Layout(gpus=4))
    for row in ("policy", "gradients", "optimizer"):
        assert four[row] == one[row] / 4
    assert four["policy"] == 81408 / 4 and four["optimizer"] == 162816 / 4
    assert four["reference"] == 81408 / 4  # the reference sharded as the policy is
    # the whole weights and the sampler's packed copy (80768) exist only while it samples (fsdp.GatheredCopy)
    assert four["gathered to sample"] == 81408 + 80768 and four["rollout weights"] == 0
    # root: embeddings 55 x 32 + final norm 32 = 1792 (tied); a layer 9280.  Gathered weights
    # (1792 + 2 x 9280) x 4 = 81408, whole gradients (1792 + 9280) x 4 = 44288
    assert four["FSDP gathered"] == 81408 + 44288
    # each process samples 1 prompt: 4 rows; 2 x 2 layers x 4 rows x 2 kv heads x 8 x 16 positions x 4 bytes
    assert four["KV cache"] == 16384 and four["rollout logits"] == 2 * 4 * 55 * 4
    # resident 20352 + 20352 + 20352 + 40704 (policy, reference, gradients, optimizer); then the larger of
    # sampling (KV 16384 + logits 1760 + gathered 162176 = 180320) and the update (activations 159104
    # + logits chunk 10560 + FSDP gathered 125696 = 295360): the phases do not add up
    assert four["total"] == 101760 + max(180320, 295360) == 397120


def test_lora_under_fsdp_has_no_reference_and_gathers_the_peft_model_to_sample():
    from rlvr.plan import Layout, trainer_gpu

    cfg = _cfg(fsdp=True, use_peft=True, lora_r=4, lora_target_modules=["all-linear"], gradient_accumulation_steps=1)
    est = trainer_gpu(ModelSize.from_config(TINY), cfg, Layout(gpus=2))
    assert est["reference"] == 0
    whole = 20352 * 4 + 4096 * 4  # the weights and the fp32 adapter, gathered
    assert est["gathered to sample"] == whole + estimate(ModelSize.from_config(TINY), cfg.for_processes(2))["rollout weights"]
    assert whole == 2 * est["policy"]
    assert est["FSDP gathered"] == 81408  # the weights only: the frozen ones have no gradients


def test_vllm_server_gpu_kv_tokens_by_hand():
    from rlvr.plan import Layout, trainer_gpu, vllm_gpu

    size = ModelSize.from_config(TINY)
    cfg = _cfg(use_vllm=True, vllm_mode="server", vllm_gpu_memory_utilization=0.5, vllm_tensor_parallel_size=2)
    v = vllm_gpu(size, cfg, Layout(gpu_memory_gb=MIB))
    # budget 0.5 x 1048576 = 524288; weights 20352 x 4 bytes / 2 GPUs = 40704; KV 483584
    assert v["total"] == 524288 and v["vLLM weights"] == 40704 and v["KV cache"] == 483584
    # a token: 2 (k, v) x 2 layers x 1 of the 2 kv heads x 8 dims x 4 bytes = 128; 483584 / 128 = 3778 tokens,
    # 3778 // (10 + 6) = 236 full-length completions
    assert v["KV bytes per token"] == 128 and v["KV tokens"] == 3778 and v["full-length completions"] == 236
    trainer = trainer_gpu(size, cfg, Layout(gpu_memory_gb=MIB))  # the sampler is on the rollout node
    assert trainer["rollout weights"] == trainer["KV cache"] == trainer["vLLM, colocated"] == 0
    assert trainer["total"] == 81408 * 3 + 162816 + 159104 + 10560


def test_colocated_vllm_takes_its_share_of_the_training_gpu():
    from rlvr.plan import Layout, trainer_gpu

    cfg = _cfg(use_vllm=True, vllm_gpu_memory_utilization=0.25)
    est = trainer_gpu(ModelSize.from_config(TINY), cfg, Layout(gpu_memory_gb=MIB))
    assert est["vLLM, colocated"] == 262144 and est["rollout weights"] == 0
    assert est["total"] == 81408 * 3 + 162816 + 262144 + 159104 + 10560


def test_rollout_workers_hold_a_policy_copy_and_the_sampler():
    import importlib.util

    import pytest

    from rlvr.plan import rollout_worker

    if importlib.util.find_spec("ray") is None:
        pytest.skip("rollout_workers needs Ray installed to validate")
    est = rollout_worker(ModelSize.from_config(TINY), _cfg(rollout_workers=2))
    # 2 prompts over 2 workers: 1 each, 4 rows; weights 81408, packed copy 80768, KV 16384, logits 1760
    assert est["total"] == 81408 + 80768 + 16384 + 1760
    with_lora = rollout_worker(ModelSize.from_config(TINY), _cfg(rollout_workers=2, use_peft=True, lora_r=4, lora_target_modules=["all-linear"]))
    assert with_lora["policy copy"] == 81408 + 4096 * 4  # the base weights and the fp32 adapter


def test_rollout_workers_with_vllm_leave_the_training_gpu_alone():
    import importlib.util

    import pytest

    from rlvr.plan import Layout, layout_estimate

    if importlib.util.find_spec("ray") is None:
        pytest.skip("rollout_workers needs Ray installed to validate")
    cfg = _cfg(rollout_workers=2, use_vllm=True, vllm_gpu_memory_utilization=0.5)
    est = layout_estimate(ModelSize.from_config(TINY), cfg, Layout(gpu_memory_gb=MIB))
    assert est["trainer"]["vLLM, colocated"] == 0 == est["trainer"]["KV cache"]  # vLLM runs in the workers
    assert est["vllm"]["KV cache"] == 524288 - 81408 and "worker" not in est


def _plan_output(capsys, *args):
    from rlvr.cli import main

    sizes = [f"{k}={str(v).lower()}" for k, v in TINY.items()]
    code = main(["plan", *sizes, "num_generations=4", "per_device_train_batch_size=4", "gradient_accumulation_steps=2",
                 "max_prompt_length=10", "max_completion_length=6", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_prints_each_node_per_gpu_and_keeps_the_one_process_table_without_a_layout(capsys):
    code, out = _plan_output(capsys, "use_vllm=true", "vllm_mode=server", "gpu_memory_gb=0.0009765625")
    assert code == 0 and "trainer node, per training GPU" in out and "rollout node: vLLM server" in out
    assert "full-length completions" in out and "of 0.000976562 GiB: fits" in out
    code, out = _plan_output(capsys, "use_vllm=true", "vllm_mode=server", "gpus=1")
    assert code == 2 and "gpu_memory_gb=" in out  # vLLM's share of a GPU needs the GPU's memory
    code, out = _plan_output(capsys)
    assert code == 0 and "trainer node" not in out and "total" in out


def test_weights_that_do_not_fit_are_reported(capsys):
    # 0.5 x 65536 bytes = 32768 < 81408 bytes of weights, on the vLLM GPU and on the trainer's
    code, out = _plan_output(capsys, "use_vllm=true", "vllm_mode=server", "vllm_gpu_memory_utilization=0.5",
                             f"gpu_memory_gb={1 / 16384}")
    assert code == 0 and "the weights do NOT fit" in out and "does NOT fit" in out
    code, out = _plan_output(capsys, "use_vllm=true", "vllm_mode=server", "vllm_tensor_parallel_size=3", "gpu_memory_gb=1")
    assert code == 0 and "vLLM refuses vllm_tensor_parallel_size=3: the 4 attention heads" in out


def test_bad_layouts_are_clear_errors(capsys):
    for args, message in ((["gpus=0"], "gpus must be a whole number >= 1"), (["gpus=1.5"], "gpus must be"),
                          (["gpu_memory_gb=0"], "gpu_memory_gb must be one GPU's memory in GiB"),
                          (["gpu_memory_gb=lots"], "gpu_memory_gb must be"),
                          (["gpus=2", "vllm_gpu_memory_utilization=1.5"], "vllm_gpu_memory_utilization must be in (0, 1]")):
        code, out = _plan_output(capsys, *args)
        assert code == 2 and message in out, (args, out)


def test_layouts_rlvr_train_refuses_are_planned_with_a_note(capsys):
    # 2 completions a process (per_device_train_batch_size is per process) are not a group of 4; fsdp in one process
    code, out = _plan_output(capsys, "gpus=2", "per_device_train_batch_size=2", "gradient_accumulation_steps=1")
    assert code == 0 and "each GPU's 2 completions of a generation are not whole groups of num_generations=4" in out
    code, out = _plan_output(capsys, "fsdp=true", "gpu_memory_gb=80")
    assert code == 0 and "fsdp=true shards across several processes" in out


def test_a_distillation_teacher_is_resident_at_its_own_size(tmp_path, capsys):
    """rlvr plan method=distill teacher=<dir>: the teacher's parameters, read from its own config (a model twice
    as wide here), in the run's dtype, added to what stays all along; none without a teacher."""
    import json

    from rlvr.plan import plan, render

    wide = {**TINY, "hidden_size": 64, "intermediate_size": 128, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(wide))
    args = [f"{k}={v}" for k, v in TINY.items()] + ["max_prompt_length=10", "max_completion_length=6"]
    size, cfg, _ = plan([*args, "method=distill", f"teacher={tmp_path}"])
    teacher = ModelSize.from_config(wide).params
    assert size.teacher_params == teacher
    est, alone = estimate(size, cfg), estimate(ModelSize.from_config(TINY), cfg)
    assert est["teacher"] == teacher * 4 and est["total"] == alone["total"] + teacher * 4
    assert "teacher" in render(size, cfg, None) and "teacher" not in render(*plan(args)[:2], None)
