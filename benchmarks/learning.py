"""Time to accuracy: the demo recipe trained by TRL's GRPOTrainer and by rlvr, held-out accuracy against training time.

    python benchmarks/learning.py --seeds 42 --budget-minutes 30 --out runs/learning
    python benchmarks/learning.py --seeds 1 2 3 --skip-trl          # rlvr's curves only
    python benchmarks/learning.py --out runs/learning --report-only  # redraw the report from the logs there

The recipe is `rlvr train` with no arguments (src/rlvr/configs/demo.yaml): the default model
(SmolLM2-135M-Instruct), the arithmetic task's train and test problems for the seed, its prompts as
rlvr renders them (the chat template, the system prompt if the config has one), the task's verifier
`numeric_accuracy` as the one reward function, and the same G, batch, learning rate and schedule,
max_completion_length, stop strings, temperature / top_p, beta, loss_type and seed (`TRL_SETTINGS`).
Changed for both: no checkpoints (TRL's benchmark setting, and rlvr's demo would save one at step
20), no evaluation inside the run (it is done here), and max_steps raised, which the constant
learning rate makes harmless: the budget or the target ends the run.  Everything runs on the CPU.
TRL samples with transformers' `generate`, which finds stop strings only when it is given the
tokenizer; TRL does not give it, so the benchmark does (a functools.partial on the model's
`generate`).  One difference is left: after a stop string TRL's completion keeps the first padding
token (<|im_end|>, the EOS) in its loss, rlvr's ends at the stop string.

Both are evaluated the same way, by rlvr's `evaluate_model` (greedy, the verifier, the same 100 test
problems) on the trainer's current weights every `--eval-every` steps and before the first step,
from a TRL TrainerCallback and from rlvr's run callbacks.  The clock counts training only: it is
stopped while evaluating (and while loading the model), so "training seconds" are comparable.
In the TRL process the evaluation leaves TRL as users run it: rlvr's allocator tuning
(rlvr/runtime.py), which the sampler would apply to the whole process, is turned off there.

Each framework and seed runs in its own process, one after another, and appends its points to
OUT/<framework>-seed<seed>.jsonl as they come, so a run cut short still has its curve.  A run stops
when its training time passes --budget-minutes, or --margin-evals evaluations after it first reached
--target.  Output: OUT/learning.json (curves, minutes to the target and the ratio TRL / rlvr, the
accuracy per step for each seed), OUT/learning.png (accuracy against training minutes and against
steps), and a printed summary.

TRL is a benchmark-only dependency: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FRAMEWORKS = ("rlvr", "trl")  # the order they run in
# Settings of the recipe that TRL's GRPOConfig takes under the same name and meaning (rlvr uses TRL's names).
TRL_SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_completion_length",
                "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "learning_rate", "lr_scheduler_type",
                "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim",
                "beta", "loss_type", "scale_rewards", "epsilon", "epsilon_high", "num_iterations",
                "mask_truncated_completions", "importance_sampling_level", "disable_dropout", "bf16",
                "gradient_checkpointing", "shuffle_dataset", "seed")


# --- pure helpers: curves, time to target, summary ---------------------------------------------------


def crossing(curve: list[dict], target: float, x: str = "seconds") -> float | None:
    """Where the curve first reaches `target` accuracy, in `x` ("seconds" or "step"), linearly
    interpolated between the last point below and the first at or above; None if it never does.
    A curve that starts at or above the target crosses at its first point."""
    for i, point in enumerate(curve):
        if point["accuracy"] >= target:
            if i == 0:
                return float(point[x])
            before = curve[i - 1]
            share = (target - before["accuracy"]) / (point["accuracy"] - before["accuracy"])
            return before[x] + share * (point[x] - before[x])
    return None


def accuracy_at(curve: list[dict], value: float, x: str = "step") -> float | None:
    """The curve's accuracy at `value` of `x`, linearly interpolated; None outside the curve."""
    for before, after in zip(curve, curve[1:]):
        if before[x] <= value <= after[x]:
            if after[x] == before[x]:
                return after["accuracy"]
            share = (value - before[x]) / (after[x] - before[x])
            return before["accuracy"] + share * (after["accuracy"] - before["accuracy"])
    if curve and curve[-1][x] == value:
        return curve[-1]["accuracy"]
    return None


def stop_reason(curve: list[dict], train_seconds: float, budget_seconds: float, target: float, margin_evals: int) -> str | None:
    """Why a run should stop now (after an evaluation or a step), or None to go on: the budget of
    training time is spent, or `margin_evals` evaluations were made after the first at the target."""
    if train_seconds >= budget_seconds:
        return "budget"
    reached = [i for i, p in enumerate(curve) if p["accuracy"] >= target]
    if reached and len(curve) - 1 - reached[0] >= margin_evals:
        return "target"
    return None


def summarize(runs: dict, target: float) -> dict:
    """runs: {framework: {seed: {"curve": [{"seconds", "step", "accuracy"}], ...}}} -> the report's numbers.

    Per framework and seed: minutes and steps to the target (None: not reached within the budget),
    seconds per step; per seed the ratio of minutes TRL / rlvr; the mean of those minutes over the
    seeds where both reached it, and its ratio; and the accuracy at each step evaluated in every run
    (learning per step), with its mean and spread (max - min) over seeds."""
    out = {"target": target, "minutes_to_target": {}, "steps_to_target": {}, "seconds_per_step": {}, "ratio_trl_over_rlvr": {}}
    for fw, seeds in runs.items():
        for seed, run in seeds.items():
            curve = run["curve"]
            seconds = crossing(curve, target, "seconds")
            out["minutes_to_target"].setdefault(fw, {})[seed] = None if seconds is None else seconds / 60
            out["steps_to_target"].setdefault(fw, {})[seed] = crossing(curve, target, "step")
            last = curve[-1] if curve else {"step": 0}
            out["seconds_per_step"].setdefault(fw, {})[seed] = last["seconds"] / last["step"] if last["step"] else None
    minutes = out["minutes_to_target"]
    both = [s for s in minutes.get("rlvr", {}) if minutes.get("trl", {}).get(s) is not None and minutes["rlvr"][s] is not None]
    for seed in both:
        out["ratio_trl_over_rlvr"][seed] = minutes["trl"][seed] / minutes["rlvr"][seed]
    if both:
        mean = {fw: sum(minutes[fw][s] for s in both) / len(both) for fw in FRAMEWORKS}
        out["mean_minutes_to_target"] = mean
        out["ratio"] = mean["trl"] / mean["rlvr"]
    out["accuracy_by_step"] = accuracy_by_step(runs)
    return out


def accuracy_by_step(runs: dict) -> dict:
    """{framework: {step: {"per_seed": {seed: accuracy}, "mean": m, "spread": max - min}}} for the
    steps evaluated in every run of every framework (so the two are compared at the same steps)."""
    step_sets = [{p["step"] for p in run["curve"]} for seeds in runs.values() for run in seeds.values()]
    common = sorted(set.intersection(*step_sets)) if step_sets else []
    out = {}
    for fw, seeds in runs.items():
        rows = {}
        for step in common:
            per_seed = {seed: next(p["accuracy"] for p in run["curve"] if p["step"] == step) for seed, run in seeds.items()}
            values = list(per_seed.values())
            rows[step] = {"per_seed": per_seed, "mean": sum(values) / len(values), "spread": max(values) - min(values)}
        out[fw] = rows
    return out


def format_summary(report: dict) -> str:
    s = report["summary"]
    fmt = lambda m: "not reached within budget" if m is None else f"{m:.1f} min"  # noqa: E731
    lines = ["", f"Time to {s['target']:.0%} held-out accuracy (training time, evaluation excluded):"]
    for fw in s["minutes_to_target"]:
        for seed, minutes in s["minutes_to_target"][fw].items():
            steps = s["steps_to_target"][fw][seed]
            per_step = s["seconds_per_step"][fw][seed]
            run = report["runs"][fw][seed]
            best = max(p["accuracy"] for p in run["curve"])
            lines.append(f"  {fw:5} seed {seed}: {fmt(minutes):>26}" + (f"  at step {steps:.1f}" if steps is not None else "")
                         + f"  ({per_step or float('nan'):.1f} s/step, best {best:.0%} at step "
                         f"{max(run['curve'], key=lambda p: p['accuracy'])['step']}, stopped by {run.get('stopped_by', '?')})")
    for seed, ratio in s["ratio_trl_over_rlvr"].items():
        lines.append(f"  seed {seed}: TRL / rlvr = {ratio:.1f}x")
    if "ratio" in s:
        lines.append(f"  mean over seeds where both reached it: TRL {s['mean_minutes_to_target']['trl']:.1f} min, "
                     f"rlvr {s['mean_minutes_to_target']['rlvr']:.1f} min: {s['ratio']:.1f}x")
    by_step = s["accuracy_by_step"]
    if by_step and any(by_step.values()):
        lines += ["", "Held-out accuracy by step (mean over seeds, spread = max - min):"]
        steps = sorted({step for rows in by_step.values() for step in rows})
        lines.append(f"  {'step':>6}" + "".join(f"{fw + ' mean':>12}{'spread':>8}" for fw in by_step))
        for step in steps:
            lines.append(f"  {step:>6}" + "".join(f"{by_step[fw][step]['mean']:>12.0%}{by_step[fw][step]['spread']:>8.0%}"
                                                  for fw in by_step))
    return "\n".join(lines)


def read_log(path: Path) -> dict:
    """A worker's log (one JSON object a line) as {"curve": [{"seconds", "step", "accuracy"}],
    "rewards": [{"step", "reward"}] (the mean training reward of each step), "stopped_by", "meta"}."""
    run = {"curve": [], "rewards": [], "stopped_by": "cut short (no end record)"}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        kind = row.pop("event")
        if kind == "eval":
            run["curve"].append(row)
        elif kind == "reward":
            run["rewards"].append(row)
        elif kind == "end":
            run["stopped_by"] = row["stopped_by"]
        elif kind == "meta":
            run.setdefault("meta", {}).update(row)
    return run


def plot(report: dict, path: Path) -> None:
    """Accuracy against training minutes (left) and against steps (right), one line per framework and seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 3.8), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    by_time, by_step = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colors = {"trl": "tab:orange", "rlvr": "tab:blue"}
    styles = ["-", "--", ":", "-."]
    for fw, seeds in report["runs"].items():
        for i, (seed, run) in enumerate(sorted(seeds.items())):
            curve = run["curve"]
            label = f"{'TRL' if fw == 'trl' else 'rlvr'}, seed {seed}"
            kw = dict(color=colors[fw], linestyle=styles[i % len(styles)], marker="o", markersize=3, label=label)
            by_time.plot([p["seconds"] / 60 for p in curve], [p["accuracy"] for p in curve], **kw)
            by_step.plot([p["step"] for p in curve], [p["accuracy"] for p in curve], **kw)
    target = report["summary"]["target"]
    for ax, xlabel in ((by_time, "training minutes (evaluation excluded)"), (by_step, "step")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.0%}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    by_time.set_title("Demo recipe: held-out accuracy vs training time", fontsize=10)
    by_step.set_title("... vs step (learning per step)", fontsize=10)
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path)


# --- one framework and seed per process ---------------------------------------------------------------


class Recorder:
    """The clock and the log of one run: training seconds exclude the evaluations; every point is
    appended to the log file as it comes."""

    def __init__(self, log: Path, evaluate, eval_every: int, budget_seconds: float, target: float, margin_evals: int):
        self.log, self.evaluate, self.eval_every = log, evaluate, eval_every
        self.budget_seconds, self.target, self.margin_evals = budget_seconds, target, margin_evals
        self.curve: list[dict] = []
        self.train_seconds, self.resumed, self.ended = 0.0, None, False
        log.write_text("")

    def write(self, **row) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def measure(self, step: int) -> None:
        accuracy = self.evaluate()
        point = {"seconds": round(self.train_seconds, 2), "step": step, "accuracy": accuracy}
        self.curve.append(point)
        self.write(event="eval", **point)
        print(f"[learning] step {step}: held-out accuracy {accuracy:.1%} after {self.train_seconds / 60:.2f} training min",
              file=sys.stderr, flush=True)

    def begin(self) -> None:
        self.measure(0)
        self.resumed = time.perf_counter()

    def step_end(self, step: int, reward: float | None) -> bool:
        """After each optimizer step; True when the run should stop."""
        self.train_seconds += time.perf_counter() - self.resumed
        self.write(event="step", step=step, seconds=round(self.train_seconds, 2))
        if reward is not None:
            self.write(event="reward", step=step, reward=reward)
        budget_spent = self.train_seconds >= self.budget_seconds
        if step % self.eval_every == 0 or budget_spent:
            self.measure(step)
        reason = stop_reason(self.curve, self.train_seconds, self.budget_seconds, self.target, self.margin_evals)
        if reason:
            self.end(reason)
        self.resumed = time.perf_counter()
        return reason is not None

    def end(self, reason: str) -> None:
        if not self.ended:
            self.write(event="end", stopped_by=reason)
            self.ended = True


def recipe(args, seed: int):
    """The demo's Config for this seed, with what this benchmark changes for both frameworks."""
    from rlvr.settings import resolve_config

    overrides = [f"seed={seed}", f"max_steps={args.max_steps}", "save_strategy=no", "eval_on_start=false",
                 "eval_on_end=false", "eval_strategy=no", "use_cpu=true"]
    if args.model:
        overrides.append(f"model={args.model}")
    return resolve_config(["demo", *overrides])


def held_out(cfg):
    from rlvr.tasks import load_splits

    _, test = load_splits(cfg.data_settings, cfg.seed)
    return test[: cfg.eval_max_examples or None]


def clock_callback(rec, trained: dict):
    """The same transformers TrainerCallback for both trainers: it starts the recorder's clock, records
    each logged reward, stops the clock at each step's end (evaluating when due), and keeps the trained
    model and tokenizer in `trained` for the evaluations."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            trained.update(model=model, tokenizer=processing_class)
            rec.begin()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:  # transformers logs a step after its on_step_end
                rec.write(event="reward", step=state.global_step, reward=logs["reward"])

        def on_step_end(self, args, state, control, **kw):
            if rec.step_end(state.global_step, None):
                control.should_training_stop = True

    return Clock()


def run_rlvr(args, cfg, recorder_for) -> None:
    import tempfile

    from rlvr.api import Callbacks, RunObjects
    from rlvr.loop import evaluate_model
    from rlvr.models import load_model
    from rlvr.run import train

    model, tokenizer, _ = load_model(cfg.model, cfg.dtype, "cpu", cfg.model_init_kwargs, cfg.trust_remote_code)
    test = held_out(cfg)
    trained = {"model": model, "tokenizer": tokenizer}  # trained in place; the callback is given the same objects
    rec = recorder_for(lambda: evaluate_model(trained["model"], trained["tokenizer"], test, cfg).accuracy)
    events = Callbacks([clock_callback(rec, trained)])
    with tempfile.TemporaryDirectory(dir=args.out, prefix=f"scratch-seed{args.seed}-") as out:  # in OUT: a killed run leaves nothing in /tmp
        train(dataclasses.replace(cfg, output_dir=str(Path(out) / "run")), objects=RunObjects(model, tokenizer, callbacks=events))
    rec.end("max_steps")


def run_trl(args, cfg, recorder_for) -> None:
    import functools
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import rlvr.rollout.engine
    from rlvr.chat import to_messages
    from rlvr.loop import evaluate_model
    from rlvr.models import resolve_model_path
    from rlvr.rewards.math import numeric_accuracy
    from rlvr.tasks import load_splits

    rlvr.rollout.engine.configure_allocator = lambda: False  # TRL's process keeps glibc's defaults, as users run it
    train_examples, _ = load_splits(cfg.data_settings, cfg.seed)
    test = held_out(cfg)
    data = Dataset.from_list([{"prompt": to_messages(ex.prompt, cfg.system_prompt), "answer": ex.answer} for ex in train_examples])
    trained = {}
    rec = recorder_for(lambda: evaluate_model(trained["model"], trained["tokenizer"], test, cfg).accuracy)

    with tempfile.TemporaryDirectory(dir=args.out, prefix=f"scratch-seed{args.seed}-") as out:  # in OUT: a killed run leaves nothing in /tmp
        settings = {name: getattr(cfg, name) for name in TRL_SETTINGS}
        config = GRPOConfig(output_dir=out, max_steps=args.max_steps, logging_steps=1, report_to="none", save_strategy="no",
                            use_cpu=True, disable_tqdm=True, log_completions=False,
                            generation_kwargs={"stop_strings": list(cfg.stop_strings)} if cfg.stop_strings else None, **settings)
        trainer = GRPOTrainer(model=str(resolve_model_path(cfg.model)), reward_funcs=numeric_accuracy, args=config,
                              train_dataset=data, callbacks=[clock_callback(rec, trained)])
        if cfg.stop_strings:  # transformers' generate needs the tokenizer to find stop strings; TRL does not pass it
            trainer.model.generate = functools.partial(trainer.model.generate, tokenizer=trainer.processing_class)
        rec.write(event="meta", trl_args={name: getattr(trainer.args, name) for name in TRL_SETTINGS},
                  trl_generation_kwargs=trainer.generation_kwargs, trl_model_dtype=str(trainer.model.dtype))
        trainer.train()
    rec.end("max_steps")


def worker(args) -> None:
    import torch

    cfg = recipe(args, args.seed)
    torch.manual_seed(cfg.seed)
    log = Path(args.out) / f"{args.worker}-seed{args.seed}.jsonl"

    def recorder_for(evaluate):
        rec = Recorder(log, evaluate, args.eval_every, args.budget_minutes * 60, args.target, args.margin_evals)
        rec.write(event="meta", framework=args.worker, seed=args.seed, model=str(cfg.model),
                  settings={name: getattr(cfg, name) for name in TRL_SETTINGS} | {"stop_strings": list(cfg.stop_strings)})
        return rec

    (run_trl if args.worker == "trl" else run_rlvr)(args, cfg, recorder_for)


# --- driver -----------------------------------------------------------------------------------------------


def collect(out: Path, seeds: list[int], frameworks: list[str]) -> dict:
    runs = {}
    for fw in frameworks:
        for seed in seeds:
            path = out / f"{fw}-seed{seed}.jsonl"
            if path.is_file():
                run = read_log(path)
                if run["curve"]:
                    runs.setdefault(fw, {})[str(seed)] = run
    return runs


def report(args, out: Path, frameworks: list[str]) -> dict:
    runs = collect(out, args.seeds, frameworks)
    result = {"command": " ".join(sys.argv), "target": args.target, "budget_minutes": args.budget_minutes,
              "eval_every": args.eval_every, "runs": runs, "summary": summarize(runs, args.target)}
    (out / "learning.json").write_text(json.dumps(result, indent=2) + "\n")
    if runs:
        plot(result, out / "learning.png")
    print(format_summary(result))
    print(f"\nwrote {out / 'learning.json'} and {out / 'learning.png'}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--target", type=float, default=0.6, help="held-out accuracy to reach (default 0.6)")
    parser.add_argument("--budget-minutes", type=float, default=30.0, help="training minutes per framework and seed")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every this many steps (and before the first)")
    parser.add_argument("--margin-evals", type=int, default=2, help="evaluations to go on after the target is first reached")
    parser.add_argument("--max-steps", type=int, default=1000, help="a cap on steps (the learning rate is constant)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--out", default="runs/learning")
    parser.add_argument("--model", help="another model than the demo's (e.g. a tiny one, to try the script)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report from the logs in --out")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    frameworks = ["rlvr"] if args.skip_trl else list(FRAMEWORKS)
    if not args.report_only:
        passed = sys.argv[1:]
        for seed in args.seeds:
            for fw in frameworks:
                print(f"[learning] {fw}, seed {seed}, budget {args.budget_minutes:g} training minutes...", file=sys.stderr, flush=True)
                cmd = [sys.executable, __file__, *passed, "--worker", fw, "--seed", str(seed)]
                code = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr).returncode
                if code != 0:
                    print(f"[learning] {fw} seed {seed} exited with status {code}; its curve so far is kept", file=sys.stderr)
    report(args, out, frameworks)


if __name__ == "__main__":
    main()
