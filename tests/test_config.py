"""Every configuration error is reported, with what to change, before any model or dataset loads."""

import pytest

from rlvr import cli
from rlvr.config import Config, ConfigError, build_config, parse_overrides
from rlvr.settings import check_settings, resolve_config


@pytest.fixture
def no_training(monkeypatch):
    """Fail loudly if a command gets as far as loading a model or training."""
    import rlvr.models
    import rlvr.run

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(rlvr.run, "train", boom)
    monkeypatch.setattr(rlvr.models, "load_model", boom)


@pytest.mark.parametrize(
    "args,message",
    [
        (["bta=0.1"], "unknown setting 'bta'; did you mean 'beta'?"),
        (["num_generations=3"], "8 completions is not divisible by num_generations = 3; make it a multiple of 3, e.g. per_device_train_batch_size=9"),
        (["num_generations=1"], "num_generations must be at least 2"),
        (["temperature=0"], "temperature must be > 0"),
        (["top_p=1.5"], "top_p must be in (0, 1]"),
        (["top_k=-1"], "top_k must be >= 0"),
        (["min_p=1.5"], "min_p must be in [0, 1] (or null: off); got 1.5"),
        (["repetition_penalty=0"], "repetition_penalty must be > 0 (1 = off, > 1 discourages repeated tokens); got 0.0"),
        (["generation_kwargs={seed: 1}"], "generation_kwargs.seed is not supported yet"),
        (["chat_template_kwargs={tokenize: true}"], "chat_template_kwargs cannot set tokenize"),
        (["vllm_tensor_parallel_size=0"], "vllm_tensor_parallel_size must be at least 1"),
        (["vllm_max_model_length=600", "max_prompt_length=512"], "vllm_max_model_length=600 has no room for a longest prompt and a full completion "
                                        "(max_prompt_length + max_completion_length = 1024 tokens)"),
        (["vllm_server_base_url=gpu-box:8000"], "vllm_server_base_url must start with http:// or https://"),
        (["epsilon=0.3", "epsilon_high=0.2"], "epsilon_high must be >= epsilon"),
        (["beta=-0.1"], "beta must be >= 0"),
        (["learning_rate=0"], "learning_rate must be a finite number > 0"),
        (["loss_type=ppo"], "loss_type must be one of grpo, dapo, dr_grpo, bnpo, cispo, sapo, luspo, vespo; got 'ppo'"),
        (["scale_rewards=sometimes"], "scale_rewards must be one of group, batch, none"),
        (["importance_sampling_level=batch"], "importance_sampling_level must be one of token, sequence"),
        (["lr_scheduler_type=step"], "lr_scheduler_type must be one of constant, linear, cosine"),
        (["reward_funcs=[accuracy,format]", "reward_weights=[1.0]"], "reward_weights has 1 values but reward_funcs has 2"),
        (["reward_weights=[1.0,0.5]"], "reward_weights has 2 values but without reward_funcs the one reward is the task's "
                                       "verifier (numeric_accuracy); name the functions in reward_funcs"),
        (["reward_funcs=[acuracy]"], "unknown reward function 'acuracy'; did you mean 'accuracy'? built-in: accuracy"),
        (["reward_funcs=[no_such_pkg.mod:fn]"], "cannot import 'no_such_pkg.mod'"),
        (["reward_funcs=[/nope/r.py:fn]"], "reward function file not found: /nope/r.py"),
        (["task=sudoku"], "unknown task 'sudoku'; built-in tasks: arithmetic"),
        (["reward_funcs=[accuracy]", "reward_args.format.partial=0.2"], "reward_args names 'format', which is not in reward_funcs"),
        (["reward_funcs=[accuracy]", "reward_args.accuracy=3"], "reward_args.accuracy must be a mapping"),
        (["task_args.digitz=2"], "task_args for 'arithmetic': unknown key(s) ['digitz']"),
        (["task_args.operators=/"], "operators must be a non-empty string of + - *"),
        (["task_args.num_test=200"], "num_test=200 leaves no train problems: only 200 distinct problems exist"),
        (["model=./no/such/model"], "model directory not found: ./no/such/model"),
        (["dataset=missing.jsonl"], "dataset file not found: missing.jsonl"),
        (["beta=lots"], "beta must be float, got 'lots'"),
        (["max_steps=0"], "max_steps must be -1 (use num_train_epochs) or at least 1"),
        (["max_completion_length=0"], "max_completion_length must be at least 1"),
        (["save_total_limit=0"], "save_total_limit must be at least 1"),
        (["logging_steps=0"], "logging_steps must be at least 1"),
        (["dtype=float16"], "dtype must be one of float32, bfloat16"),
        (["beta"], "expected at most one config file|config file not found"),
        (["max_steps=5", "resume=true", "output_dir=/no/such/run"], "does not exist|no checkpoint"),
    ],
)
def test_cli_reports_config_errors_before_loading_anything(args, message, no_training, capsys):
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    import re

    assert re.search(message if "|" in message else re.escape(message), err), err


def test_launch_and_environment_are_checked_with_the_settings_before_a_model_loads(monkeypatch, tmp_path):
    """run.train's first check (settings.check_runnable) also holds the rules of the launch and of
    the environment: each error comes before a model loads or the run directory is made."""
    import importlib.util

    import rlvr.models
    from rlvr import run
    from rlvr.rollout.vllm import VLLMError

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(rlvr.models, "load_model", boom)
    monkeypatch.setattr(run, "load_model", boom)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process, no torchrun
    real = importlib.util.find_spec  # vLLM is missing, whether or not this machine has it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:  # a rule of the launch
        run.train(build_config({"fsdp": True, "output_dir": str(out), "use_cpu": True}))
    assert str(e.value) == ("fsdp=true shards the model across several processes: launch with "
                            "torchrun --nproc_per_node N -m rlvr.cli train ... (or set fsdp=false)")
    with pytest.raises(VLLMError) as e:  # a rule of the environment
        run.train(build_config({"use_vllm": True, "output_dir": str(out), "use_cpu": True}))
    assert str(e.value).startswith("vLLM is not installed in this environment. On a CPU machine, create the vLLM "
                                   "environment with `make vllm`"), str(e.value)
    assert not out.exists()


def test_all_problems_are_listed_at_once():
    with pytest.raises(ConfigError) as e:
        build_config({"temperature": 0, "top_p": 2.0, "beta": -1})
    text = str(e.value)
    assert "temperature" in text and "top_p" in text and "beta" in text


def test_overrides_parse_as_yaml_values():
    assert parse_overrides(["beta=0.04", "reward_funcs=[accuracy, format]", "system_prompt=r1", "top_k=null", 'stop_strings=["\\n\\n"]']) == {
        "beta": 0.04,
        "reward_funcs": ["accuracy", "format"],
        "system_prompt": "r1",
        "top_k": None,
        "stop_strings": ["\n\n"],
    }
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["=3"])


def test_file_then_overrides_then_trl_spellings(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model_name_or_path: default\nlearning_rate: 1.0e-6\nnum_generations: 4\nper_device_train_batch_size: 8\n"
        "scale_rewards: false\ntask_args: {digits: 2}\n"
    )
    cfg = resolve_config([str(path), "learning_rate=3e-6", "task_args.operands=3", "reward_funcs=[accuracy]",
                          "reward_args.accuracy.timeout=2", "reward_args.accuracy.final_number=true"])
    assert cfg.reward_args == {"accuracy": {"timeout": 2, "final_number": True}}
    assert cfg.learning_rate == 3e-6 and cfg.num_generations == 4
    assert cfg.scale_rewards == "none"  # TRL's boolean form
    assert cfg.task_args == {"digits": 2, "operands": 3}
    assert cfg.prompts_per_step == 2


def test_defaults_are_trls():
    cfg = Config()
    assert (cfg.learning_rate, cfg.beta, cfg.epsilon, cfg.loss_type, cfg.num_generations, cfg.temperature) == (
        1e-6, 0.0, 0.2, "dapo", 8, 1.0)
    assert cfg.epsilon_high_value == 0.2


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("beta: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        resolve_config([str(path)])
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        resolve_config([str(path)])


@pytest.mark.parametrize(
    "reward_args, message",
    [
        ({"accuracy": {"source": ["boxed"]}}, "reward_args.accuracy: unknown setting 'source'; did you mean 'sources'?"),
        ({"accuracy": {"sources": ["box"]}}, "sources must be a non-empty list of boxed, answer_tag, stated, last_number"),
        ({"accuracy": {"compare": "plain"}}, "set sources: \\[boxed\\]"),
        ({"code_tests": {"mode": "any"}}, "mode must be one of"),
    ],
)
def test_knobs_of_built_in_rewards_are_checked_before_training(reward_args, message):
    names = list(reward_args)
    with pytest.raises(ConfigError, match=message):
        check_settings(build_config({"reward_funcs": names, "reward_args": reward_args}))  # the launch check
    build_config({"reward_funcs": ["accuracy"], "reward_args": {"accuracy": {"sources": ["boxed"], "compare": "plain"}}})
