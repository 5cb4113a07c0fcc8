"""The `rlvr` command: parse, resolve the config, call one library function.

    rlvr train [CONFIG_FILE | demo] [key=value ...]   train (no arguments: the built-in demo)
    rlvr sft | rft | dpo [CONFIG_FILE] [key=value ...]   SFT, rejection-sampling fine-tuning, DPO (finetune/)
    rlvr distill [CONFIG_FILE | demo] teacher=<path or id> [key=value ...]   on-policy distillation (distill.py)
    rlvr eval  [CONFIG_FILE ...] [key=value ...]      held-out accuracy, pass@k, maj@k of a model, task by task
    rlvr compare EVAL_JSON|RUN_DIR ...                eval results side by side
    rlvr report [RUN_DIR]                             report.html and plots of a run (default: the latest)
    rlvr sample model=... prompt="..." n=4 [answer=...] [key=value ...]
    rlvr check-reward CASES.jsonl [reward=NAME] [--json] [--min-agreement 0.95]
    rlvr vllm-serve [CONFIG_FILE] [key=value ...]    a vLLM server for training with use_vllm=true vllm_mode=server
    rlvr plan [CONFIG_FILE] [key=value ...]          estimated memory of a run (rlvr/plan.py); with gpus=N
                                                     and/or gpu_memory_gb=M, per GPU of each node
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import textwrap
from pathlib import Path

from rlvr.config import Config, ConfigError, describe_settings, parse_overrides
from rlvr import methods
from rlvr.settings import resolve_config, split_args
from rlvr.hub import HubPushError
from rlvr.trl_settings import ignored_line

USAGE_ERRORS = (ConfigError, FileNotFoundError, FileExistsError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlvr", description="Reinforcement learning from verifiable rewards (GRPO).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "train a model (no arguments: the built-in demo)"),
        ("sft", "supervised fine-tuning on demonstrations (TRL SFTConfig names)"),
        ("rft", "rejection-sampling fine-tuning: SFT on the model's own verifier-correct samples, in rounds"),
        ("dpo", "DPO on preference pairs from a dataset or built from the verifier (TRL DPOConfig names)"),
        ("distill", "on-policy distillation from a teacher: `rlvr distill teacher=<path or id>` (TRL DistillationConfig names)"),
        ("eval", "held-out accuracy, pass@k and maj@k of a model on one task per config file"),
        ("sample", "print a few completions of one prompt with their rewards"),
        ("vllm-serve", "serve vLLM for `rlvr train use_vllm=true vllm_mode=server` (model, dtype, vllm_server_host/port)"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=settings_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        files = "[CONFIG_FILE ...]" if name == "eval" else "[CONFIG_FILE]"
        p.add_argument("args", nargs="*", metavar=f"{files} key=value", help="YAML config(s) and/or settings")
    plan = sub.add_parser("plan", help="estimated memory of a run: weights, reference, optimizer, activations, KV cache",
                          description="estimated memory of a run (formulas in rlvr/plan.py); settings as for train, "
                          "plus model sizes such as hidden_size=576 num_hidden_layers=30 in place of the model's config, "
                          "plus a layout: gpus=N training processes of one GPU each (torchrun's world size; fsdp=true "
                          "shards by N) and gpu_memory_gb=M, one GPU's memory in GiB (H200 140, H100 80, A100 40 or 80, "
                          "L40S 45); with either, the plan is per GPU of the trainer node and of the rollout node "
                          "(vllm_mode=server) or per Ray rollout worker")
    plan.add_argument("args", nargs="*", metavar="[CONFIG_FILE] key=value")
    compare = sub.add_parser("compare", help="eval results side by side (rows: tasks, columns: runs)",
                             description=compare_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("args", nargs="+", metavar="EVAL_JSON|RUN_DIR")
    report_help = "write RUN_DIR/report.html: the curves, alert periods and sample completions of a run"
    report = sub.add_parser("report", help=report_help, description=report_help)
    report.add_argument("args", nargs="?", metavar="RUN_DIR", help="default: the run under runs/ that logged last")
    check = sub.add_parser("check-reward", help="check a verifier on labelled cases before training",
                           description=check_reward_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("cases", metavar="CASES.jsonl")
    check.add_argument("args", nargs="*", metavar="key=value", help="reward=NAME (default accuracy) and its keyword arguments")
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")
    check.add_argument("--min-agreement", type=float, default=0.0, help="exit with status 1 below this agreement (0-1)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm-serve"]:  # trl vllm-serve's flags (--model, --port, ...) as settings
        from rlvr.trl_settings import serve_flags

        try:
            argv = ["vllm-serve", *serve_flags(argv[1:])]
        except ValueError as e:
            print(f"rlvr vllm-serve: error: {str(e).removeprefix('rlvr vllm-serve: ')}", file=sys.stderr)
            return 2
    ns = parser.parse_args(argv)
    _quiet_libraries()
    try:
        if ns.command == "check-reward":
            return cmd_check_reward(ns)
        return COMMANDS[ns.command](ns.args)
    except USAGE_ERRORS + _library_errors() as e:
        print(f"rlvr {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        from rlvr.checkpoint import is_disk_full

        if not is_disk_full(e):
            raise
        print(f"rlvr {ns.command}: error: disk full: {e.strerror or e} ({getattr(e, 'filename', None) or 'writing'}); "
              "free some space, then continue with resume=true", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return _interrupted(ns.command, e)
    except Exception as e:  # a library that turned Ctrl-C into its own error (transformers' lazy imports do)
        cause = e
        while cause is not None and not isinstance(cause, KeyboardInterrupt):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return _interrupted(ns.command, cause)


def _interrupted(command: str, e: KeyboardInterrupt) -> int:
    from rlvr.interrupts import Terminated

    print(f"rlvr {command}: {'terminated (SIGTERM)' if isinstance(e, Terminated) else 'interrupted'}", file=sys.stderr)
    return 143 if isinstance(e, Terminated) else 130


def _quiet_libraries() -> None:
    """Our own progress and messages only: no per-file loading bars or deprecation notes from libraries."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    # peft imports bitsandbytes when it is installed; on CPUs with AVX512-BF16 bitsandbytes then tries to
    # fetch a gemm kernel from the Hub and, offline, logs two warnings before using its own. Harmless.
    logging.getLogger("kernels").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _library_errors() -> tuple:
    from rlvr.checkpoint import CheckpointError
    from rlvr.compare import EvalFileError
    from rlvr.rundir import RunLocked
    from rlvr.update import NonFinite
    from rlvr.lora import LoraError
    from rlvr.models import ModelError
    from rlvr.rewards import RewardError
    from rlvr.rewards.check import CaseError
    from rlvr.rollout import RolloutError
    from rlvr.rollout.vllm import VLLMError
    from rlvr.tasks.dataset import DatasetError

    return (ModelError, RewardError, DatasetError, CaseError, EvalFileError, LoraError, VLLMError, CheckpointError, RunLocked,
            NonFinite, RolloutError)


def cmd_train(args: list[str], command: str = "train") -> int:
    import yaml

    from rlvr.loop import AlertStop
    from rlvr.run import train

    ignored: list[str] = []
    method, extra = methods.commands()[command]
    if method.is_default:  # rlvr train: the Config as it is; a config of another method is refused
        cfg = resolve_config(args, default_file=None if args else "demo", ignored=ignored)
        if cfg.method != method.name:
            raise ConfigError(f"this run trains with method={cfg.method}: use rlvr {cfg.method} (rlvr rft for sft with self_samples)")
    else:  # rlvr sft / rft / dpo / distill: the same run with another objective, under its TRL config's names
        cfg = resolve_config([*args, *extra], default_file=None if args else "demo", ignored=ignored, method=method.name)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 prints: the settings that differ from the defaults
        if ignored:
            print(ignored_line(ignored))
        defaults = Config().to_dict()
        changed = {k: v for k, v in cfg.without_secrets().to_dict().items() if v != defaults.get(k)}
        print("settings (the rest at their defaults; all of them go to config.yaml in the run directory):")
        print(yaml.safe_dump(changed, sort_keys=False).rstrip())
    try:
        train(cfg)
    except AlertStop as e:  # on_alert marked this rule `stop`; the run was saved
        print(f"rlvr {cfg.command}: {e}", file=sys.stderr)
        return 3
    except HubPushError as e:  # the run is whole on disk; the message says how to push it later
        print(f"rlvr {cfg.command}: {e}", file=sys.stderr)
        return 4
    return 0


def cmd_eval(args: list[str]) -> int:
    """Each CONFIG_FILE is one task (the key=value settings apply to all); one JSON, one table."""
    from rlvr.evaluate import write_results
    from rlvr.loop import evaluate_model
    from rlvr.distributed import pick_device
    from rlvr.models import is_run_dir, load_model
    from rlvr.monitor import make_console
    from rlvr.tasks import load_splits, verifier_name

    files = [a for a in args if "=" not in a] or [None]
    overrides = [a for a in args if "=" in a]
    cfgs = [resolve_config(([f] if f else []) + overrides, run_base=True) for f in files]
    labels = _task_labels(cfgs, files)
    splits = [load_splits(cfg.data_settings, cfg.seed, evaluation=True) for cfg in cfgs]  # every dataset error before any model loads
    console, models, results = make_console(), {}, []
    for cfg, label, (train, test) in zip(cfgs, labels, splits):
        test = test[: cfg.eval_max_examples or None]
        if (cfg.model, cfg.dtype) not in models:
            models[cfg.model, cfg.dtype] = load_model(cfg.model, cfg.dtype, pick_device(cfg.use_cpu), cfg.model_init_kwargs,
                                                      cfg.trust_remote_code, cfg.trust_unverified_checkpoint)
        model, tokenizer, path = models[cfg.model, cfg.dtype]
        how = (f", {cfg.eval_num_samples} samples each" if cfg.eval_num_samples > 1 else "") + (
            f", {cfg.eval_num_shots}-shot" if cfg.eval_num_shots else "")
        console.print(f"evaluating {path} on {len(test)} {label} problems{how}...")
        result = evaluate_model(model, tokenizer, test, cfg, shot_pool=train)
        results.append({"model": str(path), "task": label, "verifier": verifier_name(cfg.data_settings), "config": cfg.without_secrets().to_dict(), **result.to_dict()})
    model_dir = Path(cfgs[0].model)
    out = Path(cfgs[0].eval_output) if cfgs[0].eval_output else (model_dir / "eval.json" if model_dir.is_dir() and is_run_dir(model_dir) else Path("eval.json"))
    write_results(results, out)
    console.print(_eval_table(results))
    console.print(f"written to {out}")
    return 0


def _task_labels(cfgs: list[Config], files: list[str | None]) -> list[str]:
    """The dataset or task name; the config file's name added where two tasks would share one."""
    names = [cfg.dataset or cfg.task for cfg in cfgs]
    labels = [f"{n} ({Path(f).stem})" if f and names.count(n) > 1 else n for n, f in zip(names, files)]
    return [f"{label} #{i + 1}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def _eval_table(results: list[dict]):
    from rich.table import Table

    from rlvr.compare import format_cell, metric_order

    models = list(dict.fromkeys(r["model"] for r in results))
    # mean@k is the accuracy column
    at_k = sorted(dict.fromkeys(m for r in results for m in r["at_k"] if not m.startswith("mean@")), key=metric_order)
    others = list(dict.fromkeys(n for r in results for n in r["rewards"] if n != r["verifier"]))
    table = Table(title="rlvr eval: " + (models[0] if len(models) == 1 else f"{len(models)} models"))
    columns = ["task", *(["model"] if len(models) > 1 else []), "n", "accuracy", *at_k, "mean length", *[f"reward {n}" for n in others]]
    for col in columns:
        table.add_column(col, no_wrap=col != "task", overflow="fold")
    for r in results:
        table.add_row(
            r["task"], *([r["model"]] if len(models) > 1 else []), str(r["n"]), format_cell(r["accuracy"]),
            *[format_cell(r["at_k"].get(m)) for m in at_k], f"{r['mean_completion_length']:.1f}",
            *[f"{r['rewards'][n]:.3f}" if n in r["rewards"] else "-" for n in others],
        )
    return table


def cmd_compare(args: list[str]) -> int:
    from rich.table import Table

    from rlvr.compare import column_labels, compare_rows, format_cell, load_results
    from rlvr.monitor import make_console

    columns = [load_results(arg) for arg in args]
    table = Table(title="rlvr compare")
    for col in ("task", "metric", *column_labels(args)):
        table.add_column(col)
    for task, metric, values in compare_rows(columns):
        table.add_row(task, metric, *[format_cell(v) for v in values])
    make_console().print(table)
    return 0


def compare_doc() -> str:
    from rlvr import compare

    return "eval results side by side (rows: tasks, columns: runs)\n\n" + compare.__doc__


def cmd_sample(args: list[str]) -> int:
    """A few completions of one prompt, sampled and scored along training's path (rollout/path.py):
    with model=RUN_DIR, the run's settings, tools and environment (its saved config.yaml)."""
    import torch

    from rlvr.distributed import pick_device
    from rlvr.models import load_model
    from rlvr.rollout import sampling_params
    from rlvr.rollout.path import RolloutPath, in_process_sampler
    from rlvr.tasks import build_rewards
    from rlvr.types import Example

    own = ("prompt", "n", "answer")  # sample's own arguments; the rest are settings
    config_file, overrides = split_args(args)
    values = parse_overrides([a for a in overrides if a.split("=", 1)[0] in own])
    prompt = values.pop("prompt", None)
    n = values.pop("n", 4)
    answer = values.pop("answer", None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError('sample needs prompt="..." (and optionally n=4, answer=...)')
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be a positive integer, got {n!r}")
    settings = [a for a in overrides if a.split("=", 1)[0] not in own]
    cfg = resolve_config(([config_file] if config_file else []) + settings, run_base=True)
    model, tokenizer, path = load_model(cfg.model, cfg.dtype, pick_device(cfg.use_cpu), cfg.model_init_kwargs, cfg.trust_remote_code,
                                        cfg.trust_unverified_checkpoint)
    rollouts = RolloutPath.of(cfg, tokenizer, in_process_sampler(model, tokenizer, cfg.bf16, cfg.cuda_graphs), build_rewards(cfg.reward_settings, cfg.data_settings))
    example = Example(prompt=prompt, answer=None if answer is None else str(answer),
                      columns={"answer": None if answer is None else str(answer)})
    scored = rollouts.run([example], sampling_params(cfg.rollout_settings, n=n), torch.Generator().manual_seed(cfg.seed))
    group, scores = scored.groups[0], scored.scores
    print(f"model: {path}\nprompt: {prompt}\n")
    for i, r in enumerate(group):
        shown = ", ".join(f"{k}={'n/a' if v[i] is None else f'{v[i]:g}'}" for k, v in scores.per_func.items())
        print(f"--- completion {i + 1}/{n}  ({len(r.completion_ids)} tokens, {r.finish_reason})  reward {scores.total[i]:g}  [{shown}]")
        print(_transcript(r.messages) if r.messages else r.text)
    if answer is None:
        print("\n(no answer=... given: accuracy rewards are n/a)")
    return 0


def _transcript(messages: list[dict]) -> str:
    """A multi-turn completion turn by turn: the model's turns, and between them what its tools or
    environment answered."""
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)


def check_reward_doc() -> str:
    from rlvr.rewards import check

    return "check a verifier on labelled cases before training\n\n" + check.__doc__


def cmd_check_reward(ns) -> int:
    import json

    from rlvr.rewards import check, check_reward_args, resolve_reward

    kwargs = parse_overrides(ns.args)
    reward = kwargs.pop("reward", "accuracy")
    try:
        resolve_reward(reward)
    except (ValueError, ImportError) as e:
        raise check.CaseError(str(e)) from None
    problems = check_reward_args(reward, kwargs, where=f"check-reward {reward}")  # a mistyped knob is named, not passed on
    if problems:
        raise check.CaseError("; ".join(problems))
    result = check.check_reward(check.load_cases(ns.cases), reward, kwargs)
    print(json.dumps(result.to_dict(), indent=2) if ns.json else check.format_result(result, ns.cases))
    if result.agreement < ns.min_agreement:
        if not ns.json:
            print(f"agreement {result.agreement:.1%} is below --min-agreement {ns.min_agreement:.1%}", file=sys.stderr)
        return 1
    return 0


def cmd_plan(args: list[str]) -> int:
    from rlvr.plan import plan, render

    print(render(*plan(args)))
    return 0


def cmd_report(run_dir: str | None) -> int:
    from rlvr.report import find_run_dir, write_report

    print(write_report(find_run_dir(run_dir)))
    return 0


def settings_help() -> str:
    from rlvr.trl_settings import IGNORED, TRL_NAMES, UNSUPPORTED

    lines, section = ["settings (key=value, or in the YAML file); [TRL]: TRL's GRPOConfig has it, same name and meaning;",
                      "[rlvr]: rlvr's own"], None
    for sec, name, default, help_text in describe_settings():
        if sec != section:
            lines.append(f"\n  {sec}:")
            section = sec
        origin = "[TRL] " if name in TRL_NAMES else "[rlvr]"
        lines.append(f"    {origin} {name} = {default}" + (f"   # {help_text}" if help_text else ""))
    wrap = functools.partial(textwrap.fill, width=110, initial_indent="    ", subsequent_indent="    ")
    lines += ["", "  TRL settings accepted without effect here (docs/settings.md):", wrap(", ".join(sorted(IGNORED))),
              "  TRL settings accepted only at TRL's default (another value is refused with the reason):", wrap(", ".join(UNSUPPORTED))]
    return "\n".join(lines)


def cmd_vllm_serve(args: list[str]) -> int:
    """model, dtype / bf16, vllm_server_host / vllm_server_port, vllm_gpu_memory_utilization,
    vllm_tensor_parallel_size and the length limits (vllm_max_model_length) come from the same
    settings as training."""
    from rlvr.models import resolve_model_path
    from rlvr.rollout.vllm import engine_args, import_vllm
    from rlvr.rollout.vllm_server import serve, serve_vllm

    cfg = resolve_config(args)
    import_vllm()  # a clear message before anything else when vLLM is missing
    engine = engine_args(cfg.rollout_settings, cfg.model_settings, max_prompt_length=cfg.max_prompt_length, bf16=cfg.bf16,
                         seed=cfg.seed)
    run = serve_vllm if cfg.rollout_settings.vllm_server_impl == "vllm" else serve
    run(cfg.rollout_settings, resolve_model_path(cfg.model), engine)
    return 0


COMMANDS = {**{command: functools.partial(cmd_train, command=command) for command in methods.commands()}, "eval": cmd_eval, "sample": cmd_sample, "compare": cmd_compare, "report": cmd_report,
            "vllm-serve": cmd_vllm_serve, "plan": cmd_plan}

if __name__ == "__main__":
    sys.exit(main())
