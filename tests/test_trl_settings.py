"""Every setting of TRL 1.16's GRPOConfig is known, with TRL's default unless the README's table of
deliberate differences says otherwise.  tests/data/trl_grpo_config.yaml is TRL's own
GRPOConfig(use_cpu=True).to_dict(), dumped once, so TRL is not needed to run these."""

from pathlib import Path

import pytest
import yaml

from rlvr import trl_settings
from rlvr.config import FIELDS, Config, ConfigError, build_config, defaults_markdown

TRL = yaml.safe_load((Path(__file__).parent / "data" / "trl_grpo_config.yaml").read_text())
ROOT = Path(__file__).resolve().parents[1]


def test_every_trl_setting_is_classified():
    handled = {"activation_checkpointing", "resume_from_checkpoint", "vllm_importance_sampling_cap",
               "max_tool_calling_iterations"}  # translate()
    unknown = [k for k in TRL if k not in trl_settings.TRL_NAMES | set(trl_settings.IGNORED) | set(trl_settings.UNSUPPORTED) | handled]
    assert not unknown and len(TRL) == 191
    assert trl_settings.TRL_NAMES <= set(FIELDS)  # each TRL name rlvr claims is a real setting
    assert not set(trl_settings.IGNORED) & set(FIELDS) and not set(trl_settings.UNSUPPORTED) & set(FIELDS)


def _same(ours, theirs) -> bool:
    """Equal as a user means it: () and [] and None for an unset list, {} and None for an unset mapping."""
    if ours in ((), {}) and theirs in (None, [], {}):
        return True
    return list(ours) == theirs if isinstance(ours, tuple) else ours == theirs


def test_shared_defaults_are_trls_except_the_documented_differences():
    ours = Config()
    derived = {"steps_per_generation", "generation_batch_size"}  # TRL's __post_init__ fills them in: compared below
    special = {"use_cpu": "the fixture was dumped with use_cpu=True", "hub_token": "to_dict() masks it as <HUB_TOKEN>",
               "fsdp": "TRL: None; rlvr: False", "output_dir": "in the table"}
    differ = []
    for name in sorted(trl_settings.TRL_NAMES & set(TRL)):
        if name in derived or name in special:
            continue
        if not _same(getattr(ours, name), TRL[name]):
            differ.append(name)
    assert sorted(differ) == sorted(n for n in trl_settings.TRL_DEFAULTS_DIFFER if n != "output_dir")
    for name, (trl_default, why) in trl_settings.TRL_DEFAULTS_DIFFER.items():
        assert TRL[name] == trl_default and why
    assert (ours.completions_per_generation, ours.steps_per_optimizer_step) == (TRL["generation_batch_size"], TRL["steps_per_generation"])
    assert ours.fsdp is False and not TRL["fsdp"] and ours.use_cpu is False and ours.hub_token is None


def test_readme_lists_the_differences_and_what_happens_to_the_other_settings():
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])  # the README and its manuals
    assert defaults_markdown() in readme
    assert trl_settings.other_settings_markdown() in readme


@pytest.mark.parametrize("key,value,message", [
    ("deepspeed", "ds_zero3.json", "deepspeed='ds_zero3.json' is not supported yet: DeepSpeed is not supported"),
    ("torch_compile", True, "torch_compile=True is not supported yet"),
    ("activation_offloading", True, "activation_offloading=True is not supported yet"),
    ("load_in_8bit", True, "load_in_8bit=True is not supported yet: 8-bit loading (LLM.int8) is not supported; "
                           "QLoRA is load_in_4bit=true with use_peft=true"),
])
def test_settings_rlvr_cannot_honour_are_refused_by_name(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config({key: value})
    build_config({key: TRL.get(key, False if key == "load_in_8bit" else None)})  # TRL's default is accepted


def test_trl_spellings_and_ignored_settings():
    ignored: list[str] = []
    cfg = build_config({"activation_checkpointing": True, "evaluation_strategy": "steps", "fsdp": "full_shard auto_wrap",
                        "attn_implementation": "sdpa", "model_revision": "main", "warmup_steps": 0.1,
                        "dataloader_num_workers": 4, "logging_dir": "logs", "hub_token": "<HUB_TOKEN>"}, ignored=ignored)
    assert cfg.gradient_checkpointing and cfg.eval_strategy == "steps" and cfg.fsdp is True
    assert cfg.model_init_kwargs == {"attn_implementation": "sdpa", "revision": "main"}
    assert cfg.warmup_ratio == 0.1 and cfg.warmup_steps == 0  # transformers 5: a float below 1 is a ratio
    assert cfg.hub_token is None
    assert ignored == ["dataloader_num_workers", "logging_dir"]
    assert "2 TRL settings with no effect" in trl_settings.ignored_line(ignored)
    with pytest.raises(ConfigError, match="did you mean 'dataloader_num_workers'"):
        build_config({"dataloader_num_worker": 4})


def test_generation_batch_size_and_steps_per_generation_follow_trls_rules():
    cfg = build_config({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "generation_batch_size": 24,
                        "num_generations": 4})
    assert (cfg.prompts_per_step, cfg.steps_per_optimizer_step) == (6, 3)
    with pytest.raises(ConfigError, match="not a whole number of optimizer steps"):
        build_config({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "generation_batch_size": 12,
                      "num_generations": 4})
    with pytest.raises(ConfigError, match="disagree"):
        build_config({"per_device_train_batch_size": 4, "generation_batch_size": 8, "steps_per_generation": 4, "num_generations": 4})
    build_config({"per_device_train_batch_size": 8, "generation_batch_size": 8, "steps_per_generation": 1})  # to_dict() has both


def test_trl_vllm_serve_flags_become_settings():
    """A launch script's `trl vllm-serve ...` line, with trl swapped for rlvr."""
    from rlvr.trl_settings import serve_flags

    assert serve_flags(["--model", "Qwen/Qwen2.5-7B", "--tensor-parallel-size", "2", "--port=8001", "--host", "0.0.0.0",
                        "--gpu_memory_utilization", "0.9", "--dtype", "auto", "--enforce-eager", "--max-model-len", "4096",
                        "--data-parallel-size", "1", "lora_r=8"]) == [
        "model=Qwen/Qwen2.5-7B", "vllm_tensor_parallel_size=2", "vllm_server_port=8001", "vllm_server_host=0.0.0.0",
        "vllm_gpu_memory_utilization=0.9", "vllm_enforce_eager=true", "vllm_max_model_length=4096", "lora_r=8"]
    with pytest.raises(ValueError, match="start 4 `rlvr vllm-serve`"):
        serve_flags(["--model", "m", "--data-parallel-size", "4"])
    with pytest.raises(ValueError, match="unknown flag --batch-size"):
        serve_flags(["--batch-size", "4"])


def test_rlvr_vllm_serve_refuses_a_bad_flag_in_one_line(capsys):
    from rlvr.cli import main

    assert main(["vllm-serve", "--model", "m", "--data-parallel-size", "2"]) == 2
    assert "error: --data-parallel-size 2: start 2 `rlvr vllm-serve`" in capsys.readouterr().err


@pytest.mark.parametrize("name,method", [("SFTConfig", "sft"), ("DPOConfig", "dpo")])
def test_every_trl_sft_and_dpo_setting_is_classified_and_a_dump_of_them_loads(name, method):
    """Against the installed TRL's own dataclass: each field is an rlvr setting (of its name, or
    renamed for the method: loss_type, beta), ignored with a reason, or refused unless inert; and
    TRL's <Method>Config().to_dict() loads as rlvr's with TRL's loss_type."""
    import dataclasses

    import rlvr
    from rlvr import methods

    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(getattr(trl, name))}
    handled = {"activation_checkpointing", "resume_from_checkpoint", "vllm_importance_sampling_cap",
               "max_tool_calling_iterations"}  # translate()
    known = (trl_settings.TRL_NAMES | trl_settings.FINETUNE_NAMES | set(trl_settings.IGNORED) | set(trl_settings.UNSUPPORTED)
             | handled | set(methods.get(method).renames))
    assert not sorted(fields - known)
    assert trl_settings.FINETUNE_NAMES <= set(FIELDS) and not trl_settings.FINETUNE_NAMES & set(trl_settings.IGNORED)
    dumped = getattr(trl, name)(output_dir="x", use_cpu=True).to_dict()
    ours = getattr(rlvr, name)(**dumped)
    assert list(ours.loss_type) == dumped["loss_type"] if method == "dpo" else ours.loss_type == dumped["loss_type"] == "nll"
    for key in ("max_length", "truncation_mode", "completion_only_loss", "assistant_only_loss", "dataset_text_field",
                "packing", "label_smoothing", "learning_rate"):
        if key in dumped:
            assert getattr(ours, key) == dumped[key], key


def test_dpo_loss_type_takes_trls_list_and_refuses_what_rlvr_lacks_by_name():
    import rlvr

    assert rlvr.DPOConfig().loss_type == ["sigmoid"] and rlvr.DPOConfig(loss_type="ipo").loss_type == ["ipo"]  # as TRL's
    both = rlvr.DPOConfig(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5])
    assert (both.loss_type, both.loss_weights) == (["sigmoid", "ipo"], [1.0, 0.5])
    assert (both._config.dpo_loss_type, both._config.loss_weights) == (("sigmoid", "ipo"), (1.0, 0.5))
    with pytest.raises(ConfigError, match="'bco_pair' for rlvr dpo is one of TRL's DPO losses that rlvr does not have yet"):
        rlvr.DPOConfig(loss_type=["sigmoid", "bco_pair"])
    with pytest.raises(ConfigError, match="loss_weights needs one weight per loss_type"):
        rlvr.DPOConfig(loss_type=["sigmoid"], loss_weights=[1.0, 2.0])
    with pytest.raises(ConfigError, match="use_weighting=True is not supported yet"):
        rlvr.DPOConfig(use_weighting=True)


def test_a_value_that_trains_otherwise_than_in_trl_is_named_at_start():
    """DPO's label_smoothing with the sigmoid loss is cDPO here; TRL 1.16's sigmoid loss ignores it."""
    note = trl_settings.meaning_note("dpo", ("sigmoid",), 0.1)
    assert note == ("label_smoothing=0.1 smooths the sigmoid DPO loss (cDPO), as TRL before 1.0 did; "
                    "TRL 1.16 reads it only for its robust and exo_pair losses")
    assert trl_settings.meaning_note("dpo", ("sigmoid",), 0.0) is None  # the default: TRL's loss
    assert trl_settings.meaning_note("dpo", ("ipo",), 0.0) is None
    assert trl_settings.meaning_note("grpo", ("sigmoid",), 0.1) is None


def test_trls_and_accelerates_offload_options_set_fsdp_offload_params(tmp_path):
    """transformers' fsdp="... offload" and fsdp_config {cpu_offload}, accelerate's fsdp_offload_params (its config
    file's name; transformers drops the fsdp_ prefix of fsdp_config's keys, as rlvr does) are fsdp_offload_params."""
    def offload(**settings) -> tuple[bool, bool, list[str]]:
        ignored: list[str] = []
        cfg = build_config(settings, ignored=ignored)
        return cfg.fsdp, cfg.fsdp_offload_params, ignored

    assert offload(fsdp="full_shard auto_wrap offload") == (True, True, [])
    assert offload(fsdp=["full_shard", "offload"]) == (True, True, [])
    assert offload(fsdp="full_shard auto_wrap") == (True, False, [])
    assert offload(fsdp="", fsdp_config=None) == (False, False, ["fsdp_config"])  # TRL's defaults
    assert offload(fsdp=True, fsdp_config={"cpu_offload": True}) == (True, True, [])
    assert offload(fsdp=True, fsdp_config={"fsdp_offload_params": "true"}) == (True, True, [])
    assert offload(fsdp=True, fsdp_config={"offload_params": "false"}) == (True, False, [])
    # the keys rlvr's FSDP2 decides itself are named in the start line, as before
    assert offload(fsdp=True, fsdp_config={"fsdp_cpu_offload": True, "version": 2}) == (True, True, ["fsdp_config"])
    path = tmp_path / "fsdp.json"
    path.write_text('{"fsdp_cpu_offload": true, "reshard_after_forward": true}')
    assert offload(fsdp=True, fsdp_config=str(path)) == (True, True, ["fsdp_config"])
    with pytest.raises(ConfigError) as caught:
        build_config({"fsdp": "full_shard ofload"})
    assert str(caught.value) == ("fsdp='full_shard ofload': unknown option 'ofload'; transformers' options are full_shard, "
                                 "shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard, offload, auto_wrap (or fsdp=true)")
    with pytest.raises(ConfigError, match=r"^fsdp_config='missing.json': not a mapping, nor a JSON file of one$"):
        build_config({"fsdp": True, "fsdp_config": "missing.json"})
    assert trl_settings.translate("fsdp", "full_shard offload") == [("fsdp", True), ("fsdp_offload_params", True)]
