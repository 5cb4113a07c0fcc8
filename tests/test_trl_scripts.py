"""TRL's own training scripts (trl/scripts/grpo.py, sft.py, dpo.py of TRL 1.16, copied into
tests/data/trl_scripts with `trl` imports made `rlvr` ones) run on rlvr; and what they need: configs
that HfArgumentParser reads with TRL's fields and defaults, TrlParser, ModelConfig, ScriptArguments,
get_peft_config, get_quantization_config, get_dataset, and the trainer's methods they call."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlvr
from rlvr.api import trl_fields
from rlvr.config import ConfigError, build_config
from rlvr import methods, trl_settings

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "data" / "trl_scripts"
CONFIGS = {"GRPOConfig": "grpo", "SFTConfig": "sft", "DPOConfig": "dpo"}


def _generator():
    spec = importlib.util.spec_from_file_location("trl_fields_tool", ROOT / "benchmarks" / "trl_fields.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fields_table_is_the_installed_trls():
    """trl_fields.json is what benchmarks/trl_fields.py reads from the installed TRL (rewrite it after
    upgrading TRL: python benchmarks/trl_fields.py)."""
    pytest.importorskip("trl")
    assert _generator().table() == trl_fields.table()


@pytest.mark.parametrize("name", CONFIGS)
def test_every_field_reads_back_trls_default_except_the_documented_differences(name):
    cls = getattr(rlvr, name)
    args = cls()
    differ = set(trl_settings.TRL_DEFAULTS_DIFFER) | set(trl_settings.METHOD_DEFAULTS_DIFFER.get(CONFIGS[name], {}))
    table = trl_fields.table()[name]
    assert [f.name for f in dataclasses.fields(cls)] == list(table)
    other = {n: getattr(args, n) for n, row in table.items() if n not in differ and getattr(args, n) != row["default"]}
    assert other == {}
    assert args.local_rank == -1 and args.resume_from_checkpoint is None and args.output_dir is None
    for n in differ & set(table):  # the field's default is rlvr's, so that it reads what the run does
        method = methods.get(CONFIGS[name])
        assert getattr(args, n) == getattr(build_config(method.settings({})), method.trl_name(n)) or n == "output_dir"


def test_the_only_trl_setting_of_another_meaning_in_rlvr_is_fsdps_spelling():
    """A TRL field whose name is an rlvr setting with another default is a documented difference (the
    field then has rlvr's default), or has another meaning: only fsdp, whose TRL words rlvr translates.
    (SFT's and DPO's loss_type are their methods' sft_loss_type and dpo_loss_type, with TRL's defaults.)"""
    found = []
    for name, method_name in CONFIGS.items():
        cls = getattr(rlvr, name)
        cfg = build_config(methods.get(method_name).settings({}))
        for f in dataclasses.fields(cls):
            own = methods.get(method_name).trl_name(f.name)
            if hasattr(cfg, own) and f.name not in cls._backed and f.name not in trl_settings.IGNORED:
                found.append((name, f.name))
    fsdp = [(name, "fsdp") for name in CONFIGS]  # TRL's words ("full_shard auto_wrap"), translated to rlvr's bool
    assert sorted(found) == sorted(fsdp)


def test_a_trl_subclass_of_a_config_keeps_its_own_fields():
    """open-r1's GRPOConfig adds fields of its own with @dataclass: they are the script's, not rlvr settings."""

    @dataclasses.dataclass
    class MyConfig(rlvr.GRPOConfig):
        wandb_project: str | None = None
        benchmarks: list[str] = dataclasses.field(default_factory=list)
        num_generations: int = 4  # a TRL field given another default by the subclass: a setting given

    args = MyConfig(output_dir="x", learning_rate=1e-5, wandb_project="p")
    assert args.wandb_project == "p" and args.learning_rate == 1e-5 and args._config.learning_rate == 1e-5
    assert args._config.num_generations == 4 and "wandb_project" not in args._settings
    with pytest.raises(ConfigError, match="num_generations must be at least 2"):
        args.num_generations = 1


def test_configs_answer_what_scripts_ask_trainingarguments():
    args = rlvr.GRPOConfig(output_dir="x", log_level="info")
    assert (args.world_size, args.process_index, args.local_process_index) == (1, 0, 0)
    assert args.device.type in ("cpu", "cuda") and args.n_gpu == int(args.device.type == "cuda")
    assert args.get_process_log_level() == 20 and rlvr.SFTConfig().get_process_log_level() == 30  # info; passive: warning


def test_trl_parser_reads_the_scripts_dataclasses_from_a_recipe_and_the_command_line(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("env:\n  RLVR_TEST_RECIPE_ENV: seen\nlearning_rate: 3.0e-6\nlora_r: 8\nmax_steps: 5\n"
                      "lr_scheduler_kwargs: '{\"min_lr_rate\": 0.1}'\nlr_scheduler_type: cosine_with_min_lr\n")
    monkeypatch.delenv("RLVR_TEST_RECIPE_ENV", raising=False)
    parser = rlvr.TrlParser((rlvr.ScriptArguments, rlvr.GRPOConfig, rlvr.ModelConfig, rlvr.DatasetMixtureConfig))
    script, training, model, mixture = parser.parse_args_and_config(
        ["--config", str(recipe), "--output_dir", "out", "--max_steps", "7", "--dataset_name", "d", "--use_peft",
         "--no_shuffle_dataset", "--report_to", "none", "--loss_type", "grpo"])
    assert os.environ["RLVR_TEST_RECIPE_ENV"] == "seen"
    for config in (rlvr.GRPOConfig, rlvr.SFTConfig, rlvr.DPOConfig):  # --help formats every field's help
        assert "--gradient_accumulation_steps" in rlvr.TrlParser((config, rlvr.ModelConfig)).format_help()
    assert (training.learning_rate, training.max_steps, training.shuffle_dataset, training.loss_type) == (3e-6, 7, False, "grpo")
    assert training.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and training._config.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert (model.lora_r, model.use_peft, script.dataset_name, mixture.datasets) == (8, True, "d", [])
    assert repr(training) == ("GRPOConfig(output_dir='out', max_steps=7, learning_rate=3e-06, lr_scheduler_type='cosine_with_min_lr', "
                              "lr_scheduler_kwargs={'min_lr_rate': 0.1}, shuffle_dataset=False, loss_type='grpo')")
    (args,) = rlvr.TrlParser((rlvr.SFTConfig,)).parse_args_and_config(["--max_length", "none", "--max_steps", "3"])
    assert args.max_length is None and args.max_steps == 3  # TRL's parser reads none and null as None
    recipe.write_text("not_a_setting: 1\n")
    with pytest.raises(ValueError, match="not_a_setting"):
        parser.parse_args_and_config(["--config", str(recipe)])
    with pytest.raises(ConfigError, match="num_generations"):
        parser.parse_args_and_config(["--num_generations", "1"])


@pytest.mark.parametrize("name", ["ScriptArguments", "ModelConfig", "DatasetMixtureConfig", "DatasetConfig"])
def test_script_dataclasses_have_trls_fields_and_defaults(name):
    trl = pytest.importorskip("trl")
    from trl.scripts.utils import DatasetConfig

    theirs = DatasetConfig if name == "DatasetConfig" else getattr(trl, name)

    def shape(cls):
        return [(f.name, f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(cls)]

    older = [("torch_dtype", None)] if name == "ModelConfig" else []  # TRL 0.x's name, which open-r1's get_model reads
    assert shape(getattr(rlvr, name)) == shape(theirs) + older


def test_model_config_reads_trl_0x_names_that_older_scripts_use():
    """open-r1 (written for TRL 0.18) reads model_args.torch_dtype and model_args.trust_remote_code."""
    assert (rlvr.ModelConfig().torch_dtype, rlvr.ModelConfig(dtype="bfloat16").torch_dtype) == ("float32", "bfloat16")
    assert rlvr.ModelConfig(torch_dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="disagree"):
        rlvr.ModelConfig(dtype="float16", torch_dtype="bfloat16")
    parser = rlvr.TrlParser((rlvr.GRPOConfig, rlvr.ModelConfig))
    training, model = parser.parse_args_and_config(["--trust_remote_code", "true", "--torch_dtype", "bfloat16"])
    assert (training.trust_remote_code, model.trust_remote_code, model.dtype) == (True, True, "bfloat16")
    assert rlvr.ModelConfig().trust_remote_code is False


def test_trl_parser_gives_the_config_the_settings_it_takes_besides_its_fields(tmp_path):
    """A recipe's or command line's key that no dataclass has but GRPOConfig takes (rlvr's own, or an
    older TRL's) is set on the config, the command line's over the recipe's; any other key is refused."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_prompt_length: 512\nwarmup_ratio: 0.1\noverwrite_output_dir: true\n")
    parser = rlvr.TrlParser((rlvr.ScriptArguments, rlvr.GRPOConfig))
    _, training = parser.parse_args_and_config(["--config", str(recipe), "--max_prompt_length", "256", "--beta=0.02",
                                                "--stop_strings", "a", "b"])
    assert (training.max_prompt_length, training.warmup_ratio, training.beta) == (256, 0.1, 0.02)
    assert training._ignored == ["overwrite_output_dir"] and training.stop_strings == ("a", "b")
    with pytest.raises(ValueError, match=r"arguments no dataclass of this script takes: \['--nope', '3'\]"):
        parser.parse_args_and_config(["--nope", "3"])
    with pytest.raises(ConfigError, match="max_prompt_length"):
        parser.parse_args_and_config(["--max_prompt_length", "-5"])
    *_, rest = parser.parse_args_and_config(["--nope", "3", "--warmup_ratio", "0.2"], return_remaining_strings=True)
    assert rest == ["--nope", "3"]


def test_peft_and_quantization_helpers():
    from peft import LoraConfig

    assert rlvr.get_peft_config(rlvr.ModelConfig()) is None
    lora = rlvr.get_peft_config(rlvr.ModelConfig(use_peft=True, lora_r=4, lora_target_modules=["q_proj", "v_proj"]))
    assert isinstance(lora, LoraConfig) and lora.r == 4 and set(lora.target_modules) == {"q_proj", "v_proj"}
    assert rlvr.ModelConfig(lora_target_modules=["all-linear"]).lora_target_modules == "all-linear"
    assert rlvr.get_quantization_config(rlvr.ModelConfig()) is None and rlvr.get_kbit_device_map() is None
    assert rlvr.get_kbit_device_map(rlvr.ModelConfig(load_in_4bit=True)) is None  # rlvr puts a 4-bit model on its device
    with pytest.raises(ConfigError, match=r"^load_in_8bit=True: 8-bit loading \(LLM.int8\) is not supported; QLoRA is "
                                          r"load_in_4bit=true with use_peft=true$"):
        rlvr.get_quantization_config(rlvr.ModelConfig(load_in_8bit=True))
    with pytest.raises(ConfigError, match="load_in_8bit"):
        rlvr.get_kbit_device_map(rlvr.ModelConfig(load_in_8bit=True))
    pytest.importorskip("bitsandbytes")  # QLoRA's (tests/test_qlora.py): TRL's BitsAndBytesConfig, field by field
    from trl import ModelConfig, get_quantization_config

    for kw in ({"load_in_4bit": True}, {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "use_bnb_nested_quant": True,
                                        "bnb_4bit_quant_storage": "bfloat16", "dtype": "bfloat16"}):
        theirs = get_quantization_config(ModelConfig(**kw)).to_dict()
        assert rlvr.get_quantization_config(rlvr.ModelConfig(**kw)).to_dict() == theirs


def test_get_dataset_mixes_local_files_in_their_fractions(tmp_path):
    for name, n in (("a", 10), ("b", 4)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{name}{i}", "x": i}) + "\n" for i in range(n)))
    mixture = rlvr.DatasetMixtureConfig(datasets=[
        {"path": "json", "data_files": str(tmp_path / "a.jsonl"), "columns": ["prompt"], "fraction": 0.5},
        {"path": "json", "data_files": str(tmp_path / "b.jsonl"), "columns": ["prompt"], "fraction": 0.5}])
    train = rlvr.get_dataset(mixture)["train"]
    assert train.column_names == ["prompt"] and train["prompt"] == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    mixture.test_split_size = 2
    split = rlvr.get_dataset(mixture)
    assert (len(split["train"]), len(split["test"])) == (6, 2)


def test_trainer_methods_scripts_call(tiny_model_dir, tmp_path, monkeypatch):
    """Before any training (nothing loads): the files a script writes, the processes, the callbacks, the push."""
    from transformers import PrinterCallback

    from rlvr import hub

    args = rlvr.GRPOConfig(output_dir=str(tmp_path / "out"), hub_model_id="me/model", per_device_train_batch_size=4,
                           num_generations=4)
    trainer = rlvr.GRPOTrainer(model=str(tiny_model_dir), reward_funcs="boxed_format", args=args,
                               train_dataset=[{"prompt": "1+1=", "answer": "2"}] * 4, callbacks=[PrinterCallback])
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    acc = trainer.accelerator
    assert (acc.is_main_process, acc.is_local_main_process, acc.process_index, acc.num_processes) == (True, True, 0, 1)
    assert acc.device.type in ("cpu", "cuda")
    acc.wait_for_everyone()
    trainer.log_metrics("train", {"train_loss": 0.5, "train_samples": 4})
    trainer.save_metrics("train", {"train_loss": 0.5})
    trainer.save_metrics("eval", {"eval_loss": 0.25})
    out = tmp_path / "out"
    assert json.loads((out / "train_results.json").read_text()) == {"train_loss": 0.5}
    assert json.loads((out / "all_results.json").read_text()) == {"train_loss": 0.5, "eval_loss": 0.25}
    trainer.save_state()
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 0
    trainer.create_model_card(dataset_name="my/data", tags=["open-r1"])
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and 'datasets: ["my/data"]' in card and '"open-r1"' in card
    assert isinstance(trainer.pop_callback(PrinterCallback), PrinterCallback) and trainer.pop_callback(PrinterCallback) is None
    callback = PrinterCallback()
    trainer.add_callback(callback)
    trainer.remove_callback(callback)
    assert not any(isinstance(c, PrinterCallback) for c in trainer.callback_handler.callbacks)
    pushed = {}
    monkeypatch.setattr(hub, "push", lambda settings, output_dir: pushed.update(token=settings.hub_token, dir=output_dir) or "url")
    assert trainer.push_to_hub(token="hf_x", dataset_name="my/data") == "url" and pushed == {"token": "hf_x", "dir": out}
    assert trainer.hub_model_id == "me/model"
    trainer.end()


def _write_rows(path: Path, rows: list[dict]) -> None:
    """A dataset directory as load_dataset reads it offline: train.jsonl, and test.jsonl (the first two rows)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))


def _run_script(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


COMMON = ["--max_steps", "2", "--use_cpu", "--report_to", "none", "--logging_steps", "1"]


@pytest.mark.trains
@pytest.mark.processes
@pytest.mark.parametrize("script,rows,extra", [
    ("grpo.py", [{"prompt": f"{a}+1=", "solution": str(a + 1)} for a in range(8)],
     ["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
      "--reward_funcs", "think_format_reward", "reasoning_accuracy_reward", "get_soft_overlong_punishment", "my_rewards.short",
      "--eval_strategy", "steps", "--eval_steps", "2"]),
    ("sft.py", [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(8)],
     ["--per_device_train_batch_size", "2", "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
      "--lora_target_modules", "q_proj", "v_proj", "--eval_strategy", "steps", "--eval_steps", "2"]),
    ("dpo.py", [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)} for a in range(8)],
     ["--per_device_train_batch_size", "2", "--beta", "0.2"]),
])
def test_trls_script_runs_on_rlvr(script, rows, extra, tiny_model_dir, tmp_path):
    """`python trl/scripts/<method>.py --model_name_or_path ... --dataset_name ...` with rlvr for trl: a
    local JSON-lines dataset (a directory with train.jsonl and test.jsonl), 2 steps, evaluated on the
    test split for GRPO and SFT."""
    _write_rows(tmp_path / "data", rows)
    (tmp_path / "my_rewards.py").write_text("def short(completions, **kwargs):\n"
                                            "    return [-len(str(c)) / 100 for c in completions]\n")
    out = tmp_path / "out"
    done = _run_script(script, ["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(tmp_path / "data"),
                                "--output_dir", str(out), *COMMON, *extra], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Training completed" in done.stdout and "Model saved to" in done.stdout
    weights = "adapter_model.safetensors" if "--use_peft" in extra else "model.safetensors"
    assert (out / weights).is_file() and (out / "tokenizer_config.json").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


OPEN_R1 = Path(__file__).parent / "data" / "open_r1"
# What config_demo.yaml asks that this machine cannot give, each overridden on the command line after
# --config as a user without the hub or a GPU would; every other key of the recipe is read as written.
OPEN_R1_OFFLINE = [
    "--use_vllm", "false",  # vLLM lives in its own venv here (make vllm); tests/test_vllm.py covers it
    "--bf16", "false", "--torch_dtype", "float32", "--attn_implementation", "sdpa",  # no GPU: no bf16 or flash-attention
    "--push_to_hub", "false", "--report_to", "none",  # no hub and no wandb
    "--max_steps", "2", "--num_generations", "4", "--per_device_train_batch_size", "4",  # a 2-core CPU's sizes
    "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_completion_length", "16",
    "--max_prompt_length", "200",  # the tiny model's context is 256 tokens, not 512 + 2048
]


@pytest.mark.trains
@pytest.mark.processes
def test_open_r1s_grpo_script_runs_its_demo_recipe_on_rlvr(tiny_model_dir, tmp_path):
    """open-r1's src/open_r1/grpo.py (tests/data/open_r1: its `trl` imports made `rlvr` ones) with its
    config_demo.yaml, written for TRL 0.18: the recipe's older keys (torch_dtype, max_prompt_length,
    warmup_ratio, overwrite_output_dir) and open-r1's own GRPOConfig fields (chat_template, system_prompt)
    are read; its accuracy, format and tag_count rewards score; the model, metrics and state are saved."""
    rows = [{"problem": f"What is {a} + 1?", "solution": f"The answer is $\\boxed{{{a + 1}}}$.",
             "messages": [{"role": "user", "content": "x"}]} for a in range(8)]
    _write_rows(tmp_path / "data", rows)
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(OPEN_R1 / "src")])}
    recipe = OPEN_R1 / "recipes" / "DeepSeek-R1-Distill-Qwen-1.5B" / "grpo" / "config_demo.yaml"
    # open-r1 pins transformers 4.52, whose _is_package_available answers a bool; transformers 5's answers
    # (False, None), which open-r1's import_utils takes for "e2b is installed" and then fails to import it.
    # A difference between transformers versions, not TRL's or rlvr's: the script is given 4.52's answer.
    (tmp_path / "run_open_r1.py").write_text(
        "import runpy, sys\n"
        "import open_r1.utils.import_utils as found\n"
        "for name in ('_e2b_available', '_morph_available'):\n"
        "    value = getattr(found, name)\n"
        "    setattr(found, name, value[0] if isinstance(value, tuple) else value)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "run_open_r1.py"), str(OPEN_R1 / "src" / "open_r1" / "grpo.py"), "--config", str(recipe),
         "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(tmp_path / "data"), "--output_dir", str(out),
         *OPEN_R1_OFFLINE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert ("ignored: 6 TRL settings with no effect in rlvr (see `rlvr train --help`): gradient_checkpointing_kwargs, "
            "log_level, logging_first_step, overwrite_output_dir, per_device_eval_batch_size, use_liger_kernel") in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for name in ("accuracy_reward", "format_reward", "tag_count_reward"):
        assert f"rewards/{name}/mean" in rows[0]
    assert (out / "model.safetensors").is_file() and (out / "train_results.json").is_file()
    assert (out / "trainer_state.json").is_file() and (out / "README.md").is_file()
    assert "<｜Assistant｜>" in (out / "chat_template.jinja").read_text()  # the recipe's chat_template, set by open-r1
    config = json.loads((out / "config.json").read_text())
    assert config["use_cache"] is True  # the script's last write, after the trainer saved the model
    settings = (out / "config.yaml").read_text()
    for line in ("max_prompt_length: 200", "warmup_ratio: 0.1", "lr_scheduler_type: cosine_with_min_lr", "temperature: 0.7"):
        assert line in settings
